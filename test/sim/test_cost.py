"""The simulator's step time equals the roofline formula at hand-computed points."""

from __future__ import annotations

import logging

import pytest

from sglang_spex.profile.cache import Profile
from sglang_spex.sim.cost import KNEE_GRID, CostModel, MeasuredCost, RooflineCost
from sglang_spex.sim.hardware import DEVICES, MODELS, get_model


def test_kv_bytes_per_token():
    assert get_model("Llemma-7B").kv_bytes_per_token == 2 * 32 * 32 * 128 * 2  # 512 KiB (MHA)
    assert get_model("Llemma-34B").kv_bytes_per_token == 2 * 48 * 8 * 128 * 2
    assert get_model("DeepSeek-R1-Distill-8B").kv_bytes_per_token == 131072
    assert get_model("Qwen3-30B-A3B").kv_bytes_per_token == 98304


def test_a100_llemma7b_decode_by_hand():
    c = RooflineCost("A100-80G", "Llemma-7B")
    # B = 1, 1000 context tokens: memory-bound.
    # bytes = 6.74e9·2 + (1000 + 1)·524288 = 13.48e9 + 524.812288e6 = 14.004812288e9
    # t = 0.004 + 14.004812288e9 / (2039e9 · 0.8) = 0.004 + 0.0085852 s
    assert c.decode_time(1, 1000) == pytest.approx(0.004 + 14.004812288e9 / (2039e9 * 0.8), rel=1e-9)
    assert c.decode_time(1, 1000) == pytest.approx(0.0125852, abs=1e-6)
    # B = 512, no context: flops = 2·6.74e9·512 = 6.90176e12 → 6.90176e12 / (312e12·0.65) = 0.034033 s
    # bytes = 13.48e9 + 512·524288 = 13.748435456e9 → 0.0084284 s; compute-bound wins
    assert c.decode_time(512, 0) == pytest.approx(0.004 + 6.90176e12 / (312e12 * 0.65), rel=1e-9)
    # vectorised over contexts
    ts = c.decode_time(8, [0, 8000])
    assert ts[1] > ts[0]


def test_h100_prefill_by_hand():
    c = RooflineCost("H100", "Llemma-7B")
    # 2048 new tokens, no cache: flops = 2·6.74e9·2048 + 4·32·32·128·(2048·2049/2)
    flops = 2 * 6.74e9 * 2048 + 4 * 32 * 32 * 128 * (2048 * 2049 / 2)
    assert c.prefill_time(2048) == pytest.approx(0.004 + flops / (989e12 * 0.65), rel=1e-9)
    assert c.prefill_time(0) == 0.0


def test_moe_reads_fewer_weights_at_small_batch():
    m = get_model("Qwen3-30B-A3B")
    assert m.weight_bytes_read(1) < 0.25 * m.weight_bytes
    assert m.weight_bytes_read(4096) == pytest.approx(m.weight_bytes, rel=1e-3)
    assert abs(m.params - 30.5e9) / 30.5e9 < 0.02  # the architecture sums to the card's total
    dense = m.params - m.expert_params * m.experts * m.layers
    assert abs(dense + m.expert_params * m.experts_per_token * m.layers - m.active_params) / m.active_params < 0.05


NO_FIT = {("A6000", "Llemma-34B"), ("A6000", "Qwen3-30B-A3B")}  # weights above 0.9 x memory


@pytest.mark.parametrize("dev", sorted(DEVICES))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_knee_in_plausible_range(name, dev, caplog):
    c = RooflineCost(dev, name)
    if (dev, name) in NO_FIT:
        with pytest.raises(ValueError, match="does not fit"):
            c.max_kv_tokens()
        return
    assert c.max_kv_tokens() > 0
    fit = c.knee(ctx_per_seq=512)
    if c.model.experts:  # MoE reads a fraction of its experts at small batch: its knee lies past the grid
        assert not fit.bounded
        with caplog.at_level(logging.WARNING, logger="sglang_spex.sim.cost"):
            assert c.k_total(ctx_per_seq=512) == KNEE_GRID[-1]
        assert "no knee up to batch 1024" in caplog.text
        return
    # dense: the knee is the ridge point, moved by the KV traffic of 512 tokens a sequence (MHA Llemma-7B: down)
    assert fit.bounded, (dev, name)
    assert c.device.ridge / 3 <= fit.knee <= 3 * c.device.ridge, (dev, name, fit.knee)
    with caplog.at_level(logging.WARNING, logger="sglang_spex.sim.cost"):
        assert c.k_total(ctx_per_seq=512) == round(fit.knee)
    assert not caplog.records


class _Curve(CostModel):
    """A decode curve given by a function of the batch."""

    def __init__(self, name, step):
        self.name, self.step = name, step

    def decode_time(self, batch, ctx_total):
        return self.step(batch)

    def prefill_time(self, new_tokens, cached_tokens=0, attn_pairs=None):
        return 0.0


def test_k_total_warns_once_when_the_knee_is_past_the_grid(caplog):
    flat = _Curve("flat", lambda b: 0.01)  # never turns up: no knee in the grid
    with caplog.at_level(logging.WARNING, logger="sglang_spex.sim.cost"):
        assert flat.k_total() == 1024 and flat.k_total() == 1024
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["flat"]
    caplog.clear()
    bent = _Curve("bent", lambda b: 0.01 + 1e-3 * max(b - 64, 0))  # flat to 64, then linear
    with caplog.at_level(logging.WARNING, logger="sglang_spex.sim.cost"):
        assert 32 <= bent.k_total() <= 128
    assert not caplog.records


def test_a100_knee_near_ridge():
    # with short contexts the knee is the ridge point: 2·P·B/F = 2·P/BW → B = F·eff_f / (BW·eff_b)
    c = RooflineCost("A100-80G", "Llemma-7B")
    ridge = c.device.ridge
    assert c.knee(ctx_per_seq=1).knee == pytest.approx(ridge, rel=0.1)


def test_measured_cost_replays_profile():
    prof = Profile.from_points(
        {"model": "m"}, [1, 2, 4, 8, 16, 32], [0.05 + 0.0042 * b for b in (1, 2, 4, 8, 16, 32)], 20
    )
    prof.ctx_coef, prof.prefill_tok_s, prof.prefill_overhead_s = 1e-5, 640.0, 0.01
    c = MeasuredCost(prof)
    assert c.decode_time(8, 8 * 20) == pytest.approx(0.05 + 0.0042 * 8)
    assert c.decode_time(8, 8 * 120) == pytest.approx(0.05 + 0.0042 * 8 + 1e-5 * 800)
    assert c.prefill_time(640) == pytest.approx(1.01)
    assert c.k_total() == 12
