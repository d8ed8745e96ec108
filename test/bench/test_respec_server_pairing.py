"""bench_respec_server's interleaving and pairing: modes alternate per repeat, ratios are per-pair (same overlap,
repeat and batch size) medians with min-max, and --together with --alternate is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import bench_respec_server as brs  # noqa: E402


def _rows(tok_s, repeats=None):
    return [
        {"tok_s": t, **({} if repeats is None else {"repeat": r})}
        for t, r in zip(tok_s, repeats or [None] * len(tok_s))
    ]


def test_mode_order_alternates_per_repeat():
    assert brs.mode_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert brs.mode_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert brs.mode_order(["a", "b"], 2) == ["a", "b"]


def test_paired_ratios_are_per_repeat_not_ratios_of_medians():
    # the machine slows down in repeat 1: both modes' tokens/s fall, the paired ratio does not
    results = {
        "nospec": {"runs": {"on": {4: _rows([100.0, 50.0, 100.0], [0, 1, 2])}}},
        "respec": {"runs": {"on": {4: _rows([45.0, 110.0, 90.0], [1, 0, 2])}, "off": {4: _rows([1.0], [0])}}},
    }
    got = brs.paired_ratios(results, [4])
    assert set(got) == {"respec"} and set(got["respec"]) == {"on"}  # no nospec 'off' column to pair with
    s = got["respec"]["on"][4]
    assert s["n"] == 3 and s["median"] == pytest.approx(0.9) and s["min"] == pytest.approx(0.9)
    assert s["max"] == pytest.approx(1.1)
    assert brs.paired_ratios({"respec": results["respec"]}, [4]) == {}  # no nospec: no ratios


def test_a_repeat_only_one_side_has_is_left_out_and_untagged_rows_pair_by_position():
    results = {
        "nospec": {"runs": {"on": {1: _rows([10.0, 20.0], [0, 2])}}},
        "ngram": {"runs": {"on": {1: _rows([5.0, 30.0, 40.0], [0, 1, 2])}}},
    }
    s = brs.paired_ratios(results, [1])["ngram"]["on"][1]
    assert s["n"] == 2 and (s["min"], s["max"]) == pytest.approx((0.5, 2.0))
    old = {"nospec": {"runs": {"on": {1: _rows([10.0, 20.0])}}}, "ngram": {"runs": {"on": {1: _rows([20.0, 20.0])}}}}
    assert brs.paired_ratios(old, [1])["ngram"]["on"][1]["median"] == pytest.approx(1.5)


def test_table_prints_the_paired_ratio_and_na_columns():
    results = {
        "nospec": {"runs": {"on": {2: _rows([100.0, 80.0], [0, 1])}}, "overlap_actual": {"on": "on", "off": "on"}},
        "eagle3": {"runs": {"on": {2: _rows([90.0, 88.0], [0, 1])}}, "overlap_actual": {"on": "on", "off": "on"}},
    }
    summary = {
        m: {"on": {2: brs.spread([r["tok_s"] for r in results[m]["runs"]["on"][2]])}, "off": None} for m in results
    }
    paired = brs.paired_ratios(results, [2])
    lines = brs.table_lines(results, summary, paired, ["nospec", "eagle3"], ["on", "off"], [2])
    assert lines[0].split() == ["nospec", "overlap", "on", "B=2:", "90", "(80-100)"]
    assert lines[2].endswith("B=2: 89 (88-90) 1.00 (0.90-1.10)x")
    assert "n/a (server ran overlap on)" in lines[1] and "n/a" in lines[3]


def test_together_with_alternate_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        brs.main(["--together", "--alternate"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
