"""N sglang-spex servers behind one sglang-router: start (servers, then the router), stop, kill one worker.

Placement: on a GPU host each server gets its own GPUs through ``CUDA_VISIBLE_DEVICES`` (server i the i-th slice
of ``ranks`` devices, ``ranks`` = the largest GPU id its own args index + 1: tp x pp x dp ids, dp not counted under
``--enable-dp-attention``, from ``--base-gpu-id`` on and ``--gpu-id-step`` apart; ids below the base and between the
steps are reserved but unused); on a CPU host each is bound to its own core range (``ranks`` core groups each).
GPUs are what ``torch.cuda.device_count()`` sees (it honours ``CUDA_VISIBLE_DEVICES``), asked in
:meth:`Cluster.plan`, not at import. Every server listens on 127.0.0.1 at a free port of its own (``ServerProcess``),
so ``--host`` / ``--port`` in the server args are refused (:func:`check_server_args`).
"""

from __future__ import annotations

import os
import signal
from typing import Dict, List, Optional, Sequence

from sglang_spex.config import ConfigError, flag_value
from sglang_spex.launch_server import THREAD_BIND_ENV, bind_group_ids, cpu_thread_binding
from sglang_spex.scale.router import RouterProcess, check_router
from sglang_spex.serve import ServerProcess, signal_group, start_all, stop_all

SERVER_SET_FLAGS = ("--host", "--port")  # ServerProcess appends its own, which SGLang's argparse keeps (the last)


