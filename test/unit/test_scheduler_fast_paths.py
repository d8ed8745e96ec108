"""The scheduler hooks' one-pass helpers count what the plain loops they replaced counted (fake requests, no
engine): roles of live requests, the gate's census (full and counts only), one hook argument by name, a retract
of nothing; and a search's rank change reaches its watchers."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, List, Optional

import pytest
import torch

from sglang_spex.adapters import scheduler as sa
from sglang_spex.srt.census import census
from sglang_spex.tot.context import SearchContext
from sglang_spex.tot.search_spec import SearchSpec

from .fake_port import FakePort


class Params:
    def __init__(self, custom: dict):
        self.custom_params = custom


class Req:
    def __init__(self, i: int, spec: bool, search: Optional[str], done: bool = False, sure: bool = False):
        self.rid = f"spex:{search}:0.{i}:{'s' if spec else ''}" if search else f"plain-{i}"
        custom = {"spex_role": "spec" if spec else "primary", "spex_sure": sure} if search else {}
        self.sampling_params = Params(custom)
        self.finished_reason = "length" if done else None

    def finished(self) -> bool:
        return self.finished_reason is not None


class Batch:
    def __init__(self, reqs: List[Req]):
        self.reqs = reqs


class Sched:
    def __init__(self, running: List[Req], waiting: List[Req], chunked: Optional[Req] = None):
        self.running_batch, self.waiting_queue, self.chunked_req = Batch(running), waiting, chunked


def _reqs(n: int, seed: int) -> List[Req]:
    rng = random.Random(seed)
    return [
        Req(i, rng.random() < 0.4, rng.choice(["a", "b", "c", None]), rng.random() < 0.1, rng.random() < 0.5)
        for i in range(n)
    ]


def _naive_roles(reqs, skip=()):
    live = [r for r in reqs if not r.finished() and id(r) not in skip]
    spec = sum(1 for r in live if sa.is_spec(r))
    sure = sum(1 for r in live if sa.is_spec(r) and sa.is_sure(r))
    return spec, len(live) - spec, sure, {sa.classify(r)[1] or id(r) for r in live if not sa.is_spec(r)}


@pytest.mark.parametrize("seed", range(5))
def test_live_roles_and_count_spec_equal_the_plain_loops(seed):
    reqs = _reqs(60, seed)
    skip = {id(r) for r in reqs[::7]}
    searches: set = set()
    spec, primary, sure = sa.live_roles(reqs, skip=skip, searches=searches)
    assert (spec, primary, sure, searches) == _naive_roles(reqs, skip)
    assert 0 < sure < spec  # the draw marks some speculative requests sure, not all
    fresh = _reqs(60, seed)  # not classified yet: the count classifies them one by one
    assert sa.count_spec(fresh) == sum(map(sa.is_spec, fresh)) == sa.count_spec(fresh)
    assert sa.count_spec([]) == 0


def test_a_promoted_request_counts_as_primary():
    r = Req(0, True, "a")
    assert sa.count_spec([r]) == 1
    sa.make_primary(r, 0)
    assert sa.count_spec([r]) == 0 and sa.live_roles([r]) == (0, 1, 0)


@pytest.mark.parametrize("chunked_role", [None, "spec", "primary", "in batch"])
def test_census_counts_equal_with_and_without_the_lists(chunked_role):
    running, waiting = _reqs(40, 1), _reqs(15, 2)
    for r in waiting:
        r.finished_reason = None
    chunked = {None: None, "spec": Req(99, True, "z"), "primary": Req(98, False, "y"), "in batch": running[0]}
    sched = Sched(running, waiting, chunked[chunked_role])
    full, lean = census(sched, sched.running_batch), census(sched, sched.running_batch, full=False)
    for c in (full, lean):
        assert (c.spec_running, c.primary_decoding, c.primary_chunked, c.primary_waiting, c.primary_live) == (
            full.spec_running,
            full.primary_decoding,
            full.primary_chunked,
            full.primary_waiting,
            full.primary_live,
        )
    spec, primary, sure, searches = _naive_roles(running)
    extra = chunked[chunked_role] if chunked_role in ("spec", "primary") else None
    assert full.spec_running == spec + (chunked_role == "spec")
    assert full.spec_sure == lean.spec_sure == sure > 0  # the chunked speculative request is not sure
    assert full.primary_decoding == primary and full.primary_chunked == (chunked_role == "primary")
    assert full.waiting_spec == [r for r in waiting if sa.is_spec(r)]
    assert full.waiting_primary == [r for r in waiting if not sa.is_spec(r)]
    searches |= {sa.classify(r)[1] or id(r) for r in full.waiting_primary}
    if chunked_role == "primary":
        searches.add(sa.classify(extra)[1] or id(extra))
    assert full.primary_searches == searches
    assert not lean.waiting_spec and not lean.waiting_primary and not lean.primary_searches


class Hooked:
    def method(self, req: Any, is_retracted: bool = False, running_batch: Any = None) -> None: ...


@pytest.mark.parametrize(
    "args,kwargs",
    [((1,), {}), ((1, True), {}), ((), {"req": 1}), ((1,), {"running_batch": 3}), ((1, False, 3), {})],
)
def test_hook_arg_is_hook_args_by_name(args, kwargs):
    named = sa.hook_args(Hooked.method, Hooked(), *args, **kwargs)
    for name in ("req", "is_retracted", "running_batch"):
        assert sa.hook_arg(Hooked.method, name, args, kwargs, None) == named.get(name)
    assert sa.hook_arg(Hooked.method, "req", args, kwargs) == named["req"]
    with pytest.raises(KeyError):
        sa.hook_arg(Hooked.method, "missing", args, kwargs)


def test_retract_of_nothing_leaves_the_batch_alone():
    class Untouchable(Batch):
        def release_req(self, *a):
            raise AssertionError("released")

        def filter_batch(self, *a, **k):
            raise AssertionError("filtered")

    batch = Untouchable(_reqs(5, 0))
    assert sa.retract(batch, []) == [] and len(batch.reqs) == 5


def test_a_search_tells_its_watchers_when_it_is_pinned_to_a_rank():
    ctx = SearchContext(SearchSpec.from_dict({"policy": {"name": "rstar"}}), "1 + 1?", FakePort())
    seen: List[Optional[int]] = []
    assert ctx.dp_rank is None
    ctx.rank_watchers.append(lambda c: seen.append(c.dp_rank))
    ctx.dp_rank = 1
    ctx.dp_rank = 0
    assert seen == [1, 0] and ctx.dp_rank == 0


def test_context_tokens_reads_the_sum_sglang_keeps_or_recomputes_it():
    lens = torch.tensor([5, 7, 11])
    assert sa.context_tokens(SimpleNamespace(seq_lens_sum=23, seq_lens_cpu=lens)) == 23
    assert sa.context_tokens(SimpleNamespace(seq_lens_sum=None, seq_lens_cpu=lens)) == 23  # a decode step's batch
    assert sa.context_tokens(SimpleNamespace(seq_lens_sum=None, seq_lens_cpu=None)) == 0


@pytest.mark.parametrize("low_first", [False, True])
def test_speculation_ranks_below_its_own_search_and_a_promotion_takes_the_searchs_priority(low_first):
    """A search at priority -2000 (high values first) is below the speculative floor (-1000): its speculative
    requests go one step below it, never above its own or anyone's primaries; a promoted one gets -2000 back."""
    from sglang_spex.srt import scheduling

    sign = -1 if low_first else 1  # the same ranks stated the server's way

    class Sched:
        enable_priority_scheduling, schedule_low_priority_values_first = True, low_first
        waiting_queue, chunked_req, tree_cache = [], None, SimpleNamespace()
        running_batch = Batch([])

    sched = Sched()
    scheduling.sa.attach_state(sched, scheduling.SpexSchedulerState(spec_priority=-1000))
    low, plain = Req(0, True, "a"), Req(1, True, "b")
    low.sampling_params.custom_params["spex_search_priority"] = sign * -2000
    for r in (low, plain):
        r.priority = sign * 5  # what a client might set: clamped to the floor
        scheduling._assign_priority(sched, r)
    assert (low.priority, plain.priority) == (sign * -2001, sign * -1000)
    urgent = Req(2, True, "c")
    urgent.sampling_params.custom_params["spex_search_priority"] = sign * 50  # above the floor: the floor holds
    urgent.priority = None
    scheduling._assign_priority(sched, urgent)
    assert urgent.priority == sign * -1000
    sched.waiting_queue = [low, plain]
    scheduling.promote(sched, low.rid)
    scheduling.promote(sched, plain.rid)
    assert (low.priority, plain.priority) == (sign * -2000, scheduling.PRIMARY_DEFAULT_PRIORITY)
    assert not sa.is_spec(low) and not sa.is_spec(plain)
