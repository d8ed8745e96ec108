"""``/respec/*`` routes for the online learner, installable on SGLang's FastAPI app.

- ``POST /respec/rollouts`` ``{"rollouts": [{"prompt_ids", "response_ids", "reward", "target_logprobs"?,
  "target_top_logprobs"?}], "more"?: bool}`` (the last two from the served target, see ``buffer.py``; with top-k on
  every rollout of an update the KD target comes from them): 200 ``{"accepted", "buffer_size", "version",
  "update_due", "training"}`` (``training``: false while the learner skips updates, so the client may stop sending
  log-probs and policy pushes); a bad payload → 400 ``{"error": {"field", "reason"}}`` and the buffer is unchanged.
  One post is one RL step; a step too large for one body (``learner.max_post_bytes``, 413 past it) goes in parts, each
  but the last with ``"more": true`` (``ServerClient.post_rollouts`` cuts them). The same rollouts may come as one
  binary body, ``Content-Type: application/octet-stream`` (a safetensors file, ``rollout_wire.py``; ``more`` in its
  metadata), which decodes in milliseconds where JSON's nested lists take a large step's fraction of a second. The
  body is decoded and validated in the shared threadpool; in sync mode the answer comes after the update the post made
  due, which runs on the learner's own worker thread and is awaited without holding a threadpool thread (however many
  posts wait for updates, other routes' ``run_in_threadpool`` calls keep their threads).
- ``POST /respec/policy`` ``{"version": int, "serialized_named_tensors": [b64]}`` (the payload of
  ``HotSwapClient``): new policy weights for the learner's target copy, so KD follows the moving policy;
  400 on a bad payload (no tensors, a tensor that is not float16/bfloat16/float32/float64, or one that does not fit
  the copy), 409 for a version at or below the copy's, 413 for a body larger than a push of the copy's weights can
  be (``OnlineLearner.policy_max_bytes``); the copy unchanged in each case. Or the binary body (``Content-Type:
  application/octet-stream``, a safetensors file with the version in its metadata, ``policy_wire.py``; what
  ``ServerClient.post_policy`` sends): one copy per tensor to decode, no base64 or pickle.
- ``GET /respec/state``: drafter version, buffer size, last loss, acceptance before/after each update, …
- on every server (a replica, learner or not; :func:`install_drafter`): ``POST /respec/drafter {"version": int}``,
  sent by a publisher after its drafter push landed (409 for a version below the recorded one; the same version
  again is a publisher's restore and is recorded), and ``GET /respec/drafter`` → ``{"drafter_version": v | null,
  "recorded_at": unix time | null}`` (null: the drafter the server started with). This is the drafter's own version,
  separate from SGLang's ``weight_version`` (the policy's, ``/model_info``).

Inside the SGLang server these are installed by :func:`install_from_env` when the config (``SGLANG_SPEX_CONFIG``)
holds a learner spec (the launcher's ``--respec-learner SPEC [--respec-update-interval N --respec-kd V
--respec-learner-mode M]``: ``drafter`` (checkpoint dir), ``target`` (HF model dir of the served model),
optional ``learner`` (LearnerConfig fields), ``probe`` (list of [prompt_ids, response_ids]), ``server_url``,
``replica_urls``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from transformers import AutoModelForCausalLM

from sglang_spex.config import ENV_VAR, LearnerSpec, load
from sglang_spex.respec import policy_wire, rollout_wire
from sglang_spex.respec.adaptive import best_case, drafter_never_pays
from sglang_spex.respec.buffer import RolloutError
from sglang_spex.respec.drafter import Eagle3Drafter
from sglang_spex.respec.hotswap import HotSwapClient, ReplicaPublisher, deserialize_named_tensors
from sglang_spex.respec.learner import NoPolicyCopyError, OnlineLearner, StalePolicyError
from sglang_spex.respec.target import TargetFeatures
from sglang_spex.srt.http_api import (
    Body,
    BodyError,
    PolicyBody,
    RolloutsBody,
    Version,
    decode_json,
    error_response,
    parse_body,
    read_body,
    read_json,
)

logger = logging.getLogger(__name__)
LEARNER_ATTR = "respec_learner"  # the learner lives on ``app.state.respec_learner``
DRAFTER_ATTR = "respec_drafter"  # the recorded drafter version: ``app.state.respec_drafter``


class DrafterVersionBody(Body):
    version: Version


def _bad(field_name: str, reason: str) -> JSONResponse:
    return error_response(field_name, reason)


def _content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def _learner(request: Request) -> OnlineLearner:
    return getattr(request.app.state, LEARNER_ATTR)


def submit_body(learner: OnlineLearner, data: bytes, content_type: str) -> "Future[dict]":
    """What ``POST /respec/rollouts`` does with a body once read: decode it (JSON, or binary for
    ``rollout_wire.CONTENT_TYPE``), validate and submit it; raises BodyError or RolloutError, else returns the
    Future of the learner's answer (``OnlineLearner.submit_nowait``: done at once, or after a sync-mode update)."""
    if content_type == rollout_wire.CONTENT_TYPE:
        rollouts, more = rollout_wire.decode(data, learner.buffer.vocab_size, learner.buffer.max_len)
        return learner.submit_nowait(rollouts, more)
    body = parse_body(RolloutsBody, decode_json(data))
    return learner.submit_nowait(body.rollouts, body.more)


