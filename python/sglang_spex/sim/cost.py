"""Step-time cost models for the simulated engine.

:class:`RooflineCost` (a named device × model)::

    decode(B, C) = overhead + max(bytes / (bw·bw_eff), flops / (peak·flops_eff))
        bytes = weight_bytes_read(B) + (C + B) · kv_bytes_per_token     # weights once, KV read + new KV written
        flops = 2 · active_params · B + 4 · layers · heads · head_dim · C  # GEMMs + decode attention
    prefill(P, A, X) = overhead + max(bytes / (bw·bw_eff), flops / (peak·flops_eff))
        bytes = weight_bytes_read(P) + (P + X) · kv_bytes_per_token      # X = cached prefix tokens read
        flops = 2 · active_params · P + 4 · layers · heads · head_dim · A  # A = attention (query, key) pairs

with ``B`` the running batch, ``C`` the context tokens summed over the batch, ``P`` new prompt tokens.

:class:`MeasuredCost` replays a live profile (:mod:`sglang_spex.profile`): the fitted two-segment decode
curve at the measured context, plus a per-context-token slope and a prefill rate when the profile has them.

Every cost model also carries a :class:`~sglang_spex.sim.client.ClientOverhead` (``client``): per-request
latency and client CPU outside the engine. Zero unless given (the GPU figures assume none); the CPU calibration
passes the values it measured on the real server.
"""

from __future__ import annotations

import abc
import logging
from typing import Optional, Union

import numpy as np

from sglang_spex.profile.cache import Profile, latest_profile
from sglang_spex.profile.roofline import KneeFit, find_knee, k_total_from_knee
from sglang_spex.sim.client import NO_OVERHEAD, ClientOverhead
from sglang_spex.sim.hardware import Device, Model, get_device, get_model

logger = logging.getLogger(__name__)
ArrayLike = Union[float, np.ndarray]
KNEE_GRID = np.array([1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024], dtype=float)


