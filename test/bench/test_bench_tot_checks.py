"""bench_tot's run checks: failed searches, flagged runs (unflushed, rows lost, the profiler during a run, k_total
that changed), the decode-step count against its critical-path bound, and servers stopped on any error."""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import bench_tot  # noqa: E402
import sched_trace  # noqa: E402
import tot_report  # noqa: E402

from sglang_spex.tot.result import SearchResult  # noqa: E402
from sglang_spex.tot.tree import DONE, Node  # noqa: E402

NAN = math.nan


def _stats_row(mode, decode_rows, step_s, batch_size=1, prefill_tokens=0):
    return {
        "mode": mode,
        "batch_size": batch_size,
        "n_spec": 0,
        "step_s": step_s,
        "prefill_tokens": prefill_tokens,
        "spec_prefill_tokens": 0,
        "primary_live": 1,
        "waiting": 0,
        "waiting_spec": 0,
        "spec_held": 0,
        "decode_rows": decode_rows,
        "kv_tokens": 40,
    }


def _depth_rows(tokens):
    """One node of ``tokens`` tokens as the batch-stats ring holds it: its prefill step (which makes the first
    token), ``tokens - 1`` decode steps, the last of them untimed (its time would come with the next step, but an
    idle gap follows: the reward barrier), then the idle row."""
    rows = [_stats_row(1, 0, 0.05, prefill_tokens=30)]
    rows += [_stats_row(2, 1, 0.02 + 0.001 * i) for i in range(tokens - 2)]
    rows += [_stats_row(2, 1, NAN), _stats_row(0, 0, NAN, batch_size=0)]
    return rows


def _chain(tokens_per_node):
    """A search whose tree is one chain of nodes with these token counts."""
    node = root = Node("r", status=DONE)
    for i, t in enumerate(tokens_per_node):
        child = Node(f"{node.path}.{i}", parent=node, status=DONE, num_tokens=t)
        node.children.append(child)
        node = child
    nodes = [n.to_dict() for n in [root, *(n for n in _walk(root) if n is not root)]]
    return SearchResult("s", "q", "rebase", "done", "1", None, None, [], nodes, sum(tokens_per_node), 2, 1.0)


def _walk(n):
    yield n
    for c in n.children:
        yield from _walk(c)


def test_decode_steps_and_path_bound_count_the_same_thing(monkeypatch):
    """A baseline at one query, depth 2, 8 tokens per node: 2 x (8 - 1) = 14 decode steps, two of them untimed
    (before each idle gap). The old figures: 12 timed steps against a bound of 16 tokens, "max x 0.75"."""
    rows = _depth_rows(8) + _depth_rows(8)
    answer = {
        "batch": {"seq": len(rows), "history": {"rows": rows, "next": len(rows), "seq": len(rows), "lost": 0}},
        "scheduler": {"counters": {}},
    }
    monkeypatch.setattr(sched_trace, "spex_stats", lambda url, since=None: answer)
    trace = sched_trace.scheduler_trace("http://x", {"batch": {"seq": 0}, "scheduler": {"counters": {}}})
    assert trace["decode_steps"] == 12  # the timed ones (their seconds give ms/step)
    assert tot_report.decode_steps(trace) == 14  # every step that decodes

    result = _chain([8, 8])
    assert bench_tot.critical_path(result) == 16  # tokens, prefill's first token of each node included
    assert bench_tot.critical_path_steps(result) == 14
    run = bench_tot._summary([result], [1.0], 2.0)
    assert run["critical_path_steps"] == [14]

    def row(mode):
        return {"policy": "rebase-8", "concurrency": 1, "mode": mode, "repeat": 0, **run, "trace": trace}

    cells = {s["mode"]: s for s in tot_report.summarise([row("baseline"), row("spex_t1t2")])}
    base = cells["baseline"]
    assert base["decode_steps"] == 14 and base["steps_bound"] == 14
    assert base["decode_ms"] == pytest.approx(1e3 * trace["decode_s"] / 12, abs=0.1)  # seconds over timed steps
    assert base["priced_bound"] == pytest.approx(1.0)  # already on its path: nothing left to cut
    split = tot_report.priced_bound(row("baseline"), 1.0, 0.01, 1)
    assert split == pytest.approx(1.0)


