"""The decode step time of this scheduler as a function of the batch size, measured live, and the knee it shows."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, Optional, Set, Tuple

KNEE_ELASTICITY = 0.5  # profile.roofline's knee: half of the decode step time scales with the batch


@dataclass
class LiveCurve:
    """Recent decode step times by batch size, measured in this scheduler, and the knee they show.

    The knee is that of a straight line ``t = a + b·B`` fitted to the median step time of every batch size
    with at least ``min_samples`` recent steps: the batch where ``KNEE_ELASTICITY`` of the step time scales with
    it (``a / b`` at 0.5, profile.roofline's definition for a curve without a sharp bend). It is reported only once a batch at or
    past it was measured (the engine was seen compute-bound), never extrapolated. Context length also moves
    step times; the window of recent steps keeps the estimate current. The fitted line itself (:meth:`line`) is
    published too: SPEX's pay-off gate prices a saved step at ``a`` and a wasted token at ``b``."""

    window: int = 16
    min_samples: int = 4
    refit_every: int = 16
    samples: Dict[int, Deque[float]] = field(default_factory=dict)
    _adds: int = 0
    _knee: Optional[int] = None
    _line: Optional[Tuple[float, float]] = None  # (a, b) of the last fit
    _medians: Dict[int, float] = field(default_factory=dict)  # batch size -> median of its samples at the last fit
    _changed: Set[int] = field(default_factory=set)  # batch sizes sampled since the last fit

    def add(self, batch: int, step_s: float) -> None:
        if batch <= 0 or not step_s > 0 or math.isinf(step_s):
            return
        self.samples.setdefault(batch, deque(maxlen=self.window)).append(step_s)
        self._changed.add(batch)
        self._adds += 1
        if self._adds % self.refit_every == 0:
            self._knee = self._fit()

    def _fit(self) -> Optional[int]:
        for b in self._changed:  # a median is recomputed only for the batch sizes sampled since the last fit
            q = self.samples[b]
            if len(q) >= self.min_samples:
                self._medians[b] = statistics.median(q)
        self._changed.clear()
        pts = [(b, self._medians[b]) for b in self.samples if b in self._medians]
        if len(pts) < 2:
            return None
        n = len(pts)
        mx = sum(b for b, _ in pts) / n
        my = sum(t for _, t in pts) / n
        sxx = sum((b - mx) ** 2 for b, _ in pts)
        slope = sum((b - mx) * (t - my) for b, t in pts) / sxx if sxx > 0 else 0.0
        intercept = my - slope * mx
        self._line = (intercept, max(slope, 0.0)) if intercept > 0 else None
        if slope <= 0:
            return None  # flat: memory-bound as far as measured
        ratio = KNEE_ELASTICITY / (1.0 - KNEE_ELASTICITY)  # b·B / (a + b·B) = threshold at B = ratio·a/b
        knee = max(1, math.ceil(ratio * max(my - slope * mx, 0.0) / slope - 1e-9))
        return knee if knee <= max(b for b, _ in pts) else None

    def knee(self) -> Optional[int]:
        return self._knee

    def line(self) -> Optional[Tuple[float, float]]:
        """``(a, b)`` of the last fit (``b`` 0 when flat), or None before one (the pay-off gate's step cost)."""
        return self._line
