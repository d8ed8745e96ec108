"""The control channel from the HTTP process to the scheduler: one extra IPC message type.

Why this channel: commands must reach the scheduler *in order* with the requests the same process sends
(a cancel must not overtake or trail the generate requests around it), and must be acknowledged.
``SpexControlReq`` is a ``BaseReq`` msgspec struct registered with ``io_struct.hook_custom_types``; the
tokenizer manager sends it on its normal socket to the scheduler (``_dispatch_to_scheduler``), where an
added dispatcher entry applies it between two scheduling steps. The sender then awaits one
``get_internal_state`` round trip: the scheduler answers in FIFO order, so the reply (which carries the
scheduler-side spex state, see ``hooks.scheduler_report``) proves the command was applied.
Run-time statistics go the other way through shared memory (:mod:`sglang_spex.srt.batch_stats`).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from sglang.srt.managers.io_struct import BaseReq

from sglang_spex.srt.hook_guard import HookGuard

logger = logging.getLogger(__name__)

OPS = ("budget", "cancel", "protect", "release", "set", "promote")
KNOBS = ("immediate_cancel", "protect_ttl_s", "protect_max_fraction")


class SpexControlReq(BaseReq, kw_only=True):
    """One command for the scheduler-side hooks."""

    op: str
    search_id: str = ""
    prefix: str = ""  # rid prefix (cancel) or node-path prefix (release)
    key: str = ""  # knob name for op="set"
    value: Optional[float] = None  # budget (None = unlimited) or knob value


_types_registered = False
G_CONTROL = HookGuard("control_channel")


def register_types() -> None:
    """Teach this process's IPC decoder the new message type (idempotent)."""
    global _types_registered
    if not _types_registered:
        from sglang.srt.managers.io_struct import hook_custom_types

        hook_custom_types(SpexControlReq)
        _types_registered = True


# ---------------------------------------------------------------- scheduler side
def apply(scheduler, req: SpexControlReq) -> None:
    from sglang_spex.srt import prefix_protection, scheduling

    guard = prefix_protection.GUARD
    if req.op == "budget":
        scheduling.STATE.budget = None if req.value is None or req.value < 0 else int(req.value)
    elif req.op == "cancel":
        prefix = req.prefix or (f"spex:{req.search_id}:" if req.search_id else "")
        scheduling.cancel(scheduler, prefix, req.search_id)
    elif req.op == "promote":
        scheduling.promote(scheduler, req.prefix)
    elif req.op == "protect":
        guard.start_search(req.search_id)
    elif req.op == "release":
        if req.search_id:
            guard.end_search(scheduler.tree_cache, req.search_id, req.prefix)
        else:
            guard.release_all(scheduler.tree_cache)
    elif req.op == "set":
        if req.key == "immediate_cancel":
            scheduling.STATE.immediate_cancel = bool(req.value)
        elif req.key == "protect_ttl_s":
            guard.ttl_s = float(req.value)
        elif req.key == "protect_max_fraction":
            guard.max_fraction = float(req.value)
        else:
            logger.warning("spex: unknown knob %r", req.key)
    else:
        logger.warning("spex: unknown control op %r", req.op)


def h_add_dispatch(result, scheduler, *args, **kwargs):
    """AFTER Scheduler.init_request_dispatcher: route ``SpexControlReq`` to :func:`apply`."""

    def add():
        from sglang.utils import TypeBasedDispatcher

        scheduler._request_dispatcher += TypeBasedDispatcher(
            [(SpexControlReq, lambda req: G_CONTROL.run(apply, scheduler, req))]
        )

    G_CONTROL.run(add)
    return result


def sched_report(scheduler) -> Dict[str, Any]:
    """Scheduler-side spex state with live pool figures (answered inside ``get_internal_state``)."""
    from sglang_spex.srt import prefix_protection, scheduling
    from sglang_spex.srt.hook_guard import guard_report

    tree = scheduler.tree_cache
    return {
        **scheduling.STATE.report(),
        "protection": prefix_protection.GUARD.report(),
        "hooks": guard_report(),
        "pool": {
            "kv_total": int(scheduler.max_total_num_tokens),
            "kv_available": int(scheduler.token_to_kv_pool_allocator.available_size()),
            "kv_evictable": int(tree.evictable_size()),
            "kv_protected": int(tree.protected_size()),
            "req_slots_free": int(scheduler.req_to_token_pool.available_size()),
            "waiting": len(scheduler.waiting_queue),
            "running": len(scheduler.running_batch.reqs) if scheduler.running_batch is not None else 0,
        },
    }


# ---------------------------------------------------------------- HTTP side
def validate(req: SpexControlReq) -> Optional[str]:
    """An error message for a malformed command, else None."""
    if req.op not in OPS:
        return f"unknown op {req.op!r}; choose from {list(OPS)}"
    if req.op == "cancel" and not (req.search_id or req.prefix):
        return "cancel needs search_id or rid_prefix"
    if req.op == "protect" and not req.search_id:
        return "protect needs search_id"
    if req.op == "set" and (req.key not in KNOBS or req.value is None):
        return f"set needs key in {list(KNOBS)} and a value"
    return None


async def send(tokenizer_manager, req: SpexControlReq) -> Dict[str, Any]:
    """Send ``req`` to the scheduler and return the scheduler-side spex state once it has been applied."""
    tokenizer_manager.auto_create_handle_loop()
    tokenizer_manager._dispatch_to_scheduler(req)
    return await scheduler_state(tokenizer_manager)


async def scheduler_state(tokenizer_manager) -> Dict[str, Any]:
    states = await tokenizer_manager.get_internal_state()
    spex = (states[0] if states else {}).get("spex") or {}
    return spex.get("sched") or {}
