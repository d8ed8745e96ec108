"""SPEX runner logic on a deterministic in-memory port (pure logic; the real-server checks are in test_spex_server)."""

from __future__ import annotations

import asyncio
import random

import pytest
from unit.fake_port import FakePort

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.runner import context_factory
from sglang_spex.tot.engine import parse_rid
from sglang_spex.tot.policies.rstar import RStar
from sglang_spex.tot.search import run_batch, run_search
from sglang_spex.tot.search_spec import SearchSpec, SearchSpecError

POLICIES = {
    "rebase": {"name": "rebase", "width": 6, "max_depth": 3},
    "ets": {"name": "ets", "width": 4, "max_depth": 3, "embedder": "tfidf"},
    "rstar": {"name": "rstar", "num_rollouts": 6, "max_depth": 3, "branch": 2},
    "rest": {"name": "rest", "iterations": 6, "max_depth": 3, "branch": 2, "roll_forward_steps": 1, "end_gate": 2.0},
}


class JitterPort(FakePort):
    """FakePort whose latency depends on the node (stragglers), the same in every run: keyed by the node's path,
    not by its rid (which carries a fresh search id), so a run's order of finishes does not vary by chance."""

    async def generate(self, req):
        await asyncio.sleep(random.Random(parse_rid(req.rid)[1]).uniform(0.001, 0.01))
        return await super().generate(req)


class FirstChildFirstPort(FakePort):
    """Every node's first child (or first rollout sample) finishes 30 ms before its siblings: a window, wide
    against scheduling noise, in which only the first child is known."""

    async def generate(self, req):
        last = parse_rid(req.rid)[1].rsplit(".", 1)[-1]
        await asyncio.sleep(0.002 if last.lstrip("g") == "0" else 0.032)
        return await super().generate(req)


def make_spec(policy: dict, seed: int = 3, **spec_kw) -> SearchSpec:
    return SearchSpec.from_dict(
        {
            "policy": policy,
            "step": {"max_tokens": 8},
            "reward": {"type": "verifier", "name": "arith"},
            "seed": seed,
            **spec_kw,
        }
    )


def signature(res):
    return [(n["path"], n["text"], n["reward"], n["status"]) for n in sorted(res.nodes, key=lambda n: n["path"])]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_spex_t3_off_returns_the_baseline_tree(policy):
    spec = make_spec(POLICIES[policy])
    q = "What is 2 + 3?"
    base = asyncio.run(run_search(spec, q, JitterPort()))
    cfg = SpexConfig(enabled=True, k_total=6, components=("t1", "t2"))
    spx = asyncio.run(run_search(spec, q, JitterPort(), context_factory=context_factory(cfg)))
    assert signature(spx) == signature(base)
    assert spx.answer == base.answer and spx.tokens_generated == base.tokens_generated
    acc = spx.speculation
    assert acc["issued"] > 0
    assert acc["hits"] + acc["cancelled"] + acc["never_used"] + acc["failed"] == acc["issued"]
    assert base.speculation is None


def test_rstar_speculation_hits_and_saves_primary_requests():
    spec = make_spec(POLICIES["rstar"])
    base = asyncio.run(run_search(spec, "q", JitterPort()))
    spx = asyncio.run(
        run_search(spec, "q", JitterPort(), context_factory=context_factory(SpexConfig(enabled=True, k_total=8)))
    )
    assert spx.speculation["hits"] > 0
    assert spx.num_requests == base.num_requests - spx.speculation["hits"]


def test_rebase_misses_are_cancelled_strictly():
    port = JitterPort()
    spec = make_spec({"name": "rebase", "width": 8, "max_depth": 3, "softmax_temperature": 0.2})
    res = asyncio.run(
        run_search(spec, "q", port, context_factory=context_factory(SpexConfig(enabled=True, k_total=16)))
    )
    acc = res.speculation
    assert acc["issued"] > 0 and acc["hits"] > 0
    assert acc["hits"] + acc["cancelled"] + acc["never_used"] + acc["failed"] == acc["issued"]


