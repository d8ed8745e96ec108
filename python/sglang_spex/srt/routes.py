"""HTTP routes sglang-spex adds to SGLang's FastAPI app (``/spex/*``, ``/tot/*``)."""

from __future__ import annotations

import json
import os

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from sglang_spex.config import LEARNER_ENV_VAR, SpexConfig
from sglang_spex.profile.routes import install_profile_routes


def tokenizer_manager():
    from sglang.srt.entrypoints.http_server import get_global_state

    state = get_global_state()
    if state is None:
        raise RuntimeError("SGLang HTTP server state is not initialised yet")
    return state.tokenizer_manager


async def spex_info(cfg: SpexConfig) -> dict:
    import sglang

    states = await tokenizer_manager().get_internal_state()
    reports = [s.get("spex") for s in states]
    scheduler = reports[0] if reports else None
    return {
        "sglang_version": sglang.__version__,
        "http_server_pid": os.getpid(),
        "plugin_loaded_in_scheduler": bool(scheduler and scheduler.get("plugin_loaded")),
        "scheduler": scheduler,
        "speculation": cfg.enabled,
        "config": json.loads(cfg.to_json()),
        "respec": states[0].get("respec") if states else None,  # ReSpec adaptive server (R2), when enabled
    }


def install(app: FastAPI, cfg: SpexConfig) -> None:
    """Add our routes to ``app`` once."""
    if getattr(app.state, "spex_routes", False):  # once per app (not id(app): ids of dead apps are reused)
        return
    app.state.spex_routes = True
    from sglang_spex.srt import search_routes

    search_routes.install(app, cfg)  # /tot/search* (sglang_spex.srt.search_routes)
    install_profile_routes(app, cfg)  # /spex/profile (sglang_spex.profile.routes)
    from sglang_spex.srt import spex_service

    spex_service.install(app, cfg)  # server-side searches run SPEX under --tot-speculation

    @app.get("/spex/info")
    async def _info():
        return JSONResponse(await spex_info(cfg))

    from sglang_spex.srt import control_routes

    control_routes.install(app, cfg)  # /spex/budget, /spex/cancel, /spex/protect, /spex/release, /spex/stats

    if os.environ.get(LEARNER_ENV_VAR):  # ReSpec online learner (/respec/*): --respec-learner
        from sglang_spex.respec.routes import install_from_env

        install_from_env(app)