def test_bound_of_a_run_recorded_before_critical_path_steps_uses_tokens():
    old = {"trace": {"decode_steps": 90, "mixed_steps": 10}, "critical_path_tokens": [40]}
    assert tot_report.path_steps(old) == [40]
    assert tot_report.path_steps({**old, "critical_path_steps": [35]}) == [35]
    nodes = [{"cum_tokens": 30, "depth": 3, "status": "done"}]  # nodes without tokens/parent: cum_tokens - depth
    assert (
        bench_tot.critical_path_steps(SearchResult("s", "q", "p", "done", None, None, None, [], nodes, 30, 3, 1.0))
        == 27
    )
    assert tot_report.decode_steps({"decode_steps": 5, "mixed_steps": 1}) == 6  # no step rows: the timed count


def _result(status, failures=()):
    return SearchResult("s", "q", "rebase", status, "1", None, None, [], [], 10, 2, 1.0, failures=list(failures))


def test_only_done_searches_count_as_finished_queries():
    row = bench_tot._summary(
        [_result("done"), _result("failed"), _result("done", [{"node": "r.0", "error": "x"}])], [1.0] * 3, 60.0
    )
    assert row["q_per_min"] == 2.0 and row["searches"] == 3 and row["failed_searches"] == 1
    assert row["node_failures"] == 1 and row["statuses"] == ["done", "failed"]
    assert tot_report.run_flags(row) == ["failed", "node_failures"]


def _row(mode, rep, qpm, **extra):
    return {
        "policy": "rebase-8",
        "concurrency": 1,
        "mode": mode,
        "repeat": rep,
        "q_per_min": qpm,
        "accuracy": 0.0,
        "tokens": 100,
        "answers": ["1"],
        "latencies_s": [1.0],
        "speculation": None,
        "statuses": ["done"],
        "flush_wait_s": 0.1,
        "k_total": 8,
        **extra,
    }


def test_flagged_runs_are_reported_and_left_out_of_the_ratios_for_both_modes(capsys):
    rows = [
        _row("baseline", 0, 10.0),
        _row("spex_t1t2", 0, 12.0),
        _row("baseline", 1, 5.0, flush_wait_s="unflushed"),  # warm cache: its pair leaves the ratio
        _row("spex_t1t2", 1, 30.0),
        _row("baseline", 2, 10.0),
        _row("spex_t1t2", 2, 99.0, statuses=["done", "failed"], failed_searches=1, searches=2),
        _row("baseline", 3, 10.0),
        _row("spex_t1t2", 3, 14.0, trace={"rows_lost": 5}, k_total=93, reprofiled=True),
    ]
    cells = {s["mode"]: s for s in tot_report.summarise(rows)}
    spex, base = cells["spex_t1t2"], cells["baseline"]
    assert (spex["ratio"], spex["ratio_min"], spex["ratio_max"]) == (1.2, 1.2, 1.2)  # only repeat 0 is clean
    assert spex["q_per_min"] == 21.0 and spex["repeats"] == 4  # its clean runs: repeats 0 and 1
    assert spex["flagged"] == 2
    assert spex["flags"] == {"failed": 1, "k_total varied": 2, "reprofiled": 1, "rows_lost": 1}
    assert spex["k_totals"] == [8, 93] and spex["failed_searches"] == 1 and spex["searches"] == 5
    assert base["flagged"] == 1 and base["flags"] == {"unflushed": 1} and base["q_per_min"] == 10.0
    tot_report.print_table(list(cells.values()))
    out = capsys.readouterr().out
    assert "flagged: rebase-8 conc 1 spex_t1t2: failed x1, k_total varied 2" in out and "(k_total 8/93)" in out
    assert "flagged: rebase-8 conc 1 baseline: unflushed x1" in out


