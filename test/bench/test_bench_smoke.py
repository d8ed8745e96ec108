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


def test_t2_temperature_writes_shares_latencies_and_a_plot(tmp_path, monkeypatch):
    """bench_t2_temperature: every mode's row has per-question latency percentiles; the shares table sums to k_total
    at every τ and concentrates on the best hit rate as τ falls (even at a large τ)."""
    mod = __import__("bench_t2_temperature")
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    argv = [
        "--policies",
        "rebase-8",
        "--batch-sizes",
        "2",
        "--seeds",
        "0",
        "--temperatures",
        "0.05,4",
        "--k-total",
        "8",
        "--bounds",
        "0/1",
    ]
    monkeypatch.setattr(sys, "argv", ["bench_t2_temperature", *argv, "--out", str(out), "--plot", str(png)])
    mod.main()
    data = json.loads(out.read_text())
    assert png.stat().st_size > 0
    modes = {r["mode"] for r in data["rows"]}
    assert modes == {"baseline", "T1 (even split)", "T2 tau=0.05", "T2 tau=4", "T2 min0 wait1s"}
    assert mod.modes([], mod.parse_bounds("0/1"))["T2 min0 wait1s"]["min_share"] == 0
    with pytest.raises(SystemExit, match="MIN_SHARE/MAX_WAIT_S"):
        mod.parse_bounds("2")
    assert all(0 < r["latency_p50_s"] <= r["latency_p99_s"] <= r["virtual_time_s"] for r in data["rows"])
    sharp, flat = ([v for k, v in line.items() if k != "tau"] for line in data["shares"])
    assert sum(sharp) == sum(flat) == 8
    assert sharp[0] > flat[0] and max(flat) - min(flat) <= 1


