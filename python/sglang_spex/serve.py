"""Start and stop a real SGLang server through our launcher (used by the demo, tests and benchmarks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# SGLang's crash diagnostics (py-spy dump, CUDA coredump) run when a scheduler exits on a signal, after a 5 s sleep;
# a server this class stops on purpose is not a crash, so they are off unless the caller's environment sets them.
_BIND_ERROR = "error while attempting to bind on address"  # uvicorn's log line when the port is taken
PORT_TAKEN = "HTTP port already in use"  # the launcher's error when the port is taken before any model loads
QUIET_STOP_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


class ServerProcess:
    """``python -m sglang_spex.launch_server ARGS`` in its own process group; a context manager."""

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
        self.env = {**QUIET_STOP_ENV, **os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.log_path = log_path or tempfile.mkstemp(prefix="spex-server-", suffix=".log")[1]
        self.proc: Optional[subprocess.Popen] = None

    def _set_port(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.args: List[str] = self._base_args + ["--host", "127.0.0.1", "--port", str(self.port)]

    def start(self, attempts: int = 3) -> "ServerProcess":
        """Launch and wait for ``/health_generate``. If another process took the free port before the server bound
        it (uvicorn then neither serves nor exits), the server is stopped and started again on a new port. Any
        failure or interrupt (Ctrl-C) on the way stops it: the server runs in its own session, so it would not see
        the terminal's SIGINT and would outlive the caller."""
        try:
            for _ in range(attempts if not self._fixed_port else 1):
                if self._launch():
                    return self
                self.stop()
                self._set_port(free_port())
        except BaseException:
            self.stop()
            raise
        raise RuntimeError(f"server could not bind its HTTP port; log tail:\n{self.log_tail()}")

    def _launch(self) -> bool:
        """True once healthy; False when the HTTP port was already in use."""
        cmd = [sys.executable, "-m", "sglang_spex.launch_server", *self.args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
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

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is not None:
            self._log.close()
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        finally:
            self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