def test_every_run_flagged_gives_no_ratio():
    rows = [_row("baseline", 0, 10.0, flush_wait_s="unflushed"), _row("spex_t1t2", 0, 12.0)]
    spex = {s["mode"]: s for s in tot_report.summarise(rows)}["spex_t1t2"]
    assert spex["ratio"] is None and spex["same_tree"] == "0/0"


def test_profiler_during_a_run():
    idle = {"measuring": False, "reprofiles": 1, "k_total": 93}
    assert not bench_tot.profiled_during(idle, dict(idle))
    assert bench_tot.profiled_during(idle, {**idle, "reprofiles": 2})
    assert bench_tot.profiled_during(idle, {**idle, "measuring": True})
    assert bench_tot.profiled_during(idle, {**idle, "k_total": 512})
    assert not bench_tot.profiled_during({}, {})  # a server without a profile (a fixed k_total)


def test_the_run_starts_its_trace_after_the_flush(monkeypatch):
    """The stats ring's start is read after the flush succeeded (the previous run's lingering requests are not
    charged to this run), and again when a profile sweep started meanwhile."""
    calls = []
    measuring = iter([True, False])
    monkeypatch.setattr(bench_tot, "wait_for_profiler", lambda url: calls.append("wait") or 1.0)
    monkeypatch.setattr(bench_tot, "flush_cache", lambda url: calls.append("flush") or 0.5)

    def stats(url, since=None):
        calls.append("stats")
        return {"profile": {"measuring": next(measuring)}, "batch": {"seq": len(calls)}}

    monkeypatch.setattr(bench_tot, "spex_stats", stats)
    waited, flushed, before = bench_tot._quiet_start("http://x")
    assert calls == ["wait", "flush", "stats", "wait", "flush", "stats"]
    assert (waited, flushed, before["batch"]["seq"]) == (2.0, 0.5, 6)


class _FakeServer:
    def __init__(self, args=None, **kw):
        self.started = self.stopped = False
        self.url, self.proc = "http://127.0.0.1:1", SimpleNamespace(pid=None)
        _FakeServer.last = self

    def start(self):
        self.started = True
        return self

    def stop(self):
        self.stopped = True


def test_bench_tot_stops_its_server_when_the_knob_read_fails(monkeypatch, tmp_path):
    import overlap

    monkeypatch.setattr(overlap, "stop_servers_on_sigterm", lambda: None)
    monkeypatch.setattr(bench_tot, "ServerProcess", _FakeServer)

    def broken(url, since=None):
        raise RuntimeError("no /spex/stats")

    monkeypatch.setattr(bench_tot, "spex_stats", broken)
    argv = ["--quick", "--task", "toy_add", "--knob-variant", 'share0={"spec_prefill_share": 0}']
    with pytest.raises(RuntimeError, match="no /spex/stats"):
        bench_tot.main([*argv, "--out", str(tmp_path / "bt.json")])
    assert _FakeServer.last.started and _FakeServer.last.stopped


def test_bench_soak_stops_its_server_when_the_reward_service_fails(monkeypatch):
    import bench_soak

    monkeypatch.setattr(bench_soak, "ServerProcess", _FakeServer)
    monkeypatch.setattr(bench_soak, "prepare_tiny_llama", lambda: "/nonexistent/tiny")

    def broken(score, latency_s):
        raise OSError("no port")

    monkeypatch.setattr(bench_soak, "CallbackRewardServer", broken)
    args = SimpleNamespace(reward_timeout=1.0, concurrency=1)
    with pytest.raises(OSError, match="no port"):
        asyncio.run(bench_soak.main_async(args))
    assert _FakeServer.last.started and _FakeServer.last.stopped
