"""Smoke tests for the simulator benchmarks (tiny sizes, a few seconds)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import simbench as sb  # noqa: E402


def test_run_mode_counts_hits_by_distance_and_depth():
    row = sb.run_mode(
        "rebase-8", sb.SPEX_MODES["spex_sched"], cost=("A100-80G", "Llemma-7B"), questions=1, concurrency=1
    )
    s = row["speculation"]
    assert s["issued"] > 0 and 0 < s["hits"] <= s["issued"]
    assert sum(v["issued"] for v in s["hit_depth"].values()) == s["issued"]
    assert sum(v["hits"] for v in s["hit_depth"].values()) == s["hits"]
    base = sb.run_mode("rebase-8", None, cost=("A100-80G", "Llemma-7B"), questions=1, concurrency=1)
    assert base["speculation"] is None and base["answers"] == row["answers"]  # pure scheduling: same search


@pytest.mark.parametrize(
    "script,extra",
    [
        ("bench_fig10", ["--policies", "rstar-5", "--batch-sizes", "1", "--min-questions", "1"]),
        ("bench_fig11", ["--policies", "rebase-8", "--batch-sizes", "1", "--min-questions", "1"]),
        ("bench_fig14", ["--policies", "rstar-5,rebase-8", "--questions", "1"]),
    ],
)
def test_scripts_write_json_and_png(tmp_path, monkeypatch, script, extra):
    mod = __import__(script)
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    monkeypatch.setattr(sys, "argv", [script, *extra, "--out", str(out), "--plot", str(png)])
    mod.main()
    assert json.loads(out.read_text())["rows"] and png.stat().st_size > 0


SCRIPTS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "benchmark").glob("bench_*.py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_has_help(script, monkeypatch, capsys):
    mod = __import__(script)
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out
