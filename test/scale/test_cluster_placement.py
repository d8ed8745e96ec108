"""Cluster's pure parts (no model server): per-server GPU/CPU placement, the router's pre-start checks, the
``--dp-aware`` worker list, and a stop that a second interrupt does not cut short."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from sglang_spex.config import ConfigError
from sglang_spex.scale import router as router_mod
from sglang_spex.scale.cluster import Cluster, gpu_slices, ranks_per_server, server_envs
from sglang_spex.scale.router import check_router, parse_workers, server_url
from sglang_spex.serve import ServerProcess, popen_child

STARTS_NO_SERVER = True  # Cluster is planned, its start faked, or its servers are shell children (conftest)
GPUS = [str(i) for i in range(8)]


@pytest.mark.parametrize(
    "args, ranks",
    [
        ([], 1),
        (["--tp-size", "2"], 2),
        (["--tp", "2", "--dp-size", "2"], 4),
        (["--tp-size=2", "--pp-size", "2"], 4),
        (["--tp-size", "4", "--dp-size", "2", "--enable-dp-attention"], 4),  # DP inside the TP group
        (["--base-gpu-id", "1"], 2),  # the slice must hold GPU 1
    ],
)
def test_ranks_per_server_are_read_from_its_args(args, ranks):
    assert ranks_per_server(["--model-path", "m", *args]) == ranks


def test_each_gpu_server_gets_its_own_slice_of_the_visible_gpus():
    assert gpu_slices(4, 1, GPUS) == ["0", "1", "2", "3"]
    assert gpu_slices(2, 2, GPUS) == ["0,1", "2,3"]
    assert gpu_slices(3, 2, ["GPU-a", "GPU-b", "4", "5", "6", "7"]) == ["GPU-a,GPU-b", "4,5", "6,7"]
    envs = server_envs(2, 4, GPUS, bind=True, cores=[0, 1])  # on GPUs: no CPU binding at all
    assert envs == [{"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}]


def test_more_gpus_than_visible_are_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="3 servers x 2 GPU"):
        gpu_slices(3, 2, ["0", "1", "2", "3"])
    c = Cluster(["--model-path", "m", "--tp-size", "2"], n=3, gpus=["0", "1", "2", "3"])
    with pytest.raises(ConfigError, match="only 4 are visible"):
        c.start()
    assert c.servers == []  # nothing was started


def test_cpu_servers_get_one_core_group_per_rank():
    assert server_envs(2, 1, [], bind=True, cores=range(8)) == [
        {"SGLANG_CPU_OMP_THREADS_BIND": "0-3", "OMP_NUM_THREADS": "4"},
        {"SGLANG_CPU_OMP_THREADS_BIND": "4-7", "OMP_NUM_THREADS": "4"},
    ]
    envs = server_envs(2, 2, [], bind=True, cores=range(8))  # e.g. -- --dp-size 2 (finding 10)
    assert [e["SGLANG_CPU_OMP_THREADS_BIND"] for e in envs] == ["0-1|2-3", "4-5|6-7"]
    assert server_envs(2, 1, [], bind=False) == [{}, {}]
    assert server_envs(1, 1, [], bind=True) == [{}]
    with pytest.raises(ConfigError, match="4 servers"):
        server_envs(2, 2, [], bind=True, cores=[0, 1, 2])


def test_the_router_port_and_package_are_checked_before_any_server(monkeypatch):
    for bad in (0, 70000, -5):
        with pytest.raises(ConfigError, match="out of range"):
            check_router(bad)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {taken} is taken"):
            check_router(taken)
        c = Cluster(["--model-path", "m"], n=2, bind=False, router_port=taken, gpus=[])
        with pytest.raises(ConfigError):
            c.start()
        assert c.servers == []
    check_router(None)
    monkeypatch.setattr(router_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="sglang-router is not installed"):
        check_router(None)


def test_a_dp_aware_routers_rank_entries_fold_into_one_worker():
    assert server_url("http://127.0.0.1:3001@1") == "http://127.0.0.1:3001"
    assert server_url("http://127.0.0.1:3001") == "http://127.0.0.1:3001"
    body = {
        "workers": [
            {"url": "http://h:1@0", "is_healthy": False},
            {"url": "http://h:1@1", "is_healthy": True},
            {"url": "http://h:2", "is_healthy": True},
        ]
    }
    workers = parse_workers(httpx.Response(200, json=body))
    assert [(w["url"], w["is_healthy"]) for w in workers] == [("http://h:1", True), ("http://h:2", True)]


def _child(script: str) -> ServerProcess:
    """A ServerProcess holding a real short-lived child (not an SGLang server)."""
    srv = ServerProcess(["unused"])
    srv._log = open(os.devnull, "w")
    srv.proc = popen_child(["sh", "-c", script])
    return srv


def test_a_second_interrupt_during_stop_does_not_cut_it_short():
    """Each child takes ~1 s to exit after SIGTERM; a SIGTERM to us (handled as Ctrl-C, as launch_cluster does)
    lands while stop() waits: every child must still be stopped, and stop() must return normally."""
    slow = 'trap "sleep 1; exit 0" TERM; while :; do sleep 0.1; done'
    c = Cluster(["--model-path", "m"], n=3)
    c.servers = [_child(slow) for _ in range(3)]
    time.sleep(0.3)  # the traps are set

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    interrupted = False
    try:
        timer.start()
        t0 = time.monotonic()
        c.stop()
        took = time.monotonic() - t0
    except KeyboardInterrupt:
        interrupted = True
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, old)
        for s in c.servers:  # never leave a child behind, whatever happened
            if s.proc.poll() is None:
                os.killpg(s.proc.pid, signal.SIGKILL)
                s.proc.wait()
    assert not interrupted, "the second signal aborted the cleanup"
    assert all(s.proc.returncode is not None for s in c.servers)
    assert took < 5, f"the children were stopped one after another ({took:.1f} s)"  # all SIGTERMed at once
    assert signal.getsignal(signal.SIGTERM) is old


def test_children_die_with_the_process_that_started_them():
    """PR_SET_PDEATHSIG: a parent killed outright (SIGKILL: no cleanup runs) takes its children along."""
    code = (
        "import sys, time\n"
        "from sglang_spex.serve import popen_child\n"
        "p = popen_child(['sleep', '60'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        os.killpg(child, signal.SIGKILL)
        pytest.fail("the child outlived its parent")


@pytest.mark.parametrize("dp_sizes, dp_aware", [((1, 1), False), ((1, 2), True)])
def test_the_router_is_dp_aware_when_a_worker_has_dp_ranks(monkeypatch, dp_sizes, dp_aware):
    sizes = dict(zip(["http://w0:1", "http://w1:1"], dp_sizes))
    monkeypatch.setattr(router_mod, "worker_dp_size", lambda url: sizes[url])
    started = []

    class Started(Exception):
        pass

    def fake_popen(cmd, **kw):
        started.append(cmd)
        raise Started

    monkeypatch.setattr(router_mod, "popen_child", fake_popen)
    rp = router_mod.RouterProcess(list(sizes))
    with pytest.raises(Started):
        rp.start()
    assert ("--dp-aware" in started[0]) is dp_aware and rp.dp_aware is dp_aware


def test_a_workers_dp_size_is_read_from_server_info(monkeypatch):
    answers = {"http://a:1": {"dp_size": 2}, "http://b:1": {"tp_size": 1}}

    def get(url, timeout):
        base = url.rsplit("/", 1)[0]
        if base not in answers:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json=answers[base])

    monkeypatch.setattr(router_mod.httpx, "get", get)
    assert [router_mod.worker_dp_size(u) for u in ("http://a:1", "http://b:1", "http://c:1")] == [2, 1, 1]
