"""Review 31 (DP, scale-out, stats): ``GET /spex/stats`` history pages, read off the event loop, rank 0 once, a
negative ``history_since`` refused; a rank that goes idle publishes one idle row (gauges and ``primary_live``
follow); the launcher removes its own rings on exit and stale ``.tmp<pid>`` files (no server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest
import requests
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_spex.adapters import scheduler as sa
from sglang_spex.config import STATS_FILE_PREFIX, SpexConfig
from sglang_spex.srt import batch_stats as bs
from sglang_spex.srt import control, control_routes
from sglang_spex.srt.http_state import attach
from sglang_spex.srt.scheduling import SpexSchedulerState
from sglang_spex.srt.spex_wiring import SpexWiring

PAGE = 1024  # batch_stats.HISTORY_PAGE


def _fill(path: str, n: int, dp_rank=None) -> bs.StatsWriter:
    w = bs.StatsWriter(path, dp_rank)
    for i in range(n):
        w.write({"step": i, "mode": bs.DECODE, "batch_size": 1 + i % 7, "kv_total": 100}, {})
    return w


# ---------------------------------------------------------------- finding 2: a page per answer, with its cursor
def test_history_reads_a_page_and_its_cursor_reads_on_to_every_row(tmp_path):
    w = _fill(str(tmp_path / "ring"), 2500)
    try:
        assert bs.HISTORY_PAGE == PAGE
        first = bs.read_stats(w.path, history_since=0)["history"]
        assert len(first["rows"]) == PAGE and first["next"] == PAGE
        assert (first["seq"], first["start"], first["lost"]) == (2500, 0, 0)
        rows, since = [], 0
        while True:
            hist = bs.read_stats(w.path, history_since=since)["history"]
            rows += hist["rows"]
            since = hist["next"]
            if since >= hist["seq"]:
                break
        assert [r["step"] for r in rows] == [float(i) for i in range(2500)]  # every row once, in order
        assert rows[3]["step_s"] is not None and rows[-1]["step_s"] is None  # NaN (not written yet) reads None
        assert bs.StatsReader(w.path).history(0)["rows"] == rows  # the reader itself still reads all
        assert bs.read_stats(w.path, history_since=9000)["history"] == {
            "seq": 2500, "start": 9000, "lost": 0, "rows": [], "next": 9000,
        }  # fmt: skip
    finally:
        w.close()


def test_a_page_after_the_ring_wrapped_reports_the_lost_rows(tmp_path):
    w = _fill(str(tmp_path / "ring"), bs.RING + 100)
    try:
        hist = bs.read_stats(w.path, history_since=0)["history"]
        assert (hist["start"], hist["lost"], hist["next"]) == (100, 100, 100 + PAGE)
        assert hist["rows"][0]["step"] == 100.0
        with pytest.raises(ValueError):
            bs.StatsReader(w.path).history(-1)
    finally:
        w.close()


def test_the_benchmarks_history_reader_pages_to_the_first_reads_seq(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
    import sched_trace

    w = _fill(str(tmp_path / "ring"), 2500)
    asked: List[int] = []

    def get(since: int) -> Dict[str, Any]:
        asked.append(since)
        if len(asked) == 2:  # the ring moves on while the pages are read
            w.write({"step": 2500}, {})
        return {"batch": bs.read_stats(w.path, history_since=since), "scheduler": {}}

    try:
        hist = sched_trace.stats_history("unused", 100, get)["batch"]["history"]
        assert asked == [100, 100 + PAGE, 100 + 2 * PAGE]
        assert [r["step"] for r in hist["rows"]] == [float(i) for i in range(100, 2501)]
        assert (hist["seq"], hist["start"], hist["lost"], hist["next"]) == (2500, 100, 0, 2501)
    finally:
        w.close()


class _Scheduler:
    async def get_internal_state(self) -> List[Dict[str, Any]]:
        raise AssertionError("control.scheduler_states is stubbed")


def _app(monkeypatch, base: str, ranks: int) -> tuple:
    """The stats route on an app whose scheduler state is a stand-in (``ranks`` DP ranks); records which thread
    runs the route's coroutine and which reads the rings."""
    threads: Dict[str, set] = {"loop": set(), "rings": set()}

    async def states(tm):
        threads["loop"].add(threading.get_ident())
        return [{"dp_rank": r if ranks > 1 else None} for r in range(ranks)]

    read = bs.read_stats

    def read_stats(*args, **kwargs):
        threads["rings"].add(threading.get_ident())
        return read(*args, **kwargs)

    monkeypatch.setattr(control, "scheduler_states", states)
    monkeypatch.setattr(bs, "read_stats", read_stats)
    monkeypatch.setattr(bs, "stats_channel", lambda: base)
    app = FastAPI()
    state = SimpleNamespace(cfg=SpexConfig(enabled=True), tokenizer_manager=_Scheduler(),
                            profile=SimpleNamespace(status=lambda: {"measuring": False}),
                            searches=SimpleNamespace(spex=None))  # fmt: skip
    attach(app, state)
    control_routes.install(app)
    return app, threads


