"""Scheduler-side ranking, speculative admission cap and immediate cancel (hook logic; registered in hooks.py).

Request roles come from ``SamplingParams.custom_params["spex_role"]`` (see :mod:`sglang_spex.tot.engine`),
falling back to the rid convention ``spex:{search}:{path}:``. A request without a role is treated as
primary: only work marked speculative is ever ranked down, capped or retracted first.

Everything here runs in SGLang's scheduler process, between forward steps, on the scheduler thread.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from sglang_spex.srt.hook_guard import HookGuard

logger = logging.getLogger(__name__)

ROLE_PRIMARY = "primary"
ROLE_SPEC = "spec"
PRIMARY_DEFAULT_PRIORITY = 0  # an unprioritised request outranks speculative work (SGLang's default: lowest)
CANCELLED_SEARCH_TTL_S = 60.0  # late arrivals of a cancelled search are aborted for this long
WATCH_TTL_S = 120.0
EXTRA_BINS = 5  # histogram of tokens decoded after cancel: 0, 1, 2, 3, >=4


def _classify(req) -> Tuple[Optional[str], Optional[str], str]:
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    role = search = node = None
    if isinstance(params, dict):
        role, search, node = params.get("spex_role"), params.get("spex_search"), params.get("spex_node")
    rid = getattr(req, "rid", None) or ""
    if rid.startswith("spex:"):
        parts = rid.split(":")
        if len(parts) == 4:
            search = search or parts[1]
            node = node or parts[2]
    return (ROLE_SPEC if role == ROLE_SPEC else ROLE_PRIMARY), (str(search) if search else None), str(node or "")


def classify(req) -> Tuple[str, Optional[str], str]:
    """(role, search_id or None, node path) of a scheduler ``Req``; cached on the request."""
    cached = getattr(req, "_spex_class", None)
    if cached is None:
        cached = _classify(req)
        req._spex_class = cached
    return cached


def is_spec(req) -> bool:
    return classify(req)[0] == ROLE_SPEC


@dataclass
class _Watch:
    req: Any
    n0: int
    t0: float
    immediate: bool


@dataclass
class SchedState:
    """Run-time knobs and counters of the scheduler-side hooks (one per scheduler process)."""

    budget: Optional[int] = None  # max speculative requests in the running batch; None = unlimited
    spec_priority: int = -1000
    immediate_cancel: bool = True
    watch: Dict[str, _Watch] = field(default_factory=dict)
    cancelled: Dict[str, float] = field(default_factory=dict)  # rid prefix of a cancelled search -> expiry
    counters: Dict[str, int] = field(default_factory=dict)
    extra_hist: Dict[str, List[int]] = field(
        default_factory=lambda: {"immediate": [0] * EXTRA_BINS, "plain": [0] * EXTRA_BINS}
    )

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


STATE = SchedState()
G_RANK = HookGuard("rank_priority")
G_RETRACT = HookGuard("rank_retraction")
G_PREEMPT = HookGuard("rank_preempt_on_kv_short")
G_CAP = HookGuard("admission_cap")
G_CANCEL = HookGuard("immediate_cancel")


def configure(budget: Optional[int], spec_priority: int) -> None:
    STATE.budget = budget
    STATE.spec_priority = spec_priority


def _urgency(priority: Optional[int], low_first: bool) -> int:
    """Larger = more urgent, whichever direction the server uses."""
    if priority is None:
        return -sys.maxsize
    return -priority if low_first else priority


# ---------------------------------------------------------------- ranking
def _assign_priority(scheduler, req) -> None:
    if not scheduler.enable_priority_scheduling:
        return
    low_first = bool(scheduler.schedule_low_priority_values_first)
    if is_spec(req):
        floor = -STATE.spec_priority if low_first else STATE.spec_priority
        if req.priority is None or _urgency(req.priority, low_first) > _urgency(floor, low_first):
            req.priority = floor
    elif req.priority is None:
        req.priority = PRIMARY_DEFAULT_PRIORITY


def promote(scheduler, rid: str) -> None:
    """The search now waits on this speculative request: give it primary rank (waiting or running)."""
    reqs = list(scheduler.waiting_queue) + list(getattr(scheduler.running_batch, "reqs", []) or [])
    for req in reqs:
        if getattr(req, "rid", None) == rid and is_spec(req):
            _, search, node = classify(req)
            req._spex_class = (ROLE_PRIMARY, search, node)
            req.priority = PRIMARY_DEFAULT_PRIORITY
            STATE.bump("promoted")


def h_assign_priority(scheduler, req, *args, **kwargs):
    """BEFORE Scheduler._add_request_to_queue: speculative work ranks below every primary request."""
    G_RANK.run(_assign_priority, scheduler, req)
    return None


def h_retraction_order(result, reqs, *args, **kwargs):
    """AFTER ScheduleBatch._get_decode_retraction_order: speculative requests are retracted first."""

    def order():
        return sorted(result, key=lambda i: is_spec(reqs[i]))  # stable: SGLang's order within each role

    return G_RETRACT.run(order, default=result)


def h_preempt_on_kv_short(original, adder, req, *args, **kwargs):
    """AROUND PrefillAdder.add_one_req: a primary short of KV preempts lower-ranked running requests."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    res = original(adder, req, *args, **kwargs)
    if res is not AddReqResult.NO_TOKEN:
        return res

    def try_preempt() -> bool:
        if is_spec(req) or req.priority is None:
            return False
        if not any(is_spec(r) and not r.finished() for r in adder.running_batch.reqs):
            return False
        return bool(adder.preempt_to_schedule(req))

    if G_PREEMPT.run(try_preempt, default=False):
        STATE.bump("preempt_for_primary")
        return original(adder, req, *args, **kwargs)
    return res


