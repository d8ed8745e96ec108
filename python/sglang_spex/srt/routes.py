"""HTTP routes sglang-spex adds to SGLang's FastAPI app (``/spex/*``, ``/tot/*``, ``/respec/*``).

Only :func:`install` lives here: it makes the app's :class:`~sglang_spex.srt.http_state.SpexHttpState`
(``app.state.spex``) and calls each concern's ``install``. No routes module imports this one. Imported only in
the SGLang HTTP server process (``plugin.register``), where SGLang's ``http_server`` is already loaded.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Dict, List, Optional

import sglang
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sglang.srt.entrypoints.http_server import get_global_state

from sglang_spex.config import SpexConfig
from sglang_spex.profile import routes as profile_routes
from sglang_spex.respec import routes as respec_routes
from sglang_spex.srt import (
    admin_scope,
    batch_stats,
    control,
    control_routes,
    dp_drafter_update,
    search_service,
    ui_routes,
)
from sglang_spex.srt.http_api import error_response
from sglang_spex.srt.http_state import SpexHttpState, attach, http_state, installed


def _dp_ranks(states: List[Dict[str, Any]], searches: Dict[int, int]) -> Optional[List[Dict[str, Any]]]:
    """``--dp-size`` > 1: one entry per rank, by rank: its scheduler's plugin report (``sched``: budget, gate,
    protection, KV pool of that rank), its ReSpec report, the server-side searches pinned to it and the latest row
    of its batch-stats ring (``batch``); None with one rank. ``dp_rank`` is null (and the entries in arrival
    order) where the scheduler part of the report is off (no ``--tot-speculation``)."""
    if len(states) <= 1:
        return None
    rings = batch_stats.RankReaders().latest_by_rank()
    out = []
    for s in states:
        spex = s.get("spex") or {}
        rank = (spex.get("sched") or {}).get("dp_rank")
        out.append({**spex, "dp_rank": rank, "respec": s.get("respec"), "searches": searches.get(rank, 0),
                    "batch": rings.get(rank)})  # fmt: skip
    return out


async def get_info(request: Request) -> Response:
    """``GET /spex/info``: SGLang version, the parsed config, and the report made inside the scheduler (H1);
    ``scheduler`` and ``respec`` are rank 0's under ``--dp-size``, ``dp_ranks`` has every rank's. 503 when the
    schedulers do not all answer within ``control.SCHEDULER_TIMEOUT_S`` (a DP rank dead or stuck)."""
    state = http_state(request)
    reason = f"not every scheduler answered within {control.SCHEDULER_TIMEOUT_S:g} s (a DP rank dead or stuck?)"
    states = await control.ranked_states(state.tokenizer_manager.get_internal_state())
    if states is None:
        return error_response("scheduler", reason, status_code=503)
    try:  # the limits ask the engine once (another round trip)
        limits = await asyncio.wait_for(state.searches.limits(), control.SCHEDULER_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error_response("scheduler", reason, status_code=503)
    scheduler = states[0].get("spex") if states else None
    searches = state.searches.info()
    return JSONResponse(
        {
            "sglang_version": sglang.__version__,
            "http_server_pid": os.getpid(),
            "plugin_loaded_in_scheduler": bool(scheduler and scheduler.get("plugin_loaded")),
            "scheduler": scheduler,
            "speculation": state.cfg.enabled,
            "config": json.loads(state.cfg.to_json()),
            "respec": states[0].get("respec") if states else None,  # ReSpec adaptive server (R2), when enabled
            "searches": {**searches, "limits": limits.to_dict()},
            "dp_ranks": _dp_ranks(states, searches.get("searches_per_dp_rank") or {}),
            # the drafter version a ReSpec publisher last recorded here (None: the one the server started with),
            # separate from SGLang's weight_version (the policy's)
            "drafter_version": respec_routes.drafter_version(request.app),
        }
    )


def install(app: FastAPI, cfg: SpexConfig) -> None:
    """Add our routes to ``app`` once (the state on ``app.state`` marks an app as done)."""
    if installed(app):
        return
    state = SpexHttpState(cfg, get_global_state)
    attach(app, state)
    search_service.install(app)  # /tot/search*
    profile_routes.install(app, state)  # /spex/profile
    control_routes.install(app)  # /spex/budget, cancel, promote, protect, release, knobs, stats
    ui_routes.install(app)  # /tot/ui (live tree view)
    app.add_api_route("/spex/info", get_info, methods=["GET"])
    respec_routes.install_drafter(app)  # /respec/drafter: this replica's drafter version (every server)
    dp_drafter_update.install(app)  # /respec/drafter/update_weights_from_tensor: a drafter push to every DP rank
    # ReSpec online learner (/respec/*) when the launcher's --respec-learner set its spec
    respec_routes.install_from_env(app, server_args=lambda: state.tokenizer_manager.server_args)
    admin_scope.apply(app)  # SGLang's ADMIN_OPTIONAL level on the routes that change server-wide state (W5)