def test_the_route_pages_each_ring_once_off_the_event_loop(monkeypatch, tmp_path):
    base = str(tmp_path / "stats")
    writers = [_fill(bs.rank_path(base, 0), 3000, 0), _fill(bs.rank_path(base, 1), 2000, 1)]
    try:
        app, threads = _app(monkeypatch, base, ranks=2)
        with TestClient(app) as c:
            out = c.get("/spex/stats", params={"history_since": 0}).json()
            hist = out["batch"]["history"]
            assert out["batch"]["dp_rank"] == 0 and len(hist["rows"]) == PAGE and hist["seq"] == 3000
            r0, r1 = out["batch_ranks"]["dp_ranks"]
            assert r0["dp_rank"] == 0 and "history" not in r0  # rank 0's rows are sent once (in batch)
            assert r1["dp_rank"] == 1 and len(r1["history"]["rows"]) == PAGE
            assert out["batch_ranks"]["aggregate"]["ranks"] == 2 and out["profile"] == {"measuring": False}
            last = c.get("/spex/stats", params={"history_since": 2048}).json()["batch"]["history"]
            assert (last["start"], last["next"], len(last["rows"])) == (2048, 3000, 952)
            plain = c.get("/spex/stats").json()
            assert "history" not in plain["batch"] and plain["batch"]["seq"] == 3000
        assert threads["loop"] and threads["rings"] and not threads["loop"] & threads["rings"]
    finally:
        for w in writers:
            w.close()


@pytest.mark.parametrize("since", ["-5", "-1"])
def test_a_negative_history_since_is_a_400_naming_it(monkeypatch, tmp_path, since):
    w = _fill(str(tmp_path / "stats"), 3)
    try:
        app, _ = _app(monkeypatch, w.path, ranks=1)
        with TestClient(app) as c:
            r = c.get("/spex/stats", params={"history_since": since})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["field"] == "history_since" and since in r.json()["error"]["reason"]
    finally:
        w.close()


# ---------------------------------------------------------------- finding 4: a rank that goes idle says so
class _Params:
    def __init__(self, custom: dict):
        self.custom_params = custom


class _Req:
    def __init__(self, i: int, spec: bool):
        self.rid = f"spex:s:r.{i}:{'s' if spec else ''}"
        self.sampling_params = _Params({"spex_role": "spec" if spec else "primary", "spex_search": "s"})
        self.finished_reason, self.extend_len = None, 0

    def finished(self) -> bool:
        return self.finished_reason is not None


class _Batch:
    def __init__(self, reqs: List[_Req]):
        self.reqs, self.forward_mode, self.decoding_reqs = reqs, ForwardMode.DECODE, None


class _Tree:
    def evictable_size(self) -> int:
        return 300

    def protected_size(self) -> int:
        return 40


class _Allocator:
    def __init__(self):
        self.free = 5000

    def available_size(self) -> int:
        return self.free


class _Sched:
    def __init__(self, running: _Batch):
        self.running_batch, self.waiting_queue, self.chunked_req = running, [], None
        self.tree_cache, self.token_to_kv_pool_allocator, self.max_total_num_tokens = _Tree(), _Allocator(), 8000


class _Plan:
    def __init__(self, batch, running: _Batch):
        self.batch_to_run, self.running_batch = batch, running


class _Gauges:
    """RankGauges' interface, its rate limit never passing: only a forced update lands."""

    def __init__(self):
        self.rows = []

    def due(self) -> bool:
        return False

    def update(self, row, counters, force: bool = False) -> None:
        if force:
            self.rows.append(dict(row))


