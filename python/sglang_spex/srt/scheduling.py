"""Scheduler-side ranking, speculative admission cap and immediate cancel (hook logic; registered in hooks.py).

Request roles come from ``SamplingParams.custom_params["spex_role"]`` (see :mod:`sglang_spex.tot.engine`),
falling back to the rid convention ``spex:{search}:{path}:[s]``. A request without a role is treated as
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

Never slower (the speculative gate, measured here every step, not only by the client's T2 share):

- *Below the knee.* The speculative requests allowed in the running batch (``room``) are the ``/spex/budget``
  cap and the room the primary work (running, chunked and waiting primaries) leaves below the knee, whichever
  is smaller. The knee is the roofline knee the scheduler was given (``--tot-k-total``, or the control knob
  ``knee``) or the knee of the decode step times measured live in this scheduler (:class:`LiveCurve`),
  whichever is smaller. Once the primary work alone reaches the knee the room is 0: running speculative
  requests are retracted and none is admitted (auto-off); it opens again as soon as the primary load drops
  or the live curve stops saying compute-bound. A speculative request its search marks *sure*
  (``custom_params["spex_sure"]``: its expected use measured at ≥ ``--tot-sure-use``, default 0.9, per search
  ``speculation.sure_use``) takes no room below the knee, only
  budget: a hit is work the search does anyway, sooner and batched (what the knee guards against is waste);
  unsure requests are retracted first.
- *Spec prefill never delays a primary decode step.* SGLang runs a prefill batch *instead of* the decode
  step of the running batch, unless it mixes the two into one forward (``--enable-mixed-chunk``, which the
  launcher turns on under ``--tot-mixed-prefill``): then the primaries decode in the same step and speculative
  requests are admitted within the room. Otherwise a step that would prefill only speculative requests while
  primary requests are decoding is turned into that decode step: the waiting speculative requests are held back. They
  may join a prefill that runs anyway for a primary, after every waiting primary (the waiting queue is put
  primaries first; SGLang's adder stops at the first request that does not fit, so nothing speculative is
  admitted past a primary that waits). A step that admits speculative work while a primary stays waiting is
  counted (``spec_before_primary``) so the tests can prove it never happens.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.schedule_policy import AddReqResult

from sglang_spex.adapters import scheduler as sa
from sglang_spex.config import SpexConfig
from sglang_spex.srt.census import Census, census
from sglang_spex.srt.hook_guard import HookGuard
from sglang_spex.srt.live_curve import LiveCurve
from sglang_spex.srt.prefill_allowance import PrefillAllowance, StepAllowance
from sglang_spex.srt.prefix_protection import PrefixProtection
from sglang_spex.tot.engine import ROLE_PRIMARY, parse_rid, search_rid_prefix
from sglang_spex.tot.search_spec import INT64

logger = logging.getLogger(__name__)

PRIMARY_DEFAULT_PRIORITY = 0  # an unprioritised request outranks speculative work (SGLang's default: lowest)
CANCELLED_SEARCH_TTL_S = 60.0  # late arrivals of a cancelled search are aborted for this long
MAX_CANCELLED = 4096  # cancelled searches remembered at most (the oldest forgotten first)
WATCH_TTL_S = 120.0
EXTRA_BINS = 5  # histogram of tokens decoded after cancel: 0, 1, 2, 3, >=4
DECODE = 2  # batch_stats' "mode" of a decode step

G_RANK = HookGuard("rank_priority")
G_RETRACT = HookGuard("rank_retraction")
G_PREEMPT = HookGuard("rank_preempt_on_kv_short")
G_CAP = HookGuard("admission_cap")
G_ALLOW = HookGuard("spec_prefill_allowance")
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
class Gate:
    """The speculative admission decision of the last scheduling step (published with its batch stats)."""

    room: Optional[int] = None  # speculative requests allowed in the running batch now (None: unlimited)
    knee: Optional[int] = None  # the knee in force (None: unknown)
    primary_live: int = 0  # primary requests running, chunked or waiting
    held: int = 0  # waiting speculative requests kept out of this step's prefill
    decode_protected: bool = False  # held because primary requests decode this step
    spec_prefill: Optional[StepAllowance] = None  # speculative prefill beside primaries this step (None: no limit)

    def step_done(self) -> None:
        """The step's batch is chosen: what its admission held and allowed is published, not carried over."""
        self.held, self.decode_protected, self.spec_prefill = 0, False, None


