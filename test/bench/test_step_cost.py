"""The priced schedule (benchmark/step_cost.py): one step price fitted over all modes, and bench_tot's priced ratio."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import bench_tot  # noqa: E402
import step_cost  # noqa: E402
import tot_report  # noqa: E402

PRICE = (0.10, 0.01, 0.03, 0.003, 2e-5)  # a, b per decode row, f per prefilling step, p per prompt token, c per KV


def _steps(rng, n, prefill_every=5, noise=0.002):
    """``n`` steps of varying decode rows, every ``prefill_every``-th one prefilling 20-200 tokens, each row with a
    context of 50-1000 tokens."""
    out = []
    for i in range(n):
        rows = int(rng.integers(1, 16))
        pre = 1.0 if i % prefill_every == 0 else 0.0
        tok = float(rng.integers(20, 200)) if pre else 0.0
        kv = float(rng.integers(50, 1000, rows).sum())
        t = PRICE[0] + PRICE[1] * rows + PRICE[2] * pre + PRICE[3] * tok + PRICE[4] * kv + rng.normal(0, noise)
        out.append([float(rows), pre, tok, kv, t])
    return out


def test_fit_recovers_the_price_despite_a_stalled_step():
    rng = np.random.default_rng(0)
    steps = _steps(rng, 300)
    steps[7][4] = 5.0  # the host stalled one step for seconds
    price = step_cost.fit_price([steps[:150], steps[150:]])
    assert price is not None and price.n == 300
    assert np.allclose(price.coef, PRICE, rtol=0.15, atol=2e-3)
    assert price.coef[4] == pytest.approx(PRICE[4], rel=0.15)  # the context term itself, not only within atol
    want = 0.1 + 0.04 + 0.03 + 0.3 + 2e-5 * 2000
    assert price.cost_s([[4.0, 1.0, 100.0, 2000.0, float("nan")]]) == pytest.approx(want, rel=0.1)


def test_rows_traced_before_kv_tokens_are_priced_without_context():
    rng = np.random.default_rng(3)
    old = [[r, pre, tok, t - PRICE[4] * kv] for r, pre, tok, kv, t in _steps(rng, 200)]
    price = step_cost.fit_price([old])
    assert price is not None and price.coef[4] == pytest.approx(0.0, abs=1e-9)
    assert np.allclose(price.coef[:4], PRICE[:4], rtol=0.15, atol=2e-3)


def test_fit_needs_measured_steps_and_keeps_prices_non_negative():
    assert step_cost.fit_price([[[1.0, 0.0, 0.0, 10.0, float("nan")]] * 20]) is None
    rng = np.random.default_rng(1)
    steps = [
        [r, 0.0, 0.0, 100 * r, 0.2 - 0.001 * r + rng.normal(0, 1e-4)] for r in rng.integers(1, 30, 100).astype(float)
    ]
    assert min(step_cost.fit_price([steps]).coef) >= 0.0  # time falling with rows is not a negative price


def test_compact_reads_batch_stats_rows():
    rows = [
        {"mode": 2, "decode_rows": 3, "prefill_tokens": 0, "kv_tokens": 300, "step_s": 0.1},
        {"mode": 3, "decode_rows": 2, "prefill_tokens": 40, "kv_tokens": 250, "step_s": None},
        {"mode": 1, "decode_rows": 0, "prefill_tokens": 64, "step_s": 0.3},  # a row from before kv_tokens
    ]
    got = step_cost.compact(rows)
    assert got[0] == [3.0, 0.0, 0.0, 300.0, 0.1] and got[2] == [0.0, 1.0, 64.0, 0.0, 0.3]
    assert got[1][:4] == [2.0, 1.0, 40.0, 250.0] and np.isnan(got[1][4])


def _run(mode, rep, qpm, steps):
    return {
        "policy": "rebase-8",
        "concurrency": 1,
        "mode": mode,
        "repeat": rep,
        "q_per_min": qpm,
        "accuracy": 0.5,
        "tokens": 100,
        "answers": ["1"],
        "latencies_s": [1.0],
        "speculation": None,
        "trace": {"step_rows": steps},
    }


def test_priced_ratio_follows_the_schedule_not_the_wall_clock():
    """SPEX's schedule has the same steps but half its prefill tokens; the wall clock said 0.8x (a noisy pair)."""
    rng = np.random.default_rng(2)
    base = _steps(rng, 200)
    spex = [[r, pre, tok / 2, kv, t] for r, pre, tok, kv, t in base]
    rows = [_run("baseline", 0, 10.0, base), _run("spex_t1t2", 0, 8.0, spex)]
    cells = {s["mode"]: s for s in bench_tot.summarise(rows)}
    price = tot_report.step_price(rows)
    want = price.cost_s(base) / price.cost_s(spex)
    assert want > 1.05
    assert cells["spex_t1t2"]["cost_ratio"] == pytest.approx(want, abs=1e-3)
    assert cells["spex_t1t2"]["ratio"] == 0.8 and cells["baseline"]["cost_ratio"] == 1.0


