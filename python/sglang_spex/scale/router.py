"""sglang-router (0.3.2, pinned in third_party/) in front of several servers: the process, and its affinity key.

What 0.3.2 does, found by running it (see docs/scale.md):
- ``--policy manual`` pins every request carrying the header ``X-SMG-Routing-Key`` to one worker, picked for a
  new key by ``--assignment-mode`` (``min_load``: fewest in-flight requests) and kept until that worker turns
  unhealthy. A request without the header goes to a random worker (the body's ``rid`` is not read as a key).
- It proxies ``/generate`` (re-serialised: ``rid``, ``priority``, ``sampling_seed`` and the usual sampling fields
  pass; ``sampling_params.custom_params`` and ``routed_dp_rank`` are dropped) and ``/flush_cache`` (to every
  worker), and answers ``/workers`` itself; **not** ``/abort_request``, ``/tot/*`` or ``/spex/*`` (404). A front
  therefore sends aborts and SPEX control calls to the workers, which ``GET /workers`` lists.
- A worker's own error answer (e.g. SGLang's 503 "The request queue is full.") passes through unchanged; the
  router's own errors carry the header ``x-smg-error-code`` (500 ``call_upstream_request_error`` when the worker
  cannot be reached, 503 ``no_available_workers``).
- ``--dp-aware`` (passed when a worker reports ``dp_size`` > 1) lists a ``--dp-size N`` worker as N workers
  ``URL@rank`` and sends each request on with ``data_parallel_rank`` (SGLang's deprecated name of
  ``routed_dp_rank``): a routing key is then pinned to one *rank*, so a search keeps its radix prefix.
  :func:`parse_workers` folds those entries back into one per server.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

import httpx

from sglang_spex.config import ConfigError
from sglang_spex.serve import ServerProcess, free_port, popen_child, temp_log
from sglang_spex.tot.engine import parse_rid

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # the manual policy's key (SGLang also logs it with --log-requests)
POLICIES = ("manual", "round_robin", "cache_aware", "random", "power_of_two")
ASSIGNMENT_MODES = ("min_load", "min_group", "random")


def affinity_key(search_id: str = "", rid: str = "") -> Optional[str]:
    """The routing key of a search's requests: its search id (from ``rid`` when not given); None for others."""
    if search_id:
        return search_id
    parsed = parse_rid(rid or "")
    return parsed[0] if parsed else None


def list_workers(router_url: str, timeout: float = 10.0) -> Optional[List[dict]]:
    """The router's workers (``GET /workers``: url, is_healthy, load, ...), or None when ``router_url`` answers
    like no sglang-router does (an SGLang server has no ``/workers``)."""
    try:
        r = httpx.get(router_url.rstrip("/") + "/workers", timeout=timeout)
    except httpx.HTTPError:
        return None
    return parse_workers(r)


def parse_workers(r: httpx.Response) -> Optional[List[dict]]:
    """The worker list of a ``GET /workers`` response (one entry per server: a ``--dp-aware`` router's
    ``URL@rank`` entries folded into one with the server's URL, healthy when any rank is), or None when it is not
    a router's answer."""
    if r.status_code != 200:
        return None
    try:
        body = r.json()
    except ValueError:
        return None
    workers = body.get("workers") if isinstance(body, dict) else None
    if not isinstance(workers, list) or not all(isinstance(w, dict) and isinstance(w.get("url"), str) for w in workers):
        return None
    merged: Dict[str, dict] = {}
    for w in workers:
        url = server_url(w["url"])
        if url not in merged:
            merged[url] = {**w, "url": url}
        elif w.get("is_healthy", True):
            merged[url]["is_healthy"] = True
    return list(merged.values())


def server_url(worker_url: str) -> str:
    """The server's URL of a router's worker entry: ``http://h:p@1`` (a ``--dp-aware`` router's rank 1) ->
    ``http://h:p``."""
    head, at, rank = worker_url.rpartition("@")
    return head if at and rank.isdigit() and "://" in head else worker_url


def check_router_installed() -> None:
    """Raise :class:`ConfigError` when the ``sglang_router`` package cannot be imported here."""
    if importlib.util.find_spec("sglang_router") is None:
        raise ConfigError(
            "sglang-router is not installed in this environment (pip install sglang-router==0.3.2, the version "
            "pinned in third_party/project-requirements.txt)"
        )


