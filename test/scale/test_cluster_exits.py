"""``Cluster.exited`` names what of a running cluster died on its own (``launch_cluster.py`` then stops the rest and
exits 1, where it used to sit on a dead router or worker with no message)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from sglang_spex.scale.cluster import Cluster


def _proc(code: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    p.wait(timeout=60)
    return p


def test_exited_names_the_dead_router_and_workers_and_nothing_alive():
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cluster = Cluster(["--model-path", "x"], n=2, bind=False)
        cluster.router = SimpleNamespace(proc=live, log_path="/tmp/router.log")
        cluster.servers = [
            SimpleNamespace(proc=live, url="http://127.0.0.1:1", log_path="/tmp/w0.log"),
            SimpleNamespace(proc=live, url="http://127.0.0.1:2", log_path="/tmp/w1.log"),
        ]
        assert cluster.exited() == []  # all alive
        cluster.servers[1].proc = _proc(3)
        cluster.router.proc = _proc(1)
        assert cluster.exited() == [
            "router (exit 1, log /tmp/router.log)",
            "worker http://127.0.0.1:2 (exit 3, log /tmp/w1.log)",
        ]
    finally:
        live.kill()
        live.wait(timeout=30)
