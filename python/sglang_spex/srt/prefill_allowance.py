"""How much speculative prefill may share a step with primary work: the allowance.

A speculative prefill that runs while primary requests are live lengthens the primaries' step: SGLang mixes it
into their decode step (``--enable-mixed-chunk``) or into the prefill a waiting primary starts anyway. On a GPU a
few hundred prompt tokens ride a memory-bound decode step almost free. On this CPU (SmolLM2, float32) a decode
step that becomes a mixed one costs ~30 ms more, plus ~3 ms per prompt token, against a ~110 ms step; session 11
saw REBASE-8 at 2 queries run twice as many such steps with speculation as without. Counting speculative
*requests* against the knee does not see this; pricing the step does.

- **Price** (:class:`PrefillPrice`), measured here: a step that prefilled ``E`` prompt tokens beside ``D`` decode
  rows took ``t``; the live decode line (``live_curve.LiveCurve``) says ``D`` rows alone take ``a + b·D``; the
  excess ``t - a - b·D`` is fitted as ``f + p·E`` over recent steps (least squares, ``f, p >= 0``): ``f`` what
  turning a decode step into a prefill step costs, ``p`` what each prompt token costs. Until two different
  prefill sizes were measured the price is ``f = 0, p = b`` (a prompt token priced like a decode row).
- **Allowance** (:class:`PrefillAllowance`): speculation may take ``share`` of the primaries' step time. Every
  step in which a primary request ran earns ``share`` times its time, into a bucket that holds at most one decode
  step of the primaries (so a single step is stretched by at most that much, and on average by ``share``). Beside
  live primaries a speculative request is admitted only if the bucket pays its price: ``p·E``, plus ``f`` for the
  first one when no primary prefills this step anyway (the speculative prefill alone turns the decode step into
  a prefill step). What it admits is spent. With no primary live nothing is limited: speculation then fills an
  engine the search left idle at its reward barrier, where it costs nobody a step.
- **Free**: a request the price in force makes cost 0 (measured riding the step for free) is admitted at any
  share, counted apart (``spec_prefill_free``).
- **Worth**: a speculative request the bucket cannot pay for is still admitted if its search says it is worth it:
  ``custom_params["spex_worth_s"]`` (the runner's expected use times the steps saved per hit measured on this
  engine, without a prior, at the live step's fixed cost) at least the price times the searches with live
  primaries (each of them waits it out).
  A DFS rollout whose hits save whole steps passes; a BFS node on a path-bound tree (saves ~0) does not.

``share`` is ``--tot-spec-prefill-share`` (0: nothing that costs a measurable time beside primaries).
"""

from __future__ import annotations

import math
import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Optional, Tuple

WINDOW = 32  # recent prefill steps the price is fitted on

Line = Tuple[float, float]  # (a, b) of the live decode line t = a + b·B
Price = Tuple[float, float]  # (f, p): seconds a step pays for becoming a prefill step, and per prompt token
UNKNOWN: Price = (math.inf, math.inf)  # no measurement yet: nothing is free
BUCKET, WORTH, FREE = "bucket", "worth", "free"  # who pays for an admitted speculative prefill (free: priced 0)


def fit_price(samples: Deque[Tuple[int, float]]) -> Optional[Price]:
    """Least-squares ``excess = f + p·E`` with ``f, p >= 0`` (None before two different sizes were seen)."""
    n = len(samples)
    if n < 2:
        return None
    es, xs = zip(*samples)  # the sums below run in C, in sample order (the same floats as a loop)
    return solve_price(n, sum(es), sum(map(operator.mul, es, es)), sum(xs), sum(map(operator.mul, es, xs)))


def solve_price(n: int, se: float, se2: float, sx: float, sex: float) -> Optional[Price]:
    """:func:`fit_price` from its sums over ``n`` samples: of ``E``, ``E²``, the excess ``x`` and ``E·x``."""
    denom = n * se2 - se * se
    if denom <= 1e-9 * max(n * se2, 1.0):
        return None  # one size only: f and p cannot be told apart
    p = (n * sex - se * sx) / denom
    f = (sx - p * se) / n
    if p < 0:
        return max(sx / n, 0.0), 0.0
    if f < 0:
        return 0.0, max(sex / se2, 0.0)
    return f, p


