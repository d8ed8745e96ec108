"""The cheaper control plane decides exactly as before (pure logic, no engine): the T2 split over the queries with
candidates equals the split over every query; a re-split asked with the inputs of the round's last split answers
from it; the batch-stats publish writes the row and counters it wrote as dicts, and feeds the live curve the
finished step."""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any, Dict, List, Optional, Sequence

import pytest
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_spex.adapters import scheduler as sa
from sglang_spex.speculation import budget as bm
from sglang_spex.speculation.budget import ModelBytes, QueryDemand, SpecBudget, split_budget
from sglang_spex.srt import batch_stats as bs
from sglang_spex.srt.scheduling import SpexSchedulerState


# ---------------------------------------------------------------- T2: the split over the queries with candidates
def _split_over_all(
    demands: List[QueryDemand],
    k_total: int,
    temperature: float = 1.0,
    min_share: int = 1,
    weight_bytes: float = 1.0,
    waited: Optional[Sequence[float]] = None,
) -> Dict[str, int]:
    """``split_budget`` with every query, with or without candidates, through every step (the softmax relative to
    the best score of the queries with candidates, a negative ``min_share`` as 0)."""
    if not demands or k_total <= 0:
        return {d.query_id: 0 for d in demands}
    caps = [float(max(0, d.candidates)) for d in demands]
    s = [x / temperature for x in bm.scores(demands, weight_bytes)]
    if not any(caps):
        return {d.query_id: 0 for d in demands}
    top = max(x for x, c in zip(s, caps) if c > 0)
    w = [math.exp(x - top) if c > 0 else 0.0 for x, c in zip(s, caps)]  # cap 0: never grows, whatever w
    wait = [0.0] * len(caps) if waited is None else [float(x) for x in waited]
    least = max(min_share, 0)
    minimum = [min(c, float(max(least, 1) if wt > 0 else least)) for c, wt in zip(caps, wait)]
    floor = minimum
    if sum(floor) > k_total:
        floor = [0.0] * len(caps)
        used = 0.0
        for i in sorted(range(len(caps)), key=lambda i: (-wait[i], -s[i])):
            if used + minimum[i] <= k_total:
                floor[i] = minimum[i]
                used += minimum[i]
    shares = bm._round(bm._fill(w, floor, caps, k_total), caps, k_total)
    return {d.query_id: int(x) for d, x in zip(demands, shares)}


