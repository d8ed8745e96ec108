"""The control channel from the HTTP process to the scheduler: one extra IPC message type.

Why this channel: commands must reach the scheduler *in order* with the requests the same process sends
(a cancel must not overtake or trail the generate requests around it), and must be acknowledged.
``SpexControlReq`` is a ``BaseReq`` msgspec struct registered with ``io_struct.hook_custom_types``; the
tokenizer manager sends it on its normal socket to the scheduler (``_dispatch_to_scheduler``), where an
added dispatcher entry applies it between two scheduling steps. The sender then awaits one
``get_internal_state`` round trip: the scheduler answers in FIFO order, so the reply (which carries the
scheduler-side spex state, see ``hooks.scheduler_report``) proves the command was applied.
Commands are applied in ``ingest_requests``, before the step's scheduling hooks run, with or without overlap
scheduling (a cancel is then finished by the same step's immediate-cancel hook). Run-time statistics go the other
way through shared memory (:mod:`sglang_spex.srt.batch_stats`).

Under ``--dp-size N`` the message goes to SGLang's DP controller, whose fallback (``send_control_message``) forwards
any type it does not route itself to every rank's scheduler, on the same socket as that rank's generate requests;
``get_internal_state`` fans out to every rank too and returns once all of them answered, in arrival order. So a
command reaches every rank (a cancel or release acts where the search's requests are, a no-op elsewhere; a budget
or knob applies to each rank alike), and the acknowledgement waits for all of them. A command with ``dp_rank`` set
is applied by that rank only (the others still acknowledge it). Each rank's report carries its ``dp_rank``;
:func:`scheduler_states` orders the replies by it.

A rank that died (or hangs) never answers, and SGLang's round trip waits for every rank: each round trip here is
abandoned after ``SCHEDULER_TIMEOUT_S`` (the command itself is already sent), so a release, cancel or state read
returns instead of hanging; SGLang's replies do not say which rank is missing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Dict, List, Optional

from sglang.srt.managers.io_struct import BaseReq, hook_custom_types
from sglang.utils import TypeBasedDispatcher

from sglang_spex.adapters import scheduler as sa
from sglang_spex.srt import scheduling
from sglang_spex.srt.dp_ranks import process_dp_rank
from sglang_spex.srt.hook_guard import HookGuard, guard_report
from sglang_spex.srt.seeded_sampling import unseeded_counts
from sglang_spex.tot.engine import search_rid_prefix

logger = logging.getLogger(__name__)

OPS = ("budget", "cancel", "protect", "release", "set", "promote")
KNOBS = ("immediate_cancel", "protect_ttl_s", "protect_max_fraction", "knee", "live_knee", "spec_prefill_share")
G_CONTROL = HookGuard("control_channel")
# One get_internal_state round trip: a live scheduler answers between two steps (each state request queued ahead
# adds one more), well under this even for a long prefill chunk; past it the schedulers are taken as not answering.
SCHEDULER_TIMEOUT_S = 10.0


class SpexControlReq(BaseReq, kw_only=True):
    """One command for the scheduler-side hooks."""

    op: str
    search_id: str = ""
    prefix: str = ""  # rid prefix (cancel) or node-path prefix (release)
    key: str = ""  # knob name for op="set"
    value: Optional[float] = None  # budget (None = unlimited) or knob value
    dp_rank: Optional[int] = None  # --dp-size: only this rank applies it (None: every rank)


def register_types() -> None:
    """Teach this process's IPC decoder the new message type (SGLang's ``hook_custom_types`` is idempotent)."""
    hook_custom_types(SpexControlReq)


# ---------------------------------------------------------------- scheduler side
def apply(scheduler: Any, req: SpexControlReq) -> None:
    """Apply one command to this scheduler's plugin state (between two scheduling steps); a command for another
    DP rank is ignored."""
    rank = process_dp_rank()
    if req.dp_rank is not None and rank is not None and req.dp_rank != rank:
        return
    state = scheduling.state_of(scheduler)
    protection = state.protection
    if req.op == "budget":
        state.budget = None if req.value is None or req.value < 0 else int(req.value)
    elif req.op == "cancel":
        prefix = req.prefix or (search_rid_prefix(req.search_id) if req.search_id else "")
        scheduling.cancel(scheduler, prefix, req.search_id)
    elif req.op == "promote":
        scheduling.promote(scheduler, req.prefix)
    elif req.op == "protect":
        protection.start_search(req.search_id)
    elif req.op == "release":
        if req.search_id:
            protection.end_search(scheduler.tree_cache, req.search_id, req.prefix)
        else:
            protection.release_all(scheduler.tree_cache)
    elif req.op == "set":
        if req.key == "immediate_cancel":
            state.immediate_cancel = bool(req.value)
        elif req.key == "protect_ttl_s":
            protection.ttl_s = float(req.value)
        elif req.key == "protect_max_fraction":
            protection.max_fraction = float(req.value)
        elif req.key == "knee":  # the roofline knee speculation stays below (< 0: unknown)
            state.knee = None if req.value < 0 else max(int(req.value), 1)
        elif req.key == "live_knee":  # also stay below the knee of the live decode step times
            state.live_knee = bool(req.value)
        elif req.key == "spec_prefill_share":  # share of primary step time speculative prefill beside them may take
            state.prefill.share = min(max(float(req.value), 0.0), 1.0)
        else:
            logger.warning("spex: unknown knob %r", req.key)
    else:
        logger.warning("spex: unknown control op %r", req.op)


def _add_dispatch(scheduler: Any) -> None:
    scheduler._request_dispatcher += TypeBasedDispatcher(
        [(SpexControlReq, lambda req: G_CONTROL.run(apply, scheduler, req))]
    )


def h_add_dispatch(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER Scheduler.init_request_dispatcher: route ``SpexControlReq`` to :func:`apply`."""
    G_CONTROL.run(_add_dispatch, scheduler)
    return result