@dataclass
class PrefillPrice:
    """What prefill adds to a step, from recent prefill and mixed steps measured in this scheduler."""

    samples: Deque[Tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _fit: Optional[Price] = None
    _stale: bool = False  # samples were added since ``_fit`` was computed (it is fitted when next asked for)

    def add(self, line: Optional[Line], decode_rows: int, tokens: int, step_s: float) -> None:
        """One step that prefilled ``tokens`` beside ``decode_rows`` decode rows took ``step_s``."""
        if line is None or tokens <= 0 or not step_s > 0:
            return
        a, b = line
        self.samples.append((int(tokens), max(step_s - a - b * max(decode_rows, 0), 0.0)))
        self._stale = True

    def fit(self) -> Optional[Price]:
        """:func:`fit_price` of the samples, computed once per change of them."""
        if self._stale:
            self._fit, self._stale = fit_price(self.samples), False
        return self._fit

    def price(self, line: Optional[Line]) -> Optional[Price]:
        """``(f, p)`` in seconds (None: neither a fit nor a decode line yet)."""
        fit = self.fit()
        if fit is not None:
            return fit
        return None if line is None else (0.0, line[1])


@dataclass
class StepAllowance:
    """One step's admission beside live primaries: the credit it may spend at the price in force."""

    credit_s: float  # the bucket when the gate decided
    price: Price
    new_step: bool  # no primary prefills this step: the first speculative prefill pays ``f``
    searches: int = 1  # searches with live primary requests: each waits out the step's extra time
    spent_s: float = 0.0  # paid from the bucket this step

    def cost(self, tokens: int) -> float:
        f, p = self.price
        return (f if self.new_step else 0.0) + p * tokens

    def pays(self, tokens: int, worth_s: Optional[float] = None) -> Optional[str]:
        """Who pays for a speculative request of ``tokens`` prompt tokens: ``"free"`` (the price in force is 0: it
        costs no measurable time, at any share), ``"bucket"``, ``"worth"`` (the seconds its expected hit saves its
        search cover the time it costs every search with live primaries), or None."""
        cost = self.cost(tokens)
        if cost <= 0:
            return FREE
        if self.spent_s + cost <= self.credit_s:
            return BUCKET
        if worth_s is not None and worth_s >= max(self.searches, 1) * cost:
            return WORTH
        return None

    def take(self, tokens: int, payer: str) -> float:
        """Charge an admitted request; returns what it takes from the bucket."""
        cost = self.cost(tokens) if payer == BUCKET else 0.0
        self.spent_s += cost
        self.new_step = False
        return cost


@dataclass
class PrefillAllowance:
    """The bucket of primary step time speculative prefill may take, and the price it is spent at."""

    share: float = 0.02  # SpexConfig.spec_prefill_share
    credit_s: float = 0.0
    price: PrefillPrice = field(default_factory=PrefillPrice)

    def earn(self, step_s: float, cap_s: float) -> None:
        """A step with primary requests took ``step_s``; the bucket holds at most ``cap_s``."""
        if step_s > 0:
            self.credit_s = min(self.credit_s + self.share * step_s, max(cap_s, 0.0))

    def open(self, line: Optional[Line], primary_searches: int, primary_prefills: bool) -> Optional[StepAllowance]:
        """This step's allowance beside the live primaries of ``primary_searches`` searches (None: no limit; no
        primary shares the step, or no price is known yet and the share is not 0)."""
        if primary_searches <= 0:
            return None
        price = self.price.price(line)
        if self.share <= 0:
            price = UNKNOWN if price is None else price
            return StepAllowance(0.0, price, new_step=not primary_prefills, searches=primary_searches)
        if price is None:
            return None
        return StepAllowance(self.credit_s, price, new_step=not primary_prefills, searches=primary_searches)

    def spend(self, cost_s: float) -> None:
        self.credit_s = max(self.credit_s - cost_s, 0.0)
