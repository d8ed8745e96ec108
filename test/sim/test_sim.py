"""The simulator: deterministic workload, virtual clock, continuous-batching engine, searches on it."""

from __future__ import annotations

import asyncio
import time

import pytest

from sglang_spex.sim.clock import SimulationDeadlock, run_virtual
from sglang_spex.sim.cost import RooflineCost
from sglang_spex.sim.engine import SimPort
from sglang_spex.sim.run import simulate
from sglang_spex.sim.workload import Workload, WorkloadParams
from sglang_spex.tot.answers import extract_answer
from sglang_spex.tot.engine import GenRequest
from sglang_spex.tot.search_spec import DEFAULT_ANSWER_PATTERN, PolicyConfig, SearchSpec


def _req(prompt: str, path: str, max_new: int = 256, priority=None) -> GenRequest:
    return GenRequest(
        prompt=prompt, rid=f"spex:s:{path}:", max_new_tokens=max_new, stop=["\n\n"], node_path=path, priority=priority
    )


def test_workload_is_a_function_of_seed_and_path():
    a, b, c = Workload(seed=1), Workload(seed=1), Workload(seed=2)
    q = a.question(3)
    paths = ["r.0", "r.1", "r.0.0", "r.0.1.2.0", "r.2.g1"]
    outs = [a.generate(_req(q, p)) for p in paths]
    assert [b.generate(_req(q + " extra trajectory text", p)) for p in paths] == outs  # not the prompt tail
    assert [c.generate(_req(q, p)).reward for p in paths] != [o.reward for o in outs]
    assert len({o.text for o in outs}) == len(outs)
    for p in paths:  # lengths within the DFS/BFS ranges, text tokens = completion tokens
        o = a.generate(_req(q, p))
        assert o.completion_tokens == len(o.text.split()) + (1 if o.finish_reason == "stop" else 0)


def test_answers_parse_with_the_search_pattern_and_skew_shallow():
    wl = Workload(seed=0)
    found = {}
    for qid in range(300):
        for path in ("r.0", "r.0.0", "r.0.0.0", "r.0.0.0.0", "r.0.0.0.0.0", "r.0.0.0.0.0.0"):
            o = wl.outcome(qid, path)
            if o.answer is not None:
                text = wl.generate(_req(wl.question(qid), path, max_new=1000)).text
                assert extract_answer(text, DEFAULT_ANSWER_PATTERN) == o.answer
                found[wl.depth(path)] = found.get(wl.depth(path), 0) + 1
                break
    assert 1 not in found and sum(found.values()) >= 200
    assert found.get(2, 0) + found.get(3, 0) > sum(v for d, v in found.items() if d > 3)


def test_dfs_lengths():
    wl = Workload(WorkloadParams(lengths="dfs"), seed=0)
    lens = [wl.outcome(0, f"r.{i}").num_tokens for i in range(200)]
    assert min(lens) >= 50 and max(lens) <= 100


def test_virtual_clock_is_fast_and_ordered():
    order = []

    async def sleeper(name, dt):
        await asyncio.sleep(dt)
        order.append((name, asyncio.get_running_loop().time()))

    async def main():
        await asyncio.gather(sleeper("b", 7200.0), sleeper("a", 3600.0), asyncio.to_thread(time.sleep, 0.01))
        return asyncio.get_running_loop().time()

    t0 = time.perf_counter()
    end = run_virtual(main)
    assert time.perf_counter() - t0 < 2.0
    assert order == [("a", 3600.0), ("b", 7200.0)] and end == 7200.0


def test_deadlock_is_reported(monkeypatch):
    monkeypatch.setattr("sglang_spex.sim.clock.DEADLOCK_WALL_S", 0.05)

    async def main():
        await asyncio.Event().wait()

    with pytest.raises(SimulationDeadlock):
        run_virtual(main)


def _engine_run(reqs_at, cost, abort_at=None, **kw):
    """Submit (t, GenRequest) pairs; optionally abort a rid at a time; return results and end time."""
    wl = Workload(WorkloadParams(lengths="dfs"), seed=0)

    async def main():
        port = SimPort(cost, wl, **kw)

        async def at(t, req):
            await asyncio.sleep(t)
            return await port.generate(req)

        async def abort(t, rid):
            await asyncio.sleep(t)
            await port.abort(rid)

        tasks = [at(t, r) for t, r in reqs_at] + ([abort(*abort_at)] if abort_at else [])
        out = await asyncio.gather(*tasks)
        await port.close()
        return out[: len(reqs_at)], asyncio.get_running_loop().time(), port.metrics, wl

    return run_virtual(main)


def test_engine_timing_matches_cost_model():
    cost = RooflineCost("A100-80G", "Llemma-7B")
    q = Workload().question(0)
    (res,), end, m, wl = _engine_run([(0.0, _req(q, "r.0"))], cost)
    n, p = res.completion_tokens, res.prompt_tokens
    expect = cost.prefill_time(p, 0) + sum(cost.decode_time(1, p + i) for i in range(1, n))
    assert res.latency == pytest.approx(expect, rel=1e-9) and end == pytest.approx(expect, rel=1e-9)
    assert m.decode_steps == n - 1 and m.generated_tokens == n


