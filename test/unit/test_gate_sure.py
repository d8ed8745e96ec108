"""The speculative gate and *sure* requests (fake scheduler, no engine): a request its search expects to use takes
no room below the knee, only budget; unsure ones keep the knee's bound and are retracted first."""

from __future__ import annotations

from types import SimpleNamespace
from typing import List, Optional

from sglang_spex.adapters import scheduler as sa
from sglang_spex.srt.census import census
from sglang_spex.srt.scheduling import SpexSchedulerState, _hold_waiting, _spec_over_room, spec_room


class Req:
    def __init__(self, i: int, spec: bool, sure: bool = False, priority: int = 0):
        role = "spec" if spec else "primary"
        self.rid = f"spex:s{i}:r.{i}:{'s' if spec else ''}"
        custom = {"spex_role": role, "spex_search": f"s{i}", "spex_node": f"r.{i}"}
        if sure:
            custom["spex_sure"] = True
        self.sampling_params = SimpleNamespace(custom_params=custom)
        self.priority = -1000 if spec else priority
        self.time_stats = SimpleNamespace(wait_queue_entry_time=float(i))
        self.return_logprob = False
        self.to_finish = self.beam_group = None
        self.origin_input_ids, self.output_ids = [1, 2], [3] * i

    def finished(self) -> bool:
        return False


class Batch:
    def __init__(self, reqs: List[Req]):
        self.reqs = reqs
        self.return_logprob = False

    def is_empty(self) -> bool:
        return not self.reqs


def scheduler(running: List[Req], waiting: List[Req], knee: Optional[int], budget: Optional[int]):
    sched = SimpleNamespace(
        running_batch=Batch(running),
        waiting_queue=waiting,
        chunked_req=None,
        is_mixed_chunk=True,  # a speculative prefill rides the primaries' decode step: only the room limits it
        schedule_low_priority_values_first=False,
        tree_cache=SimpleNamespace(),
        _reqs_finishing_inflight=lambda batch: [],
    )
    state = SpexSchedulerState(knee=knee, live_knee=False)
    state.budget = budget
    sa.attach_state(sched, state)
    return sched, state


def test_sure_running_requests_take_no_room_below_the_knee():
    running = [Req(0, False), Req(1, False), Req(2, True, sure=True), Req(3, True, sure=True), Req(4, True)]
    sched, state = scheduler(running, [], knee=3, budget=8)
    c = census(sched, sched.running_batch)
    assert (c.spec_running, c.spec_sure, c.primary_live) == (3, 2, 2)
    room = spec_room(state, c)
    assert room == 3  # knee 3 - 2 primaries = 1 unsure, plus the 2 sure ones
    assert _spec_over_room(sched, sched.running_batch, room, c.spec_running) == []
    # with the same requests unsure, the knee leaves room for one: two are over it
    plain = [Req(0, False), Req(1, False), Req(2, True), Req(3, True), Req(4, True)]
    sched2, state2 = scheduler(plain, [], knee=3, budget=8)
    c2 = census(sched2, sched2.running_batch)
    assert spec_room(state2, c2) == 1 and len(_spec_over_room(sched2, sched2.running_batch, 1, 3)) == 2


def test_unsure_requests_are_retracted_first():
    running = [Req(0, False), Req(1, True, sure=True), Req(2, True), Req(3, True, sure=True)]
    sched, state = scheduler(running, [], knee=None, budget=2)
    c = census(sched, sched.running_batch)
    room = spec_room(state, c)  # only the budget binds
    assert room == 2
    assert _spec_over_room(sched, sched.running_batch, room, c.spec_running) == [running[2]]


def test_waiting_sure_requests_are_admitted_within_the_budget_only():
    running = [Req(0, False), Req(1, False), Req(2, False)]
    waiting = [Req(10, True), Req(11, True, sure=True), Req(12, True), Req(13, True, sure=True), Req(14, True)]
    sched, state = scheduler(running, list(waiting), knee=4, budget=3)
    c = census(sched, sched.running_batch)
    room = spec_room(state, c)
    assert room == 1  # knee 4 - 3 primaries: one unsure request fits
    hidden = _hold_waiting(sched, sched.running_batch, c, room, c.spec_running)
    admitted = [r for r in sched.waiting_queue]
    # by queue order: 10 (the one unsure slot), 11 (sure), 12 (no unsure room), 13 (sure, the budget's last), 14 out
    assert admitted == [waiting[0], waiting[1], waiting[3]]
    assert hidden == [waiting[2], waiting[4]] and state.gate.held == 2


def test_without_sure_requests_the_gate_is_unchanged():
    waiting = [Req(10, True), Req(11, True), Req(12, True)]
    sched, state = scheduler([Req(0, False), Req(1, False)], list(waiting), knee=3, budget=8)
    c = census(sched, sched.running_batch)
    room = spec_room(state, c)
    hidden = _hold_waiting(sched, sched.running_batch, c, room, c.spec_running)
    assert room == 1 and sched.waiting_queue == waiting[:1] and hidden == waiting[1:]
