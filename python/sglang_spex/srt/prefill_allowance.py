"""How many speculative prompt tokens may be prefilled in a step that primary work shares: the allowance.

A speculative prefill that runs while primary requests are live lengthens the primaries' step: SGLang mixes it
into their decode step (``--enable-mixed-chunk``) or into the prefill a waiting primary starts anyway. On a GPU a
few hundred prompt tokens ride a memory-bound decode step almost free; on a CPU each costs about half a decode
row, so a speculative expansion mixed into a decode step made that step 2-3x longer (session 11, REBASE-8 at 2
queries). Counting speculative *requests* against the knee does not see this; counting their prompt tokens does.

- **Price of a prefill token**, measured here (:class:`PrefillPrice`): a step that prefilled ``E`` tokens beside
  ``D`` decode rows took ``t``; the live decode line (``LiveCurve``) says ``D`` rows alone take ``a + b·D``; so
  each prompt token cost ``(t - a - b·D) / E``. The price is the median of recent steps, and ``b`` (a decode
  row's cost) until a step with enough prefill tokens was measured.
- **Allowance** (:class:`PrefillAllowance`): speculation may take ``share`` of the primaries' step time. Every
  step in which a primary request ran earns ``share`` times its time, into a bucket that holds at most one
  decode step of the primaries (so one step is stretched by at most that much, and on average by ``share``).
  A speculative request is prefilled beside live primaries only while the bucket pays for its prompt tokens at
  the price; what it admits is spent. With no primary live nothing is limited: speculation then fills an engine
  the search left idle at its reward barrier, where it costs nobody a step.

On a GPU the measured price is near 0 and the allowance is large (the gate counts requests, as before); on this
CPU it is small. ``share`` is ``--tot-spec-prefill-share`` (0: no speculative prefill beside primaries).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Optional, Tuple

MIN_TOKENS = 4  # a step prefilling fewer tokens says too little about their price (timer noise)
WINDOW = 32  # recent steps the price is the median of

Line = Tuple[float, float]  # (a, b) of the live decode line t = a + b·B


@dataclass
class PrefillPrice:
    """Seconds one prompt token adds to a step, from recent prefill and mixed steps measured in this scheduler."""

    samples: Deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(self, line: Optional[Line], decode_rows: int, tokens: int, step_s: float) -> None:
        """One step that prefilled ``tokens`` beside ``decode_rows`` decode rows took ``step_s``."""
        if line is None or tokens < MIN_TOKENS or not step_s > 0:
            return
        a, b = line
        self.samples.append(max(step_s - a - b * max(decode_rows, 0), 0.0) / tokens)

    def per_token(self, line: Optional[Line]) -> Optional[float]:
        """The price in seconds per token (None: neither a measured step nor a decode line yet)."""
        if self.samples:
            return statistics.median(self.samples)
        return None if line is None else line[1]


@dataclass
class PrefillAllowance:
    """The bucket of primary step time speculative prefill may take, and the price it is spent at."""

    share: float = 0.1
    credit_s: float = 0.0
    price: PrefillPrice = field(default_factory=PrefillPrice)

    def earn(self, step_s: float, cap_s: float) -> None:
        """A step with primary requests took ``step_s``; the bucket holds at most ``cap_s``."""
        if step_s > 0:
            self.credit_s = min(self.credit_s + self.share * step_s, max(cap_s, 0.0))

    def tokens(self, line: Optional[Line], primary_live: bool) -> Optional[int]:
        """Speculative prompt tokens this step may prefill (None: no limit; no primary shares the step, or no
        price is known, or prefill tokens cost nothing measurable)."""
        if not primary_live:
            return None
        if self.share <= 0:
            return 0
        price = self.price.per_token(line)
        if price is None or price <= 0:
            return None
        return int(self.credit_s / price)

    def spend(self, tokens: int, line: Optional[Line]) -> None:
        price = self.price.per_token(line)
        if price:
            self.credit_s = max(self.credit_s - tokens * price, 0.0)