def test_engine_batches_and_shares_prefix():
    cost = RooflineCost("A100-80G", "Llemma-7B")
    q = Workload().question(0)
    res, end, m, wl = _engine_run([(0.0, _req(q, "r.0")), (0.0, _req(q, "r.1"))], cost)
    assert m.prefill_passes == 1 and m.mean_batch > 1.0  # both decode together
    # a later request reusing r.0's prompt + output hits the cache
    follow = q + " " + res[0].text + "\n\n"
    res2, _, m2, _ = _engine_run([(0.0, _req(q, "r.0")), (60.0, _req(follow, "r.0.0"))], cost)
    assert res2[1].cached_tokens >= len(follow.split()) - 16


def test_abort_frees_the_slot_at_the_next_step():
    cost = RooflineCost("A100-80G", "Llemma-7B")
    q = Workload().question(0)
    res, end, m, _ = _engine_run([(0.0, _req(q, "r.0")), (0.0, _req(q, "r.1"))], cost, abort_at=(0.1, "spex:s:r.0:"))
    assert res[0].finish_reason == "abort" and 0 < res[0].completion_tokens < 100
    assert res[1].finish_reason == "stop" and m.aborted == 1


def test_abort_during_the_prefill_pass_stops_the_request():
    """A request aborted while its prefill pass runs (in neither the waiting nor the running list) ends with that
    pass: it must not decode to the end. SPEX cancels a speculative node this way; a lost abort made the search wait
    for the whole node (its finalize waits for every cancel)."""
    cost = RooflineCost("A100-80G", "Llemma-7B")
    q = Workload().question(0)
    prefill = cost.prefill_time(len(q.split()), 0)
    (full,), full_end, _, _ = _engine_run([(0.0, _req(q, "r.0"))], cost)
    (res,), end, m, _ = _engine_run([(0.0, _req(q, "r.0"))], cost, abort_at=(prefill / 2, "spex:s:r.0:"))
    assert res.finish_reason == "abort" and res.completion_tokens == 0 and m.aborted == 1
    assert end == pytest.approx(prefill, rel=1e-6) and end < full_end / 2


def test_priority_preempts_when_full():
    cost = RooflineCost("A100-80G", "Llemma-7B")
    q = Workload().question(0)
    res, end, m, _ = _engine_run(
        [(0.0, _req(q, "r.0", priority=-1000)), (0.05, _req(q, "r.1", priority=0))], cost, max_running=1
    )
    assert m.preempted == 1 and res[1].latency < res[0].latency
    assert (
        res[0].completion_tokens == Workload(WorkloadParams(lengths="dfs")).generate(_req(q, "r.0")).completion_tokens
    )


@pytest.mark.parametrize("policy", ["rebase-8", "rstar-5"])
def test_baseline_search_is_deterministic_on_the_simulator(policy):
    spec = SearchSpec(policy=PolicyConfig(policy), seed=3)
    runs = [simulate(spec, cost=("A100-80G", "Llemma-7B"), questions=4, concurrency=2) for _ in range(2)]
    a, b = runs
    assert a.virtual_time == b.virtual_time and a.engine == b.engine
    assert a.answers == b.answers
    assert [[(n["path"], n["text"], n["reward"]) for n in r.nodes] for r in a.results] == [
        [(n["path"], n["text"], n["reward"]) for n in r.nodes] for r in b.results
    ]
    assert all(r.status == "done" for r in a.results) and a.questions_per_min > 0
    assert a.wall_time < 10
    other = simulate(
        SearchSpec(policy=PolicyConfig(policy), seed=4), cost=("A100-80G", "Llemma-7B"), questions=4, concurrency=2
    )
    assert other.virtual_time != a.virtual_time


def test_batching_helps_on_gpu_roofline():
    spec = SearchSpec(policy=PolicyConfig("rstar-5"))
    one = simulate(spec, cost=("A100-80G", "Llemma-7B"), questions=8, concurrency=1)
    eight = simulate(spec, cost=("A100-80G", "Llemma-7B"), questions=8, concurrency=8)
    assert eight.questions_per_min > 3 * one.questions_per_min  # memory-bound: batching is nearly free
    assert eight.answers == one.answers  # the tree does not depend on timing


def test_results_carry_their_virtual_latency():
    """A simulated result's ``wall_time`` is its search's virtual latency: one at a time they add up to the run's
    virtual time; with every question at once each is at most the run, and the last one to finish equals it."""
    spec = SearchSpec(policy=PolicyConfig("rebase-8"), seed=1)
    serial = simulate(spec, cost=("A100-80G", "Llemma-7B"), questions=3, concurrency=1)
    assert sum(r.wall_time for r in serial.results) == pytest.approx(serial.virtual_time, rel=1e-9, abs=1e-9)
    wave = simulate(spec, cost=("A100-80G", "Llemma-7B"), questions=3, concurrency=3)
    lat = [r.wall_time for r in wave.results]
    assert all(0 < x <= wave.virtual_time + 1e-9 for x in lat)
    assert max(lat) == pytest.approx(wave.virtual_time, rel=1e-9, abs=1e-9)
    assert wave.virtual_time < serial.virtual_time  # and these are virtual seconds, not the host's


def test_reward_noise_spread_gives_each_question_its_own_noise():
    flat = Workload(WorkloadParams(), seed=2)
    spread = Workload(WorkloadParams(reward_noise_spread=1.0), seed=2)
    assert {flat.reward_noise(q) for q in range(8)} == {WorkloadParams().reward_noise}
    levels = [spread.reward_noise(q) for q in range(8)]
    assert len(set(levels)) == 8 and levels == [Workload(spread.params, seed=2).reward_noise(q) for q in range(8)]
    assert [flat.outcome(3, "r.0").num_tokens] == [spread.outcome(3, "r.0").num_tokens]  # only the reward moves
