"""Scheduler-side ranking, speculative admission cap and immediate cancel (hook logic; registered in hooks.py).

Request roles come from ``SamplingParams.custom_params["spex_role"]`` (see :mod:`sglang_spex.tot.engine`),
falling back to the rid convention ``spex:{search}:{path}:``. A request without a role is treated as
primary: only work marked speculative is ever ranked down, capped or retracted first.

Everything here runs in SGLang's scheduler process, between forward steps, on the scheduler thread. The
run-time state (budget, counters, cancel watch, prefix protection, stats writer) is one
:class:`SpexSchedulerState` per ``Scheduler``, attached to it by :func:`state_of`. SGLang internals are
reached only through :mod:`sglang_spex.adapters.scheduler`.

Overlap scheduling: the hooks act at the scheduling point, where the batch launched last step is still in
flight. A request of that batch may be finished (immediate cancel) or retracted (budget) there, as SGLang's
own priority preemption does: its in-flight result is skipped because the request is finished or retracted
by then. Requests retracted for the budget are re-queued only after this step's admission (as SGLang does
with ``PrefillAdder.preempt_list``), so a retracted request is never prefilled again before its in-flight
result has been processed.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.schedule_policy import AddReqResult

from sglang_spex.adapters import scheduler as sa
from sglang_spex.config import SpexConfig
from sglang_spex.srt.hook_guard import HookGuard
from sglang_spex.srt.prefix_protection import PrefixProtection
from sglang_spex.tot.engine import ROLE_PRIMARY, search_rid_prefix

logger = logging.getLogger(__name__)

PRIMARY_DEFAULT_PRIORITY = 0  # an unprioritised request outranks speculative work (SGLang's default: lowest)
CANCELLED_SEARCH_TTL_S = 60.0  # late arrivals of a cancelled search are aborted for this long
WATCH_TTL_S = 120.0
EXTRA_BINS = 5  # histogram of tokens decoded after cancel: 0, 1, 2, 3, >=4

G_RANK = HookGuard("rank_priority")
G_RETRACT = HookGuard("rank_retraction")
G_PREEMPT = HookGuard("rank_preempt_on_kv_short")
G_CAP = HookGuard("admission_cap")
G_CANCEL = HookGuard("immediate_cancel")

classify = sa.classify  # (role, search id, node path) of a scheduler Req
is_spec = sa.is_spec


@dataclass
class _Watch:
    req: Any
    n0: int
    t0: float
    immediate: bool


@dataclass
class SpexSchedulerState:
    """The plugin's run-time state in one scheduler: knobs, counters, cancel watch, protection, stats writer."""

    budget: Optional[int] = None  # max speculative requests in the running batch; None = unlimited
    spec_priority: int = -1000
    immediate_cancel: bool = True
    watch: Dict[str, _Watch] = field(default_factory=dict)
    cancelled: Dict[str, float] = field(default_factory=dict)  # rid prefix of a cancelled search -> expiry
    counters: Dict[str, int] = field(default_factory=dict)
    extra_hist: Dict[str, List[int]] = field(
        default_factory=lambda: {"immediate": [0] * EXTRA_BINS, "plain": [0] * EXTRA_BINS}
    )
    protection: PrefixProtection = field(default_factory=PrefixProtection)
    stats: Any = None  # batch_stats.StatsWriter, created by the first published step

    @classmethod
    def from_config(cls, cfg: SpexConfig) -> "SpexSchedulerState":
        return cls(budget=cfg.k_total, spec_priority=cfg.spec_priority)

    def bump(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def report(self) -> Dict[str, Any]:
        return {
            "budget": self.budget,
            "immediate_cancel": self.immediate_cancel,
            "watched_cancels": len(self.watch),
            "cancelled_searches": len(self.cancelled),
            "counters": dict(self.counters),
            "cancel_extra_tokens_hist": {k: list(v) for k, v in self.extra_hist.items()},
        }


def state_of(scheduler: Any) -> SpexSchedulerState:
    """The scheduler's plugin state; created on first use from the process's ``SpexConfig`` (read once)."""
    state = sa.attached_state(scheduler)
    if state is None:
        state = SpexSchedulerState.from_config(SpexConfig.from_env())
        sa.attach_state(scheduler, state)
    return state


def _urgency(priority: Optional[int], low_first: bool) -> int:
    """Larger = more urgent, whichever direction the server uses."""
    if priority is None:
        return -sys.maxsize
    return -priority if low_first else priority


# ---------------------------------------------------------------- ranking
def _assign_priority(scheduler: Any, req: Any) -> None:
    if not sa.priority_scheduling(scheduler):
        return
    state = state_of(scheduler)
    low_first = sa.low_values_first(scheduler)
    current = sa.priority(req)
    if is_spec(req):
        floor = -state.spec_priority if low_first else state.spec_priority
        if current is None or _urgency(current, low_first) > _urgency(floor, low_first):
            sa.set_priority(req, floor)
    elif current is None:
        sa.set_priority(req, PRIMARY_DEFAULT_PRIORITY)


def promote(scheduler: Any, rid: str) -> None:
    """The search now waits on this speculative request: give it primary rank (waiting or running)."""
    state = state_of(scheduler)
    for req in sa.waiting(scheduler) + sa.batch_reqs(sa.running_batch(scheduler)):
        if sa.rid(req) == rid and is_spec(req):
            sa.make_primary(req, PRIMARY_DEFAULT_PRIORITY)
            state.bump("promoted")


def h_assign_priority(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Scheduler._add_request_to_queue: speculative work ranks below every primary request."""
    req = sa.hook_args(type(scheduler)._add_request_to_queue, scheduler, *args, **kwargs)["req"]
    G_RANK.run(_assign_priority, scheduler, req)
    return None


def h_retraction_order(result: List[int], *args: Any, **kwargs: Any) -> List[int]:
    """AFTER ScheduleBatch._get_decode_retraction_order: speculative requests are retracted first."""

    def order() -> List[int]:
        reqs = sa.hook_args(ScheduleBatch._get_decode_retraction_order, *args, **kwargs)["reqs"]
        return sorted(result, key=lambda i: is_spec(reqs[i]))  # stable: SGLang's order within each role

    return G_RETRACT.run(order, default=result)


def h_preempt_on_kv_short(original: Any, adder: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND PrefillAdder.add_one_req: a primary short of KV preempts lower-ranked running requests."""
    res = original(adder, *args, **kwargs)
    if res is not AddReqResult.NO_TOKEN:
        return res

    def try_preempt() -> bool:
        req = sa.hook_args(type(adder).add_one_req, adder, *args, **kwargs)["req"]
        if is_spec(req) or sa.priority(req) is None:
            return False
        if not any(is_spec(r) and not r.finished() for r in sa.adder_running_reqs(adder)):
            return False
        if not sa.preempt_for(adder, req):
            return False
        state = sa.attached_state(sa.adder_tree_cache(adder))
        if state is not None:
            state.bump("preempt_for_primary")
        return True

    if G_PREEMPT.run(try_preempt, default=False):
        return original(adder, *args, **kwargs)
    return res


# ---------------------------------------------------------------- admission cap
def _running_spec(scheduler: Any, batch: Any) -> List[Any]:
    spec = [r for r in sa.batch_reqs(batch) if is_spec(r) and not r.finished()]
    chunked = sa.chunked_req(scheduler)
    if chunked is not None and is_spec(chunked) and chunked not in spec:
        spec.append(chunked)
    return spec


def _spec_over_budget(scheduler: Any, batch: Any, state: SpexSchedulerState) -> List[Any]:
    """Running speculative requests beyond the budget, lowest ranked and least advanced first.

    Every live speculative request counts against the budget; requests already marked to finish, beam
    groups, the chunked request and (overlap) requests whose in-flight result finishes them are never picked."""
    if state.budget is None or batch is None:
        return []
    excess = len(_running_spec(scheduler, batch)) - max(state.budget, 0)
    if excess <= 0:
        return []
    finishing = sa.finishing_inflight(scheduler, batch)
    chunked = sa.chunked_req(scheduler)
    candidates = [
        r
        for r in sa.batch_reqs(batch)
        if is_spec(r) and sa.is_live(r) and not sa.in_beam_group(r) and r not in finishing and r is not chunked
    ]
    low_first = sa.low_values_first(scheduler)
    candidates.sort(key=lambda r: (_urgency(sa.priority(r), low_first), sa.output_len(r)))
    return candidates[:excess]


def _trim_to_budget(scheduler: Any, batch: Any) -> List[Any]:
    """Retract the speculative requests above the budget from ``batch``; returns them (not yet re-queued)."""
    state = state_of(scheduler)
    victims = sa.retract(batch, _spec_over_budget(scheduler, batch, state))
    if victims:
        state.bump("spec_retracted_for_budget", len(victims))
    return victims


def _hide_excess_waiting(scheduler: Any, running_batch: Any) -> List[Any]:
    state = state_of(scheduler)
    if state.budget is None:
        return []
    allowed = max(state.budget - len(_running_spec(scheduler, running_batch)), 0)
    waiting_spec = [r for r in sa.waiting(scheduler) if is_spec(r)]
    if len(waiting_spec) <= allowed:
        return []
    low_first = sa.low_values_first(scheduler)
    waiting_spec.sort(key=lambda r: (-_urgency(sa.priority(r), low_first), sa.queued_at(r)))
    hidden = waiting_spec[allowed:]
    hidden_ids = {id(r) for r in hidden}
    sa.set_waiting(scheduler, [r for r in sa.waiting(scheduler) if id(r) not in hidden_ids])
    return hidden


def h_cap_prefill(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Scheduler._get_new_batch_prefill_raw: trim running speculative work to the budget and admit
    speculative requests only while the budget has room (the rest stay queued, in order). Requests trimmed
    here are re-queued after this step's admission."""
    running_batch = sa.hook_args(type(scheduler)._get_new_batch_prefill_raw, scheduler, *args, **kwargs).get(
        "running_batch"
    )
    hidden: List[Any] = []
    victims: List[Any] = []
    if running_batch is not None:
        victims = G_CAP.run(_trim_to_budget, scheduler, running_batch, default=[]) or []
        hidden = G_CAP.run(_hide_excess_waiting, scheduler, running_batch, default=[]) or []
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        if hidden:
            sa.waiting(scheduler).extend(hidden)
        if victims:
            G_CAP.run(sa.requeue, scheduler, victims)


def _cap_decode(scheduler: Any, batch: Any) -> None:
    sa.requeue(scheduler, _trim_to_budget(scheduler, batch))  # no admission in a decode step


def h_cap_decode(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Scheduler.update_running_batch: a lowered budget retracts excess speculative requests."""
    batch = sa.hook_args(type(scheduler).update_running_batch, scheduler, *args, **kwargs)["batch"]
    G_CAP.run(_cap_decode, scheduler, batch)
    return None


# ---------------------------------------------------------------- cancel
def _before_abort(scheduler: Any, recv_req: Any) -> List[Any]:
    seen = [r for r in sa.waiting(scheduler) if sa.abort_matches(recv_req, sa.rid(r))]
    seen += [r for r in sa.inflight_reqs(scheduler) if not r.finished() and sa.abort_matches(recv_req, sa.rid(r))]
    return seen


def _after_abort(scheduler: Any, recv_req: Any, seen: List[Any]) -> None:
    state = state_of(scheduler)
    now = time.monotonic()
    inflight = {id(r) for r in sa.inflight_reqs(scheduler)}
    ended = set()
    for r in seen:
        role, search, _ = classify(r)
        if search and (role == ROLE_PRIMARY or sa.abort_rid(recv_req) == search_rid_prefix(search)):
            ended.add(search)  # a primary's abort (cancel or client disconnect) ends its search
        if id(r) in inflight and sa.abort_pending(r) and sa.rid(r) not in state.watch:
            state.watch[sa.rid(r)] = _Watch(r, sa.output_len(r), now, state.immediate_cancel)
        elif id(r) not in inflight:
            state.bump("cancel_waiting")
    for search in ended:
        state.protection.end_search(scheduler.tree_cache, search)


def h_abort(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Scheduler.abort_request: watch cancelled running requests; end the searches they belong to."""
    recv_req = sa.hook_args(type(scheduler).abort_request, scheduler, *args, **kwargs)["recv_req"]
    seen = G_CANCEL.run(_before_abort, scheduler, recv_req, default=[]) or []
    result = original(scheduler, *args, **kwargs)
    if seen:
        G_CANCEL.run(_after_abort, scheduler, recv_req, seen)
    return result


def cancel(scheduler: Any, prefix: str, search_id: str = "") -> None:
    """Cancel every request whose rid starts with ``prefix`` (a whole search: ``spex:{id}:``)."""
    if not prefix:
        return
    state = state_of(scheduler)
    if search_id:
        state.cancelled[prefix] = time.monotonic() + CANCELLED_SEARCH_TTL_S
    state.bump("cancel_calls")
    sa.abort(scheduler, prefix)
    if search_id:
        state.protection.end_search(scheduler.tree_cache, search_id)


def _record_extra(state: SpexSchedulerState, w: _Watch) -> None:
    extra = max(sa.output_len(w.req) - w.n0, 0)
    state.extra_hist["immediate" if w.immediate else "plain"][min(extra, EXTRA_BINS - 1)] += 1


def _pre_step(scheduler: Any, running_batch: Any, last_batch: Any) -> None:
    state = state_of(scheduler)
    now = time.monotonic()
    if state.cancelled:  # requests of a cancelled search that were still in the tokenizer
        for prefix, expiry in list(state.cancelled.items()):
            if expiry < now:
                del state.cancelled[prefix]
            elif any(sa.rid(r).startswith(prefix) for r in sa.waiting(scheduler)):
                sa.abort(scheduler, prefix)
    if not state.watch:
        return
    live = {id(r) for r in sa.scheduled_reqs(running_batch, last_batch)}
    for rid, w in list(state.watch.items()):
        req = w.req
        if req.finished():
            _record_extra(state, w)
            del state.watch[rid]
        elif w.immediate and id(req) in live and sa.can_finish_now(scheduler, req):
            sa.finish_now(scheduler, req)
            state.bump("cancel_immediate")
            _record_extra(state, w)
            del state.watch[rid]
        elif now - w.t0 > WATCH_TTL_S:
            del state.watch[rid]


def h_pre_step(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Scheduler.get_next_batch_to_run: finish cancelled running requests now (no extra decode step),
    with or without overlap scheduling."""
    a = sa.hook_args(type(scheduler).get_next_batch_to_run, scheduler, *args, **kwargs)
    G_CANCEL.run(_pre_step, scheduler, a.get("running_batch"), a.get("last_batch"))
    return None