def test_a_rank_that_goes_idle_writes_one_idle_row_and_sets_its_gauges(tmp_path):
    running = _Batch([_Req(i, i % 3 == 0) for i in range(9)])
    sched = _Sched(running)
    state = SpexSchedulerState(knee=12)
    sa.attach_state(sched, state)
    state.stats = bs.StatsWriter(str(tmp_path / "ring"))
    state.stats.gauges = gauges = _Gauges()
    state.measured = lambda **kw: None  # type: ignore[method-assign]
    try:
        idle = _Batch([])
        bs.h_publish(_Plan(None, idle), sched)  # idle from the start: nothing to report
        assert bs.StatsReader(state.stats.path).seq == 0
        state.gate.primary_live = 6
        bs.h_publish(_Plan(running, running), sched)
        bs.h_publish(_Plan(running, running), sched)
        reader = bs.StatsReader(state.stats.path)
        assert reader.latest()["batch_size"] == 9 and reader.latest()["primary_live"] == 6
        sched.running_batch, sched.token_to_kv_pool_allocator.free = idle, 7000
        sched.waiting_queue = [_Req(50, False)]  # a primary the pool cannot admit yet
        bs.h_publish(_Plan(None, idle), sched)
        row = reader.latest()
        assert reader.seq == 3 and row["step"] == 2.0
        assert (row["batch_size"], row["n_primary"], row["n_spec"], row["spec_total"], row["mode"]) == (0, 0, 0, 0, 0)
        assert (row["kv_available"], row["kv_total"], row["kv_used"]) == (7000, 8000, 8000 - 7000 - 300)
        assert (row["waiting"], row["primary_live"], row["knee"], row["spec_room"]) == (1, 1, 12, 11)
        assert row["step_s"] is None and reader.history(1)["rows"][0]["step_s"] is None  # no step time over idle
        assert state.gate.primary_live == 1  # the gate's census was taken again
        (g,) = gauges.rows
        assert g["batch_size"] == 0 and g["kv_used"] == 700 and g["primary_live"] == 1
        for _ in range(50):  # staying idle costs no row
            bs.h_publish(_Plan(None, idle), sched)
        assert reader.seq == 3 and len(gauges.rows) == 1
        bs.h_publish(_Plan(running, running), sched)  # work again, then idle again: one more idle row
        bs.h_publish(_Plan(None, idle), sched)
        assert reader.seq == 5 and reader.latest()["batch_size"] == 0
    finally:
        state.stats.close()


def test_engine_primary_reads_the_idle_rank_as_unloaded(tmp_path):
    w = bs.StatsWriter(str(tmp_path / "ring"))
    try:
        w.write({"mode": bs.DECODE, "batch_size": 9, "primary_live": 6}, {})
        w.idle()
        w.write({"mode": 0, "batch_size": 0, "primary_live": 0}, {})
        wiring = SpexWiring.__new__(SpexWiring)  # only what engine_primary reads
        wiring._readers, wiring._last_row_time = {None: bs.StatsReader(w.path)}, {}
        wiring.cfg = SimpleNamespace(k_total=None)
        assert wiring.engine_primary() == 0
        assert bs.aggregate_rows([bs.StatsReader(w.path).latest()])["batch_size"] == 0
    finally:
        w.close()


# ---------------------------------------------------------------- finding 8: the launcher's rings do not outlive it
def _dead_pid() -> int:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(gone.stdout)


