"""Calibration pieces that need no server: the engine time split from stats rows, and the workload fit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import bench_tot  # noqa: E402
import calib_fit as cf  # noqa: E402
import calib_real as cr  # noqa: E402

from sglang_spex.sim.run import simulate  # noqa: E402
from sglang_spex.sim.workload import Workload, WorkloadParams  # noqa: E402


def _row(mode: int, batch: int, step_s):
    return {"mode": mode, "batch_size": batch, "step_s": step_s}


def test_engine_summary_charges_untimed_steps_their_median():
    rows = [
        _row(cr.PREFILL, 2, 0.10),
        _row(cr.DECODE, 2, 0.05),
        _row(cr.DECODE, 2, 0.07),
        _row(cr.DECODE, 1, None),  # the step before an idle gap: no recorded duration
        _row(cr.PREFILL, 1, None),
    ]
    out = cr.engine_summary(rows, wall=0.6)
    assert out["decode_s"] == pytest.approx(0.05 + 0.07 + 0.06)
    assert out["prefill_s"] == pytest.approx(0.20)
    assert out["busy_s"] == pytest.approx(0.38) and out["idle_s"] == pytest.approx(0.22)
    assert out["idle_periods"] == 2 and out["decode_steps"] == 3 and out["mean_decode_batch"] == round(5 / 3, 2)


def test_workload_fit_recovers_a_simulated_tree():
    """Trees made by the simulator with known parameters: the fit reproduces their size and step lengths."""
    spec = cf.sim_spec_like(bench_tot.build_spec("rebase-8", 4, 24, 0))
    truth = WorkloadParams(lengths="bfs", bfs_median_tokens=18.0, bfs_sigma=0.8, min_tokens=1, answer_hazard=0.35)
    run = simulate(spec, cost=("A100-80G", "Llemma-7B"), workload=Workload(truth, seed=7), questions=6)
    trees = cf.compact_trees(run.results)
    real = cf.tree_stats(trees)
    params, measured = cf.fit_workload(trees, step_tokens=24, max_depth=4, question_words=40)
    fitted, size = cf.match_tree_size(params, spec, real["nodes_per_q"], questions=6, seeds=[7])
    assert abs(size["nodes_per_q_fitted"] / real["nodes_per_q"] - 1) < 0.1
    again = simulate(spec, cost=("A100-80G", "Llemma-7B"), workload=Workload(fitted, seed=8), questions=6)
    sim = cf.tree_stats(cf.compact_trees(again.results))
    assert abs(sim["mean_step_tokens"] / real["mean_step_tokens"] - 1) < 0.15
    assert measured["nodes"] == sum(len([n for n in t if n["depth"] > 0 and n["status"] == "done"]) for t in trees)
