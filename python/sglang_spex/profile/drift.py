"""One drift monitor for every profile prediction (SPEX's roofline step times, ReSpec's step costs and acceptance).

A :class:`DriftMonitor` keeps the last ``window`` (observed, predicted) pairs of one quantity and reports the
relative drift of the observations from the predictions once ``min_samples`` are in:

* ``statistic="median"``: the median of the per-sample relative errors -- robust to one slow step, right for
  step times, where interference only ever adds time in bursts;
* ``statistic="mean"``: the window's mean observation over its mean prediction, minus one -- right for a
  per-step count such as speculative acceptance (1..n+1 tokens per step), whose median is not its mean (a
  1-draft chain accepting 40 % of the time has median 1 and mean 1.4).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Callable, Deque, Optional, Tuple

STATISTICS = ("median", "mean")


class DriftMonitor:
    """Flags when observations of a quantity drift from ``predict(batch)`` by more than ``threshold``."""

    def __init__(
        self,
        predict: Callable[[int], float],
        threshold: float = 0.2,
        window: int = 32,
        min_samples: int = 8,
        statistic: str = "median",
    ):
        if statistic not in STATISTICS:
            raise ValueError(f"statistic {statistic!r}: expected one of {STATISTICS}")
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples ({min_samples}) <= window ({window})")
        self.predict = predict
        self.threshold = threshold
        self.window = window
        self.min_samples = min_samples
        self.statistic = statistic
        self._pairs: Deque[Tuple[float, float]] = deque(maxlen=window)

    def observe(self, batch: int, value: float) -> bool:
        """Record one observation at ``batch`` (ignored unless batch, value and prediction are positive); True when
        the window has drifted past the threshold."""
        if batch <= 0 or value <= 0:
            return False
        pred = float(self.predict(batch))
        if pred <= 0:
            return False
        self._pairs.append((float(value), pred))
        return self.drifted

    @property
    def samples(self) -> int:
        return len(self._pairs)

    @property
    def drift(self) -> float:
        """Relative drift of the window (0 while empty); positive means observations exceed predictions."""
        if not self._pairs:
            return 0.0
        if self.statistic == "median":
            return float(statistics.median(v / p - 1.0 for v, p in self._pairs))
        return sum(v for v, _ in self._pairs) / sum(p for _, p in self._pairs) - 1.0

    @property
    def drifted(self) -> bool:
        return len(self._pairs) >= self.min_samples and abs(self.drift) > self.threshold

    def reset(self, predict: Optional[Callable[[int], float]] = None) -> None:
        """Empty the window (and predict with ``predict`` from now on, when given)."""
        if predict is not None:
            self.predict = predict
        self._pairs.clear()
