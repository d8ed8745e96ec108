"""``/respec/*`` routes for the online learner, installable on SGLang's FastAPI app.

- ``POST /respec/rollouts`` ``{"rollouts": [{"prompt_ids", "response_ids", "reward", "target_logprobs"?}]}``:
  200 ``{"accepted", "buffer_size", "version", "update_due"}``; a bad payload → 400 ``{"error", "field"}`` and
  the buffer is unchanged.
- ``POST /respec/policy`` ``{"version": int, "serialized_named_tensors": [b64]}`` (the payload of
  ``HotSwapClient``): new policy weights for the learner's target copy, so KD follows the moving policy;
  400 on a bad payload, the copy unchanged.
- ``GET /respec/state``: drafter version, buffer size, last loss, acceptance before/after each update, …

Inside the SGLang server these are installed by :func:`install_from_env` when ``SPEX_RESPEC`` is set (by the
launcher's ``--respec-learner SPEC [--respec-update-interval N --respec-kd V --respec-learner-mode M]``; a JSON
object or the path of a JSON file: ``drafter`` (checkpoint dir), ``target`` (HF model dir of the served model),
optional ``learner`` (LearnerConfig fields), ``probe`` (list of [prompt_ids, response_ids]), ``server_url``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sglang_spex.config import LEARNER_ENV_VAR, LEARNER_FIELDS
from sglang_spex.respec.buffer import RolloutError
from sglang_spex.respec.learner import LearnerConfig, OnlineLearner

logger = logging.getLogger(__name__)
ENV_VAR = LEARNER_ENV_VAR  # set by the launcher's --respec-learner (or directly)


def install(app: FastAPI, learner: OnlineLearner) -> None:
    """Add the routes to ``app`` once, bound to ``learner``."""
    if getattr(app.state, "respec_learner", None) is not None:  # (not id(app): ids of dead apps are reused)
        return
    app.state.respec_learner = learner

    @app.post("/respec/rollouts")
    async def _rollouts(request: Request):
        try:
            body: Any = await request.json()
        except Exception:
            return JSONResponse({"error": "body must be JSON", "field": "body"}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": "body must be an object", "field": "body"}, status_code=400)
        unknown = sorted(set(body) - {"rollouts"})
        if unknown:
            return JSONResponse({"error": f"unknown field {unknown[0]!r}", "field": unknown[0]}, status_code=400)
        if "rollouts" not in body:
            return JSONResponse({"error": "missing field 'rollouts'", "field": "rollouts"}, status_code=400)
        try:
            # sync mode trains here; run it off the event loop so other requests keep flowing
            from starlette.concurrency import run_in_threadpool

            result = await run_in_threadpool(learner.submit, body["rollouts"])
        except RolloutError as e:
            return JSONResponse({"error": str(e), "field": e.field}, status_code=400)
        return JSONResponse(result)

    @app.post("/respec/policy")
    async def _policy(request: Request):
        from starlette.concurrency import run_in_threadpool

        from sglang_spex.respec.hotswap import deserialize_named_tensors

        try:
            body: Any = await request.json()
        except Exception:
            return JSONResponse({"error": "body must be JSON", "field": "body"}, status_code=400)
        if not isinstance(body, dict) or set(body) != {"version", "serialized_named_tensors"}:
            return JSONResponse(
                {"error": "body must be {version, serialized_named_tensors}", "field": "body"}, status_code=400
            )
        version, data = body["version"], body["serialized_named_tensors"]
        if isinstance(version, bool) or not isinstance(version, int):
            return JSONResponse({"error": "version must be an int", "field": "version"}, status_code=400)
        if not isinstance(data, list) or len(data) != 1 or not isinstance(data[0], str):
            return JSONResponse(
                {"error": "one base64 payload expected", "field": "serialized_named_tensors"}, status_code=400
            )
        try:
            named = deserialize_named_tensors(data[0])
            n = await run_in_threadpool(learner.set_policy, version, named)
        except RuntimeError as e:
            return JSONResponse({"error": str(e), "field": "learner"}, status_code=400)
        except Exception as e:
            return JSONResponse({"error": f"{type(e).__name__}: {e}", "field": "serialized_named_tensors"}, 400)
        return JSONResponse({"loaded": n, "policy_version": version})

    @app.get("/respec/state")
    async def _state():
        return JSONResponse(learner.state())


def _load_spec(text: str) -> dict:
    text = text.strip()
    if text.startswith("{"):
        return json.loads(text)
    return json.loads(Path(text).read_text())


def build_learner(spec: dict, server_url: Optional[str] = None) -> OnlineLearner:
    """A learner from an ``SPEX_RESPEC`` spec: HF target copy for features, hot-swap into ``server_url``."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_spex.respec.drafter import Eagle3Drafter
    from sglang_spex.respec.hotswap import HotSwapClient
    from sglang_spex.respec.target import TargetFeatures

    unknown = sorted(set(spec) - set(LEARNER_FIELDS))
    if unknown:
        raise ValueError(f"{ENV_VAR}: unknown field(s) {unknown}")
    drafter = Eagle3Drafter.from_pretrained(spec["drafter"]).float()
    target = AutoModelForCausalLM.from_pretrained(spec["target"], torch_dtype=torch.float32)
    feats = TargetFeatures(target, drafter.cfg.aux_layer_ids, drafter.t2d)
    url = spec.get("server_url") or server_url
    publish = HotSwapClient(url, begin_retries=240) if url else None
    probe = [(p, r) for p, r in spec.get("probe", [])]
    cfg = LearnerConfig(**spec.get("learner", {}))
    return OnlineLearner(drafter, feats.batch, cfg, probe, publish, policy_sync=feats.load_weights)


class LocalServerPublisher:
    """Hot-swap into the SGLang server this learner runs in. Its port is only known once SGLang's HTTP state
    exists (after the routes are installed), so it is looked up at the first publish; if that fails the publish
    raises and the learner rolls the update back (never a silent "published" that reached no server)."""

    def __init__(self) -> None:
        self.client = None

    def __call__(self, version: int, named) -> None:
        if self.client is None:
            from sglang_spex.respec.hotswap import HotSwapClient
            from sglang_spex.srt.routes import tokenizer_manager

            port = tokenizer_manager().server_args.port
            self.client = HotSwapClient(f"http://127.0.0.1:{port}", begin_retries=240)
        self.client.push(version, named)


def install_from_env(app: FastAPI) -> Optional[OnlineLearner]:
    """Install the routes when ``SPEX_RESPEC`` is set (called from ``sglang_spex.srt.routes.install``)."""
    text = os.environ.get(ENV_VAR)
    if not text:
        return None
    spec = _load_spec(text)
    learner = build_learner(spec)
    if learner.publish is None:  # no server_url: publish into this server
        learner.publish = LocalServerPublisher()
    install(app, learner)
    logger.info("respec: online learner installed (variant=%s)", learner.config.variant)
    return learner