# ---------------------------------------------------------------- admission cap
def _spec_over_budget(scheduler, batch) -> List[Any]:
    """Running speculative requests beyond the budget, lowest ranked and least advanced first."""
    budget = STATE.budget
    if budget is None or batch is None:
        return []
    low_first = bool(scheduler.schedule_low_priority_values_first)
    spec = [r for r in batch.reqs if is_spec(r) and not r.finished() and r.to_finish is None and r.beam_group is None]
    chunked = scheduler.chunked_req
    n = len(spec) + (1 if chunked is not None and is_spec(chunked) else 0)
    excess = n - max(budget, 0)
    if excess <= 0:
        return []
    spec.sort(key=lambda r: (_urgency(r.priority, low_first), len(r.output_ids)))
    return spec[:excess]


def _trim_to_budget(scheduler, batch) -> None:
    victims = _spec_over_budget(scheduler, batch)
    if not victims:
        return
    drop = set(victims)
    keep, released = [], 0
    for i, r in enumerate(batch.reqs):
        if r in drop:
            released += 1
            batch.release_req(i, len(batch.reqs) - released)
        else:
            keep.append(i)
    batch.filter_batch(keep_indices=keep)
    batch.batch_is_full = False
    for r in victims:
        scheduler._add_request_to_queue(r, is_retracted=True)
    STATE.bump("spec_retracted_for_budget", len(victims))


def _hide_excess_waiting(scheduler, running_batch) -> List[Any]:
    budget = STATE.budget
    if budget is None:
        return []
    running = sum(1 for r in running_batch.reqs if is_spec(r) and not r.finished())
    chunked = scheduler.chunked_req
    running += 1 if chunked is not None and is_spec(chunked) else 0
    allowed = max(budget - running, 0)
    waiting_spec = [r for r in scheduler.waiting_queue if is_spec(r)]
    if len(waiting_spec) <= allowed:
        return []
    low_first = bool(scheduler.schedule_low_priority_values_first)
    waiting_spec.sort(key=lambda r: (-_urgency(r.priority, low_first), r.time_stats.wait_queue_entry_time or 0.0))
    hidden = waiting_spec[allowed:]
    hidden_ids = {id(r) for r in hidden}
    scheduler.waiting_queue = [r for r in scheduler.waiting_queue if id(r) not in hidden_ids]
    return hidden


def h_cap_prefill(original, scheduler, *args, **kwargs):
    """AROUND Scheduler._get_new_batch_prefill_raw: trim running speculative work to the budget and admit
    speculative requests only while the budget has room (the rest stay queued, in order)."""
    running_batch = kwargs.get("running_batch", args[1] if len(args) > 1 else None)
    hidden: List[Any] = []
    if running_batch is not None:
        G_CAP.run(_trim_to_budget, scheduler, running_batch)
        hidden = G_CAP.run(_hide_excess_waiting, scheduler, running_batch, default=[]) or []
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        if hidden:
            scheduler.waiting_queue.extend(hidden)


def h_cap_decode(scheduler, batch, *args, **kwargs):
    """BEFORE Scheduler.update_running_batch: a lowered budget retracts excess speculative requests."""
    G_CAP.run(_trim_to_budget, scheduler, batch)
    return None


# ---------------------------------------------------------------- cancel
def _matches(recv_req, rid: str) -> bool:
    return bool(recv_req.abort_all or (recv_req.rid and rid.startswith(recv_req.rid)))


