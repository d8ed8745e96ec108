"""The decode step time of this scheduler as a function of the batch size, measured live, and the knee it shows."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence, Set, Tuple

KNEE_ELASTICITY = 0.5  # profile.roofline's knee: half of the decode step time scales with the batch
# A knee is reported only when the data supports it: the fit spans at least MIN_BATCH_SIZES batch sizes (each with
# min_samples steps) whose largest is at least MIN_BATCH_RANGE times the smallest, and the knee of the line pivoted
# about its centroid to slope − KNEE_SE standard errors still lies within the measured batches. A workload that
# shows only batches 1-3 on a noisy host otherwise reads a steep slope from noise and holds speculation to 1-2 rows.
MIN_BATCH_SIZES = 4
MIN_BATCH_RANGE = 2.0
KNEE_SE = 2.0
MEDIAN_SE = math.sqrt(math.pi / 2)  # standard error of a median / that of a mean (normal samples)


@dataclass(frozen=True)
class LiveFit:
    """One fit of ``t = a + b·B`` to the medians of the batch sizes, and why its knee is or is not reported."""

    line: Optional[Tuple[float, float]]  # (a, b), b clipped at 0; None when the intercept is not positive
    knee: Optional[int]  # the reported knee (None: none the data supports)
    knee_lo: Optional[int]  # the knee at the conservative slope (slope − KNEE_SE·se); None: that slope is flat
    slope_se: float  # standard error of the slope (s per row): the larger of sampling and residual scatter
    batch_sizes: int  # distinct batch sizes in the fit
    batch_range: float  # largest / smallest of them
    why: str  # "ok", or why no knee: "few batch sizes", "narrow range", "flat", "uncertain", "past range"

    def report(self) -> Dict[str, Any]:
        """JSON-ready quality of the fit (``/spex/stats`` → ``scheduler.live_fit``)."""
        return {
            "why": self.why,
            "knee_lo": self.knee_lo,
            "slope_se_s": self.slope_se,
            "batch_sizes": self.batch_sizes,
            "batch_range": self.batch_range,
        }


def _knee_of(a: float, b: float) -> Optional[int]:
    """Batch where ``KNEE_ELASTICITY`` of ``a + b·B`` scales with B (None for a flat line)."""
    if b <= 0:
        return None
    ratio = KNEE_ELASTICITY / (1.0 - KNEE_ELASTICITY)  # b·B / (a + b·B) = threshold at B = ratio·a/b
    return max(1, math.ceil(ratio * max(a, 0.0) / b - 1e-9))


def fit_line(pts: Sequence[Tuple[int, float, float]]) -> Optional[LiveFit]:
    """Least-squares ``t = a + b·B`` to ``(batch, median step time, its standard error)`` points (None under 2).

    The slope's standard error is the larger of the one the medians' own errors give and the one the residuals
    around the line give (n > 2): the first sees step-time noise, the second a curve that is not a line."""
    n = len(pts)
    if n < 2:
        return None
    mx = sum(b for b, _, _ in pts) / n
    my = sum(t for _, t, _ in pts) / n
    sxx = sum((b - mx) ** 2 for b, _, _ in pts)
    slope = sum((b - mx) * (t - my) for b, t, _ in pts) / sxx if sxx > 0 else 0.0
    intercept = my - slope * mx
    line = (intercept, max(slope, 0.0)) if intercept > 0 else None
    var_sampling = sum(((b - mx) * se) ** 2 for b, _, se in pts) / sxx**2 if sxx > 0 else 0.0
    rss = sum((t - intercept - slope * b) ** 2 for b, t, _ in pts)
    var_resid = rss / (n - 2) / sxx if n > 2 and sxx > 0 else 0.0
    se = math.sqrt(max(var_sampling, var_resid))
    lo, hi = min(b for b, _, _ in pts), max(b for b, _, _ in pts)
    slope_lo = slope - KNEE_SE * se
    knee_lo = _knee_of(my - slope_lo * mx, slope_lo)  # the line pivoted about the centroid, where it is surest
    knee = _knee_of(intercept, slope)
    if n < MIN_BATCH_SIZES:
        why = "few batch sizes"
    elif hi < MIN_BATCH_RANGE * lo:
        why = "narrow range"
    elif knee is None:
        why = "flat"  # memory-bound as far as measured
    elif knee > hi:
        why = "past range"  # never extrapolated
    elif knee_lo is None or knee_lo > hi:
        why = "uncertain"
    else:
        why = "ok"
    return LiveFit(line, knee if why == "ok" else None, knee_lo, se, n, hi / lo, why)


def median_se(q: Sequence[float]) -> float:
    """Standard error of the median of ``q`` (0 for fewer than two samples; plain floats: it runs in the scheduler)."""
    n = len(q)
    if n < 2:
        return 0.0
    mean = sum(q) / n
    return MEDIAN_SE * math.sqrt(sum((t - mean) ** 2 for t in q) / (n - 1) / n)


@dataclass
class LiveCurve:
    """Recent decode step times by batch size, measured in this scheduler, and the knee they show.

    The knee is that of a straight line ``t = a + b·B`` fitted to the median step time of every batch size
    with at least ``min_samples`` recent steps: the batch where ``KNEE_ELASTICITY`` of the step time scales with
    it (``a / b`` at 0.5, profile.roofline's definition for a curve without a sharp bend). It is reported only once a
    batch at or past it was measured (the engine was seen compute-bound), never extrapolated, and only when the fit
    is sure of it (:func:`fit_line`: enough batch sizes over a wide enough range, a small enough slope error).
    Context length also moves step times; the window of recent steps keeps the estimate current. The fitted line
    itself (:meth:`line`) is published too: SPEX's pay-off gate prices a saved step at ``a`` and a wasted token
    at ``b``."""

    window: int = 16
    min_samples: int = 4
    refit_every: int = 16
    samples: Dict[int, Deque[float]] = field(default_factory=dict)
    _adds: int = 0
    _fit: Optional[LiveFit] = None
    _line: Optional[Tuple[float, float]] = None  # (a, b) of the last fit with two batch sizes or more
    _medians: Dict[int, Tuple[float, float]] = field(default_factory=dict)  # batch -> (median, its se) at last fit
    _changed: Set[int] = field(default_factory=set)  # batch sizes sampled since the last fit

    def add(self, batch: int, step_s: float) -> None:
        if batch <= 0 or not step_s > 0 or math.isinf(step_s):
            return
        self.samples.setdefault(batch, deque(maxlen=self.window)).append(step_s)
        self._changed.add(batch)
        self._adds += 1
        if self._adds % self.refit_every == 0:
            self._refit()

    def points(self) -> List[Tuple[int, float, float]]:
        """``(batch, median, its standard error)`` of every batch size with ``min_samples`` steps, as last fitted."""
        return [(b, *self._medians[b]) for b in self.samples if b in self._medians]

    def _refit(self) -> None:
        for b in self._changed:  # a median is recomputed only for the batch sizes sampled since the last fit
            q = self.samples[b]
            if len(q) >= self.min_samples:
                self._medians[b] = (statistics.median(q), median_se(q))
        self._changed.clear()
        fit = fit_line(self.points())
        if fit is not None:
            self._fit, self._line = fit, fit.line

    def knee(self) -> Optional[int]:
        return self._fit.knee if self._fit is not None else None

    def line(self) -> Optional[Tuple[float, float]]:
        """``(a, b)`` of the last fit (``b`` 0 when flat), or None before one (the pay-off gate's step cost)."""
        return self._line

    def quality(self) -> Optional[Dict[str, Any]]:
        """How sure the last fit is of its knee (:meth:`LiveFit.report`), None before a fit."""
        return self._fit.report() if self._fit is not None else None