def test_t3_stops_early_and_reports_it():
    # alpha 0: the margin rule holds as soon as 2 answers exist, whatever order they arrive in (timing-free)
    spec = make_spec({"name": "rebase", "width": 12, "max_depth": 4})
    base = asyncio.run(run_search(spec, "q", JitterPort(answer_from_depth=1)))
    cfg = SpexConfig(enabled=True, k_total=8, early_stop=True, early_stop_min_answers=2, early_stop_alpha=0.0)
    res = asyncio.run(run_search(spec, "q", JitterPort(answer_from_depth=1), context_factory=context_factory(cfg)))
    assert res.speculation["early_stopped"] is True and res.stop_reason == "early_stop"
    assert res.tokens_generated < base.tokens_generated


def test_t2_budget_is_shared_across_queries():
    cfg = SpexConfig(enabled=True, k_total=4)
    factory = context_factory(cfg)
    spec = make_spec(POLICIES["rstar"])
    results = asyncio.run(run_batch(spec, ["a", "b", "c"], JitterPort(), concurrency=3, context_factory=factory))
    assert all(r.speculation is not None for r in results)
    peak = max(s for r in results for _, s in r.speculation["budget_shares"])
    assert peak <= 4
    assert not factory.keywords["budget"].contexts  # every search unregistered


def test_bad_speculation_override_names_the_field():
    with pytest.raises(SearchSpecError, match="speculation.lookahead"):
        asyncio.run(
            run_search(
                make_spec(POLICIES["rstar"], speculation={"lookahead": 0}),
                "q",
                FakePort(),
                context_factory=context_factory(SpexConfig(enabled=True)),
            )
        )
    with pytest.raises(SearchSpecError, match="speculation.bogus"):
        asyncio.run(
            run_search(
                make_spec(POLICIES["rstar"], speculation={"bogus": 1}),
                "q",
                FakePort(),
                context_factory=context_factory(SpexConfig(enabled=True)),
            )
        )


class AltStream(RStar):
    """rSTAR drawing its rollouts from another random stream."""

    rng_label = "alt"


def test_speculation_follows_the_policy_objects_own_rollout_stream():
    # no answers: a rollout ends only at max depth, so the current rollout's whole path is predictable, and with
    # lookahead 1 every speculative node is one the search uses, provided the runner replays the policy's stream
    spec = make_spec({"name": "rstar", "num_rollouts": 4, "max_depth": 4, "branch": 3}, seed=3)
    params = spec.policy.build().params
    default = asyncio.run(run_search(spec, "q", JitterPort(answer_from_depth=99)))
    base = asyncio.run(run_search(spec, "q", JitterPort(answer_from_depth=99), policy=AltStream(params)))
    assert signature(base) != signature(default)  # the stream is the policy's: another stream, another tree
    cfg = SpexConfig(enabled=True, k_total=8, lookahead=1, components=("t1", "t2"))
    spx = asyncio.run(
        run_search(
            spec, "q", JitterPort(answer_from_depth=99), policy=AltStream(params), context_factory=context_factory(cfg)
        )
    )
    assert signature(spx) == signature(base)
    acc = spx.speculation
    assert acc["issued"] > 0 and acc["hits"] == acc["issued"]


def test_rest_partial_rollouts_are_speculated_and_adopted():
    """REST-MCTS: while an expansion's children finish, the next rollout samples of the best child so far are
    generated speculatively; the search adopts them (same tree as the baseline)."""
    policy = {"name": "rest", "iterations": 12, "max_depth": 5, "branch": 3, "roll_forward_steps": 2,
              "end_gate": 2.0, "target_answers": 6}  # fmt: skip
    spec, q = make_spec(policy), "What is 2 + 3?"
    base = asyncio.run(run_search(spec, q, FirstChildFirstPort()))
    cfg = SpexConfig(enabled=True, k_total=6, components=("t1", "t2"))
    spx = asyncio.run(run_search(spec, q, FirstChildFirstPort(), context_factory=context_factory(cfg)))
    assert signature(spx) == signature(base)
    rollouts = [n for n in spx.nodes if n["kind"] == "rollout"]
    assert rollouts and any(n["speculative"] for n in rollouts), rollouts
    acc = spx.speculation
    assert acc["hits"] + acc["cancelled"] + acc["never_used"] + acc["failed"] == acc["issued"]