async def post_rollouts(request: Request) -> Response:
    try:
        learner = _learner(request)
        data = await read_body(request, learner.config.max_post_bytes, "learner.max_post_bytes")
        # decoding and validating a large step run off the event loop: other clients' requests keep flowing
        answer = await run_in_threadpool(submit_body, learner, data, _content_type(request))
        # a sync-mode update runs on the learner's one worker thread: awaited here, not in a threadpool thread (a
        # burst of posts waiting for their updates would take every thread other routes need)
        result = await asyncio.wrap_future(answer)
    except BodyError as e:
        return error_response(e.field, e.reason, e.status_code)  # 413 for a body over the limit
    except RolloutError as e:
        return _bad(e.field, str(e).removeprefix(f"{e.field}: "))
    return JSONResponse(result)


def decode_policy(data: bytes, content_type: str) -> Tuple[int, Any]:
    """The policy version and its named tensors, from the binary body (``policy_wire``) or SGLang's JSON payload
    (raises BodyError naming what is wrong)."""
    if content_type == policy_wire.CONTENT_TYPE:
        return policy_wire.decode(data)
    body = parse_body(PolicyBody, decode_json(data))
    try:
        named = deserialize_named_tensors(body.serialized_named_tensors[0])
    except Exception as e:  # whatever the payload decodes to (pickle, base64): the learner stays unchanged
        raise BodyError("serialized_named_tensors", f"{type(e).__name__}: {e}") from None
    policy_wire.check_tensors(named, "serialized_named_tensors")
    return body.version, named


async def post_policy(request: Request) -> Response:
    learner = _learner(request)
    if learner.policy_sync is None:  # nothing could be loaded: the body is not read
        return _bad("learner", "this learner has no policy copy to update")
    limit = learner.policy_max_bytes()  # None: a copy whose size is unknown (a custom ``policy_sync``)
    try:
        data = await read_body(request, limit, "a push of the learner's policy copy: float64 values, base64, framing")
        # a policy is hundreds of MB: decoded off the event loop (the JSON payload's base64 and pickle steps still
        # hold the GIL while they run, in C; the binary body is one copy per tensor)
        content_type = _content_type(request)
        version, named = await run_in_threadpool(decode_policy, data, content_type)
    except BodyError as e:
        return error_response(e.field, e.reason, e.status_code)
    try:
        n = await run_in_threadpool(learner.set_policy, version, named)
    except NoPolicyCopyError as e:
        return _bad("learner", str(e))
    except StalePolicyError as e:
        return error_response("version", str(e), 409)
    except Exception as e:  # tensors that do not fit the learner's policy copy: 400, the copy unchanged
        where = "body" if content_type == policy_wire.CONTENT_TYPE else "serialized_named_tensors"
        return _bad(where, f"{type(e).__name__}: {e}")
    return JSONResponse({"loaded": n, "policy_version": version})


async def get_state(request: Request) -> Response:
    return JSONResponse(_learner(request).state())


def drafter_version(app: FastAPI) -> Optional[int]:
    """The drafter version a publisher last recorded on this server (None: its start-up drafter)."""
    return (getattr(app.state, DRAFTER_ATTR, None) or {}).get("drafter_version")


async def post_drafter(request: Request) -> Response:
    try:
        body = parse_body(DrafterVersionBody, await read_json(request))
    except BodyError as e:
        return error_response(e.field, e.reason, e.status_code)  # 413 for a body over the limit
    current = drafter_version(request.app)
    if current is not None and body.version < current:  # (no await since the read: the check and the set are one)
        return error_response("version", f"drafter version {body.version} is older than the recorded {current}", 409)
    setattr(request.app.state, DRAFTER_ATTR, {"drafter_version": body.version, "recorded_at": time.time()})
    return JSONResponse(getattr(request.app.state, DRAFTER_ATTR))


async def get_drafter(request: Request) -> Response:
    return JSONResponse(getattr(request.app.state, DRAFTER_ATTR, None) or {"drafter_version": None,
                                                                          "recorded_at": None})  # fmt: skip


def install_drafter(app: FastAPI) -> None:
    """Add ``/respec/drafter`` (every server: the replica's drafter version) once."""
    if any(getattr(r, "path", None) == "/respec/drafter" for r in app.router.routes):
        return
    app.add_api_route("/respec/drafter", post_drafter, methods=["POST"])
    app.add_api_route("/respec/drafter", get_drafter, methods=["GET"])