class CostModel(abc.ABC):
    name: str = "cost"
    client: ClientOverhead = NO_OVERHEAD  # per-request cost outside the engine (sim/client.py)

    @abc.abstractmethod
    def decode_time(self, batch: int, ctx_total: ArrayLike) -> ArrayLike:
        """Seconds for one decode step of ``batch`` sequences holding ``ctx_total`` context tokens in all."""

    @abc.abstractmethod
    def prefill_time(self, new_tokens: int, cached_tokens: int = 0, attn_pairs: Optional[float] = None) -> float:
        """Seconds for one prefill pass over ``new_tokens`` (after ``cached_tokens`` of reused prefix)."""

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights a decode step reads (T2's S_w); 0 when unknown."""
        return 0.0

    @property
    def kv_bytes_per_token(self) -> float:
        return 0.0

    def knee(self, ctx_per_seq: int = 512, grid: np.ndarray = KNEE_GRID) -> KneeFit:
        """Knee of this model's decode curve at ``ctx_per_seq`` tokens of context per sequence."""
        times = np.array([float(self.decode_time(int(b), b * ctx_per_seq)) for b in grid])
        return find_knee(grid, times)

    def k_total(self, ctx_per_seq: int = 512) -> int:
        """The knee's batch, rounded; an unbounded knee (past the grid) gives the grid's edge and logs a warning."""
        fit = self.knee(ctx_per_seq)
        if not fit.bounded and not getattr(self, "_warned_unbounded", False):
            self._warned_unbounded = True
            logger.warning(
                "%s: the decode curve has no knee up to batch %d (ctx %d per sequence); k_total is that grid edge, "
                "not a measured knee",
                self.name,
                int(fit.knee),
                ctx_per_seq,
            )
        return k_total_from_knee(fit)


def default_attn_pairs(new_tokens: int, cached_tokens: int) -> float:
    """Attention (query, key) pairs of one causal prefill of ``new_tokens`` after ``cached_tokens``."""
    return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2.0


class RooflineCost(CostModel):
    def __init__(self, device: Union[str, Device], model: Union[str, Model], client: ClientOverhead = NO_OVERHEAD):
        self.client = client
        self.device = get_device(device) if isinstance(device, str) else device
        self.model = get_model(model) if isinstance(model, str) else model
        self.name = f"{self.device.name}/{self.model.name}"
        self._bw = self.device.mem_bw * self.device.bw_eff
        self._flops = self.device.peak_flops * self.device.flops_eff

    @property
    def weight_bytes(self) -> float:
        return self.model.weight_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return float(self.model.kv_bytes_per_token)

    def decode_time(self, batch: int, ctx_total: ArrayLike) -> ArrayLike:
        m = self.model
        ctx = np.asarray(ctx_total, dtype=float)
        nbytes = m.weight_bytes_read(batch) + (ctx + batch) * m.kv_bytes_per_token
        flops = 2.0 * m.active_params * batch + m.attn_flops_per_ctx_token * ctx
        t = self.device.step_overhead_s + np.maximum(nbytes / self._bw, flops / self._flops)
        return float(t) if np.ndim(t) == 0 else t

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0, attn_pairs: Optional[float] = None) -> float:
        if new_tokens <= 0:
            return 0.0
        m = self.model
        pairs = default_attn_pairs(new_tokens, cached_tokens) if attn_pairs is None else attn_pairs
        nbytes = m.weight_bytes_read(new_tokens) + (new_tokens + cached_tokens) * m.kv_bytes_per_token
        flops = 2.0 * m.active_params * new_tokens + m.attn_flops_per_ctx_token * pairs
        return self.device.step_overhead_s + max(nbytes / self._bw, flops / self._flops)

    def max_kv_tokens(self, mem_fraction: float = 0.9) -> int:
        """KV tokens that fit next to the weights in ``mem_fraction`` of device memory; ValueError when none do."""
        free = self.device.memory * mem_fraction - self.model.weight_bytes
        tokens = int(free // self.model.kv_bytes_per_token) if free > 0 else 0
        if tokens < 1:
            raise ValueError(
                f"model {self.model.name} ({self.model.weight_bytes / 1e9:.1f} GB of weights) does not fit in "
                f"{self.device.name} ({self.device.memory / 1e9:.0f} GB x mem_fraction {mem_fraction}): "
                "no room for the KV cache"
            )
        return tokens


class MeasuredCost(CostModel):
    """Step times replayed from a live profile (``cpu-measured``)."""

    def __init__(self, profile: Profile, name: str = "cpu-measured", client: ClientOverhead = NO_OVERHEAD):
        self.profile = profile
        self.client = client
        self.fit: KneeFit = profile.fit
        self.name = name
        self.ctx_ref = float(profile.context_len)
        self.ctx_coef = float(profile.ctx_coef or 0.0)
        self.prefill_tok_s = float(profile.prefill_tok_s or 0.0)
        self.prefill_overhead_s = float(profile.prefill_overhead_s or 0.0)

    def decode_time(self, batch: int, ctx_total: ArrayLike) -> ArrayLike:
        ctx = np.asarray(ctx_total, dtype=float)
        t = float(self.fit.step_time(batch)) + self.ctx_coef * (ctx - batch * self.ctx_ref)
        t = np.maximum(t, 0.2 * float(self.fit.step_time(batch)))  # never extrapolate below a sane floor
        return float(t) if np.ndim(t) == 0 else t

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0, attn_pairs: Optional[float] = None) -> float:
        if new_tokens <= 0:
            return 0.0
        if self.prefill_tok_s <= 0:  # no prefill measurement: one decode step per 16 tokens, a rough stand-in
            return float(self.decode_time(1, self.ctx_ref)) * max(new_tokens / 16.0, 1.0)
        return self.prefill_overhead_s + new_tokens / self.prefill_tok_s

    def knee(self, ctx_per_seq: int = 0, grid: np.ndarray = KNEE_GRID) -> KneeFit:
        return self.fit  # the measured knee (at the measured context)


def make_cost(spec: str, model: Optional[str] = None, profile: Optional[Profile] = None) -> CostModel:
    """``make_cost("A100-80G", "Llemma-7B")``, or ``make_cost("cpu-measured", profile=p)`` — without ``p``, the
    newest cached profile whose model path contains ``model`` (default ``"SmolLM2"``)."""
    if spec == "cpu-measured":
        if profile is None:
            profile = latest_profile(model_contains=model or "SmolLM2")
            if profile is None:
                raise FileNotFoundError("no cached profile: run the profiler first (POST /spex/profile)")
        return MeasuredCost(profile)
    if model is None:
        raise ValueError("a device cost model needs a model name")
    return RooflineCost(spec, model)
