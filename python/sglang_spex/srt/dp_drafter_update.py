"""``POST /respec/drafter/update_weights_from_tensor``: a drafter push that reaches every DP rank (touch point W6).

SGLang 0.5.23's ``TokenizerManager.update_weights_from_tensor`` asserts ``dp_size == 1``, although everything around
it already spans the ranks: ``/pause_generation``, ``/begin_weight_update`` and ``/end_weight_update`` fan out to
every scheduler, the DP controller forwards any control message it does not route itself to every rank, and the
tokenizer manager's ``update_weights_from_tensor`` communicator (``_COMMUNICATOR_SPECS``) waits for one reply per
rank. This route sends SGLang's own ``UpdateWeightsFromTensorReqInput`` through that communicator, with the rule of
SGLang's method (paused in place: at once; otherwise under the model-update writer lock), for the drafter only
(``selector`` draft, no cache flush: the target's KV is unaffected). ``HotSwapClient`` uses it in place of step 2 of
its session when the server runs ``--dp-size`` > 1.

Body ``{"serialized_named_tensors": [b64 per TP rank], "load_format": null}``. Before any scheduler is reached, every
payload is checked here, in full: a 400 ``{"error": {"field": "serialized_named_tensors[i]", "reason"}}`` names the
first failure and *no* rank receives anything (the schedulers' own checks come tensor by tensor, after the tensors
before have been loaded: a wrong shape after a good tensor left every rank with half a drafter; an unknown name or a
float ``d2t`` loaded nothing, or garbage, and answered success). Checked:

- the payload decodes with SGLang's safe unpickler (after a walk that builds nothing) into (name, tensor) pairs of
  dense tensors;
- each name is a tensor of the drafter checkpoint the server was started with (``--speculative-draft-model-path``),
  matched as ``LlamaForCausalLMEagle3.load_weights`` matches it (legacy ``midlayer`` → ``layers.0``,
  ``aux_norm_{low,mid,high}`` → ``fc_norm.{0,1,2}``, an optional leading ``model.``), its shape is the checkpoint's
  and the checkpoint's tensor is floating point (``d2t`` / ``t2d``, integer/bool vocabulary maps read once at
  start, are refused: a drafter push never sends them). Names, shapes and dtypes come from the safetensors headers
  (no weights read), cached per folder and file mtimes. When the checkpoint is not a local folder with readable
  ``*.safetensors`` files (a ``.bin`` checkpoint, a hub id) this check is skipped, as before it existed: the
  schedulers' own (per tensor, after the tensors before it) are then the only ones;
- no name is a tensor the served drafter shares with the target (SGLang's ``set_embed`` / ``set_embed_and_head``):
  the embedding, and the lm_head when the checkpoint's config.json has a null ``draft_vocab_size`` or tied
  embeddings -- a push there would rewrite the policy's own weights;
- each tensor is floating point and finite.

Answers 200 ``{"success": true, "message", "ranks": [{"success", "message"}, ...]}`` (one entry per rank, in arrival
order), 400 ``{"success": false, ...}`` when a rank failed (the publisher then restores that replica), 400
``{"error": {"field", "reason"}}`` for a bad body, 413 for one past :func:`max_body_bytes` (a push is at most the
drafter's weights per TP rank, in any float dtype, base64-encoded). Admin-scoped (W5).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field
from safetensors import safe_open
from sglang.srt.managers import tokenizer_control_mixin
from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
from starlette.concurrency import run_in_threadpool

from sglang_spex.respec.drafter import shares_target_head
from sglang_spex.respec.hotswap import DP_DRAFTER_PATH, check_weights, deserialize_named_tensors
from sglang_spex.srt.http_api import Body, BodyError, error_response, parse_body, read_json
from sglang_spex.srt.http_state import http_state

logger = logging.getLogger(__name__)

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


# ``LlamaForCausalLMEagle3.load_weights`` (SGLang 0.5.23): legacy names first (substring replace), then the name as
# it is or under ``model.`` (``lm_head.weight`` is the model's own, the rest the inner model's)
LEGACY_NAMES = (("midlayer", "layers.0"), ("aux_norm_low", "fc_norm.0"), ("aux_norm_mid", "fc_norm.1"),
                ("aux_norm_high", "fc_norm.2"))  # fmt: skip
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype names of floating-point types: F16, BF16, F32, F64, F8_E4M3, F8_E5M2, ...
FLOAT_DTYPE_PREFIXES = ("F", "BF")

TensorSpec = Tuple[Tuple[int, ...], str]  # (shape, safetensors dtype name)


def parameter_key(name: str) -> str:
    """The drafter parameter a tensor name loads into, as SGLang's EAGLE3 ``load_weights`` resolves it (a pushed
    ``layers.0.mlp.up_proj.weight`` and a checkpoint's ``midlayer.mlp.up_proj.weight`` or
    ``model.layers.0.mlp.up_proj.weight`` are one)."""
    for legacy, new in LEGACY_NAMES:
        if legacy in name:
            name = name.replace(legacy, new)
    return name[len("model.") :] if name.startswith("model.") else name


def checkpoint_tensors(path: Any) -> Optional[Mapping[str, TensorSpec]]:
    """{:func:`parameter_key`: (shape, dtype)} of the drafter checkpoint folder's safetensors files (the shards its
    ``model.safetensors.index.json`` lists, when it has one, else every ``*.safetensors``), read from the headers
    only and cached until a file changes; None when ``path`` is not a local folder with readable safetensors files
    (a ``.bin`` checkpoint, a hub id): the check against the checkpoint is then skipped."""
    folder = Path(path) if isinstance(path, str) and path else None
    if folder is None or not folder.is_dir():
        return None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    index = folder / INDEX_FILE
    try:
        stats = [(f.name, f.stat()) for f in [*files, index] if f.exists()]
    except OSError:
        return None
    stamp = tuple((name, st.st_mtime_ns, st.st_size) for name, st in stats)
    return _read_headers(str(folder.resolve()), stamp)


@functools.lru_cache(maxsize=8)
def _read_headers(folder: str, stamp: Tuple[Tuple[str, int, int], ...]) -> Optional[Mapping[str, TensorSpec]]:
    """The headers of ``folder``'s safetensors files as they were at ``stamp`` (names, mtimes and sizes: a changed
    file is a new key, so the cache never serves stale shapes)."""
    root = Path(folder)
    out = {}
    try:
        if (root / INDEX_FILE).exists():
            shards = sorted(set(json.loads((root / INDEX_FILE).read_text())["weight_map"].values()))
        else:
            shards = [name for name, _, _ in stamp if name.endswith(".safetensors")]
        for shard in shards:
            with safe_open(str(root / shard), framework="pt") as f:
                for name in f.keys():
                    part = f.get_slice(name)
                    out.setdefault(parameter_key(name), (tuple(part.get_shape()), str(part.get_dtype())))
    except Exception as e:  # unreadable or malformed: the check is skipped, as for a checkpoint it cannot read
        logger.warning("drafter checkpoint %s: safetensors headers unreadable (%s: %s); drafter pushes are not "
                       "checked against its names and shapes", folder, type(e).__name__, e)  # fmt: skip
        return None
    return MappingProxyType(out)


def check_against_checkpoint(name: str, tensor: torch.Tensor, expected: Mapping[str, TensorSpec]) -> Optional[str]:
    """Why ``name`` cannot be pushed into the drafter the checkpoint describes, or None when it can."""
    spec = expected.get(parameter_key(name))
    if spec is None:
        return "not a tensor of the drafter checkpoint (--speculative-draft-model-path)"
    shape, dtype = spec
    if not dtype.startswith(FLOAT_DTYPE_PREFIXES):
        return f"the checkpoint's tensor is {dtype}, not floating point (a vocabulary map: never hot-swapped)"
    if tuple(tensor.shape) != shape:
        return f"shape {list(tensor.shape)} is not the checkpoint's {list(shape)}"
    return None


SHARED_EMBEDDING = "the served drafter's embedding is the target's own tensor: a push would rewrite the policy"
SHARED_HEAD = ("the served drafter's lm_head is the target's own tensor (its config's draft_vocab_size is null or "
               "its embeddings tied): a push would rewrite the policy's output head")  # fmt: skip


def shared_with_target(drafter_path: Any) -> Dict[str, str]:
    """{:func:`parameter_key`: why} of the drafter tensors SGLang shares with the target (``set_embed`` /
    ``set_embed_and_head``): the embedding always, the lm_head when the checkpoint's config.json says so."""
    shared = {"embed_tokens.weight": SHARED_EMBEDDING}
    config = Path(drafter_path) / "config.json" if isinstance(drafter_path, str) and drafter_path else None
    try:
        cfg = json.loads(config.read_text()) if config is not None and config.is_file() else {}
    except (OSError, ValueError):
        cfg = {}
    if isinstance(cfg, dict) and cfg and shares_target_head(cfg):
        shared["lm_head.weight"] = SHARED_HEAD
    return shared