def core_groups(n: int, cores: Optional[Sequence[int]] = None) -> List[str]:
    """One core list per server for ``n`` servers: the launcher's split of this machine's cores for ``n`` DP ranks
    (so N one-rank servers share the machine like one server with N ranks); [] for one server."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if n > len(cores):
        raise ConfigError(
            f"{n} servers, but only {len(cores)} CPU cores are available: each bound CPU server needs a core of its "
            "own (--no-bind lets them share)"
        )
    binding = cpu_thread_binding(["--dp-size", str(n)], cores)
    return binding.split("|") if binding else []


def ranks_per_server(server_args: Sequence[str]) -> int:
    """The devices (GPUs, or CPU core groups) one server started with ``server_args`` indexes: its largest device
    id + 1, the ids being tp x pp x dp (dp not counted under ``--enable-dp-attention``) from ``--base-gpu-id`` on,
    ``--gpu-id-step`` apart (``bind_group_ids``)."""
    return max(bind_group_ids(server_args)) + 1


def check_server_args(server_args: Sequence[str]) -> int:
    """:func:`ranks_per_server` of ``server_args``, after refusing a ``--host`` or ``--port`` in them (each server
    listens on 127.0.0.1 at a free port of its own). Raises :class:`ConfigError` naming the flag."""
    for flag in SERVER_SET_FLAGS:
        value = flag_value(server_args, flag)
        if value is not None:
            raise ConfigError(
                f"{flag} {value!r}: set by the cluster (each server listens on 127.0.0.1 at a free port of its own)"
            )
    return ranks_per_server(server_args)


def visible_gpus() -> List[str]:
    """The GPUs this process may use: ``torch.cuda.device_count()`` of them (torch imported here, not at import
    time), named as ``CUDA_VISIBLE_DEVICES`` names them when it is set (ids or UUIDs), else 0..n-1; [] on CPU."""
    try:
        import torch

        count = torch.cuda.device_count()
    except Exception:  # no torch, or no CUDA runtime: a CPU host
        return []
    named = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return named[:count] if "CUDA_VISIBLE_DEVICES" in os.environ else [str(i) for i in range(count)]


def gpu_slices(n: int, ranks: int, gpus: Sequence[str]) -> List[str]:
    """``CUDA_VISIBLE_DEVICES`` of each of ``n`` servers needing ``ranks`` GPUs each: consecutive slices of
    ``gpus``. Raises :class:`ConfigError` when there are too few."""
    if n * ranks > len(gpus):
        raise ConfigError(
            f"{n} servers x {ranks} GPU(s) each = {n * ranks} GPUs, but only {len(gpus)} are visible "
            f"({','.join(gpus)}): lower --servers or the server's --tp-size/--dp-size/--pp-size"
            "/--base-gpu-id/--gpu-id-step"
        )
    return [",".join(gpus[i * ranks : (i + 1) * ranks]) for i in range(n)]


def server_envs(
    n: int, ranks: int, gpus: Sequence[str], bind: bool, cores: Optional[Sequence[int]] = None
) -> List[dict]:
    """Each server's placement env: its GPU slice on a GPU host (``gpus`` non-empty); on a CPU host, with ``bind``
    and more than one server, its ``ranks`` core groups (``|``-separated, as SGLang binds one per rank) and its
    thread count; {} otherwise."""
    if gpus:
        return [{"CUDA_VISIBLE_DEVICES": s} for s in gpu_slices(n, ranks, gpus)]
    if not bind or n == 1:
        return [{} for _ in range(n)]
    groups = core_groups(n * ranks, cores)
    out = []
    for i in range(n):
        mine = groups[i * ranks : (i + 1) * ranks]
        out.append({THREAD_BIND_ENV: "|".join(mine), "OMP_NUM_THREADS": str(min(_threads(g) for g in mine))})
    return out


def _threads(cores: str) -> int:
    """How many cores an ``a-b,c`` list names."""
    total = 0
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        total += int(hi) - int(lo) + 1 if hi else 1
    return total


class Cluster:
    """``n`` servers (``python -m sglang_spex.launch_server SERVER_ARGS``) and a router in front; ``url`` is the
    router's. On GPUs each server gets its own slice (``CUDA_VISIBLE_DEVICES``; ``gpus``: the devices to split,
    default :func:`visible_gpus`); on CPU each is bound to its own core range (``bind``). :meth:`plan` checks the
    placement and the router (port, package) before anything starts (:class:`ConfigError`). Servers start
    together (each waits for its own health check); a failure or interrupt during the start stops every server
    already started; :meth:`stop` stops them all at once, and a second interrupt does not cut it short. Start it
    from the main thread: its children then die with this process (``serve.popen_child``). A context manager."""

    def __init__(
        self,
        server_args: Sequence[str],
        n: int = 2,
        policy: str = "manual",
        assignment_mode: str = "min_load",
        router_args: Sequence[str] = (),
        bind: bool = True,
        startup_timeout: float = 600.0,
        router_port: Optional[int] = None,
        gpus: Optional[Sequence[str]] = None,
    ):
        self.server_args = list(server_args)
        self.n = n
        self.policy = policy
        self.assignment_mode = assignment_mode
        self.router_args = list(router_args)
        self.bind = bind
        self.startup_timeout = startup_timeout
        self.router_port = router_port
        self.gpus = list(gpus) if gpus is not None else None
        self.envs: Optional[List[Dict[str, str]]] = None
        self.servers: List[ServerProcess] = []
        self.router: Optional[RouterProcess] = None

    @property
    def url(self) -> str:
        assert self.router is not None, "cluster not started"
        return self.router.url

    @property
    def worker_urls(self) -> List[str]:
        return [s.url for s in self.servers]

    def plan(self) -> List[Dict[str, str]]:
        """Each server's placement env (:func:`server_envs`), after checking the server args
        (:func:`check_server_args`) and that the router can start (:func:`check_router`); raises
        :class:`ConfigError` before anything started."""
        if self.envs is None:
            gpus = visible_gpus() if self.gpus is None else self.gpus
            envs = server_envs(self.n, check_server_args(self.server_args), gpus, self.bind)
            check_router(self.router_port)
            self.envs = envs
        return self.envs

    def start(self) -> "Cluster":
        envs = self.plan()
        try:
            self.servers = [
                ServerProcess(self.server_args, env=envs[i], startup_timeout=self.startup_timeout)
                for i in range(self.n)
            ]
            start_all(self.servers)  # spawned from this thread: their death signal follows it
            self.router = RouterProcess(
                self.worker_urls,
                policy=self.policy,
                assignment_mode=self.assignment_mode,
                port=self.router_port,
                extra_args=self.router_args,
            ).start()
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, i: int) -> None:
        """SIGKILL server ``i`` and its children at once (a crash, not a shutdown)."""
        proc = self.servers[i].proc
        if proc is not None and proc.poll() is None:
            signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=30)

    def exited(self) -> List[str]:
        """What of the started cluster has exited on its own: ``"router (exit 1, log PATH)"`` / ``"worker URL ..."``."""
        procs = [("router", self.router)] if self.router is not None else []
        procs += [(f"worker {srv.url}", srv) for srv in self.servers]
        return [
            f"{name} (exit {p.proc.returncode}, log {p.log_path})"
            for name, p in procs
            if p.proc is not None and p.proc.poll() is not None
        ]

    def stop(self) -> None:
        """SIGTERM to the router and every server at once, then wait for all of them (``serve.stop_all``)."""
        stop_all(([self.router] if self.router is not None else []) + list(self.servers))

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