def sched_report(scheduler: Any) -> Dict[str, Any]:
    """Scheduler-side spex state with live pool figures (answered inside ``get_internal_state``)."""
    state = scheduling.state_of(scheduler)
    return {
        **state.report(),
        "dp_rank": process_dp_rank(),
        "overlap": sa.overlap(scheduler),
        "protection": state.protection.report(),
        "hooks": guard_report(),
        "pool": sa.pool(scheduler),
        "unseeded_sampling": unseeded_counts(sa.sampler(scheduler)),  # H2c: steps sampled without their seeds
    }


# ---------------------------------------------------------------- HTTP side
def validate(req: SpexControlReq) -> Optional[str]:
    """An error message for a malformed command, else None."""
    if req.op not in OPS:
        return f"unknown op {req.op!r}; choose from {list(OPS)}"
    if req.op == "cancel" and bool(req.search_id) == bool(req.prefix):
        return "cancel needs one of search_id and rid_prefix"
    if req.op == "protect" and not req.search_id:
        return "protect needs search_id"
    if req.op == "set" and (req.key not in KNOBS or req.value is None):
        return f"set needs key in {list(KNOBS)} and a value"
    return None


def post(tokenizer_manager: Any, req: SpexControlReq) -> None:
    """Queue ``req`` to every rank's scheduler without waiting for it to be applied (no ``get_internal_state``
    round trip: each one costs the scheduler a full report); it still reaches the scheduler in order with the
    requests this process sends."""
    tokenizer_manager.auto_create_handle_loop()
    tokenizer_manager._dispatch_to_scheduler(req)


async def send(tokenizer_manager: Any, req: SpexControlReq) -> Dict[str, Any]:
    """Send ``req`` to the scheduler and return the scheduler-side spex state once it has been applied (rank 0's
    under DP; :func:`send_all` returns every rank's)."""
    return (await send_all(tokenizer_manager, req))[0]


async def send_all(tokenizer_manager: Any, req: SpexControlReq) -> List[Dict[str, Any]]:
    """Send ``req`` to every rank's scheduler; their states once all of them applied it, ordered by DP rank
    (:func:`scheduler_states`: error entries when not all answered in time; the command is sent all the same)."""
    post(tokenizer_manager, req)
    return await scheduler_states(tokenizer_manager)


def rank_order(states: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``get_internal_state`` replies (arrival order) ordered by the DP rank in their spex report."""

    def rank(s: Dict[str, Any]) -> int:
        r = ((s.get("spex") or {}).get("sched") or {}).get("dp_rank")
        return -1 if r is None else int(r)

    return sorted(states, key=rank)  # stable: replies without a rank keep their order


async def ranked_states(
    round_trip: Awaitable[List[Dict[str, Any]]], timeout: Optional[float] = None
) -> Optional[List[Dict[str, Any]]]:
    """The replies of a ``get_internal_state`` round trip, by DP rank; None (logged) when not all ranks answered
    within ``timeout`` (default ``SCHEDULER_TIMEOUT_S``), the round trip then cancelled."""
    timeout = SCHEDULER_TIMEOUT_S if timeout is None else timeout
    try:
        return rank_order(await asyncio.wait_for(round_trip, timeout))
    except asyncio.TimeoutError:
        logger.warning("spex: the schedulers did not all answer within %g s (a DP rank dead or stuck?)", timeout)
        return None


def unanswered(tokenizer_manager: Any, timeout: Optional[float] = None) -> List[Dict[str, Any]]:
    """What :func:`scheduler_states` returns when the schedulers did not all answer: per DP rank (one entry
    without DP) its ``dp_rank`` and an ``error``."""
    timeout = SCHEDULER_TIMEOUT_S if timeout is None else timeout
    dp_size = int(getattr(getattr(tokenizer_manager, "server_args", None), "dp_size", 1) or 1)
    if dp_size <= 1:
        return [{"error": f"the scheduler did not answer within {timeout:g} s"}]
    error = f"not every DP rank's scheduler answered within {timeout:g} s (which did is not known)"
    return [{"dp_rank": rank, "error": error} for rank in range(dp_size)]


async def scheduler_states(tokenizer_manager: Any) -> List[Dict[str, Any]]:
    """Every rank's scheduler-side spex state, by DP rank (one ``get_internal_state`` round trip; H1 adds it);
    one element without DP, ``[{}]`` when there is none, :func:`unanswered` when not all ranks answered within
    ``SCHEDULER_TIMEOUT_S``."""
    states = await ranked_states(tokenizer_manager.get_internal_state())
    if states is None:
        return unanswered(tokenizer_manager)
    return [((s.get("spex") or {}).get("sched") or {}) for s in states] or [{}]


async def scheduler_state(tokenizer_manager: Any) -> Dict[str, Any]:
    """The scheduler-side spex state (rank 0's under DP)."""
    return (await scheduler_states(tokenizer_manager))[0]