def _check_payloads(payloads: List[str], drafter_path: Any = None) -> None:
    expected = checkpoint_tensors(drafter_path)
    shared = shared_with_target(drafter_path)
    for i, data in enumerate(payloads):
        field = f"serialized_named_tensors[{i}]"
        try:
            named = deserialize_named_tensors(data)
        except Exception as e:  # bad base64, a refused pickle, not (name, tensor) pairs
            raise BodyError(field, f"{type(e).__name__}: {e}") from None
        for name, _ in named:
            if parameter_key(name) in shared:
                raise BodyError(field, f"{name}: {shared[parameter_key(name)]}")
        if expected is not None:  # names and shapes first: cheaper than the finiteness scan below
            for name, tensor in named:
                problem = check_against_checkpoint(name, tensor, expected)
                if problem is not None:
                    raise BodyError(field, f"{name}: {problem}")
        try:
            check_weights(named)
        except Exception as e:  # not float, not finite
            raise BodyError(field, f"{type(e).__name__}: {e}") from None


async def post_drafter_weights(request: Request) -> Response:
    tm = http_state(request).tokenizer_manager
    try:
        limit = max_body_bytes(tm.server_args)
        body = parse_body(DrafterWeightsBody, await read_json(request, limit=limit, setting="the drafter's size"))
        tp = int(tm.server_args.tp_size)
        if len(body.serialized_named_tensors) != tp:
            raise BodyError("serialized_named_tensors", f"needs one payload per TP rank ({tp}), got "
                            f"{len(body.serialized_named_tensors)}")  # fmt: skip
        await run_in_threadpool(
            _check_payloads,
            body.serialized_named_tensors,
            getattr(tm.server_args, "speculative_draft_model_path", None),
        )
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
