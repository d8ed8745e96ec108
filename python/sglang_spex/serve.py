"""Start and stop a real SGLang server through our launcher (used by the demo, tests and benchmarks)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, TextIO

import httpx

from sglang_spex.flags import parse_args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# SGLang's crash diagnostics (py-spy dump, CUDA coredump) run when a scheduler exits on a signal, after a 5 s sleep;
# a server this class stops on purpose is not a crash, so they are off unless the caller's environment sets them.
_BIND_ERROR = "error while attempting to bind on address"  # uvicorn's log line when the port is taken
PORT_TAKEN = "HTTP port already in use"  # the launcher's error when the port is taken before any model loads
QUIET_STOP_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, n))
PROFILE_WAIT_S = 1800.0  # the longest a one-run server's first roofline sweep is waited for
STOP_WAIT_S = 30.0  # after SIGTERM, how long a child has to exit before it gets SIGKILL
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # loaded here, not in the forked child


def temp_log(prefix: str) -> str:
    """A new empty log file's path (its descriptor closed)."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log")
    os.close(fd)
    return path


def _die_with_parent() -> None:  # runs in the child between fork and exec: no locks, no imports
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def popen_child(cmd: Sequence[str], **kw) -> subprocess.Popen:
    """``Popen(cmd)`` in a new session (a terminal's signals do not reach it; :func:`stop_all` stops its group).
    On Linux, started from the main thread, the child also gets SIGTERM when this process dies, however it dies
    (``PR_SET_PDEATHSIG``, as SGLang does for its schedulers): a ``kill -9`` or OOM kill of the caller leaves no
    server running. The signal follows the *thread* that forked the child, so a child started from another thread
    (which may exit first) is not tied to it."""
    tie = _LIBC is not None and threading.current_thread() is threading.main_thread()
    return subprocess.Popen(list(cmd), start_new_session=True, preexec_fn=_die_with_parent if tie else None, **kw)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """While stopping children, a second Ctrl-C, SIGTERM, SIGHUP or SIGQUIT is noted and ignored (a supervisor
    resending SIGTERM, a user pressing Ctrl-C twice) instead of aborting the cleanup half way; the old handlers
    are back afterwards. Only the main thread can change handlers: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {}
    for sig in STOP_SIGNALS:
        try:
            old[sig] = signal.signal(sig, lambda *_: None)
        except (OSError, ValueError):
            pass
    try:
        yield
    finally:
        for sig, handler in old.items():
            if handler is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(sig, handler)


def stop_all(servers: Sequence["ServerProcess"], wait_s: float = STOP_WAIT_S) -> None:
    """Stop every server (or router): SIGTERM to all their process groups first, then wait for all of them
    together (SIGKILL to a group still there after ``wait_s``); returns once every one has exited. Interrupts
    meanwhile are deferred (:func:`signals_deferred`)."""
    with signals_deferred():
        running = [s for s in servers if s.proc is not None and s.proc.poll() is None]
        for s in running:
            signal_group(s.proc, signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        for s in running:
            try:
                s.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(s.proc, signal.SIGKILL)
        for s in servers:
            try:
                if s.proc is not None:
                    s.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:  # not even SIGKILL took it (e.g. stuck in the kernel): go on
                pass
            finally:
                s.close_log()


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def start_all(servers: Sequence["ServerProcess"], attempts: int = 3) -> None:
    """Spawn every server from this thread (the thread its children's death signal follows) and wait for them
    together. If another process took a server's free port before it bound it (uvicorn then neither serves nor
    exits), that server is stopped and started again on a new port, up to ``attempts`` tries (one when a port was
    given). Raises on a server that exits, times out or finds no port; stopping them is the caller's part."""
    waiting = list(servers)
    if not waiting:
        return
    pool = cf.ThreadPoolExecutor(len(waiting)) if len(waiting) > 1 else None
    try:
        for _ in range(min(s.attempts(attempts) for s in waiting)):
            for s in waiting:
                s.spawn()
            if pool is None:
                ready = [waiting[0].wait_ready()]
            else:  # the first server to fail raises at once, not after the ones before it are ready or time out
                futures = [pool.submit(ServerProcess.wait_ready, s) for s in waiting]
                done, _ = cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
                for f in done:
                    if f.exception() is not None:
                        f.result()  # raises it
                ready = [f.result() for f in futures]
            waiting = [s for s, ok in zip(waiting, ready) if not ok]
            if not waiting:
                return
            for s in waiting:
                s.move_to_free_port()
    finally:  # an interrupt stops the servers now: a wait still running then sees its server exit
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
    raise RuntimeError(f"server could not bind its HTTP port; log tail:\n{waiting[0].log_tail()}")


def server_env(env: Optional[dict] = None) -> Dict[str, str]:
    """The environment a ``ServerProcess`` starts its server with: this process's, quiet on stop, ``env`` added."""
    return {**QUIET_STOP_ENV, **os.environ, **(env or {})}