def test_stale_cleanup_removes_tmp_files_of_dead_writers(tmp_path):
    from sglang_spex.launch_server import remove_stale_rings

    dead, live = _dead_pid(), os.getpid()
    names = {
        f"{STATS_FILE_PREFIX}{live}.tmp{dead}": False,  # a writer killed mid-init, its launcher still up
        f"{STATS_FILE_PREFIX}{live}.1.tmp{dead}": False,
        f"{STATS_FILE_PREFIX}{dead}.0.tmp{dead}": False,
        f"{STATS_FILE_PREFIX}{dead}.0": False,
        f"{STATS_FILE_PREFIX}{live}.tmp{live}": True,  # a live writer's, about to be renamed
        f"{STATS_FILE_PREFIX}{dead}.tmp{live}": True,
        f"{STATS_FILE_PREFIX}{live}.0": True,
        f"{STATS_FILE_PREFIX}{dead}.tmpx": True,
        f"{STATS_FILE_PREFIX}{dead}.x": True,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_stale_rings(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == sorted(n for n, keep in names.items() if not keep)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, keep in names.items() if keep)


def test_remove_rings_takes_only_this_servers_rings(tmp_path):
    from sglang_spex.launch_server import remove_rings

    base = str(tmp_path / f"{STATS_FILE_PREFIX}12")
    mine = ["", ".0", ".1", ".tmp77", ".1.tmp77"]
    other = [str(tmp_path / f"{STATS_FILE_PREFIX}123"), str(tmp_path / f"{STATS_FILE_PREFIX}123.0"), base + ".x"]
    for p in [base + s for s in mine] + other:
        open(p, "wb").close()
    assert sorted(remove_rings(base)) == sorted(base + s for s in mine)
    assert sorted(str(p) for p in tmp_path.iterdir()) == sorted(other)


# ``main`` with SGLang's launch stood in for: it writes this server's rings, then returns (or waits for SIGTERM)
_MAIN = textwrap.dedent("""
    import os, sys, time, types
    import sglang_spex.launch_server as ls
    from sglang_spex.config import stats_channel

    d, mode = sys.argv[1], sys.argv[2]
    ls.default_stats_path = lambda: os.path.join(d, "sglang-spex-stats-%d" % os.getpid())
    ls.has_gpu = lambda: True
    ls.sglang_server_args = lambda parse, args: None

    def launch(server_args):
        base = stats_channel()
        for suffix in ("", ".0", ".1", ".1.tmp99999999"):
            open(base + suffix, "wb").close()
        print("up", flush=True)
        if mode == "term":
            time.sleep(120)
        sys.stdin.readline()  # (return: once the test saw the rings)

    fakes = {
        "sglang.srt.entrypoints.http_server": {"launch_server": launch},
        "sglang.srt.server_args": {"prepare_server_args": None},
        "sglang.srt.utils": {"kill_process_tree": lambda pid, include_parent=True: None},
    }
    for name, attrs in fakes.items():
        sys.modules[name] = types.SimpleNamespace(**attrs)
    ls.main(["--model-path", d, "--port", "0"])
    """)


@pytest.mark.parametrize("mode", ["return", "term"])
def test_the_launcher_removes_its_rings_when_it_exits(tmp_path, mode):
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_SPEX_CONFIG", "SGLANG_CPU_OMP_THREADS_BIND")}
    proc = subprocess.Popen([sys.executable, "-c", _MAIN, str(tmp_path), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "up", proc.stderr.read()
        assert len(list(tmp_path.glob(STATS_FILE_PREFIX + "*"))) == 4  # the stand-in wrote the rings
        if mode == "term":
            proc.send_signal(signal.SIGTERM)
        else:
            proc.stdin.write("\n")
            proc.stdin.flush()
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert rc == (128 + signal.SIGTERM if mode == "term" else 0), proc.stderr.read()
    assert not list(tmp_path.glob(STATS_FILE_PREFIX + "*"))


# ---------------------------------------------------------------- live: SGLang's idle step reaches the publish hook
def test_a_server_that_went_idle_reports_an_idle_row_and_pages_its_history(spex_server):
    url = spex_server.url
    body = {"text": "Count: one two three", "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}}
    requests.post(url + "/generate", json=body, timeout=120).raise_for_status()
    deadline = time.monotonic() + 30
    while True:
        batch = requests.get(url + "/spex/stats", timeout=30).json()["batch"]
        if batch["latest"]["batch_size"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    latest = batch["latest"]
    assert latest["batch_size"] == 0 and latest["mode"] == 0, latest
    assert latest["primary_live"] == 0 and latest["waiting"] == 0 and latest["kv_total"] > 0
    hist = requests.get(url + "/spex/stats", params={"history_since": 0}, timeout=30).json()["batch"]["history"]
    n = len(hist["rows"])
    assert n == min(hist["seq"] - hist["start"], PAGE) and hist["next"] == hist["start"] + n
    assert any(r["batch_size"] > 0 for r in hist["rows"])
    r = requests.get(url + "/spex/stats", params={"history_since": -5}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["field"] == "history_since"
