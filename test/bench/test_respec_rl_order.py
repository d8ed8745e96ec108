"""bench_respec_rl's run order and summary: the mode order rotates per (repeat, seed), the raw runs are written
before the summary, and the summary works for any subset of modes (ratios to ``none`` only when it ran)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import bench_respec_rl as rl  # noqa: E402
from bench_respec_rl import mode_order, summarize  # noqa: E402


def _run(seed, seconds, reward=0.5, accept=None, repeat=None):
    r = {
        "seed": seed,
        "server_start_s": 1.0,
        "steps": [
            {
                "step": i,
                "seconds": s,
                "generation_s": s / 2,
                "drafter_update_s": 0.0,
                "policy_update_s": s / 4,
                "push_s": 0.0,
                "active_batch": 4.0,
                "reward_mean": reward,
                "accept_length": accept,
                "distinct_per_group": 3.0,
            }
            for i, s in enumerate(seconds)
        ],
    }
    if repeat is not None:
        r["repeat"] = repeat
    return r


def test_mode_order_rotates_so_every_mode_takes_every_position():
    modes = ["none", "naive", "respec"]
    orders = [mode_order(modes, k) for k in range(3)]
    assert orders[0] == modes  # the first (repeat, seed) runs in --modes order
    assert orders[1] == ["naive", "respec", "none"] and orders[2] == ["respec", "none", "naive"]
    for pos in range(3):
        assert sorted(o[pos] for o in orders) == sorted(modes)
    assert mode_order(modes, 3) == modes and mode_order(["none"], 5) == ["none"] and mode_order([], 2) == []


def test_summary_without_none_first_or_at_all():
    naive = [_run(0, [1.0, 1.0], reward=0.4, accept=2.0)]
    none = [_run(0, [2.0, 2.0], reward=0.5)]
    out = summarize({"naive": naive, "none": none})  # --modes naive none: used to raise KeyError 'none'
    assert out["naive"]["speedup_total"] == pytest.approx(2.0)
    assert out["naive"]["reward_gap_vs_none"] == pytest.approx(-0.1)
    assert "speedup_total" not in out["none"]
    alone = summarize({"naive": naive, "respec": [_run(0, [1.0], accept=3.0)]})  # no none: no ratios, no error
    assert set(alone) == {"naive", "respec"}
    assert all("speedup_total" not in m and "reward_gap_vs_none" not in m for m in alone.values())


def test_speedup_pairs_by_repeat_and_seed_and_tolerates_uneven_runs():
    none = [_run(0, [2.0, 2.0], repeat=0), _run(0, [4.0, 4.0], repeat=1)]
    # listed in another order than none's, one run shorter, one without steps, one without a partner
    naive = [_run(0, [2.0], repeat=1), _run(0, [1.0, 1.0], repeat=0), _run(0, [], repeat=2), _run(7, [9.0], repeat=0)]
    m = summarize({"none": none, "naive": naive})["naive"]
    assert m["speedup_pairs"] == 2
    assert m["speedup_per_step_min_max"] == pytest.approx([2.0, 2.0])  # 2/1, 2/1 (repeat 0) and 4/2 (repeat 1)
    assert m["speedup_total"] == pytest.approx((4.0 + 8.0) / (2.0 + 2.0))
    assert len(m["reward_curve"]) == 1  # the steps every run has
    # results written before the repeat tag pair by position
    old = summarize({"none": [_run(0, [2.0]), _run(1, [3.0])], "naive": [_run(0, [1.0]), _run(1, [1.0])]})
    assert old["naive"]["speedup_per_step_min_max"] == pytest.approx([2.0, 3.0])


def _stub_main(monkeypatch, tmp_path, calls):
    import sglang_spex.respec.grpo_setup as gs

    monkeypatch.setattr(gs, "resolve_model", lambda name: name)
    monkeypatch.setattr(gs, "resolve_task", lambda name, rng=None: name)

    class Setup:
        info = {}

    monkeypatch.setattr(rl, "prepare", lambda a, task, work: (Setup(), tmp_path / "profile.json"))
    monkeypatch.setattr(rl, "plot", lambda runs, path: None)

    def run_mode(mode, a, setup, profile, task, seed):
        calls.append((mode, seed))
        return _run(seed, [2.0 if mode == "none" else 1.0], accept=None if mode == "none" else 2.0)

    monkeypatch.setattr(rl, "run_mode", run_mode)


def test_main_rotates_the_order_and_writes_raw_runs_before_the_summary(tmp_path, monkeypatch):
    calls = []
    _stub_main(monkeypatch, tmp_path, calls)
    out = tmp_path / "r.json"

    def broken(runs):
        raise RuntimeError("summary failed")

    monkeypatch.setattr(rl, "summarize", broken)
    argv = [
        "--modes",
        "naive",
        "none",
        "--repeats",
        "2",
        "--seeds",
        "3",
        "--work-dir",
        str(tmp_path),
        "--out",
        str(out),
    ]
    with pytest.raises(RuntimeError):
        rl.main(argv)
    assert calls == [("naive", 3), ("none", 3), ("none", 3), ("naive", 3)]
    d = json.loads(out.read_text())
    assert d["partial"] is True and len(d["runs"]["naive"]) == 2 and len(d["runs"]["none"]) == 2
    assert [r["repeat"] for r in d["runs"]["none"]] == [0, 1] and [r["position"] for r in d["runs"]["none"]] == [1, 0]


def test_main_summarises_any_subset(tmp_path, monkeypatch):
    calls = []
    _stub_main(monkeypatch, tmp_path, calls)
    out = tmp_path / "r.json"
    assert rl.main(["--modes", "naive", "none", "--work-dir", str(tmp_path), "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert "partial" not in d and d["summary"]["naive"]["speedup_total"] == pytest.approx(2.0)
    with pytest.raises(SystemExit):
        rl.main(["--modes", "none", "none", "--out", str(out)])