@dataclass
class SpexSchedulerState:
    """The plugin's run-time state in one scheduler: knobs, counters, cancel watch, protection, stats writer."""

    budget: Optional[int] = None  # /spex/budget: max speculative requests in the running batch; None = unlimited
    knee: Optional[int] = None  # roofline knee (batch size) speculation stays below; None = unknown
    live_knee: bool = True  # also stay below the knee of the live decode step times (LiveCurve)
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
    curve: LiveCurve = field(default_factory=LiveCurve)
    prefill: PrefillAllowance = field(default_factory=PrefillAllowance)
    gate: Gate = field(default_factory=Gate)
    hook_s: float = 0.0  # seconds spent in the plugin's scheduler hooks (own work, SGLang's excluded)
    hook_s_published: float = 0.0  # hook_s when the last batch-stats row was written
    hook_by: Dict[str, float] = field(default_factory=dict)  # hook_s per hook

    @classmethod
    def from_config(cls, cfg: SpexConfig) -> "SpexSchedulerState":
        return cls(
            budget=cfg.k_total,
            knee=cfg.k_total,
            spec_priority=cfg.spec_priority,
            live_knee=cfg.live_knee,
            prefill=PrefillAllowance(share=cfg.spec_prefill_share),
        )

    def measured(
        self, mode: float, batch_size: float, n_primary: float, decode_rows: float, prefill_tokens: float, step_s: float
    ) -> None:
        """A published step finished after ``step_s``: feed the live decode curve, the price of a prefill token
        and the speculative prefill allowance (earned by steps that primary requests ran in)."""
        if mode == DECODE:
            self.curve.add(int(batch_size), step_s)
        line = self.curve.line()
        if prefill_tokens > 0:
            self.prefill.price.add(line, int(decode_rows), int(prefill_tokens), step_s)
        if n_primary > 0:
            self.prefill.earn(step_s, line[0] + line[1] * n_primary if line is not None else step_s)

    def knee_in_force(self) -> Optional[int]:
        """The smaller of the given knee and the live one (None when neither is known)."""
        live = self.curve.knee() if self.live_knee else None
        known = [k for k in (self.knee, live) if k is not None]
        return min(known) if known else None

    def bump(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def report(self) -> Dict[str, Any]:
        g = self.gate
        return {
            "budget": self.budget,
            "knee": self.knee,
            "live_knee": self.curve.knee() if self.live_knee else None,
            "live_fit": self.curve.quality(),  # why the live knee is (not) reported: batch sizes, range, slope error
            "gate": {"room": g.room, "knee": g.knee, "primary_live": g.primary_live, "held": g.held},
            "spec_prefill": {
                "share": self.prefill.share,
                "credit_s": self.prefill.credit_s,
                "price_f_p_s": self.prefill.price.price(self.curve.line()),
            },
            "hook_s": self.hook_s,
            "hook_by": dict(self.hook_by),
            "immediate_cancel": self.immediate_cancel,
            "knobs": {  # the /spex/knobs values in force (knee -1: none)
                "immediate_cancel": self.immediate_cancel,
                "protect_ttl_s": self.protection.ttl_s,
                "protect_max_fraction": self.protection.max_fraction,
                "knee": -1 if self.knee is None else self.knee,
                "live_knee": self.live_knee,
                "spec_prefill_share": self.prefill.share,
            },
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
        floor = _spec_floor(state.spec_priority, sa.search_priority(req), low_first)
        if current is None or _urgency(current, low_first) > _urgency(floor, low_first):
            sa.set_priority(req, floor)
    elif current is None:
        sa.set_priority(req, PRIMARY_DEFAULT_PRIORITY)


def _spec_floor(spec_priority: int, search: Optional[int], low_first: bool) -> int:
    """The most urgent priority a speculative request may have: ``spec_priority`` (stated with high values first),
    and one step below its search's primary priority when that is lower (a low-priority search's speculation
    never outranks its own, or anyone's, primary work)."""
    floor = -spec_priority if low_first else spec_priority
    if search is not None and _urgency(search, low_first) <= _urgency(floor, low_first):
        floor = min(max(search + (1 if low_first else -1), INT64[0]), INT64[1])
    return floor


def promote(scheduler: Any, rid: str) -> None:
    """The search now waits on this speculative request: give it primary rank (waiting or running): its search's
    priority, else the default."""
    state = state_of(scheduler)
    for req in sa.waiting(scheduler) + sa.batch_reqs(sa.running_batch(scheduler)):
        if sa.rid(req) == rid and is_spec(req):
            own = sa.search_priority(req)
            sa.make_primary(req, PRIMARY_DEFAULT_PRIORITY if own is None else own)
            state.bump("promoted")


def h_assign_priority(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Scheduler._add_request_to_queue: speculative work ranks below every primary request."""
    t0 = time.perf_counter()
    req = sa.hook_arg(type(scheduler)._add_request_to_queue, "req", args, kwargs)
    G_RANK.run(_assign_priority, scheduler, req)
    sa.charge_hook_time(scheduler, t0, "assign_priority")
    return None


def h_retraction_order(result: List[int], *args: Any, **kwargs: Any) -> List[int]:
    """AFTER ScheduleBatch._get_decode_retraction_order: speculative requests are retracted first."""

    def order() -> List[int]:
        reqs = sa.hook_args(ScheduleBatch._get_decode_retraction_order, *args, **kwargs)["reqs"]
        return sorted(result, key=lambda i: is_spec(reqs[i]))  # stable: SGLang's order within each role

    return G_RETRACT.run(order, default=result)


def _over_allowance(adder: Any, req: Any) -> Tuple[Optional[str], int]:
    """(None, -1) for a speculative request the step's prefill allowance cannot pay for (skip it); (who pays, its
    prompt tokens) to charge once admitted for one it can; (None, 0) where no allowance applies."""
    state = sa.attached_state(sa.adder_tree_cache(adder))
    if state is None or state.gate.spec_prefill is None or not is_spec(req):
        return None, 0
    tokens = sa.pending_prefill_tokens(req)
    payer = state.gate.spec_prefill.pays(tokens, sa.worth_s(req))
    if payer is None:
        state.bump("spec_prefill_deferred")
        return None, -1
    return payer, tokens


def _charge(adder: Any, req: Any, payer: str, tokens: int) -> None:
    admitted = sa.adder_can_run(adder)
    if admitted and admitted[-1] is req:
        state = sa.attached_state(sa.adder_tree_cache(adder))
        state.prefill.spend(state.gate.spec_prefill.take(tokens, payer))
        state.bump("spec_prefill_" + payer)


def h_add_one_req(original: Any, adder: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND PrefillAdder.add_one_req: a speculative request is admitted beside primary work only within the
    step's prefill allowance (else skipped: it stays queued); a primary short of KV preempts lower-ranked
    running requests."""
    req = sa.hook_arg(type(adder).add_one_req, "req", args, kwargs)
    payer, tokens = G_ALLOW.run(_over_allowance, adder, req, default=(None, 0))
    if tokens < 0:
        return AddReqResult.CONTINUE  # SGLang's adder goes on to the next request; this one stays waiting
    res = original(adder, *args, **kwargs)
    if payer is not None:
        G_ALLOW.run(_charge, adder, req, payer, tokens)
    if res is not AddReqResult.NO_TOKEN:
        return res

    def try_preempt() -> bool:
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


# ---------------------------------------------------------------- admission cap (the speculative gate)
def spec_room(state: SpexSchedulerState, counts: Census) -> Optional[int]:
    """Speculative requests allowed in the running batch this step: the budget and the room primary work leaves
    below the knee, whichever is smaller (None: no limit known). Recorded in ``state.gate``."""
    knee = state.knee_in_force()
    primary = counts.primary_live
    caps = [] if state.budget is None else [state.budget]
    if knee is not None:  # a sure speculative request takes no room below the knee: a hit is work done anyway
        caps.append(knee - primary + counts.spec_sure)
    room = max(min(caps), 0) if caps else None
    state.gate.room, state.gate.knee, state.gate.primary_live = room, knee, primary
    return room


def _spec_over_room(scheduler: Any, batch: Any, room: Optional[int], running: int) -> List[Any]:
    """Running speculative requests beyond ``room`` (``running`` of them now), lowest ranked and least advanced
    first.

    Every live speculative request counts against the room; requests already marked to finish, beam
    groups, the chunked request and (overlap) requests whose in-flight result finishes them are never picked."""
    if room is None or batch is None or running <= room:
        return []
    finishing = sa.finishing_inflight(scheduler, batch)
    chunked = sa.chunked_req(scheduler)
    candidates = [
        r
        for r in sa.batch_reqs(batch)
        if is_spec(r) and sa.is_live(r) and not sa.in_beam_group(r) and r not in finishing and r is not chunked
    ]
    low_first = sa.low_values_first(scheduler)
    candidates.sort(key=lambda r: (sa.is_sure(r), _urgency(sa.priority(r), low_first), sa.output_len(r)))
    return candidates[: running - room]


def _trim_to_room(scheduler: Any, batch: Any, room: Optional[int], running: int) -> List[Any]:
    """Retract the speculative requests above ``room`` from ``batch``; returns them (not yet re-queued)."""
    victims = sa.retract(batch, _spec_over_room(scheduler, batch, room, running))
    if victims:
        state_of(scheduler).bump("spec_retracted_for_budget", len(victims))
    return victims


def _hold_waiting(scheduler: Any, batch: Any, counts: Census, room: Optional[int], running: int) -> List[Any]:
    """Take the waiting speculative requests this step may not admit out of the queue (returned, in order);
    the rest stay behind every waiting primary. ``running``: live speculative requests after the trim."""
    state = state_of(scheduler)
    spec, primary = list(counts.waiting_spec), counts.waiting_primary
    if not spec:
        return []
    prefill_anyway = bool(primary) or counts.primary_chunked
    # a spec-only prefill would replace their decode step, unless SGLang mixes it into that step
    protect = (
        counts.primary_decoding > 0 and not prefill_anyway and not sa.mixes_prefill_with_decode(scheduler, batch, spec)
    )
    if protect:
        total = unsure = 0
    elif room is None:
        total = unsure = len(spec)
    else:  # the room left below the knee (and the budget) for unsure requests; sure ones need only the budget
        unsure = max(room - running, 0)
        total = len(spec) if state.budget is None else max(state.budget - running, 0)
    hidden: List[Any] = []
    if len(spec) > min(total, unsure):
        low_first = sa.low_values_first(scheduler)
        spec.sort(key=lambda r: (-_urgency(sa.priority(r), low_first), sa.queued_at(r)))
        kept: List[Any] = []
        for r in spec:
            sure = sa.is_sure(r)
            if len(kept) < total and (sure or unsure > 0):
                kept.append(r)
                unsure -= 0 if sure else 1
            else:
                hidden.append(r)
        spec = kept
    if hidden or (primary and spec):
        kept = {id(r) for r in spec}
        queue = sa.waiting(scheduler)
        sa.set_waiting(scheduler, primary + [r for r in queue if id(r) in kept])  # primaries first, stable
    state.gate.held = len(hidden)
    state.gate.decode_protected = protect and bool(hidden)
    return hidden


def _gate_prefill(scheduler: Any, running_batch: Any) -> Tuple[List[Any], List[Any]]:
    c = census(scheduler, running_batch)
    room = spec_room(state_of(scheduler), c)
    victims = _trim_to_room(scheduler, running_batch, room, c.spec_running)
    state = state_of(scheduler)
    primary_prefills = bool(c.waiting_primary) or c.primary_chunked
    state.gate.spec_prefill = state.prefill.open(state.curve.line(), len(c.primary_searches), primary_prefills)
    return victims, _hold_waiting(scheduler, running_batch, c, room, c.spec_running - len(victims))


def _check_order(scheduler: Any, result: Any) -> None:
    """Count a step that admitted speculative work while a primary stayed waiting (never expected). A mixed batch's
    running rows decode: only the requests it prefills were admitted."""
    batch = result[0] if isinstance(result, tuple) and result else None
    if any(is_spec(r) for r in sa.prefilled_reqs(batch)) and any(not is_spec(r) for r in sa.waiting(scheduler)):
        state_of(scheduler).bump("spec_before_primary")


def h_cap_prefill(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Scheduler._get_new_batch_prefill_raw: the speculative gate. Trim running speculative work to this
    step's room, admit speculative requests only within it, after every waiting primary, and never in a
    prefill that would replace a primary decode step (the rest stay queued, in order). Requests trimmed here
    are re-queued after this step's admission."""
    t0 = time.perf_counter()
    hidden: List[Any] = []
    victims: List[Any] = []
    if not sa.nothing_to_admit(scheduler):  # else the decode path's trim runs
        running_batch = sa.hook_arg(type(scheduler)._get_new_batch_prefill_raw, "running_batch", args, kwargs, None)
        if running_batch is not None:
            victims, hidden = G_CAP.run(_gate_prefill, scheduler, running_batch, default=([], [])) or ([], [])
    t1 = time.perf_counter()
    result = None
    try:
        result = original(scheduler, *args, **kwargs)
        return result
    finally:
        t2 = time.perf_counter()
        if hidden:
            sa.waiting(scheduler).extend(hidden)
        if victims:
            G_CAP.run(sa.requeue, scheduler, victims)
        if isinstance(result, tuple) and result and result[0] is not None:
            G_CAP.run(_check_order, scheduler, result)
        sa.charge_hook_time(scheduler, t0, "cap_prefill", exclude=t2 - t1)  # SGLang's own admission is not ours


def _cap_decode(scheduler: Any, batch: Any) -> None:
    c = census(scheduler, batch, full=False)  # the counts: no admission in decode
    room = spec_room(state_of(scheduler), c)
    sa.requeue(scheduler, _trim_to_room(scheduler, batch, room, c.spec_running))


def h_cap_decode(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Scheduler.update_running_batch: the decode-only path's trim to this step's room."""
    t0 = time.perf_counter()
    batch = sa.hook_arg(type(scheduler).update_running_batch, "batch", args, kwargs)
    G_CAP.run(_cap_decode, scheduler, batch)
    sa.charge_hook_time(scheduler, t0, "cap_decode")
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
    t0 = time.perf_counter()
    recv_req = sa.hook_arg(type(scheduler).abort_request, "recv_req", args, kwargs)
    seen = G_CANCEL.run(_before_abort, scheduler, recv_req, default=[]) or []
    t1 = time.perf_counter()
    result = original(scheduler, *args, **kwargs)
    t2 = time.perf_counter()
    if seen:
        G_CANCEL.run(_after_abort, scheduler, recv_req, seen)
    sa.charge_hook_time(scheduler, t0, "abort", exclude=t2 - t1)
    return result


def cancel(scheduler: Any, prefix: str, search_id: str = "") -> None:
    """Cancel every request whose rid starts with ``prefix`` (a whole search: ``spex:{id}:``)."""
    if not prefix:
        return
    state = state_of(scheduler)
    if search_id:  # keyed by the search's own rid prefix, whatever was aborted
        state.cancelled.pop(search_rid_prefix(search_id), None)  # re-inserted last: the newest
        state.cancelled[search_rid_prefix(search_id)] = time.monotonic() + CANCELLED_SEARCH_TTL_S
        while len(state.cancelled) > MAX_CANCELLED:
            del state.cancelled[next(iter(state.cancelled))]
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
        while state.cancelled and next(iter(state.cancelled.values())) < now:  # oldest first (same TTL for all)
            del state.cancelled[next(iter(state.cancelled))]
        ids = (parse_rid(sa.rid(r)) for r in sa.waiting(scheduler))
        late = {p for parsed in ids if parsed and (p := search_rid_prefix(parsed[0])) in state.cancelled}
        for prefix in late:  # one lookup per waiting request, not a scan of every cancelled search
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
    t0 = time.perf_counter()
    state = sa.attached_state(scheduler)
    if state is None or state.cancelled or state.watch:  # else nothing to do this step
        method = type(scheduler).get_next_batch_to_run
        running = sa.hook_arg(method, "running_batch", args, kwargs, None)
        G_CANCEL.run(_pre_step, scheduler, running, sa.hook_arg(method, "last_batch", args, kwargs, None))
    sa.charge_hook_time(scheduler, t0, "pre_step")
    return None