class ServerProcess:
    """``python -m sglang_spex.launch_server ARGS`` in its own process group; a context manager. It listens on
    127.0.0.1 at ``port`` (default: a free one): its ``--host`` / ``--port`` follow ``args``, so they win over any
    there."""

    def __init__(
        self,
        args: Sequence[str],
        port: Optional[int] = None,
        env: Optional[dict] = None,
        startup_timeout: float = 600.0,
        log_path: Optional[str] = None,
    ):
        self._base_args = list(args)
        self._fixed_port = port is not None
        self._set_port(port or free_port())
        self.env = server_env(env)
        self.startup_timeout = startup_timeout
        self.log_path = log_path or temp_log("spex-server-")
        self.proc: Optional[subprocess.Popen] = None
        self._log = None

    def _set_port(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.args: List[str] = self._base_args + ["--host", "127.0.0.1", "--port", str(self.port)]

    def start(self, attempts: int = 3) -> "ServerProcess":
        """Launch and wait for ``/health_generate`` (:func:`start_all`). Any failure or interrupt (Ctrl-C) on the
        way stops it: the server runs in its own session, so it would not see the terminal's SIGINT and would
        outlive the caller."""
        try:
            start_all([self], attempts)
        except BaseException:
            self.stop()
            raise
        return self

    def attempts(self, attempts: int = 3) -> int:
        """How many ports to try: one when the port was given."""
        return attempts if not self._fixed_port else 1

    def move_to_free_port(self) -> None:
        """Stop a server whose port was taken and move it to a new free port (``spawn`` starts it there)."""
        self.stop()
        self._set_port(free_port())

    def spawn(self) -> None:
        """Start the process (:func:`popen_child`), without waiting for it to serve."""
        cmd = [sys.executable, "-m", "sglang_spex.launch_server", *self.args]
        self.close_log()
        self._log = open(self.log_path, "w")
        self.proc = popen_child(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)

    def wait_ready(self) -> bool:
        """True once the spawned server answers ``/health_generate``; False when the HTTP port was already in use.
        Raises when it exits or is not ready within ``startup_timeout`` (then it is stopped)."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if PORT_TAKEN in self.log_tail(20):  # the launcher's own check, before any model loaded
                    return False
                raise RuntimeError(f"server exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")
            if _BIND_ERROR in self.log_tail(20):
                return False
            try:
                if httpx.get(self.url + "/health_generate", timeout=5).status_code == 200:  # short: a taken port hangs
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.25)  # a test run starts ~37 servers: poll often
        self.stop()
        raise TimeoutError(f"server not ready after {self.startup_timeout}s; log tail:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        lines = Path(self.log_path).read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``STOP_WAIT_S``; a second interrupt meanwhile does
        not cut this short (:func:`stop_all`)."""
        stop_all([self])

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_for_profile(url: str, timeout_s: float = PROFILE_WAIT_S) -> Dict[str, Any]:
    """The roofline profile of the ``--tot-speculation`` server at ``url``, loaded from the cache or measured now
    (``POST /spex/profile`` with ``force`` false joins the startup sweep when it runs). Raises on a refusal."""
    r = httpx.post(f"{url}/spex/profile", json={"force": False}, timeout=timeout_s)
    r.raise_for_status()
    return r.json()


def start_for_one_run(
    args: Sequence[str] = (), env: Optional[dict] = None, out: Optional[TextIO] = None
) -> ServerProcess:
    """Start a ``--tot-speculation`` server (``args`` added) for one run (the CLI without ``--url``, the demo) and
    wait for its roofline profile before any search: measured on an idle engine it is cached, so the next run
    loads it; measured under the run's own searches it would slow them, not be cached, and run again next time.
    Progress lines go to ``out`` (default stderr)."""
    out = out or sys.stderr
    t0 = time.monotonic()
    print("starting the server (--tot-speculation) ...", file=out, flush=True)
    numeric_k_total = parse_args(["--tot-speculation", *args])[0].spex.k_total is not None  # then no profile is read
    srv = ServerProcess(["--tot-speculation", *args], env=env).start()
    if numeric_k_total:
        print(f"server ready in {time.monotonic() - t0:.0f}s", file=out, flush=True)
        return srv
    print(
        f"server ready in {time.monotonic() - t0:.0f}s; roofline profile: loading it, or measuring it once for this "
        "model and host (then cached) ...",
        file=out,
        flush=True,
    )
    t1 = time.monotonic()
    try:
        prof = wait_for_profile(srv.url)
    except httpx.HTTPError as e:  # the searches still run, with k_total's default until a profile exists
        print(f"roofline profile failed ({e}); the first search measures it under its own load", file=out, flush=True)
    except BaseException:  # an interrupt: the server runs in its own session and would outlive the caller
        srv.stop()
        raise
    else:
        print(
            f"roofline profile ready in {time.monotonic() - t1:.0f}s: k_total {prof.get('k_total')}",
            file=out,
            flush=True,
        )
    return srv
