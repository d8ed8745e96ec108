"""The profiler against the real tiny-model server (short: batch sizes 1, 2, 4, 8; few tokens)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time

import pytest
import requests
from server_modes import TINY

from sglang_spex.profile import cache
from sglang_spex.profile.measure import ProfileSpec, ensure_profile, profile_key
from sglang_spex.serve import ServerProcess
from sglang_spex.tot.http_port import HttpPort

SMALL = {
    "batch_sizes": [1, 2, 4, 8],
    "short_tokens": 2,
    "long_tokens": 8,
    "ctx_prefix_words": 40,
    "prefill_words": 40,
    "repeats": 1,
}


def _sane(d):
    assert d["batch_sizes"] == [1, 2, 4, 8]
    times = d["step_times"]
    assert all(0 < t < 5.0 for t in times), times
    assert d["k_total"] >= 1 and d["fit"]["knee"] > 0


def test_post_and_get_profile(spex_server, tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "CACHE_DIR", tmp_path)  # only affects this process; the server has its own
    r = requests.post(spex_server.url + "/spex/profile", json=SMALL, timeout=120)
    assert r.status_code == 200, r.text
    d = r.json()
    _sane(d)
    assert "B=1" in d["summary"]
    g = requests.get(spex_server.url + "/spex/profile", timeout=10)
    assert g.status_code == 200 and g.json()["created_at"] == d["created_at"]


def test_client_side_profile_is_cached(spex_server, tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "CACHE_DIR", tmp_path)
    info = requests.get(spex_server.url + "/get_server_info", timeout=10).json()
    key = profile_key(info, device="test-host")
    spec = ProfileSpec(  # max_dip 1: the tiny model's few-ms steps lie within host noise, never judge their order
        batch_sizes=(1, 2, 4, 8),
        short_tokens=2,
        long_tokens=8,
        ctx_prefix_words=0,
        prefill_words=0,
        max_batch=8,
        max_dip=1.0,
    )

    async def go():
        port = HttpPort(spex_server.url)
        try:
            first = await ensure_profile(port, key, spec, progress=False)
            second = await ensure_profile(port, key, spec, progress=False)
        finally:
            await port.close()
        return first, second

    first, second = asyncio.run(go())
    _sane(first.to_dict())
    assert not first.measured_under_load and first.meta["load"]["others_in_flight"] is None  # HttpPort: unknown
    assert second.created_at == first.created_at  # served from the cache, not re-measured
    assert cache.load(key) is not None


def test_ctrl_c_during_the_first_sweep_stops_the_server(tiny_model, tmp_path):
    """The auto profile runs as a task, not inside an HTTP request that uvicorn's shutdown waits for: one Ctrl-C
    (SIGINT to the launcher) ends a server mid-sweep at once, without finishing (and caching) the sweep first."""
    srv = ServerProcess(
        [*TINY, tiny_model, "--tot-speculation", "--tot-k-total", "auto"],
        env={"SPEX_CACHE_DIR": str(tmp_path)},  # a fresh profile cache: the server starts measuring at once
    ).start()
    try:
        deadline = time.monotonic() + 120
        while not requests.get(srv.url + "/spex/stats", timeout=30).json()["profile"]["measuring"]:
            assert time.monotonic() < deadline, "the auto profile never started"
            time.sleep(0.2)
        os.kill(srv.proc.pid, signal.SIGINT)
        try:
            srv.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("one Ctrl-C did not stop a server measuring its first profile")
    finally:
        srv.stop()
    saved = list((tmp_path / "profiles").glob("*.json")) if (tmp_path / "profiles").exists() else []
    assert saved == [], "the server finished its sweep before it stopped"


def test_a_first_profile_measured_under_load_is_measured_again_once_the_server_is_quiet(tiny_model, tmp_path):
    """Plain ``/generate`` traffic during the first sweep: that profile serves the run, uncached; once the server has
    been quiet for ``QUIET_S`` a re-profile runs on its own (no server-side search needed) and is cached."""
    srv = ServerProcess(
        [*TINY, tiny_model, "--tot-speculation", "--tot-k-total", "auto", "--max-running-requests", "8"],
        env={"SPEX_CACHE_DIR": str(tmp_path)},  # a fresh profile cache: the first sweep starts at once
    ).start()
    stop = threading.Event()

    def traffic():
        body = {"text": "Count:", "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0}}
        while not stop.is_set():
            requests.post(srv.url + "/generate", json=body, timeout=120).raise_for_status()

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()

    def profile_status():
        return requests.get(srv.url + "/spex/stats", timeout=30).json()["profile"]

    try:
        deadline = time.monotonic() + 240
        while (first := profile_status())["k_total"] is None:  # the first sweep, under the traffic
            assert time.monotonic() < deadline, "the first profile never came"
            time.sleep(0.5)
        stop.set()
        sender.join(timeout=120)
        assert first["measured_under_load"] is True and first["reprofile_due"], first
        while (prof := profile_status())["reprofiles"] < 1 or prof["measuring"] or prof["reprofile_due"]:
            assert time.monotonic() < deadline, f"no quiet re-profile: {prof}"  # quiet from here on
            time.sleep(1.0)
        load = requests.get(srv.url + "/spex/profile", timeout=30).json()["meta"]["load"]
    finally:
        stop.set()
        srv.stop()
    assert prof["k_total"] is not None and load["others_in_flight"] == 0, load  # measured on the quiet engine
    # cached, unless the tiny model's few-ms steps read as a disturbed curve (``max_dip``), which no quiet can help
    assert len(list((tmp_path / "profiles").glob("*.json"))) == (0 if load["why"] else 1), load