SCRIPTS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "benchmark").glob("bench_*.py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_has_help(script, monkeypatch, capsys):
    mod = __import__(script)
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


def _row(policy, conc, mode, rep, qpm, lat, spec=None, tokens=100):
    return {
        "policy": policy,
        "concurrency": conc,
        "mode": mode,
        "repeat": rep,
        "q_per_min": qpm,
        "accuracy": 0.5,
        "tokens": tokens,
        "answers": ["4", "7"],
        "latencies_s": lat,
        "speculation": spec,
    }


def test_bench_tot_summary_pairs_each_repeat_with_its_baseline():
    import bench_tot

    rows = []
    for rep, (b, s) in enumerate([(10.0, 20.0), (5.0, 15.0), (10.0, 12.0)]):
        rows.append(_row("rstar-10", 1, "baseline", rep, b, [6.0, 7.0]))
        rows.append(_row("rstar-10", 1, "spex_t1t2", rep, s, [3.0, 4.0], {"hits": 2, "issued": 3, "wasted_tokens": 5}))
    cells = {r["mode"]: r for r in bench_tot.summarise(rows)}
    spex, base = cells["spex_t1t2"], cells["baseline"]
    assert (spex["ratio"], spex["ratio_min"], spex["ratio_max"]) == (2.0, 1.2, 3.0)  # per-repeat ratios 2, 3, 1.2
    assert spex["q_per_min"] == 15.0 and base["ratio"] == 1.0
    assert (spex["hits"], spex["issued"], spex["wasted_tokens"]) == (6, 9, 15)
    assert spex["latency_p50_s"] == 3.5 and base["latency_p50_s"] == 6.5 and spex["latency_p99_s"] <= 4.0
    assert spex["same_tree"] == "3/3"


def test_bench_tot_reports_a_run_that_grew_another_tree():
    import bench_tot

    rows = [_row("rebase-8", 8, "baseline", rep, 10.0, [1.0]) for rep in range(2)]
    rows += [
        _row("rebase-8", 8, "spex_t1t2", 0, 10.0, [1.0]),
        _row("rebase-8", 8, "spex_t1t2", 1, 9.0, [1.0], tokens=90),
    ]
    spex = {r["mode"]: r for r in bench_tot.summarise(rows)}["spex_t1t2"]
    assert spex["same_tree"] == "1/2"


def test_bench_tot_run_hit_rate_is_over_the_run_not_summed_per_search():
    import bench_tot

    from sglang_spex.tot.result import SearchResult

    def result(hits, issued):
        return SearchResult(
            "s",
            "q",
            "rebase",
            "done",
            "1",
            None,
            None,
            [],
            [],
            10,
            2,
            1.0,
            speculation={"hits": hits, "issued": issued, "hit_rate": hits / issued},
        )

    acc = bench_tot._summary([result(3, 4), result(1, 4)], [1.0, 1.0], 2.0)["speculation"]
    assert (acc["hits"], acc["issued"], acc["hit_rate"]) == (4, 8, 0.5)


def test_bench_tot_cli_defaults_and_quick():
    import bench_tot

    full = bench_tot.parse_args([])
    assert not full.client_side and full.repeats == 3 and full.max_depth == 4 and full.step_tokens == 48
    assert full.policies == "rebase-8,rebase-16,rstar-10" and full.task.startswith("rg:")
    quick = bench_tot.parse_args(["--quick", "--task", "toy_add", "--repeats", "2"])
    assert quick.repeats == 2 and quick.questions == 1 and quick.task == "toy_add"  # explicit flags win
    with pytest.raises(SystemExit):
        bench_tot.parse_args(["--client-side", "--k-total", "auto"])
    args = bench_tot.parse_args(["--variant", 'bfs2={"bfs_lookahead": 2}'])
    assert args.variants == ["bfs2"] and args.overrides["bfs2"] == {
        **bench_tot.OVERRIDES["spex_t1t2"],
        "bfs_lookahead": 2,
    }
    assert "bfs2" not in bench_tot.OVERRIDES  # parsing leaves the module's modes alone
    for bad in ("bfs2", "bfs2={", "baseline={}", "x=[1]"):
        with pytest.raises(SystemExit):
            bench_tot.parse_args(["--variant", bad])
    args = bench_tot.parse_args(["--knob-variant", 'share0={"spec_prefill_share": 0}'])
    assert args.variants == ["share0"] and args.knob_variants == {"share0": {"spec_prefill_share": 0}}
    assert args.overrides["share0"] == bench_tot.OVERRIDES["spex_t1t2"]  # the searches are plain SPEX
    for bad in ('s={"bogus": 1}', "s={}", 'spex_t1t2={"knee": 4}'):
        with pytest.raises(SystemExit):
            bench_tot.parse_args(["--knob-variant", bad])
    spec = bench_tot.build_spec("rebase-8", 2, 8, 0, "rg:chain_sum", speculation=bench_tot.OVERRIDES["baseline"])
    assert spec.speculation == {"enabled": False} and spec.to_dict()["task"] == "rg:chain_sum"


def test_bench_tot_critical_path_bound():
    import bench_tot
    import tot_report

    from sglang_spex.tot.result import SearchResult

    nodes = [
        {"cum_tokens": 10, "status": "done"},
        {"cum_tokens": 30, "status": "done"},
        {"cum_tokens": 50, "status": "cancelled"},  # never finished: not on the search's path
    ]
    r = SearchResult("s", "q", "rebase", "done", "1", None, None, [], nodes, 40, 3, 1.0)
    assert bench_tot.critical_path(r) == 30
    assert tot_report.steps_bound([30, 20, 10], 1) == 60  # one at a time: the paths add up
    assert tot_report.steps_bound([30, 20, 10], 4) == 30  # all at once: the longest path
    assert tot_report.steps_bound([30, 30, 30, 30], 2) == 60


def test_bench_tot_priced_bound_cuts_steps_to_the_path_and_keeps_the_rows():
    import tot_report

    row = {"trace": {"decode_steps": 90, "mixed_steps": 10}, "critical_path_tokens": [40]}
    # 100 steps priced 20 s; cutting 60 of them at a = 0.1 s leaves 14 s: at most 20/14 on this host
    assert tot_report.priced_bound(row, 20.0, 0.1, 1) == pytest.approx(20.0 / 14.0)
    assert tot_report.priced_bound(row, 20.0, 0.0, 1) == pytest.approx(1.0)  # no fixed price: nothing to gain
    short = {"trace": {"decode_steps": 30}, "critical_path_tokens": [40]}
    assert tot_report.priced_bound(short, 20.0, 0.1, 1) == pytest.approx(1.0)  # already at the path
    assert tot_report.priced_bound({"trace": {}}, 20.0, 0.1, 1) is None


def test_bench_tot_time_split_counts_mixed_steps_as_decoding():
    import tot_report

    trace = {"decode_steps": 10, "decode_s": 1.0, "mixed_steps": 2, "mixed_s": 0.4, "prefill_s": 0.9}
    row = {**_row("rebase-8", 1, "baseline", 0, 1.0, [1.0]), "trace": {**trace, "mean_decode_batch": 3.0}}
    row["critical_path_tokens"] = [5, 5]
    split = tot_report._time_split([row], 1)
    assert split["decode_steps"] == 12 and split["decode_ms"] == 116.7  # (1.0 + 0.4) s over 12 steps
    assert split["prefill_s"] == 0.5 and split["steps_bound"] == 10  # prefill-only; two 5-token paths in turn


def test_a_mixed_preset_reports_each_program():
    """simbench's ``a+b`` preset: one run of both programs on one engine; its row and bench_t2_temperature's
    summary carry each program's own latency and speculation."""
    mod = __import__("bench_t2_temperature")
    rows = []
    for name, mode in (("baseline", None), ("T1 (even split)", sb.ABLATION_MODES["T1"])):
        row = sb.run_mode("rstar-5+rebase-8", mode, cost=("A100-80G", "Llemma-7B"), questions=4, concurrency=2)
        rows.append({"policy": "rstar-5+rebase-8", "concurrency": 2, "seed": 0, "mode": name, **row})
    assert set(rows[1]["by_policy"]) == {"rstar-5", "rebase-8"}
    assert all(p["questions"] == 2 and p["issued"] > 0 for p in rows[1]["by_policy"].values())
    (line,) = mod.summarise(rows, ["T1 (even split)"])
    assert set(line["by_policy"]) == {"rstar-5", "rebase-8"}
    assert all(0 < part["p50_ratio"][0] for part in line["by_policy"].values())
