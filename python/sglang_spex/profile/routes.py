"""``/spex/profile`` routes inside the SGLang HTTP server process (the manager is ``app.state.spex.profile``).

- ``GET /spex/profile``: the current (or cached) profile, 404 if none yet.
- ``POST /spex/profile``: measure now; body (optional) :class:`~sglang_spex.srt.http_api.ProfileBody`:
  ``batch_sizes``, ``short_tokens``, ``long_tokens``, ``ctx_prefix_words``, ``ctx_batch``, ``prefill_words``,
  ``repeats`` (a new measure spec when any is given, measured whatever ``force`` says; given ``batch_sizes``, strictly
  increasing, are measured exactly, without the sweep's extension), ``force`` (default true). Bounded by the engine
  (``ProfileSpec.check``): batch sizes by the sweep's ceiling (512, ``--max-running-requests`` and
  ``--max-queued-requests``), tokens and words by the model's context, at most 16 sizes and 8 repeats; past a bound a
  400 names the field and nothing changes. A measurement that fails keeps the spec in use. A profile measured with
  such settings serves this server but is not cached (later starts read only the default sweep's). One measurement
  at a time: while one runs (another POST's, the auto profile's or a re-profile), a POST without settings joins it
  and answers with its outcome, and one with settings gets 409 (field ``profile``) with ``Retry-After``.
- With ``--tot-speculation --tot-k-total auto`` a background thread waits until the server is healthy, then
  loads the cached profile or measures one as a task on the server's event loop, so the first search finds the
  roofline knee ready.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from dataclasses import replace

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sglang_spex.profile.manager import ProfileBusy
from sglang_spex.profile.measure import ProfileSpec, ProfileStopped, filler_tokens_per_word, sweep_limit
from sglang_spex.srt.http_api import ProfileBody, error_response, json_body
from sglang_spex.srt.http_state import SpexHttpState, http_state
from sglang_spex.tot.validation import FieldError

logger = logging.getLogger(__name__)
BUSY_RETRY_S = 30  # ``Retry-After`` of a POST refused while a measurement runs (no profile's duration known yet)


async def get_profile(request: Request) -> Response:
    prof = http_state(request).profile.profile
    if prof is None:
        return error_response("profile", "none yet: POST /spex/profile", status_code=404)
    return JSONResponse({**prof.to_dict(), "summary": prof.summary()})


@json_body(ProfileBody, optional=True)
async def post_profile(request: Request, body: ProfileBody) -> Response:
    state = http_state(request)
    mgr, spec = state.profile, None
    fields = body.spec_fields()
    if fields:
        if "batch_sizes" in fields:  # sizes given: measure exactly those (no sweep extension)
            fields["max_batch"] = max(fields["batch_sizes"])
        limit = sweep_limit(ProfileSpec(), mgr.key)
        spec = replace(ProfileSpec().within(limit), **fields)  # defaults not given kept to the ceiling
        tm = state.tokenizer_manager
        per_word = filler_tokens_per_word(getattr(tm, "tokenizer", None))
        try:  # bounded by the engine: the sweep's own ceiling and the model's context
            spec.check(limit, tm.context_len, per_word)
        except FieldError as e:
            return error_response(e.field, e.reason)
    try:  # a new spec is measured now and kept only once that measurement succeeded
        prof = await mgr.get(force=body.force, spec=spec, join=True)
    except ProfileBusy as e:
        resp = error_response("profile", f"{e}: retry with these settings once it ended", status_code=409)
        last = mgr.profile.duration_s if mgr.profile is not None else 0.0
        resp.headers["Retry-After"] = str(max(1, math.ceil(last)) if last > 0 else BUSY_RETRY_S)
        return resp
    except Exception as e:  # report, never take the server down; the spec in use stays what it was
        logger.exception("spex: profile failed")
        return error_response("profile", f"measurement failed: {e}", status_code=500)
    return JSONResponse({**prof.to_dict(), "summary": prof.summary()})


def _auto_profile_when_ready(state: SpexHttpState, poll_s: float = 1.0, timeout_s: float = 1800.0) -> None:
    """Thread body: wait for ``/health_generate`` on our own port, then measure (or load the cached) profile as a
    task on the server's event loop. Not as an HTTP request: uvicorn's shutdown waits for open requests, so a sweep
    inside one would hold a Ctrl-C for minutes."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=60) as client:
        while time.monotonic() < deadline:
            tm = None
            try:
                tm = state.tokenizer_manager
                ready = client.get(f"http://127.0.0.1:{tm.server_args.port}/health_generate").status_code == 200
            except (RuntimeError, ValueError, httpx.HTTPError):  # SGLang's state or server not up yet
                ready = False
            loop = getattr(tm, "event_loop", None) if ready else None  # set by the first request SGLang handled
            if loop is not None:
                _measure_on(loop, state)
                return
            time.sleep(poll_s)
    logger.warning("spex: auto profile gave up waiting for the server")


def _measure_on(loop: asyncio.AbstractEventLoop, state: SpexHttpState) -> None:
    try:
        prof = asyncio.run_coroutine_threadsafe(state.profile.get(force=False), loop).result()
    except (asyncio.CancelledError, concurrent.futures.CancelledError, ProfileStopped):  # the server is stopping
        logger.info("spex: auto profile stopped with the server")
    except Exception:
        if loop.is_closed():  # (run_coroutine_threadsafe's RuntimeError on a loop already gone)
            logger.info("spex: auto profile stopped with the server")
        else:
            logger.exception("spex: auto profile failed")
    else:
        logger.info("spex: auto profile: %s", prof.summary())


def install(app: FastAPI, state: SpexHttpState) -> None:
    """Add the profile routes; start the auto-profile thread for ``--tot-speculation --tot-k-total auto``."""
    app.add_api_route("/spex/profile", get_profile, methods=["GET"])
    app.add_api_route("/spex/profile", post_profile, methods=["POST"])
    if state.cfg.enabled and state.cfg.k_total is None:
        state.profile_thread = threading.Thread(
            target=_auto_profile_when_ready, args=(state,), name="spex-auto-profile", daemon=True
        )
        state.profile_thread.start()
