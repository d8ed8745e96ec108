"""T2 with real byte sizes: S_w / S_KV / P_q move the shares as the score says, τ sharpens the split, shares sum
to the budget and respect caps, and the starvation bound gives a waiting query a slot (pure logic)."""

from __future__ import annotations

import math

import pytest

from sglang_spex.speculation.budget import (
    ModelBytes,
    QueryDemand,
    SpecBudget,
    dtype_bytes,
    model_bytes,
    scores,
    split_budget,
)

# SmolLM2-135M-Instruct config.json
SMOLLM2 = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def test_model_bytes_of_smollm2():
    m = model_bytes(SMOLLM2, "bfloat16")
    assert m.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 kv heads, head_dim 64, bf16
    assert m.weight_bytes == pytest.approx(134.5e6 * 2, rel=0.01)  # the card's 135M parameters
    f32 = model_bytes(SMOLLM2, "float32", kv_cache_dtype="fp8_e4m3")
    assert f32.weight_bytes == 2 * m.weight_bytes and f32.kv_bytes_per_token == m.kv_bytes_per_token / 2
    untied = model_bytes({**SMOLLM2, "tie_word_embeddings": False}, "auto")  # auto: the config's torch_dtype
    assert untied.weight_bytes - m.weight_bytes == 49152 * 576 * 2
    assert dtype_bytes("torch.float16") == 2 and dtype_bytes("weird", default=4) == 4


def _demand(qid, prefix_tokens, total_tokens, hit_rate=0.5, m=ModelBytes(1e6, 1e4), cands=100):
    kv = m.kv_bytes_per_token
    return QueryDemand(qid, cands, hit_rate, shared_kv=prefix_tokens * kv, total_kv=total_tokens * kv)


def test_score_follows_the_formula_in_bytes():
    m = ModelBytes(weight_bytes=1e6, kv_bytes_per_token=1e4)
    d = [_demand("a", 50, 100, 0.8, m), _demand("b", 0, 100, 0.8, m)]
    s = scores(d, m.weight_bytes)
    assert s[0] == pytest.approx(0.8 * (1e6 + 50 * 1e4) / (1e6 + 100 * 1e4))
    assert s[1] == pytest.approx(0.8 * 1e6 / (1e6 + 100 * 1e4))


def test_shared_prefix_matters_when_kv_rivals_the_weights_not_when_weights_dominate():
    kv_heavy = ModelBytes(weight_bytes=1e6, kv_bytes_per_token=1e5)
    weight_heavy = ModelBytes(weight_bytes=1e12, kv_bytes_per_token=1e5)
    for m, separates in ((kv_heavy, True), (weight_heavy, False)):
        d = [_demand("cached", 400, 450, m=m), _demand("cold", 0, 450, m=m)]
        shares = split_budget(d, 20, temperature=0.05, min_share=0, weight_bytes=m.weight_bytes)
        assert sum(shares.values()) == 20
        assert (shares["cached"] - shares["cold"] >= 10) is separates, shares


def test_hit_rate_moves_shares():
    m = ModelBytes(1e6, 1e4)
    d = [_demand("good", 10, 100, 0.9, m), _demand("bad", 10, 100, 0.1, m)]
    shares = split_budget(d, 10, temperature=0.1, min_share=0, weight_bytes=m.weight_bytes)
    assert shares["good"] > shares["bad"] and sum(shares.values()) == 10


def test_temperature_sharpens_the_split():
    m = ModelBytes(1e6, 1e4)
    d = [_demand("good", 10, 100, 0.9, m), _demand("bad", 10, 100, 0.3, m)]
    split = {t: split_budget(d, 12, temperature=t, min_share=0, weight_bytes=m.weight_bytes) for t in (1.0, 0.1)}
    s = scores(d, m.weight_bytes)
    w = math.exp(s[0] / 1.0) / (math.exp(s[0] / 1.0) + math.exp(s[1] / 1.0))
    assert split[1.0]["good"] == round(12 * w)  # τ = 1: nearly even (7 / 5)
    assert split[1.0]["good"] - split[1.0]["bad"] <= 2
    assert split[0.1]["good"] >= 11  # τ = 0.1: almost all to the better query
    assert all(sum(v.values()) == 12 for v in split.values())


def test_caps_hold_with_bytes():
    m = ModelBytes(1e6, 1e4)
    d = [_demand("a", 90, 100, 0.9, m, cands=2), _demand("b", 0, 100, 0.1, m, cands=50)]
    shares = split_budget(d, 10, temperature=0.01, min_share=0, weight_bytes=m.weight_bytes)
    assert shares == {"a": 2, "b": 8}


class FakeQuery:
    def __init__(self, qid, hit_rate, cands=10):
        self.search_id, self.inflight = qid, set()
        self.hit_rate, self.cands = hit_rate, cands

    def should_stop(self):
        return False

    def demand(self):
        return QueryDemand(self.search_id, self.cands, self.hit_rate, 0.0, 0.0)


def test_starvation_bound_gives_a_waiting_query_a_slot():
    now = [0.0]
    budget = SpecBudget(2, temperature=0.01, min_share=0, max_wait_s=1.0, clock=lambda: now[0])
    good, starved = FakeQuery("good", 0.9), FakeQuery("starved", 0.1)
    for q in (good, starved):
        budget.register(q)
    assert budget.share(starved) == 0 and budget.share(good) == 2  # τ small: all to the better query
    now[0] = 0.9
    assert budget.share(starved) == 0  # still inside the bound
    now[0] = 1.5
    assert budget.share(starved) == 1  # past the bound: one slot (it issues one speculative request) ...
    assert budget.share(starved) == 0  # ... which resets its clock: the next slot comes after another wait
    now[0] = 2.4
    assert budget.share(starved) == 0
    now[0] = 2.6
    assert budget.share(starved) == 1
    budget.unregister(starved)
    assert "starved" not in budget._starved_since


def test_starved_queries_go_first_when_slots_are_short():
    d = [QueryDemand(f"q{i}", 5, p, 0.0, 1.0) for i, p in enumerate((0.9, 0.5, 0.1))]
    assert split_budget(d, 1, temperature=0.01, min_share=1) == {"q0": 1, "q1": 0, "q2": 0}  # best score
    waited = [0.0, 0.5, 3.0]
    assert split_budget(d, 1, temperature=0.01, min_share=1, waited=waited) == {"q0": 0, "q1": 0, "q2": 1}
    two = split_budget(d, 2, temperature=0.01, min_share=0, waited=waited)  # min_share 0: the starving still get 1
    assert two["q1"] == 1 and two["q2"] == 1 and sum(two.values()) == 2
