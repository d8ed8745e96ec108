"""A spare ``sglang_spex.launch_server`` process for the test suite (``test/warm_launchers.py`` runs it).

It imports what the launcher's ``main`` imports (SGLang's HTTP server, ~13 s of a server start on CPU) with the
environment the launcher sets on a CPU machine before that import, then waits for one JSON line on stdin:
``{"argv": [...], "env": {...}, "log": path}``. It then takes exactly that environment, sends its output to that
log and runs ``launch_server.main(argv)``, as ``python -m sglang_spex.launch_server ARGV`` would. EOF instead of a
line (the pool closing it unused) exits 0.

This file lives alone in its folder: SGLang's spawned processes import it as their ``__mp_main__`` and inherit its
folder on ``sys.path``, so only this module's top level (light) runs in them, and no test folder shadows a module.
"""

import json
import os
import sys

from sglang_spex import launch_server


def _import_sglang() -> None:
    launch_server.set_cpu_env()  # what launch_server.prepare sets before SGLang is imported
    import sglang.srt.entrypoints.http_server  # noqa: F401
    import sglang.srt.server_args  # noqa: F401
    import sglang.srt.utils  # noqa: F401
    import torch  # noqa: F401


def _run_job() -> None:
    line = sys.stdin.readline()
    if not line:
        return
    job = json.loads(line)
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for src, dst in ((log, 1), (log, 2), (null, 0)):
        os.dup2(src, dst)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(job["env"])
    sys.argv = [launch_server.__file__, *job["argv"]]
    launch_server.main(job["argv"])


if __name__ == "__main__":
    _import_sglang()
    _run_job()
