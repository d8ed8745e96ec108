"""Server starts without the launcher's import: the suite keeps spare launchers (``warm/warm_launcher.py``)
that have imported SGLang in the background, and a ``ServerProcess`` whose environment matches one takes it instead
of starting ``python -m sglang_spex.launch_server`` cold. The spare runs the launcher's own ``main`` with the
server's arguments, environment and log, in its own process group like a cold start (``popen_child``), so stopping,
port retries and log reads are unchanged; SGLang's scheduler and detokenizer are still spawned fresh by SGLang.
A spare is replaced once a server is ready (waited for from the main thread: a spare started elsewhere would not
die with the suite), so its import does not compete with that server's start.
``pytest --cold-launchers`` turns this off; the CLI, cluster-script and launcher-error tests always start cold.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Dict, List, Tuple

from sglang_spex import serve
from sglang_spex.launch_server import has_gpu
from sglang_spex.serve import ServerProcess, popen_child, server_env, signal_group

SCRIPT = Path(__file__).parent / "warm" / "warm_launcher.py"


def _imported_with(env: Dict[str, str]) -> Dict[str, str]:
    """What of ``env`` a spare's import could have read: all but pytest's name of the running test."""
    return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}


def _discard(spare: subprocess.Popen) -> None:
    spare.stdin.close()
    signal_group(spare, signal.SIGKILL)  # it holds nothing but imports
    spare.wait()


class WarmLaunchers:
    """Up to ``size`` spare launchers; :meth:`install` routes ``ServerProcess.spawn`` through them. Two let a spare
    import during a whole server start and its tests, and cover a start retried on a new port."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self.spares: List[Tuple[subprocess.Popen, Dict[str, str]]] = []
        self.taken = 0  # starts handed to a spare
        self.cold = 0  # starts that found none with their environment

    def refill(self) -> None:
        """Start spares up to ``size`` (from the main thread, so they die with the suite: ``popen_child``). A spare
        whose environment is no longer the suite's (a test changed ``os.environ`` since) is stopped first."""
        now = _imported_with(server_env())
        kept = []
        for proc, env in self.spares:
            if _imported_with(env) != now:
                _discard(proc)
            elif proc.poll() is None:
                kept.append((proc, env))
        self.spares = kept
        while len(self.spares) < self.size:
            env = server_env()
            proc = popen_child(
                [sys.executable, str(SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
            )
            self.spares.append((proc, env))

    def take(self, srv: ServerProcess) -> bool:
        """Hand ``srv``'s start to the oldest live spare that has ``srv``'s environment; False: start it cold."""
        for i, (spare, env) in enumerate(self.spares):
            if spare.poll() is None and _imported_with(srv.env) == _imported_with(env):
                break
        else:
            return False
        del self.spares[i]
        Path(srv.log_path).write_text("")  # read by wait_ready before the spare opens it
        job = {"argv": srv.args, "env": srv.env, "log": srv.log_path}
        try:
            spare.stdin.write(json.dumps(job).encode() + b"\n")
            spare.stdin.close()
        except OSError:  # it died between the check and the write
            return False
        srv.close_log()
        srv.proc = spare
        self.taken += 1
        return True

    def close(self) -> None:
        for spare, _ in self.spares:
            _discard(spare)
        self.spares = []

    def install(self, mp) -> None:
        """Patch ``ServerProcess.spawn`` / ``wait_ready`` (``mp``: a ``pytest.MonkeyPatch``)."""
        cold_spawn: Callable = ServerProcess.spawn
        wait_ready: Callable = ServerProcess.wait_ready

        def spawn(srv: ServerProcess) -> None:
            if not self.take(srv):
                self.cold += 1
                cold_spawn(srv)

        def ready(srv: ServerProcess) -> bool:
            ok = wait_ready(srv)
            if ok and threading.current_thread() is threading.main_thread():  # else the spare would not be tied
                self.refill()
            return ok

        mp.setattr(serve.ServerProcess, "spawn", spawn)
        mp.setattr(serve.ServerProcess, "wait_ready", ready)


def usable() -> bool:
    """Spares import SGLang with the launcher's CPU environment: on a GPU machine every start stays cold."""
    return not has_gpu()
