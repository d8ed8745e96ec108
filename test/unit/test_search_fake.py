"""Every policy end-to-end against a deterministic fake engine (fast logic checks; the real-server tests are in
test/search/)."""

from __future__ import annotations

import asyncio

import pytest

from sglang_spex.tot.context import SearchContext
from sglang_spex.tot.engine import GenResult
from sglang_spex.tot.rewards import VERIFIERS, Reward, register_verifier
from sglang_spex.tot.search import run_batch, run_search
from sglang_spex.tot.search_spec import SearchSpec

from .fake_port import FakePort

POLICIES = [
    {"name": "rebase", "width": 4, "max_depth": 4},
    {"name": "ets", "width": 4, "max_depth": 4, "embedder": "tfidf"},
    {"name": "rstar", "num_rollouts": 4, "max_depth": 3, "branch": 2},
    {"name": "rest", "iterations": 4, "max_depth": 3, "branch": 2, "target_answers": 3},
]


def spec_for(policy, reward=None, **kw):
    return SearchSpec.from_dict(
        {"policy": policy, "reward": reward or {"type": "verifier", "name": "arith"}, "seed": 5, **kw}
    )


@pytest.mark.parametrize("policy", POLICIES, ids=[p["name"] for p in POLICIES])
async def test_policy_runs_and_is_reproducible(policy):
    a = await run_search(spec_for(policy), "What is 2 + 3?", FakePort(), reference="5")
    b = await run_search(spec_for(policy), "What is 2 + 3?", FakePort(), reference="5")
    assert a.status == "done" and a.num_requests > 0 and a.tokens_generated == 5 * a.num_requests
    assert len(a.nodes) == a.num_requests + 1
    assert [(n["path"], n["text"], n["reward"]) for n in a.nodes] == [
        (n["path"], n["text"], n["reward"]) for n in b.nodes
    ]
    assert a.answer == b.answer and a.correct == (a.answer is not None and a.correct)


async def test_bfs_issues_a_whole_depth_at_once():
    port = FakePort(delay=0.01)
    seen = []

    class Spy(SearchContext):
        def on_frontier_decided(self, depth, chosen):
            seen.append((depth, sum(w for _, w in chosen), len(port.requests)))

    res = await run_search(spec_for({"name": "rebase", "width": 4, "max_depth": 3}), "q", port, context_factory=Spy)
    assert seen[0] == (0, 4, 0)
    # each depth's requests are all issued before the next frontier is decided
    for (d, w, before), (_, _, after) in zip(seen, seen[1:] + [(None, None, len(port.requests))]):
        assert after - before == w
    assert res.status == "done"


async def test_failing_reward_marks_node_failed():
    @register_verifier("test_flaky")
    def flaky(question, steps):
        if "= 1" in steps[-1][:8] or steps[-1].startswith("3"):
            raise RuntimeError("boom")
        return 0.5

    try:
        res = await run_search(
            spec_for({"name": "rebase", "width": 6, "max_depth": 3}, reward={"type": "verifier", "name": "test_flaky"}),
            "q",
            FakePort(),
        )
    finally:
        VERIFIERS.pop("test_flaky")
    assert res.status == "done" and res.failures
    assert all("boom" in f["error"] for f in res.failures)
    assert {n["status"] for n in res.nodes if n["path"] in {f["path"] for f in res.failures}} == {"failed"}


async def test_reward_timeout_marks_node_failed():
    class SlowReward(Reward):
        async def score(self, node, question, search_id=""):
            await asyncio.sleep(10 if node.path.endswith(".1") else 0)
            return 0.5

    res = await run_search(
        spec_for({"name": "rstar", "num_rollouts": 2, "max_depth": 2, "branch": 2}, reward_timeout=0.05),
        "q",
        FakePort(),
        reward=SlowReward(),
    )
    assert res.status == "done" and res.failures and "timed out" in res.failures[0]["error"]


async def test_cancel_aborts_by_search_prefix():
    port = FakePort(delay=0.05)
    spec = spec_for({"name": "rebase", "width": 4, "max_depth": 20})
    ctx = SearchContext(spec, "q", port)
    task = asyncio.create_task(ctx.run())
    await asyncio.sleep(0.12)
    await ctx.cancel()
    res = await task
    assert res.status == "cancelled" and port.aborted[0] == f"spex:{ctx.search_id}:"
    assert not ctx.inflight
    assert not res.failures and all(n["error"] is None for n in res.nodes)  # its own cancel is no failure


async def test_requests_the_engine_aborted_fail_the_search_and_say_so():
    port = FakePort()
    port.aborted.append("spex:")  # e.g. an operator's abort of every request: none of this search's doing
    res = await run_search(spec_for({"name": "rebase", "width": 2, "max_depth": 2}), "q", port)
    assert res.status == "failed" and "aborted by the engine" in res.error, res.error
    steps = res.nodes[1:]
    assert steps and all(n["status"] == "cancelled" and n["error"] == "aborted by the engine" for n in steps)
    assert [f["path"] for f in res.failures] == [n["path"] for n in steps]


async def test_an_abort_says_sglangs_reason():
    class Updating(FakePort):
        async def generate(self, req):
            return GenResult(
                rid=req.rid, text="", output_ids=[], finish_reason="abort", abort_message="weights updated"
            )

    res = await run_search(spec_for({"name": "rebase", "width": 2, "max_depth": 2}), "q", Updating())
    assert res.status == "failed" and {f["error"] for f in res.failures} == {"aborted by the engine: weights updated"}


def test_sglangs_abort_message_is_kept():
    out = {
        "text": "",
        "meta_info": {"finish_reason": {"type": "abort", "message": "weights updated", "status_code": 200}},
    }
    assert GenResult.from_sglang("x", out).abort_message == "weights updated"
    done = {"text": "a", "meta_info": {"finish_reason": {"type": "length", "length": 4}}}
    assert GenResult.from_sglang("x", done).abort_message is None


async def test_run_batch_orders_results():
    spec = spec_for({"name": "rebase", "width": 2, "max_depth": 2})
    res = await run_batch(spec, ["a", "b", "c"], FakePort(), concurrency=2, references=["1", "2", "3"])
    assert [r.question for r in res] == ["a", "b", "c"]
