"""Control routes for the scheduler-side hooks (installed by :func:`sglang_spex.srt.routes.install`).

Bodies are the models in :mod:`sglang_spex.srt.http_api` (unknown fields and wrong types → 400
``{"error": {"field", "reason"}}``):

- ``POST /spex/budget {"k": N | null}``: speculative admission cap (null = unlimited).
- ``POST /spex/cancel {"search_id": S} | {"rid_prefix": P}`` (one of them): cancel a whole search (or any rid
  prefix) in one call; cancelling a search also releases its prefix protection, and its requests that reach the
  scheduler in the next ``scheduling.CANCELLED_SEARCH_TTL_S`` are aborted too (the last ``MAX_CANCELLED``
  searches are remembered).
- ``POST /spex/promote {"rid": R, "ack": true}``: a speculative request the search now waits on becomes primary
  (``ack`` false: answered once queued to the scheduler, without the scheduler-state round trip).
- ``POST /spex/protect {"search_id": S}``: register a live search / renew its protection lease.
- ``POST /spex/release {"search_id": S, "node_prefix": "r.0"?}``: release a search's protection (or a
  subtree's); without the ``search_id`` field releases every protection (an empty one is a 400).
- ``POST /spex/knobs {"immediate_cancel": bool, "protect_ttl_s": s, "protect_max_fraction": f, "knee": N (-1: none),
  "live_knee": bool, "spec_prefill_share": f}`` (any of them). ``/spex/budget {"k": null}`` lifts only the budget; the gate's knee stays
  (``knee: -1`` and ``live_knee: false`` open it fully).
- ``GET /spex/stats?history_since=N``: scheduler-side state (one IPC round trip) and the shared-memory
  batch statistics (latest step, counters, optionally ``history``: the per-step rows from sequence number N >= 0 on,
  at most ``batch_stats.HISTORY_PAGE`` (1,024) per ring; ``history.next`` is the N that reads on, and more rows
  follow while it is below ``history.seq``); ``profile``: the roofline profiler's state (``measuring``,
  ``reprofile_due``, ``reprofiles``, ``k_total``); ``payoff``: a row per pooled pay-off entry (at most
  ``budget.PAYOFF_POOL_MAX`` kept). The rings are read, the pay-off rows made and the answer encoded in a worker
  thread.

Every POST answers ``{"ok": true, "scheduler": ...}``, the scheduler-side state after the command was applied
(see :mod:`.control`); without ``--tot-speculation`` 409; 503 naming ``scheduler`` when the schedulers did not all
acknowledge it within ``control.SCHEDULER_TIMEOUT_S`` (it was sent and may still apply).

Under ``--dp-size N`` a command reaches every rank (see :mod:`.control`); ``scheduler`` and ``batch`` stay rank 0's
(the single-rank shape), and ``dp_ranks`` lists each rank's scheduler state by rank (null without DP).
``/spex/stats`` adds ``batch_ranks``: each rank's ring by rank and their ``aggregate`` (sums of the latest rows and
counters; ``history_since`` applies to every ring, each with its own sequence numbers, but rank 0's entry has no
``history``: it is ``batch.history``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from sglang_spex.speculation.payoff import pool_report
from sglang_spex.srt import batch_stats, control
from sglang_spex.srt.http_api import (
    BodyError,
    BudgetBody,
    CancelBody,
    KnobsBody,
    PromoteBody,
    ProtectBody,
    ReleaseBody,
    error_response,
    json_body,
    query_number,
)
from sglang_spex.srt.http_state import http_state

SPECULATION_OFF = ("speculation", "off: start the server with --tot-speculation")


async def _run(request: Request, reqs: List[control.SpexControlReq], ack: bool = True) -> Response:
    """Send ``reqs`` in order; ``ack``: answer with the scheduler state once applied, else once queued."""
    state = http_state(request)
    if not state.cfg.enabled:
        return error_response(*SPECULATION_OFF, status_code=409)
    for req in reqs:
        err = control.validate(req)
        if err:
            return error_response("body", err)
    if not ack:
        for req in reqs:
            control.post(state.tokenizer_manager, req)
        return JSONResponse({"ok": True, "scheduler": None, "dp_ranks": None})
    states: List[dict] = [{}]
    for req in reqs:
        states = await control.send_all(state.tokenizer_manager, req)
        missing = [s["error"] for s in states if "error" in s]
        if missing:  # sent, but not acknowledged in time (a DP rank dead or stuck): it may still apply
            return error_response("scheduler", f"sent, not acknowledged: {missing[0]}", status_code=503)
    return JSONResponse({"ok": True, "scheduler": states[0], "dp_ranks": states if len(states) > 1 else None})


@json_body(BudgetBody)
async def post_budget(request: Request, body: BudgetBody) -> Response:
    value = None if body.k is None else float(body.k)
    return await _run(request, [control.SpexControlReq(op="budget", value=value)])


@json_body(CancelBody)
async def post_cancel(request: Request, body: CancelBody) -> Response:
    return await _run(request, [control.SpexControlReq(op="cancel", search_id=body.search_id, prefix=body.rid_prefix)])


@json_body(PromoteBody)
async def post_promote(request: Request, body: PromoteBody) -> Response:
    return await _run(request, [control.SpexControlReq(op="promote", prefix=body.rid)], ack=body.ack)


@json_body(ProtectBody)
async def post_protect(request: Request, body: ProtectBody) -> Response:
    return await _run(request, [control.SpexControlReq(op="protect", search_id=body.search_id)])


@json_body(ReleaseBody)
async def post_release(request: Request, body: ReleaseBody) -> Response:
    req = control.SpexControlReq(op="release", search_id=body.search_id, prefix=body.node_prefix)
    return await _run(request, [req])


@json_body(KnobsBody)
async def post_knobs(request: Request, body: KnobsBody) -> Response:
    reqs = [control.SpexControlReq(op="set", key=k, value=v) for k, v in body.values().items()]
    return await _run(request, reqs)


def _stats_answer(out: Dict[str, Any], since: Optional[int], dp: bool, payoffs: List[Any]) -> JSONResponse:
    """``out`` with the batch-stats rings and the pay-off rows (``payoffs``: a ``SpecBudget.payoff_snapshot``)
    added, encoded (run off the event loop: a page of rows per ring, a row per pooled pay-off entry)."""
    out["batch"] = batch_stats.read_stats(history_since=since)
    out["batch_ranks"] = batch_stats.read_all_ranks(history_since=since, history_skip=(0,)) if dp else None
    out["payoff"] = pool_report(payoffs)
    return JSONResponse(out)


async def get_stats(request: Request, history_since: Optional[str] = None) -> Response:
    state = http_state(request)
    try:
        since = query_number(history_since, "history_since")
    except BodyError as e:
        return error_response(e.field, e.reason)
    if since is not None and since < 0:
        return error_response("history_since", f"{history_since!r}: must be an integer >= 0 (a row's sequence number)")
    if not state.cfg.enabled:
        return error_response(*SPECULATION_OFF, status_code=409)
    states = await control.scheduler_states(state.tokenizer_manager)
    out: Dict[str, Any] = {"scheduler": states[0], "dp_ranks": states if len(states) > 1 else None}
    out["batch"] = out["batch_ranks"] = None  # (filled in by _stats_answer)
    out["profile"] = state.profile.status()  # a benchmark waits while the roofline is being measured
    out["payoff"] = None  # (filled in by _stats_answer, from what the budget holds now)
    spex = state.searches.spex
    payoffs = spex.budget.payoff_snapshot() if spex is not None else []
    return await run_in_threadpool(_stats_answer, out, since, len(states) > 1, payoffs)


def install(app: FastAPI) -> None:
    """Add the control routes to ``app``."""
    for path, endpoint in (
        ("/spex/budget", post_budget),
        ("/spex/cancel", post_cancel),
        ("/spex/promote", post_promote),
        ("/spex/protect", post_protect),
        ("/spex/release", post_release),
        ("/spex/knobs", post_knobs),
    ):
        app.add_api_route(path, endpoint, methods=["POST"])
    app.add_api_route("/spex/stats", get_stats, methods=["GET"])
