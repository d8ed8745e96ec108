"""T3: adaptive early termination (paper §4.4, eqs. 3–4; the margin rule is our reading of the summary).

Count finished answers n; accumulate the reward mass c(a) of each distinct answer. With c1 ≥ c2 the masses of
the top-1 and top-2 answers, stop the whole search when n ≥ t and c1 − c2 ≥ α · Σ_a c(a), returning the
top-1 (majority by mass) answer. α = 0.5 as in the paper. Answers are told apart as the final vote tells them
(:func:`~sglang_spex.tot.answer_key.normalize`: "1,000", "1000" and "1000.0" are one answer), so ``mass`` is keyed
by that vote key, and ``stopped_answer`` is the top-1 answer as T3 first saw it spelled (the vote may report
another spelling of it). An answer's mass is its reward, a score >= 0 as every built-in reward gives (``logprob``:
exp of the mean token log-probability; a verifier's 0 or 1; a PRM's probability); a negative (a callback's),
missing or NaN reward adds none, so the mass never falls as a reward rises.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Optional

from sglang_spex.tot.answer_key import normalize


@dataclass
class EarlyStop:
    alpha: float = 0.5
    min_answers: int = 4
    enabled: bool = True
    mass: Dict[str, float] = field(default_factory=lambda: defaultdict(float))  # vote key -> reward mass
    n: int = 0
    stopped_answer: Optional[str] = None  # the top-1 answer's first spelling, once T3 fired
    spelling: Dict[str, str] = field(default_factory=dict)  # vote key -> the answer as first seen

    @staticmethod
    def weight(reward: Optional[float]) -> float:
        """Reward → non-negative mass that never falls as the reward rises: a score's positive part."""
        if reward is None or (isinstance(reward, float) and math.isnan(reward)):
            return 0.0
        return max(float(reward), 0.0)

    def add(self, answer: Optional[str], reward: Optional[float]) -> bool:
        """Record one finished answer (under its vote key); True when the search should stop now."""
        if answer is None:
            return False
        key = normalize(answer)
        self.spelling.setdefault(key, answer)
        self.n += 1
        self.mass[key] += self.weight(reward)
        return self.should_stop()

    def margin(self) -> tuple:
        ranked = sorted(self.mass.values(), reverse=True) + [0.0, 0.0]
        return ranked[0], ranked[1], sum(self.mass.values())

    def should_stop(self) -> bool:
        if not self.enabled or self.n < self.min_answers or not self.mass:
            return False
        c1, c2, total = self.margin()
        if total <= 0:
            return False
        if c1 - c2 >= self.alpha * total:
            top = max(self.mass, key=self.mass.__getitem__)  # ties (only with α = 0): the answer seen first
            self.stopped_answer = self.spelling[top]
            return True
        return False