def test_runs_without_step_rows_have_no_priced_ratio():
    rows = [_run("baseline", 0, 10.0, []), _run("spex_t1t2", 0, 8.0, [])]
    for r in rows:
        del r["trace"]
    assert bench_tot.summarise(rows)[1]["cost_ratio"] is None


def test_schedules_priced_at_another_machines_price(tmp_path):
    """--summarise RUN --price FILE[:KEY]: the same two schedules at a price where a row costs nothing beside the
    step give the ratio of their step counts; a file without that key is refused naming what it has."""
    import gpu_step_price

    rng = np.random.default_rng(3)
    base = _steps(rng, 120)
    spex = base[::2]  # half the steps
    rows = [_run("baseline", 0, 10.0, base), _run("spex_t1t2", 0, 8.0, spex)]
    flat = {"a_s": 0.002, "b_s_per_row": 0.0, "f_s": 0.0, "p_s_per_token": 0.0, "c_s_per_kv_token": 0.0}
    path = tmp_path / "price.json"
    path.write_text(json.dumps({"device": "x", "rows": [], "price": {"wall": flat}}))
    price = bench_tot.load_price(f"{path}:wall")
    assert price.coef == (0.002, 0.0, 0.0, 0.0, 0.0)
    cells = {s["mode"]: s for s in bench_tot.summarise(rows, price)}
    assert cells["spex_t1t2"]["cost_ratio"] == pytest.approx(2.0)
    assert bench_tot.summarise(rows)[1]["cost_ratio"] != pytest.approx(2.0)  # the run's own price differs
    assert bench_tot.load_price(str(path)).coef == price.coef  # no kernel price: the wall one
    with pytest.raises(SystemExit, match="no 'kernel' price.*has \\['wall'\\]"):
        bench_tot.load_price(f"{path}:kernel")
    with pytest.raises(ValueError, match="missing"):
        step_cost.StepPrice.from_dict({"a_s": 1.0})
    with pytest.raises(SystemExit):  # a price without recorded schedules to price
        bench_tot.parse_args(["--price", str(path)])
    assert gpu_step_price.step_rows(
        [{"kind": "decode", "batch": 4, "context": 100, "wall_s": 0.01}, {"kind": "prefill", "tokens": 64}],
        "wall_s",
    ) == [[4.0, 0.0, 0.0, 400.0, 0.01]]


def test_gpu_step_price_measures_a_price_on_cpu(tmp_path):
    """The step-price sweep (benchmark/gpu_step_price.py) on CPU, two layers: every point timed, a price fitted."""
    import gpu_step_price

    out = tmp_path / "sp.json"
    data = gpu_step_price.main(
        ["--device", "cpu", "--dtype", "float32", "--layers", "2", "--batches", "1,8", "--contexts", "16,64",
         "--prefills", "16,128", "--reps", "2", "--out", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text())["price"] == data["price"]
    assert [r["kind"] for r in data["rows"]] == ["decode"] * 4 + ["prefill"] * 2
    assert all(r["wall_s"] > 0 and "kernel_s" not in r for r in data["rows"])
    wall = data["price"]["wall"]
    assert wall["steps"] == 6 and wall["a_s"] + wall["b_s_per_row"] + wall["p_s_per_token"] > 0
    # the static-cache step a CUDA graph replays: every call decodes the same position again
    model = gpu_step_price.build_model("cpu", torch.float32, 2)
    with torch.inference_mode():
        step = gpu_step_price.static_decode(model, 2, 12)
        first, again = step().logits, step().logits
    assert first.shape == (2, 1, model.config.vocab_size) and torch.equal(first, again)