def install(app: FastAPI, learner: OnlineLearner) -> None:
    """Add the routes to ``app`` once, bound to ``learner`` (stored on ``app.state``)."""
    if getattr(app.state, LEARNER_ATTR, None) is not None:  # (not id(app): ids of dead apps are reused)
        return
    setattr(app.state, LEARNER_ATTR, learner)
    app.add_api_route("/respec/rollouts", post_rollouts, methods=["POST"])
    app.add_api_route("/respec/policy", post_policy, methods=["POST"])
    app.add_api_route("/respec/state", get_state, methods=["GET"])


def build_learner(
    spec: LearnerSpec, server_url: Optional[str] = None, replica_urls: Sequence[str] = ()
) -> OnlineLearner:
    """A learner from the config's learner spec: HF target copy for features, hot-swap into ``server_url``, or
    into every one of ``replica_urls`` (with ``server_url`` first when given; :class:`ReplicaPublisher`)."""
    target = AutoModelForCausalLM.from_pretrained(spec.target, torch_dtype=torch.float32)
    drafter = Eagle3Drafter.from_pretrained(spec.drafter, target_model=target).float()  # ours or SpecForge's
    feats = TargetFeatures(target, drafter.cfg.aux_layer_ids, drafter.t2d)
    url = spec.server_url or server_url
    publish: Any = HotSwapClient(url, begin_retries=240) if url else None
    if replica_urls:
        publish = ReplicaPublisher([*([url] if url else []), *replica_urls], begin_retries=240)
    probe = [(list(p), list(r)) for p, r in spec.probe]
    cfg = spec.learner
    return OnlineLearner(
        drafter,
        feats.batch,
        cfg,
        probe,
        publish,
        policy_sync=feats.load_weights,
        kd_target=cfg.kd_target,
        max_rollout_tokens=getattr(target.config, "max_position_embeddings", None),
    )


class LocalServerPublisher:
    """Hot-swap into the SGLang server this learner runs in (and, with ``replica_urls``, into those replicas too,
    one :class:`ReplicaPublisher`). Its port is only known once SGLang's HTTP state exists (after the routes are
    installed), so ``server_args`` is called at the first publish; if that fails the publish raises and the
    learner rolls the update back (never a silent "published" that reached no server)."""

    def __init__(self, server_args: Callable[[], Any], replica_urls: Sequence[str] = ()) -> None:
        self.server_args = server_args
        self.replica_urls = list(replica_urls)
        self.client: Any = None  # HotSwapClient, or ReplicaPublisher with replicas

    def __call__(self, version: int, named: Sequence[Tuple[str, torch.Tensor]]) -> Optional[dict]:
        if self.client is None:
            args = self.server_args()  # SGLang's ServerArgs: the port, and the key its weight-update routes take
            key = getattr(args, "admin_api_key", None) or getattr(args, "api_key", None)
            local = HotSwapClient(f"http://127.0.0.1:{args.port}", begin_retries=240, api_key=key)
            # the replicas take the same key (one deployment); a replica with another key fails and is reported
            others = [HotSwapClient(u, begin_retries=240, api_key=key) for u in self.replica_urls]
            self.client = ReplicaPublisher(clients=[local, *others]) if others else local
        return self.client(version, named)

    def status(self) -> Optional[list]:
        """Each replica's drafter version (None without replicas)."""
        return self.client.status() if isinstance(self.client, ReplicaPublisher) else None


def install_from_env(app: FastAPI, server_args: Optional[Callable[[], Any]] = None) -> Optional[OnlineLearner]:
    """Install the routes when this process's config (``SGLANG_SPEX_CONFIG``) has a learner spec (the launcher's
    ``--respec-learner``); called from ``sglang_spex.srt.routes.install``. ``server_args`` gives this server's
    SGLang ``ServerArgs`` (port and keys) for a spec without ``server_url``; the spec's ``replica_urls``: more
    servers each version goes to."""
    spec = load().learner
    if spec is None:
        return None
    replica_urls = spec.replica_urls
    learner = build_learner(spec, replica_urls=replica_urls if spec.server_url else ())
    if learner.publish is None:  # no server_url: publish into this server
        if server_args is None:
            raise ValueError(f"{ENV_VAR}: the learner spec has no server_url and there is no server to publish into")
        learner.publish = LocalServerPublisher(server_args, replica_urls)
    best = best_case(load().respec, spec.target)
    learner.best_speedup = best[0] if best is not None else None
    learner.idle_reason = drafter_never_pays(load().respec, best=best)
    if learner.idle_reason:
        logger.info("respec: the learner skips its updates: %s", learner.idle_reason)
    install(app, learner)
    logger.info("respec: online learner installed (variant=%s)", learner.config.variant)
    return learner
