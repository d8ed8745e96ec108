"""One batch-stats ring per DP rank: file naming, readers by rank, the aggregate, reply ordering (no server)."""

from __future__ import annotations

import math

import pytest

from sglang_spex.srt import batch_stats as bs
from sglang_spex.srt import control


def _row(**kw) -> dict:
    return {"mode": bs.DECODE, "batch_size": 3, "n_primary": 2, "n_spec": 1, "kv_used": 10, "waiting": 1, **kw}


@pytest.fixture
def base(tmp_path):
    return str(tmp_path / "stats")


def test_rank_rings_are_named_by_rank_and_read_by_rank(base):
    w0, w1 = bs.StatsWriter(bs.rank_path(base, 0), 0), bs.StatsWriter(bs.rank_path(base, 1), 1)
    try:
        assert bs.rank_paths(base) == {0: f"{base}.0", 1: f"{base}.1"}
        w0.write(_row(batch_size=3), {"preempt_for_primary": 1})
        for n in (5, 7):
            w1.write(_row(batch_size=n), {"preempt_for_primary": 2})
        r0, r1 = bs.StatsReader(bs.rank_path(base, 0)), bs.StatsReader(bs.rank_path(base, 1))
        assert (r0.dp_rank, r0.seq, r0.latest()["batch_size"]) == (0, 1, 3)
        assert (r1.dp_rank, r1.seq, r1.latest()["batch_size"]) == (1, 2, 7)
        readers = bs.RankReaders(base)
        assert sorted(readers.latest_by_rank()) == [0, 1]
        agg = readers.aggregate_latest()
        assert agg["batch_size"] == 10 and agg["kv_used"] == 20 and agg["waiting"] == 2
        out = bs.read_all_ranks(base, history_since=0)
        assert [r["dp_rank"] for r in out["dp_ranks"]] == [0, 1]
        assert [len(r["history"]["rows"]) for r in out["dp_ranks"]] == [1, 2]  # each ring its own sequence
        assert out["aggregate"]["ranks"] == 2 and out["aggregate"]["counters"]["preempt_for_primary"] == 3
        assert "knee" not in out["aggregate"]["latest"]  # per rank only
    finally:
        w0.close()
        w1.close()
    assert bs.rank_paths(base) == {None: base}  # closed writers leave no ring behind


def test_single_ring_without_dp_keeps_its_name_and_no_rank(base):
    w = bs.StatsWriter(bs.rank_path(base, None))
    try:
        w.write(_row(), {})
        assert bs.rank_paths(base) == {None: base}
        r = bs.StatsReader(base)
        assert r.dp_rank is None and r.latest()["batch_size"] == 3
        out = bs.read_all_ranks(base)
        assert len(out["dp_ranks"]) == 1 and out["aggregate"]["latest"]["batch_size"] == 3
    finally:
        w.close()


def test_a_reader_without_a_rank_reads_rank_0_under_dp(base, monkeypatch):
    monkeypatch.setattr(bs, "stats_channel", lambda: base)
    w0, w1 = bs.StatsWriter(bs.rank_path(base, 0), 0), bs.StatsWriter(bs.rank_path(base, 1), 1)
    try:
        w0.write(_row(batch_size=4), {})
        w1.write(_row(batch_size=9), {})
        assert bs.StatsReader().latest()["batch_size"] == 4  # the single-rank semantics readers had before DP
        assert bs.StatsReader(dp_rank=1).latest()["batch_size"] == 9
        assert bs.read_stats()["dp_rank"] == 0 and bs.read_stats(dp_rank=1)["dp_rank"] == 1
    finally:
        w0.close()
        w1.close()


def test_rank_readers_pick_up_a_rank_that_starts_late(base):
    w0 = bs.StatsWriter(bs.rank_path(base, 0), 0)
    w1 = None
    try:
        w0.write(_row(), {})
        readers = bs.RankReaders(base)
        assert list(readers.latest_by_rank()) == [0]
        w1 = bs.StatsWriter(bs.rank_path(base, 1), 1)
        w1.write(_row(batch_size=1), {})
        assert readers.latest_by_rank()[1]["batch_size"] == 1
    finally:
        w0.close()
        if w1:
            w1.close()


def test_aggregate_skips_missing_rows_and_values():
    agg = bs.aggregate_rows([None, {"batch_size": 2, "kv_used": None}, {"batch_size": 1}])
    assert agg["batch_size"] == 3 and agg["kv_used"] == 0
    assert not any(math.isnan(v) for v in agg.values())


def test_internal_state_replies_are_ordered_by_dp_rank():
    replies = [{"spex": {"sched": {"dp_rank": r}}, "n": r} for r in (1, 0, 2)]
    assert [s["n"] for s in control.rank_order(replies)] == [0, 1, 2]
    plain = [{"n": 1}, {"n": 0}]  # no plugin report: arrival order kept
    assert [s["n"] for s in control.rank_order(plain)] == [1, 0]


def test_a_command_for_another_rank_is_ignored(monkeypatch):
    class Untouchable:  # the scheduler: any use of it means the command was applied
        def __getattr__(self, name):
            raise AssertionError(f"applied: {name}")

    monkeypatch.setattr(control, "process_dp_rank", lambda: 1)
    control.apply(Untouchable(), control.SpexControlReq(op="budget", value=2.0, dp_rank=0))
    with pytest.raises(AssertionError, match="applied"):
        control.apply(Untouchable(), control.SpexControlReq(op="budget", value=2.0, dp_rank=1))
