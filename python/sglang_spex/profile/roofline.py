"""Knee detection on a decode step-time curve t(B) (batch size B → seconds per decode step).

A roofline engine reads the weights once per step whatever the batch (memory-bound: t flat), until the
per-sequence work outgrows that read (compute-bound: t grows ∝ B). We fit a continuous two-segment
line ``t(B) = a + b1·B + (b2 − b1)·max(0, B − k)`` by least squares over a grid of breakpoints ``k``,
then define the knee as the smallest batch from which on the fitted curve's elasticity ``d ln t / d ln B``
stays at or above ``threshold`` (default 0.5: half of the step time scales with the batch). Past it a
bigger batch buys at most √2× throughput per doubling; before it, batching is nearly free.

This one rule covers both shapes we meet:
- an ideal roofline ``max(a, b·B)``: elasticity jumps 0 → 1 at the ridge ``a/b`` (the knee);
- a straight line ``a + b·B`` (CPU torch_native, no sharp knee): elasticity ``bB/(a+bB)`` is 0.5 at
  ``B = a/b``, where throughput reaches half its asymptote — the analogue of the ridge point.
If the elasticity stays below the threshold over the measured range the engine is memory-bound
everywhere we looked: the knee is reported as the largest measured batch with ``bounded=False``.
:func:`next_batch` keeps the profiler's sweep going (doubling the batch) until throughput B/t(B) flattens, so a
knee past the initial sizes is measured instead of reported at the last one. A bigger batch never decodes a step
faster: :func:`out_of_order` and :func:`worst_dip` find points that say otherwise (a disturbed sweep), and
:func:`monotone_envelope` is the curve the knee is then read from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class KneeFit:
    """A fitted two-segment step-time curve and its knee."""

    a: float  # intercept (s)
    b1: float  # slope before the breakpoint (s per sequence)
    b2: float  # slope after the breakpoint (s per sequence)
    breakpoint: float  # k (batch)
    knee: float  # batch where elasticity reaches the threshold
    bounded: bool  # False: the threshold was not reached inside the measured range
    threshold: float
    rmse: float  # fit residual, relative to the step time

    def step_time(self, batch) -> np.ndarray:
        """Fitted seconds per decode step at ``batch`` (array-friendly; extrapolates linearly)."""
        b = np.asarray(batch, dtype=float)
        return self.a + self.b1 * b + (self.b2 - self.b1) * np.maximum(0.0, b - self.breakpoint)

    def to_dict(self) -> Dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict) -> "KneeFit":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def _lstsq_segments(x: np.ndarray, y: np.ndarray, k: float):
    """Best continuous two-segment fit with breakpoint ``k`` in *relative* error (timing noise is
    multiplicative); slopes clipped to be non-negative. Returns (a, b1, b2, relative rmse)."""
    w = 1.0 / np.maximum(np.abs(y), 1e-12)
    design = np.stack([np.ones_like(x), x, np.maximum(0.0, x - k)], axis=1)
    coef, *_ = np.linalg.lstsq(design * w[:, None], y * w, rcond=None)
    a, b1, d = coef
    b1 = max(b1, 0.0)
    b2 = max(b1 + d, 0.0)
    pred = a + b1 * x + (b2 - b1) * np.maximum(0.0, x - k)
    a += float(np.sum(w * w * (y - pred)) / np.sum(w * w))  # re-centre after clipping
    pred = a + b1 * x + (b2 - b1) * np.maximum(0.0, x - k)
    return float(a), float(b1), float(b2), float(np.sqrt(np.mean(((y - pred) * w) ** 2)))


def fit_segments(batch: Sequence[float], step_time: Sequence[float], min_gain: float = 0.3):
    """(a, b1, b2, breakpoint, rmse) of the best continuous two-segment fit (needs ≥ 2 points).

    A breakpoint is kept only if it cuts the single-line residual by at least ``min_gain`` (relative);
    otherwise the curve is one line (``b1 == b2``, breakpoint at the largest batch).
    """
    from scipy.optimize import minimize_scalar

    x = np.asarray(batch, dtype=float)
    y = np.asarray(step_time, dtype=float)
    if x.size < 2 or x.size != y.size:
        raise ValueError("need at least two (batch, step_time) points of equal length")
    order = np.argsort(x)
    x, y = x[order], y[order]
    a, b, _, line_rmse = _lstsq_segments(x, y, float(x[-1]))
    line = (a, b, b, float(x[-1]), line_rmse)
    if x.size < 4:
        return line
    grid = np.geomspace(x[1], x[-1], 257)[:-1]
    rmses = [_lstsq_segments(x, y, k)[-1] for k in grid]
    i = int(np.argmin(rmses))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
    k = grid[i]
    if hi > lo:
        res = minimize_scalar(lambda k: _lstsq_segments(x, y, k)[-1], bounds=(lo, hi), method="bounded")
        if res.fun <= rmses[i]:
            k = float(res.x)
    a2, b1, b2, rmse = _lstsq_segments(x, y, k)
    if rmse >= (1 - min_gain) * line[-1] or line[-1] - rmse <= 1e-9 * float(np.mean(np.abs(y))):
        return line
    return a2, b1, b2, float(k), rmse


def elasticity(fit_a: float, b1: float, b2: float, k: float, batch) -> np.ndarray:
    """d ln t / d ln B of the two-segment curve."""
    b = np.asarray(batch, dtype=float)
    slope = np.where(b < k, b1, b2)
    t = fit_a + b1 * b + (b2 - b1) * np.maximum(0.0, b - k)
    return slope * b / np.maximum(t, 1e-15)


def _segment_knee(base: float, slope: float, lo: float, hi: float, threshold: float):
    """Smallest B in [lo, hi] with slope·B / (base + slope·B) ≥ threshold on ``t = base + slope·B``, else None."""
    if slope <= 0:
        return None
    if base <= 0:
        return lo
    b = threshold * base / (slope * (1 - threshold))
    return max(b, lo) if b <= hi else None


def find_knee(batch: Sequence[float], step_time: Sequence[float], threshold: float = 0.5) -> KneeFit:
    """Fit ``t(B)`` and locate the knee (see the module docstring)."""
    if not 0 < threshold < 1:
        raise ValueError("threshold must be in (0, 1)")
    a, b1, b2, k, rmse = fit_segments(batch, step_time)
    lo, hi = float(np.min(batch)), float(np.max(batch))
    if k >= hi:  # one line
        knee = _segment_knee(a, b1, lo, hi, threshold)
    else:  # the knee is where elasticity reaches the threshold *and stays there* to the end of the range
        start2 = max(k, lo)
        knee = _segment_knee(a - (b2 - b1) * k, b2, start2, hi, threshold)
        if knee is not None and knee <= start2 and k > lo:
            knee = _segment_knee(a, b1, lo, k, threshold) or knee
    bounded = knee is not None
    return KneeFit(
        a=a,
        b1=b1,
        b2=b2,
        breakpoint=k,
        knee=float(knee if bounded else hi),
        bounded=bounded,
        threshold=threshold,
        rmse=rmse,
    )


def k_total_from_knee(fit: KneeFit, minimum: int = 1) -> int:
    """The global speculative budget: the concurrency at the knee (paper §4.3), rounded, at least ``minimum``."""
    return max(int(round(fit.knee)), minimum)


def throughput_gain(batch: Sequence[float], step_time: Sequence[float]) -> float:
    """Throughput (B / t) gain per batch doubling between the two largest measured batches."""
    order = np.argsort(np.asarray(batch, dtype=float))
    b = np.asarray(batch, dtype=float)[order][-2:]
    t = np.asarray(step_time, dtype=float)[order][-2:]
    if b.size < 2 or b[1] <= b[0]:
        raise ValueError("need two distinct batch sizes")
    ratio = (b[1] / t[1]) / (b[0] / t[0])
    return float(ratio ** (1.0 / np.log2(b[1] / b[0])))


def next_batch(batch: Sequence[float], step_time: Sequence[float], limit: int, flat_gain: float = 0.1) -> Optional[int]:
    """The next batch of the sweep: twice the largest (at most ``limit``) while the last doubling still raised
    throughput by more than ``flat_gain``; None once it flattened or the limit is reached."""
    if len(batch) < 2:
        return None
    top = int(max(batch))
    if top >= limit or throughput_gain(batch, step_time) < 1.0 + flat_gain:
        return None
    return min(2 * top, int(limit))


def out_of_order(step_time: Sequence[float], tol: float) -> List[int]:
    """Indices of points (in sweep order, batch ascending) that read more than ``tol`` slower than a later, bigger
    batch: a bigger batch never decodes a step faster, so one of the two was disturbed."""
    return [j for j, t in enumerate(step_time) if any(u < (1.0 - tol) * t for u in step_time[j + 1 :])]


def worst_dip(step_time: Sequence[float]) -> float:
    """The largest fraction by which a point (batch ascending) reads below an earlier, smaller batch (0: monotone)."""
    dip, top = 0.0, 0.0
    for t in step_time:
        if top > 0:
            dip = max(dip, 1.0 - t / top)
        top = max(top, t)
    return dip


def monotone_envelope(step_time: Sequence[float]) -> List[float]:
    """Each point lowered to the fastest later (bigger batch) point: the non-decreasing curve below the data,
    read as interference slowing the points above it (their long walls)."""
    out, low = [], float("inf")
    for t in reversed(step_time):
        low = min(low, t)
        out.append(low)
    return out[::-1]
