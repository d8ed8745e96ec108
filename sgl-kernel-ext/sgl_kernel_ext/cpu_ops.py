"""Torch implementations of the ``sgl_kernel`` ops SGLang's CPU path really calls.

Found by running the CPU server and the tests: on the torch_native path the only op reached is
``torch.ops.sgl_kernel.murmur_hash32_cpu`` (seeded sampling, ``sglang.kernels.ops.sampling.murmur_hash``).
Everything else in the stand-in raises :class:`~sgl_kernel_ext.standin.StandinOpError` naming the op.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch

_MASK = 0xFFFFFFFF
_registered = False


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32 in int64 without overflow (split c into 16-bit halves)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _mul32(k, 0xCC9E2D51)
    k = _rotl32(k, 15)
    k = _mul32(k, 0x1B873593)
    h = h ^ k
    h = _rotl32(h, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _MASK


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 (x86_32) of the 16-byte key (seed_lo, seed_hi, position, column), h0 = 0: [n, m] uint32."""
    s = seed.to(torch.int64)
    seed_lo = (s & _MASK).unsqueeze(1)
    seed_hi = ((s >> 32) & _MASK).unsqueeze(1)
    pos = (positions.to(torch.int64) & _MASK).unsqueeze(1)
    col = (col_indices.to(torch.int64) & _MASK).unsqueeze(0)
    h = torch.zeros_like(seed_lo)
    h = _mix(h, seed_lo)
    h = _mix(h, seed_hi)
    h = _mix(h, pos)
    h = _mix(h.expand(-1, col.shape[1]), col.expand(h.shape[0], -1))
    h = _fmix(h ^ 16)
    return h.to(torch.uint32)


def register_torch_ops() -> None:
    """Define ``torch.ops.sgl_kernel.*`` for the implemented ops (once per process)."""
    global _registered
    if _registered:
        return
    _registered = True
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    lib.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
    lib.impl("murmur_hash32_cpu", murmur_hash32_cpu, "CPU")
    globals()["_lib"] = lib  # keep the registration alive


def _implemented() -> Dict[str, Callable[..., Any]]:
    from sgl_kernel_ext import spec_ops

    return dict(spec_ops.IMPLEMENTED)


# Python-level names served by the stand-in module (module.attr -> implementation).
IMPLEMENTED: Dict[str, Callable[..., Any]] = _implemented()