def _random_demands(rng: random.Random, n: int, p_none: float) -> List[QueryDemand]:
    return [
        QueryDemand(
            f"q{i}",
            0 if rng.random() < p_none else rng.randint(-1, 9),
            rng.choice([0.5, rng.random()]),  # ties in score are common (the prior)
            rng.choice([0.0, rng.random() * 1e5]),
            rng.random() * 1e6,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("seed", range(6))
def test_split_over_the_queries_with_candidates_equals_the_split_over_all(seed):
    rng = random.Random(seed)
    for _ in range(300):
        n = rng.randint(1, 70)
        demands = _random_demands(rng, n, p_none=rng.choice([0.0, 0.5, 0.9, 1.0]))
        waited = rng.choice([None, [rng.choice([0.0, 0.0, rng.random() * 5]) for _ in range(n)]])
        args = (rng.randint(0, 24), rng.choice([0.05, 0.3, 1.0]), rng.choice([-1, 0, 1, 2]))
        kw = {"weight_bytes": rng.choice([1.0, 1e8]), "waited": waited}
        assert split_budget(demands, *args, **kw) == _split_over_all(demands, *args, **kw)


def test_scores_equal_the_formula_with_max():
    rng = random.Random(7)
    for _ in range(2000):
        wb = rng.choice([0.0, 1.0, 1e8, -5.0])
        kv = rng.choice([0.0, -wb, -wb + 1e-12, rng.random() * 1e6, math.nan, -1e6, 7])
        d = QueryDemand("a", 1, rng.random(), rng.choice([0.0, rng.random() * 1e5]), kv)
        want = d.hit_rate * (wb + d.shared_kv) / max(wb + d.total_kv, 1e-9)
        got = bm.scores([d], wb)[0]
        assert got == want or (math.isnan(got) and math.isnan(want))


# ---------------------------------------------------------------- T2: a re-split with the same inputs
class Query:
    """A live search as the budget sees it; its demand and its key change only when told to."""

    def __init__(self, qid: str, cands: int, hit_rate: float):
        self.search_id, self.inflight, self.rank_watchers = qid, set(), []  # never changes its rank
        self.cands, self.hit_rate, self.version, self.asked = cands, hit_rate, 0, 0

    def should_stop(self) -> bool:
        return False

    def demand_key(self):
        return (self.version, self.cands, self.hit_rate)

    def demand(self) -> QueryDemand:
        self.asked += 1
        return QueryDemand(self.search_id, self.cands, self.hit_rate, 0.0, 1.0)


def _counting_splits(monkeypatch) -> List[int]:
    calls: List[int] = []
    real = bm.split_budget

    def counted(*args: Any, **kwargs: Any) -> Dict[str, int]:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bm, "split_budget", counted)
    return calls


def test_a_resplit_with_unchanged_inputs_answers_from_the_last_split(monkeypatch):
    calls = _counting_splits(monkeypatch)
    budget = SpecBudget(4, min_share=1, max_wait_s=1e9)
    queries = [Query("a", 0, 0.5), Query("b", 8, 0.9), Query("c", 8, 0.2)]
    for q in queries:
        budget.register(q)

    async def round_():
        first = [budget.share(q) for q in queries]
        assert len(calls) == 1
        queries[0].version += 1  # a's key changed and its share (0) was held by its C_q (0): split again ...
        assert budget.share(queries[0]) == first[0]
        assert [q.asked for q in queries] == [2, 2, 2]  # ... every demand asked, as before
        assert len(calls) == 1  # ... but the same demands: the last split answers
        queries[0].cands = 3  # a's demand changed: a new split
        got = budget.share(queries[0])
        assert len(calls) == 2 and got > 0
        return first

    first = asyncio.run(round_())
    assert first[0] == 0 and sum(first) == 4 and min(first[1:]) >= 1


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Afresh(SpecBudget):
    """The budget as it was: every re-split computed, every round without room starting every search's clock."""

    def shares(self, demands: List[QueryDemand], total: int, rank: Any = None) -> Dict[str, int]:
        self._last_split.clear()
        return super().shares(demands, total, rank)

    def share(self, ctx: Any) -> int:
        self._clocks_running.clear()
        return super().share(ctx)


@pytest.mark.parametrize("seed", range(6))
def test_shares_and_wait_clocks_equal_those_of_the_budget_as_it_was(seed):
    rng = random.Random(seed)
    k_total, min_share = rng.randint(1, 8), rng.choice([0, 1])
    script = [
        (rng.randrange(12), rng.random(), rng.randint(0, 3), rng.random() < 0.3, rng.choice([0, 0, 2, 40]))
        for _ in range(600)
    ]

    async def run(cls):
        qrng = random.Random(seed)
        clock, load = Clock(), [0]
        budget = cls(k_total, min_share=min_share, max_wait_s=0.5, clock=clock, engine_primary=lambda: load[0])
        queries = [Query(f"q{i}", qrng.randint(0, 3), qrng.random()) for i in range(12)]
        for q in queries:
            budget.register(q)
        out = []
        for i, (who, p, cands, change_key, primary) in enumerate(script):
            q = queries[who]
            if p < 0.15:
                q.cands = cands  # the demand changes
            elif p > 0.99:  # the search ends and a new one takes its place
                budget.unregister(q)
                queries[who] = q = Query(f"n{i}", cands, qrng.random())
                budget.register(q)
            elif change_key:
                q.version += 1  # only the key changes
            out.append(budget.share(q))
            if i % 25 == 24:  # the next event-loop round, a little later, under another primary load
                clock.t += 0.3
                load[0] = primary
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            out.append(sorted(budget._starved_since.items()))
        return out

    fast, afresh = asyncio.run(run(SpecBudget)), asyncio.run(run(Afresh))
    assert fast == afresh
    assert any(isinstance(x, int) and x > 0 for x in fast)  # not vacuous: shares given ...
    assert any(isinstance(x, list) and x for x in fast)  # ... and clocks running


def test_rounds_without_room_start_the_clocks_once_until_one_stops():
    clock, load = Clock(), [9]
    budget = SpecBudget(4, engine_primary=lambda: load[0], clock=clock, max_wait_s=0.5)
    queries = [Query(f"q{i}", 2, 0.5) for i in range(3)]
    for q in queries:
        budget.register(q)
    reads: List[int] = []
    groups = budget.on_rank

    def counted(rank: Any) -> Any:
        reads.append(1)
        return groups(rank)

    budget.on_rank = counted  # type: ignore[method-assign]

    async def rounds(n: int) -> None:
        for _ in range(n):
            assert all(budget.share(q) == 0 for q in queries)
            clock.t += 0.1
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    asyncio.run(rounds(3))
    started = dict(budget._starved_since)
    assert set(started) == {"q0", "q1", "q2"} and len(set(started.values())) == 1
    assert len(reads) == 3 + 1  # the room once per round, the searches' clocks in the first round only
    asyncio.run(rounds(3))
    assert budget._starved_since == started and len(reads) == 4 + 3
    load[0] = 0  # room again: the split gives shares, the clocks of the searches with a share stop
    assert sum(budget.share(q) for q in queries) == 4
    load[0] = 9
    asyncio.run(rounds(1))
    assert set(budget._starved_since) == {"q0", "q1", "q2"} and budget._starved_since != started


def test_a_changed_model_is_a_changed_input():
    budget = SpecBudget(4, max_wait_s=1e9)
    demands = [QueryDemand("a", 4, 0.5, 1e3, 1e4), QueryDemand("b", 4, 0.5, 0.0, 1e6)]

    async def run():
        before = budget.shares(demands, 4)
        budget.model = ModelBytes(1e9, 1.0)
        return before, budget.shares(demands, 4)

    before, after = asyncio.run(run())
    assert after == split_budget(demands, 4, weight_bytes=1e9)
    assert before == split_budget(demands, 4, weight_bytes=1.0)


# ---------------------------------------------------------------- batch-stats publish: the row and counters
class Params:
    def __init__(self, custom: dict):
        self.custom_params = custom


class Req:
    def __init__(self, i: int, spec: bool, search: str, extend_len: int = 0):
        self.rid = f"spex:{search}:r.{i}:{'s' if spec else ''}"
        self.sampling_params = Params({"spex_role": "spec" if spec else "primary", "spex_search": search})
        self.finished_reason, self.extend_len = None, extend_len

    def finished(self) -> bool:
        return self.finished_reason is not None


class Batch:
    def __init__(self, reqs: List[Req], mode: ForwardMode):
        self.reqs, self.forward_mode, self.decoding_reqs = reqs, mode, None


class Tree:
    def evictable_size(self) -> int:
        return 300

    def protected_size(self) -> int:
        return 40


class Allocator:
    def available_size(self) -> int:
        return 5000


class Sched:
    def __init__(self, running: Batch, waiting: List[Req]):
        self.running_batch, self.waiting_queue, self.chunked_req = running, waiting, None
        self.tree_cache, self.token_to_kv_pool_allocator, self.max_total_num_tokens = Tree(), Allocator(), 8000


class Plan:
    def __init__(self, batch: Batch, running: Batch):
        self.batch_to_run, self.running_batch = batch, running


def test_publish_writes_every_field_and_counter_and_feeds_the_finished_step(tmp_path):
    running = Batch([Req(i, i % 3 == 0, f"s{i % 4}") for i in range(9)], ForwardMode.DECODE)
    running.reqs[1].finished_reason = "length"  # finished: not live
    waiting = [Req(20 + i, i % 2 == 0, "w") for i in range(5)]
    sched = Sched(running, waiting)
    state = SpexSchedulerState(budget=6, knee=12)
    sa.attach_state(sched, state)
    state.stats = bs.StatsWriter(str(tmp_path / "ring"))
    try:
        state.gate.room, state.gate.knee, state.gate.primary_live, state.gate.held = 3, 12, 7, 2
        state.counters.update(preempt_for_primary=4, spec_retracted_for_budget=5, spec_before_primary=0)
        state.extra_hist["immediate"][:] = [1, 2, 3, 4, 5]
        state.extra_hist["plain"][:] = [6, 7, 8, 9, 10]
        state.hook_s, state.hook_s_published = 0.25, 0.05
        fed: List[Dict[str, float]] = []
        state.measured = lambda **kw: fed.append(kw)  # type: ignore[method-assign]
        prefill = Batch([Req(30, True, "p", extend_len=7), Req(31, False, "p", extend_len=11)], ForwardMode.EXTEND)
        bs.h_publish(Plan(prefill, running), sched)
        bs.h_publish(Plan(running, running), sched)
        reader = bs.StatsReader(state.stats.path)
        first, second = reader.history(0)["rows"]
        expect_first = {
            "step": 0, "mode": 1, "batch_size": 2, "n_primary": 1, "n_spec": 1, "spec_total": 1 + 3, "budget": 6,
            "kv_used": 8000 - 5000 - 300, "kv_available": 5000, "kv_evictable": 300, "kv_protected": 40,
            "kv_total": 8000, "waiting": 5, "waiting_spec": 3, "spec_room": 3, "knee": 12, "primary_live": 7,
            "primary_running": 5, "spec_held": 2, "decode_protected": 0, "hook_s": 0.2, "prefill_tokens": 18,
            "spec_prefill_tokens": 7, "spec_prefill_credit_s": -1, "spec_prefill_cost_s": 0.0, "decode_rows": 0,
        }  # fmt: skip
        for k, v in expect_first.items():
            assert first[k] == pytest.approx(v), k
        assert first["step_s"] is not None and first["step_s"] >= 0 and first["time"] > 0
        assert second["step"] == 1 and second["mode"] == 2 and second["batch_size"] == 9 and second["n_spec"] == 3
        assert second["spec_total"] == 3 and second["primary_running"] == 0 and second["decode_rows"] == 9
        assert second["spec_held"] == 0  # the gate's step was done
        assert 0 < second["hook_s"] < 0.1  # the first publish's own time
        assert second["step_s"] is None  # written with the next row
        counters = reader.counters()
        hist = [float(x) for x in range(1, 11)]
        assert [counters[k] for k in bs.COUNTERS[:10]] == hist
        assert counters["preempt_for_primary"] == 4 and counters["spec_retracted_for_budget"] == 5
        assert counters["hook_s_total"] == pytest.approx(0.25 + second["hook_s"]) and counters["live_knee"] == -1
        assert counters["curve_a_s"] == -1 and counters["curve_b_s"] == -1
        assert counters["last_step_s"] == pytest.approx(first["step_s"]) == counters["ema_step_s"]
        assert fed == [
            {"mode": 1, "batch_size": 2, "n_primary": 1, "decode_rows": 0, "prefill_tokens": 18,
             "step_s": first["step_s"]}
        ]  # fmt: skip
    finally:
        state.stats.close()


def test_write_step_keeps_the_step_time_counters_while_the_step_time_is_unknown(tmp_path):
    writer = bs.StatsWriter(str(tmp_path / "ring"))
    try:
        row = [0.0] * len(bs.FIELDS)
        assert writer.write_step(row, [1.0] * len(bs.COUNTERS)) is None
        counters = bs.StatsReader(writer.path).counters()
        assert counters["last_step_s"] == 0.0 and counters["ema_step_s"] == 0.0  # the file's initial values
        done = writer.write_step(row, [2.0] * len(bs.COUNTERS))
        assert done is not None and len(done) == len(bs.DONE_FIELDS) + 1
        writer.idle()
        assert writer.write_step(row, [3.0] * len(bs.COUNTERS)) is None  # after idle: the gap is no step time
        counters = bs.StatsReader(writer.path).counters()
        assert counters["last_step_s"] == done[-1] == counters["ema_step_s"]
        assert counters["preempt_for_primary"] == 3.0
    finally:
        writer.close()
