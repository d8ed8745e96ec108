"""``POST /respec/drafter/update_weights_from_tensor``: a drafter push that reaches every DP rank (touch point W6).

SGLang 0.5.23's ``TokenizerManager.update_weights_from_tensor`` asserts ``dp_size == 1``, although everything around
it already spans the ranks: ``/pause_generation``, ``/begin_weight_update`` and ``/end_weight_update`` fan out to
every scheduler, the DP controller forwards any control message it does not route itself to every rank, and the
tokenizer manager's ``update_weights_from_tensor`` communicator (``_COMMUNICATOR_SPECS``) waits for one reply per
rank. This route sends SGLang's own ``UpdateWeightsFromTensorReqInput`` through that communicator, with the rule of
SGLang's method (paused in place: at once; otherwise under the model-update writer lock), for the drafter only
(``selector`` draft, no cache flush: the target's KV is unaffected). ``HotSwapClient`` uses it in place of step 2 of
its session when the server runs ``--dp-size`` > 1.

Body ``{"serialized_named_tensors": [b64 per TP rank], "load_format": null}``. Each payload is decoded with SGLang's
safe unpickler here first, so a payload the schedulers could not read, or weights that are not floating point or
not finite, are a 400 that reaches none of them. Answers
200 ``{"success": true, "message", "ranks": [{"success", "message"}, ...]}`` (one entry per rank, in arrival
order), 400 ``{"success": false, ...}`` when a rank failed (the publisher then restores that replica), 400
``{"error": {"field", "reason"}}`` for a bad body, 413 for one past :func:`max_body_bytes` (a push is at most the
drafter's weights per TP rank, in any float dtype, base64-encoded). Admin-scoped (W5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field
from sglang.srt.managers import tokenizer_control_mixin
from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
from starlette.concurrency import run_in_threadpool

from sglang_spex.respec.hotswap import DP_DRAFTER_PATH, check_weights, deserialize_named_tensors
from sglang_spex.srt.http_api import Body, BodyError, error_response, parse_body, read_json
from sglang_spex.srt.http_state import http_state

PATH = DP_DRAFTER_PATH  # the path HotSwapClient sends a DP server's drafter update to


class DrafterWeightsBody(Body):
    serialized_named_tensors: List[str] = Field(min_length=1)
    load_format: Optional[str] = None


# a push over the drafter checkpoint's bytes on disk: fp32 weights over a bf16 checkpoint (2x), base64 (4/3x) and
# the pickle's framing fit in 4x; plus 1 MiB for a tiny drafter's fixed costs
PUSH_BYTES_PER_CHECKPOINT_BYTE = 4
PUSH_SLACK_BYTES = 1 << 20


def max_body_bytes(server_args: Any) -> Optional[int]:
    """The largest body this route reads: ``PUSH_BYTES_PER_CHECKPOINT_BYTE`` times the drafter checkpoint's weight
    files (``*.safetensors``, ``*.bin``, ``*.pt``) per TP rank, plus ``PUSH_SLACK_BYTES``; None (no bound, as
    SGLang's own weight routes) when the checkpoint is not a local folder with weight files."""
    path = getattr(server_args, "speculative_draft_model_path", None)
    folder = Path(path) if isinstance(path, str) and path else None
    if folder is None or not folder.is_dir():
        return None
    size = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.pt") for f in folder.glob(pattern))
    if size <= 0:
        return None
    return int(getattr(server_args, "tp_size", 1) or 1) * PUSH_BYTES_PER_CHECKPOINT_BYTE * size + PUSH_SLACK_BYTES


def _check_payloads(payloads: List[str]) -> None:
    for i, data in enumerate(payloads):
        try:
            check_weights(deserialize_named_tensors(data))
        except Exception as e:  # bad base64, a refused pickle, not (name, tensor) pairs, not float, not finite
            raise BodyError(f"serialized_named_tensors[{i}]", f"{type(e).__name__}: {e}") from None


async def post_drafter_weights(request: Request) -> Response:
    tm = http_state(request).tokenizer_manager
    try:
        limit = max_body_bytes(tm.server_args)
        body = parse_body(DrafterWeightsBody, await read_json(request, limit=limit, setting="the drafter's size"))
        tp = int(tm.server_args.tp_size)
        if len(body.serialized_named_tensors) != tp:
            raise BodyError("serialized_named_tensors", f"needs one payload per TP rank ({tp}), got "
                            f"{len(body.serialized_named_tensors)}")  # fmt: skip
        await run_in_threadpool(_check_payloads, body.serialized_named_tensors)
    except BodyError as e:
        return error_response(e.field, e.reason, e.status_code)
    obj = UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=normalize_serialized_named_tensor_payloads(body.serialized_named_tensors),
        load_format=body.load_format,
        flush_cache=False,
        selector="draft",
    )
    async with tm.is_pause_cond:
        paused = tm.is_pause
        if paused:
            results = await tm.update_weights_from_tensor_communicator(obj)
    if not paused:
        async with tm.model_update_lock.writer_lock:
            results = await tm.update_weights_from_tensor_communicator(obj)
    ranks = [{"success": bool(r.success), "message": str(r.message)} for r in results]
    ok = bool(ranks) and all(r["success"] for r in ranks)
    message = "; ".join(r["message"] for r in ranks)
    return JSONResponse({"success": ok, "message": message, "ranks": ranks}, status_code=200 if ok else 400)


def available() -> bool:
    """The installed SGLang makes the fan-out communicator this route sends through."""
    specs = getattr(tokenizer_control_mixin, "_COMMUNICATOR_SPECS", ())
    return any(spec[0] == "update_weights_from_tensor" for spec in specs)


def install(app: FastAPI) -> bool:
    """Add the route once; False (and no route) when the installed SGLang lacks the communicator."""
    if not available():
        return False
    if not any(getattr(r, "path", None) == PATH for r in app.router.routes):
        app.add_api_route(PATH, post_drafter_weights, methods=["POST"])
    return True
