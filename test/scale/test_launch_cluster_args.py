"""``scripts/launch_cluster.py``: a server count it cannot start, a bad or taken router port are refused in one line
before any start; a SIGTERM or SIGHUP during the start stops the servers started so far."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from sglang_spex.serve import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "launch_cluster.py"


@pytest.mark.parametrize("servers", ["0", "-1", "two"])
def test_a_server_count_below_one_exits_2_with_one_line(servers):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--servers", servers], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "argument --servers:" in last and last.endswith("expected an integer >= 1"), last


def test_more_bound_servers_than_cores_exits_2_naming_servers():
    out = subprocess.run([sys.executable, str(SCRIPT), "--servers", "999"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("launch_cluster.py: error: --servers 999: 999 servers") and "--no-bind" in last, last


@pytest.mark.parametrize("port", ["99999", "-5", "0", "http"])
def test_a_router_port_out_of_range_exits_2_with_one_line(port):
    out = subprocess.run([sys.executable, str(SCRIPT), "--port", port], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "argument --port:" in last and last.endswith("expected a port number (1-65535)"), last


def test_a_taken_router_port_exits_2_before_any_server_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, str(SCRIPT), "--servers", "2", "--port", str(port), "--", "--model-path", "no/such"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"launch_cluster.py: error: --port {port}: port {port} is taken on 127.0.0.1 (Address already in use)"
    ]
    assert "starting" not in out.stdout and time.monotonic() - t0 < 60


def _children(pid: int) -> List[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _assert_stopped(launchers: List[int], wait_s: float = 60.0) -> None:
    """Every server launcher has exited within ``wait_s`` (any left are killed, then the test fails)."""
    deadline = time.monotonic() + wait_s
    while any(_alive(p) for p in launchers) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [p for p in launchers if _alive(p)]
    for p in left:
        os.killpg(p, signal.SIGKILL)
    assert left == [], "servers outlived the script"


@pytest.mark.server
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_while_the_servers_start_stops_them(tiny_model, sig):
    """The servers run in their own sessions: a SIGTERM (or a hang-up: a closed SSH session) to the script during
    their start must stop them too."""
    port = str(free_port())  # the router never starts: the signal comes first
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--servers", "2", "--no-bind", "--port", port, "--", "--model-path", tiny_model],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while len(_children(proc.pid)) < 2:  # both launchers started (their model loads take far longer)
        assert proc.poll() is None and time.monotonic() < deadline, "the servers never started"
        time.sleep(0.2)
    launchers = _children(proc.pid)
    time.sleep(2.0)
    proc.send_signal(sig)
    proc.wait(timeout=90)
    _assert_stopped(launchers)


@pytest.mark.parametrize("seconds", ["0", "-3", "soon", "inf"])
def test_a_startup_timeout_that_is_not_positive_seconds_exits_2(seconds):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--startup-timeout", seconds], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "argument --startup-timeout:" in out.stderr.strip().splitlines()[-1], out.stderr


@pytest.mark.server
def test_servers_not_ready_within_the_startup_timeout_stop_and_the_script_exits_1(tiny_model):
    """Was: no way to give a large model more than 600 s, and a server that failed its start ended the script with a
    traceback. Now ``--startup-timeout`` is the bound, and missing it stops every server and exits 1 with the log."""
    port = str(free_port())
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--servers", "2", "--no-bind", "--port", port, "--startup-timeout", "3",
         "--", "--model-path", tiny_model],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while len(_children(proc.pid)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    launchers = _children(proc.pid)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "Traceback" not in err and "not ready after 3.0s" in err, err
    _assert_stopped(launchers)
