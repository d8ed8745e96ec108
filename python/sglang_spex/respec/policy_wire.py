"""Policy weights as one binary body for ``POST /respec/policy`` (``Content-Type: application/octet-stream``).

The body is a safetensors file of the named tensors (HF names, what ``TargetFeatures.load_weights`` takes) with
metadata ``{"version": "<int>"}``. SGLang's own payload (``serialized_named_tensors``: pickled tensors in base64
inside JSON) costs a JSON parse, a base64 decode and an unpickle of the whole policy, seconds per 200 MB with
Python's GIL held for most of it; this body decodes with one copy per tensor and no pickle.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from safetensors.torch import load, save

from sglang_spex.respec.rollout_wire import CONTENT_TYPE, header_metadata
from sglang_spex.srt.http_api import BodyError

__all__ = ["CONTENT_TYPE", "check_tensors", "decode", "encode"]
VERSION_MAX = 2**63 - 1  # as the JSON body's ``version`` (``http_api.Version``)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what a policy push may carry


def encode(version: int, named: Sequence[Tuple[str, torch.Tensor]]) -> bytes:
    """The body of policy ``version``'s weights ``named`` (a tensor sharing memory with an earlier one is copied:
    safetensors stores each tensor once)."""
    if not 0 <= version <= VERSION_MAX:
        raise ValueError(f"version {version}: must be in [0, {VERSION_MAX}]")
    seen = set()
    tensors: Dict[str, torch.Tensor] = {}
    for name, t in named:
        if name in tensors:
            raise ValueError(f"tensor {name!r} given twice")
        t = t.detach().contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    return save(tensors, metadata={"version": str(version)})


def decode(data: bytes) -> Tuple[int, List[Tuple[str, torch.Tensor]]]:
    """(version, named tensors) of a body; :class:`BodyError` naming ``body`` or ``version`` otherwise."""
    try:
        named = list(load(data).items())
        header = header_metadata(data)
    except Exception as e:  # not a safetensors file, a truncated one, an unknown dtype
        raise BodyError("body", f"not a safetensors file of named tensors ({type(e).__name__}: {e})") from None
    text = header.get("version", "")
    if not (text.isascii() and text.isdigit() and len(text) <= 19 and int(text) <= VERSION_MAX):
        raise BodyError("version", f"{text!r} in the safetensors metadata: must be an integer in [0, {VERSION_MAX}]")
    check_tensors(named, "body")
    return int(text), named


def check_tensors(named: Sequence[Tuple[str, torch.Tensor]], field: str) -> None:
    """Raise :class:`BodyError` naming ``field`` for no tensors or a tensor whose dtype is not in ``DTYPES`` (an
    integer, bool or complex tensor would be cast into the float copy; float8 has no finiteness check)."""
    if not named:
        raise BodyError(field, "no tensors")
    for name, t in named:
        if t.dtype not in DTYPES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
            raise BodyError(
                field, f"tensor {name!r} has dtype {str(t.dtype).removeprefix('torch.')}; allowed: {allowed}"
            )
