"""ReSpec Adaptive Server, offline part 2: from a profile, the best (s, t, n) or "no speculation" per batch size.

Speedup model, per config c and batch size B (from :class:`~sglang_spex.respec.profiler.Profile` points):

    throughput_c(B) = B * a_c(B) / C_c(B)        speedup_c(B) = throughput_c(B) / throughput_plain(B)
                                                               = a_c(B) * C_plain(B) / C_c(B)

with ``a_c`` the tokens a sequence gains per verify step (accepted drafts + the bonus token, 1 for plain decode)
and ``C_c`` the seconds of one draft+verify step of the batch. Both are interpolated linearly between profiled
batch sizes; beyond them the step cost is extrapolated linearly (cost grows ~linearly with B) and the
acceptance held at the nearest point. A config is chosen only if it beats plain decode by ``min_gain``.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from sglang_spex.respec.profiler import PLAIN, Profile, SpecConfig


def _interp(xs: Sequence[int], ys: Sequence[float], x: float, extrapolate: bool) -> float:
    if len(xs) == 1:
        return ys[0]
    if x <= xs[0] or x >= xs[-1]:
        if not extrapolate:
            return ys[0] if x <= xs[0] else ys[-1]
        i = 0 if x <= xs[0] else len(xs) - 2
    else:
        i = bisect.bisect_right(xs, x) - 1
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class SpeedupModel:
    """Interpolated step cost and tokens per step of every profiled config (and ``PLAIN``)."""

    def __init__(self, profile: Profile):
        if PLAIN not in profile.points:
            raise ValueError("profile has no no-speculation baseline ('none')")
        self.profile = profile
        self._curves: Dict[str, Tuple[List[int], List[float], List[float]]] = {}
        self._accept: Dict[str, List[float]] = {}
        for key, pts in profile.points.items():
            bs = sorted(pts)
            self._curves[key] = (bs, [pts[b].step_s for b in bs], [pts[b].tokens_per_step for b in bs])
            self._accept[key] = [pts[b].accept_length or pts[b].tokens_per_step for b in bs]

    @property
    def configs(self) -> List[str]:
        return [k for k in self._curves if k != PLAIN]

    def measured_batches(self, key: str) -> List[int]:
        """The batch sizes the profile measured for ``key``, ascending."""
        return self._curves[key][0]

    def step_s(self, key: str, batch: int) -> float:
        bs, cost, _ = self._curves[key]
        floor = min(cost) * 0.5  # extrapolating a noisy profile downwards must not reach zero
        return max(_interp(bs, cost, batch, extrapolate=True), floor)

    def tokens_per_step(self, key: str, batch: int) -> float:
        bs, _, tps = self._curves[key]
        return max(_interp(bs, tps, batch, extrapolate=False), 1.0 if key == PLAIN else 0.0)

    def accept_length(self, key: str, batch: int) -> float:
        """Mean tokens per request per step (SGLang's accept length), the quantity a live step reports."""
        return max(_interp(self._curves[key][0], self._accept[key], batch, extrapolate=False), 1.0)

    def throughput(self, key: str, batch: int) -> float:
        return batch * self.tokens_per_step(key, batch) / self.step_s(key, batch)

    def speedup(self, key: str, batch: int) -> float:
        """Throughput ratio to plain decode. Past the largest batch both curves measured it is never more than
        there: two extrapolated lines may cross anywhere (a noisy spec curve falling at its end would have
        speculation "pay" at a batch no measurement supports), while a measured gain may still fade."""
        s = self.throughput(key, batch) / self.throughput(PLAIN, batch)
        hi = min(self.measured_batches(key)[-1], self.measured_batches(PLAIN)[-1])
        if batch > hi:
            s = min(s, self.throughput(key, hi) / self.throughput(PLAIN, hi))
        return s


@dataclass(frozen=True)
class Choice:
    """What to run at one batch size: a config key, or ``None`` for plain decode; its predicted speedup."""

    config: Optional[str]
    speedup: float


@dataclass
class Plan:
    """The solver's answer for batch sizes 1..max_batch (larger batches use the last entry)."""

    choices: Dict[int, Choice]

    @property
    def max_batch(self) -> int:
        return max(self.choices)

    def choose(self, batch: int) -> Optional[str]:
        return self.choices[min(max(batch, 1), self.max_batch)].config

    def boundaries(self) -> List[int]:
        """Batch sizes B where the choice differs from B - 1 (the thresholds the FSM guards with hysteresis)."""
        return [b for b in range(2, self.max_batch + 1) if self.choose(b) != self.choose(b - 1)]

    def spec_max_batch(self) -> int:
        """Largest B such that every batch size 1..B speculates (0: never speculate at B=1)."""
        b = 0
        while b < self.max_batch and self.choose(b + 1) is not None:
            b += 1
        return b

    def summary(self) -> str:
        runs: List[str] = []
        start = 1
        for b in range(2, self.max_batch + 2):
            if b > self.max_batch or self.choose(b) != self.choose(start):
                c = self.choices[start]
                rng = f"B={start}" if b - 1 == start else f"B={start}..{b - 1}"
                runs.append(f"{rng}: {c.config or 'no-spec'} (x{c.speedup:.2f})")
                start = b
        return "; ".join(runs)

    def to_json(self) -> str:
        return json.dumps({str(b): {"config": c.config, "speedup": c.speedup} for b, c in self.choices.items()})

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls({int(b): Choice(c["config"], c["speedup"]) for b, c in json.loads(text).items()})


MIN_GAIN = 0.02  # a config is chosen only if it beats plain decode by this fraction


def solve(
    profile: Profile, max_batch: int = 64, min_gain: float = MIN_GAIN, configs: Optional[Sequence[str]] = None
) -> Plan:
    """Best config per batch size 1..max_batch; plain decode unless a config is ``min_gain`` faster."""
    model = SpeedupModel(profile)
    keys = list(configs) if configs is not None else model.configs
    choices: Dict[int, Choice] = {}
    for b in range(1, max_batch + 1):
        best = Choice(None, 1.0)
        for key in keys:
            s = model.speedup(key, b)
            if s > best.speedup and s >= 1.0 + min_gain:
                best = Choice(key, s)
        choices[b] = best
    return Plan(choices)


def best_case_speedup(
    profile: Profile, max_batch: int = 64, configs: Optional[Sequence[str]] = None
) -> Tuple[float, Optional[str], int]:
    """The largest speedup any config could reach at batch sizes 1..max_batch if every draft were accepted
    (``num_steps`` + 1 tokens per step, at most ``num_draft_tokens``) at its profiled step cost: (speedup, config,
    batch). Only batch sizes inside the range both curves measured count: a bound read from a line extrapolated
    past the profile (a noisy curve that falls with the batch) could claim anything. Below 1 + ``MIN_GAIN`` no
    drafter, however well trained, makes speculation pay on this profile."""
    model = SpeedupModel(profile)
    best: Tuple[float, Optional[str], int] = (0.0, None, 1)
    plain = model.measured_batches(PLAIN)
    for key in configs if configs is not None else model.configs:
        c = SpecConfig.parse(key)
        tokens = min(c.num_steps + 1, c.num_draft_tokens)
        measured = model.measured_batches(key)
        lo, hi = max(plain[0], measured[0]), min(plain[-1], measured[-1], max_batch)
        for b in range(lo, hi + 1):
            s = tokens * model.step_s(PLAIN, b) / model.step_s(key, b)
            if s > best[0]:
                best = (s, key, b)
    return best