def check_router(port: Optional[int]) -> None:
    """Raise :class:`ConfigError` (before anything starts) when the router cannot run: sglang-router is not
    installed (:func:`check_router_installed`), or ``port`` is out of range or taken on 127.0.0.1 (bound as the
    router binds, SO_REUSEADDR)."""
    check_router_installed()
    if port is None:
        return
    if not 1 <= port <= 65535:
        raise ConfigError(f"port {port} is out of range (1-65535)")
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    except OSError as e:
        raise ConfigError(f"port {port} is taken on 127.0.0.1 ({e.strerror or e})") from None


def worker_dp_size(url: str, timeout: float = 10.0) -> int:
    """A server's ``dp_size`` (``GET /server_info``); 1 when it does not say."""
    try:
        r = httpx.get(url.rstrip("/") + "/server_info", timeout=timeout)
        dp = r.json().get("dp_size") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return 1
    return dp if isinstance(dp, int) and not isinstance(dp, bool) and dp > 1 else 1


class RouterProcess(ServerProcess):
    """``python -m sglang_router.launch_router`` over ``worker_urls`` in its own process group, listening on
    127.0.0.1 (loopback) at ``port`` (default: a free one); a context manager (``stop``, ``log_tail`` as
    :class:`ServerProcess`).

    ``start()`` returns once the router lists every worker healthy. Health checks run every
    ``health_check_interval_s`` and mark a worker unhealthy after ``health_failure_threshold`` misses in a row
    (the manual policy then moves that worker's keys); a busy CPU worker can take seconds to answer SGLang's
    ``/health`` (it may run a one-token generate), hence ``health_check_timeout_s`` well above the router's 5 s.
    ``extra_args`` pass through to the router unchanged. ``dp_aware`` (None: when any worker reports
    ``dp_size`` > 1 at ``start()``) passes ``--dp-aware``, so a search's key is pinned to one DP rank of its worker.
    """

    def __init__(
        self,
        worker_urls: Sequence[str],
        policy: str = "manual",
        assignment_mode: str = "min_load",
        port: Optional[int] = None,
        health_check_interval_s: int = 2,
        health_failure_threshold: int = 3,
        health_check_timeout_s: int = 30,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 120.0,
        log_path: Optional[str] = None,
        dp_aware: Optional[bool] = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: choose from {list(POLICIES)}")
        if assignment_mode not in ASSIGNMENT_MODES:
            raise ValueError(f"assignment_mode {assignment_mode!r}: choose from {list(ASSIGNMENT_MODES)}")
        log_path = log_path or temp_log("spex-router-")
        super().__init__([], port=port, startup_timeout=startup_timeout, log_path=log_path)
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.policy = policy
        self.dp_aware = dp_aware
        self.args = [
            "--host", "127.0.0.1", "--port", str(self.port),
            "--worker-urls", *self.worker_urls,
            "--policy", policy,
            "--health-check-interval-secs", str(health_check_interval_s),
            "--health-failure-threshold", str(health_failure_threshold),
            "--health-check-timeout-secs", str(health_check_timeout_s),
            "--log-level", "warn",
            "--prometheus-port", str(free_port()),  # its default (29000) is one per machine: a 2nd router panics
            # a request whose worker died comes back as an error (HttpPort fails that search: WorkerLost), never
            # retried onto another worker once the circuit breaker opens, where its search has no cache or state
            "--disable-retries",
        ]  # fmt: skip
        if policy == "manual":
            self.args += ["--assignment-mode", assignment_mode]
        self.args += list(extra_args)

    def start(self) -> "RouterProcess":
        if self.dp_aware is None:
            self.dp_aware = any(worker_dp_size(u) > 1 for u in self.worker_urls)
        if self.dp_aware and "--dp-aware" not in self.args:
            self.args.append("--dp-aware")
        cmd = [sys.executable, "-m", "sglang_router.launch_router", *self.args]
        self.close_log()
        self._log = open(self.log_path, "w")
        self.proc = popen_child(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"router exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")
                if self.healthy_workers() == set(self.worker_urls):
                    return self
                time.sleep(0.5)
        except BaseException:  # an interrupt too: the router runs in its own session and would outlive us
            self.stop()
            raise
        self.stop()
        raise TimeoutError(f"router not ready after {self.startup_timeout}s; log tail:\n{self.log_tail()}")

    def healthy_workers(self) -> set:
        """URLs of the workers the router currently routes to."""
        workers = list_workers(self.url, timeout=5.0) or []
        return {w["url"].rstrip("/") for w in workers if w.get("is_healthy")}  # dp-aware ranks folded

    def __enter__(self) -> "RouterProcess":
        return self.start()
