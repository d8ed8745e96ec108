"""The simulator benchmarks' helpers: speedup cells without a baseline, summed accounting, models that do not fit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import bench_fig10  # noqa: E402
import bench_fig11  # noqa: E402
import bench_fig14  # noqa: E402
import simbench as sb  # noqa: E402


def _row(mode: str, q_per_min: float, concurrency: int = 1) -> dict:
    return {
        "policy": "rebase-8",
        "concurrency": concurrency,
        "mode": mode,
        "q_per_min": q_per_min,
        "virtual_time_s": 60.0,
        "answers": ["1"],
        "requests_per_q": 4.0,
        "max_depth_per_q": 2.0,
        "crit_path_tokens_per_q": 100.0,
        "mean_batch": 1.0,
        "speculation": {"hits": 1, "issued": 2, "hit_rate": 0.5, "hit_distance": {}},
    }


def test_fig10_tables_print_a_dash_when_the_baseline_made_no_progress(capsys):
    rows = [_row("baseline", 0.0), _row("spex_sched", 3.0), _row("spex_t3", 3.0)]
    sb.add_ratios(rows)
    assert rows[1]["speedup"] is None
    bench_fig10.print_table(rows, "t")
    why = bench_fig10.print_why(rows, step_s=0.01)
    out = capsys.readouterr().out
    assert "0.00 q/min" in out and "     -    3.00" in out
    assert why[0]["speedup"] is None


def test_fig11_table_and_plot_survive_a_missing_speedup(monkeypatch, tmp_path, capsys):
    def fake_run_mode(preset, mode, **kw):
        return {"q_per_min": 0.0 if mode is None else 2.0}

    monkeypatch.setattr(sb, "run_mode", fake_run_mode)
    out, png = tmp_path / "fig11.json", tmp_path / "fig11.png"
    argv = ["bench_fig11", "--policies", "rebase-8", "--batch-sizes", "1", "--out", str(out), "--plot", str(png)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_fig11.main()
    assert out.exists() and png.exists()
    assert "     -    2.0" in capsys.readouterr().out


def test_fmt_speedup():
    assert sb.fmt_speedup(1.234) == " 1.23x" and sb.fmt_speedup(None) == "     -"
    assert sb.fmt_speedup(2.0, "") == " 2.00" and sb.fmt_speedup(None, "") == "    -"


def test_sum_speculation_averages_gauges_and_sums_counts():
    accs = [
        {"issued": 4, "hits": 1, "min_use": 0.5, "hit_rate": 0.25, "early_stopped": True},
        {"issued": 6, "hits": 3, "min_use": 0.7, "hit_rate": 0.5, "early_stopped": False},
        None,
    ]
    out = sb.sum_speculation(accs)
    assert out["issued"] == 10 and out["hits"] == 4 and out["hit_rate"] == 0.4 and out["early_stops"] == 1
    assert out["min_use"] == pytest.approx(0.6)  # a per-search floor: its mean, not N x the floor


def test_require_fit_exits_with_the_simulators_message():
    sb.require_fit("A100-80G", "Llemma-7B")
    with pytest.raises(SystemExit, match="--device A6000 --model Llemma-34B: model Llemma-34B .* does not fit"):
        sb.require_fit("A6000", "Llemma-34B")


@pytest.mark.parametrize("script", [bench_fig10, bench_fig11, bench_fig14])
def test_a_figure_with_a_model_that_does_not_fit_stops_before_any_run(script, monkeypatch, tmp_path):
    monkeypatch.setattr(sb, "run_mode", lambda *a, **k: pytest.fail("ran a cell"))
    out = ["--out", str(tmp_path / "o.json"), "--plot", str(tmp_path / "o.png")]
    monkeypatch.setattr(sys, "argv", ["x", "--device", "A6000", "--model", "Qwen3-30B-A3B", *out])
    with pytest.raises(SystemExit, match="does not fit"):
        script.main()
