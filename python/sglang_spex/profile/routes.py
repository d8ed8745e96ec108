"""``/spex/profile`` routes and ``--tot-k-total auto`` inside the SGLang HTTP server process.

- ``GET /spex/profile``: the current (or cached) profile, 404 if none yet.
- ``POST /spex/profile``: measure now (JSON body optional: ``batch_sizes``, ``short_tokens``,
  ``long_tokens``, ``ctx_prefix_words``, ``prefill_words``, ``repeats``, ``force`` (default true)).
- With ``--tot-speculation --tot-k-total auto`` a background thread profiles once the server is healthy
  (from the cache when fresh), so :func:`server_k_total` has an answer before the first search needs it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Dict, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sglang_spex.config import SpexConfig
from sglang_spex.profile.measure import ProfileManager, ProfileSpec, profile_key, server_args_dict

logger = logging.getLogger(__name__)
_manager: Optional[ProfileManager] = None


def _tokenizer_manager():
    from sglang_spex.srt.routes import tokenizer_manager

    return tokenizer_manager()


def manager() -> ProfileManager:
    """The server's :class:`ProfileManager` (created on first use, in the HTTP server process)."""
    global _manager
    if _manager is None:
        from sglang_spex.srt.engine_port import TokenizerManagerPort

        tm = _tokenizer_manager()
        _manager = ProfileManager(TokenizerManagerPort(tm), profile_key(server_args_dict(tm.server_args)))
    return _manager


async def server_k_total(cfg: SpexConfig) -> int:
    """k_total for this server: the flag if set, else the roofline knee (cached or measured now)."""
    if cfg.k_total is not None:
        return cfg.k_total
    return (await manager().get()).k_total


def _spec_from(body: Dict[str, Any]) -> ProfileSpec:
    names = {f.name for f in dataclasses.fields(ProfileSpec)}
    kw = {k: v for k, v in body.items() if k in names}
    if "batch_sizes" in kw:
        kw["batch_sizes"] = tuple(int(b) for b in kw["batch_sizes"])
    return ProfileSpec(**kw)


def _auto_profile_when_ready(poll_s: float = 1.0, timeout_s: float = 1800.0) -> None:
    """Thread body: wait for ``/health_generate`` on our own port, then ask for a (cached) profile."""
    import requests

    deadline = time.monotonic() + timeout_s
    base = None
    while time.monotonic() < deadline:
        try:
            if base is None:
                args = _tokenizer_manager().server_args
                base = f"http://127.0.0.1:{args.port}"
            if requests.get(base + "/health_generate", timeout=60).status_code == 200:
                r = requests.post(base + "/spex/profile", json={"force": False}, timeout=600)
                logger.info("spex: auto profile %s: %s", r.status_code, r.json().get("summary"))
                return
        except Exception:  # server not up yet
            pass
        time.sleep(poll_s)
    logger.warning("spex: auto profile gave up waiting for the server")


def install_profile_routes(app: FastAPI, cfg: SpexConfig) -> None:
    """Add the profile routes; start the auto-profile thread for ``--tot-k-total auto``."""

    @app.get("/spex/profile")
    async def _get_profile():
        prof = manager().profile
        if prof is None:
            return JSONResponse({"error": "no profile yet: POST /spex/profile"}, status_code=404)
        return JSONResponse({**prof.to_dict(), "summary": prof.summary()})

    @app.post("/spex/profile")
    async def _post_profile(request: Request):
        try:
            body = await request.json()
        except Exception:
            body = {}
        body = body or {}
        mgr = manager()
        if "batch_sizes" in body or any(k in body for k in ("short_tokens", "long_tokens")):
            mgr.spec = _spec_from(body)
        try:
            prof = await mgr.get(force=bool(body.get("force", True)))
        except Exception as e:  # report, never take the server down
            logger.exception("spex: profile failed")
            return JSONResponse({"error": f"profile failed: {e}"}, status_code=500)
        return JSONResponse({**prof.to_dict(), "summary": prof.summary()})

    if cfg.enabled and cfg.k_total is None:
        threading.Thread(target=_auto_profile_when_ready, name="spex-auto-profile", daemon=True).start()
