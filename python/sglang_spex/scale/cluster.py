"""N sglang-spex servers behind one sglang-router: start (servers, then the router), stop, kill one worker."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
from typing import List, Optional, Sequence

from sglang_spex.config import ConfigError
from sglang_spex.launch_server import THREAD_BIND_ENV, cpu_thread_binding
from sglang_spex.scale.router import RouterProcess
from sglang_spex.serve import ServerProcess


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


def _threads(cores: str) -> int:
    """How many cores an ``a-b,c`` list names."""
    total = 0
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        total += int(hi) - int(lo) + 1 if hi else 1
    return total


class Cluster:
    """``n`` servers (``python -m sglang_spex.launch_server SERVER_ARGS``) and a router in front; ``url`` is the
    router's. On CPU each server is bound to its own core range and runs that many torch threads (``bind``).
    Servers start together (each waits for its own health check); a failure or interrupt during the start stops
    every server already started; a context manager."""

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
    ):
        self.server_args = list(server_args)
        self.n = n
        self.policy = policy
        self.assignment_mode = assignment_mode
        self.router_args = list(router_args)
        self.bind = bind
        self.startup_timeout = startup_timeout
        self.router_port = router_port
        self.servers: List[ServerProcess] = []
        self.router: Optional[RouterProcess] = None

    @property
    def url(self) -> str:
        assert self.router is not None, "cluster not started"
        return self.router.url

    @property
    def worker_urls(self) -> List[str]:
        return [s.url for s in self.servers]

    def _env(self, i: int, groups: List[str]) -> dict:
        if not groups:
            return {}
        return {THREAD_BIND_ENV: groups[i], "OMP_NUM_THREADS": str(_threads(groups[i]))}

    def start(self) -> "Cluster":
        groups = core_groups(self.n) if self.bind else []
        try:
            self.servers = [
                ServerProcess(self.server_args, env=self._env(i, groups), startup_timeout=self.startup_timeout)
                for i in range(self.n)
            ]
            pool = cf.ThreadPoolExecutor(self.n)
            try:
                for fut in [pool.submit(s.start) for s in self.servers]:
                    fut.result()
            finally:  # an interrupt stops the servers now: a start still waiting then sees its server exit
                pool.shutdown(wait=False, cancel_futures=True)
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
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for srv in self.servers:
            srv.stop()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