def _before_abort(scheduler, recv_req) -> List[Any]:
    seen = [r for r in scheduler.waiting_queue if _matches(recv_req, r.rid)]
    seen += [r for r in scheduler.collect_inflight_reqs() if not r.finished() and _matches(recv_req, r.rid)]
    return seen


def _after_abort(scheduler, recv_req, seen: List[Any]) -> None:
    from sglang_spex.srt import prefix_protection

    now = time.monotonic()
    inflight = {id(r) for r in scheduler.collect_inflight_reqs()}
    ended = set()
    for r in seen:
        role, search, _ = classify(r)
        if search and (role == ROLE_PRIMARY or recv_req.rid == f"spex:{search}:"):
            ended.add(search)  # a primary's abort (cancel or client disconnect) ends its search
        if id(r) in inflight and r.to_finish is not None and r.rid not in STATE.watch:
            STATE.watch[r.rid] = _Watch(r, len(r.output_ids), now, STATE.immediate_cancel)
        elif id(r) not in inflight:
            STATE.bump("cancel_waiting")
    for search in ended:
        prefix_protection.GUARD.end_search(scheduler.tree_cache, search)


def h_abort(original, scheduler, recv_req, *args, **kwargs):
    """AROUND Scheduler.abort_request: watch cancelled running requests; end the searches they belong to."""
    seen = G_CANCEL.run(_before_abort, scheduler, recv_req, default=[]) or []
    result = original(scheduler, recv_req, *args, **kwargs)
    if seen:
        G_CANCEL.run(_after_abort, scheduler, recv_req, seen)
    return result


def cancel(scheduler, prefix: str, search_id: str = "") -> None:
    """Cancel every request whose rid starts with ``prefix`` (a whole search: ``spex:{id}:``)."""
    from sglang.srt.managers.io_struct import AbortReq

    if not prefix:
        return
    if search_id:
        STATE.cancelled[prefix] = time.monotonic() + CANCELLED_SEARCH_TTL_S
    STATE.bump("cancel_calls")
    scheduler.abort_request(AbortReq(rid=prefix))
    if search_id:
        from sglang_spex.srt import prefix_protection

        prefix_protection.GUARD.end_search(scheduler.tree_cache, search_id)


def _record_extra(w: _Watch) -> None:
    extra = max(len(w.req.output_ids) - w.n0, 0)
    STATE.extra_hist["immediate" if w.immediate else "plain"][min(extra, EXTRA_BINS - 1)] += 1


def _finish_now(scheduler, req) -> None:
    from sglang.srt.mem_cache.common import release_kv_cache

    req.finished_reason = req.to_finish
    req.to_finish = None
    release_kv_cache(req, scheduler.tree_cache, checkpoint=True)
    req.time_stats.set_completion_time()
    scheduler.output_streamer.stream_output([req], req.return_logprob)


def _pre_step(scheduler, running_batch, last_batch) -> None:
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    now = time.monotonic()
    if STATE.cancelled:  # requests of a cancelled search that were still in the tokenizer
        for prefix, expiry in list(STATE.cancelled.items()):
            if expiry < now:
                del STATE.cancelled[prefix]
            elif any(r.rid.startswith(prefix) for r in scheduler.waiting_queue):
                scheduler.abort_request(AbortReq(rid=prefix))
    if not STATE.watch:
        return
    batches = [running_batch.reqs if running_batch is not None else []]
    if last_batch is not None and last_batch is not running_batch and last_batch.forward_mode.is_extend():
        batches.append(last_batch.reqs)
    live = {id(r) for reqs in batches for r in reqs}
    can_finish_now = not scheduler.enable_overlap
    for rid, w in list(STATE.watch.items()):
        req = w.req
        if req.finished():
            _record_extra(w)
            del STATE.watch[rid]
        elif (
            w.immediate
            and can_finish_now
            and id(req) in live
            and isinstance(req.to_finish, FINISH_ABORT)
            and req is not scheduler.chunked_req
            and req.beam_group is None
            and req.grammar is None
            and req.kv.holds_kv
        ):
            _finish_now(scheduler, req)
            STATE.bump("cancel_immediate")
            _record_extra(w)
            del STATE.watch[rid]
        elif now - w.t0 > WATCH_TTL_S:
            del STATE.watch[rid]


def h_pre_step(scheduler, running_batch=None, last_batch=None, *args, **kwargs):
    """BEFORE Scheduler.get_next_batch_to_run: finish cancelled running requests now (no extra decode step)."""
    G_CANCEL.run(_pre_step, scheduler, running_batch, last_batch)
    return None
