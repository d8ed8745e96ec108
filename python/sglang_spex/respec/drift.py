"""ReSpec online re-profiling: when live decode steps drift from the profile, refit it from what was measured.

Every decode step reports (state, batch size, wall seconds, mean tokens per sequence). Per state, two
:class:`~sglang_spex.profile.drift.DriftMonitor` windows (128 steps, a verdict only after 64: one spec step
accepts 1..n+1 tokens, so a short window is noise) compare them with the profile's prediction at that batch size:
step cost by the median relative error (robust to one slow step), and SGLang's accept length -- the same
per-request mean the profile records next to its straggler-bound tokens per batch step -- by the window's mean
over the predictions' mean (a per-step count's median is not its mean). A drift beyond the threshold (default
20 %) triggers a refit: step costs of *every* state scale by the trigger's cost drift (load or clocks slow all
configs alike, so a uniform slowdown never flips the plan), the trigger's acceptance curve scales by its
acceptance drift (a policy update moves acceptance at every batch size; tokens per step and accept length move by
the same factor), the trigger's profiled batch sizes seen live often enough then take their own measured values,
the solver re-plans, and the FSM carries on with the new plan (no server restart, no offline run).
"""

from __future__ import annotations

import copy
import statistics
from collections import defaultdict, deque
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from sglang_spex.profile.drift import DriftMonitor
from sglang_spex.respec.profiler import PLAIN, Point, Profile
from sglang_spex.respec.solver import Plan, SpeedupModel, solve


def _scaled(p: Point, cost: float, tokens: float) -> Point:
    """``p`` with its step cost times ``cost`` and its tokens per step / accept length times ``tokens``."""
    tps = max(1.0, p.tokens_per_step * tokens)
    acc = None if p.accept_length is None else max(1.0, p.accept_length * tokens)
    step = p.step_s * cost
    return Point(p.batch_size, step, tps, p.batch_size * tps / step, acc, p.verify_ct)


class OnlineReprofiler:
    """Drift detection and profile refit for the configs a server can run (``configs``) plus plain decode."""

    def __init__(
        self,
        profile: Profile,
        configs: Sequence[str],
        max_batch: int = 256,
        threshold: float = 0.2,
        window: int = 128,
        min_samples: int = 64,  # one spec step accepts 1..n+1 tokens: a short window is noise
        min_point_samples: int = 4,
    ):
        self.profile = copy.deepcopy(profile)
        self.configs = list(configs)
        self.max_batch = max_batch
        self.threshold, self.window, self.min_samples = threshold, window, min_samples
        self.min_point_samples = min_point_samples
        self.model = SpeedupModel(self.profile)
        self._monitors: Dict[Tuple[str, str], DriftMonitor] = {}
        self._samples: Dict[Tuple[str, int], Deque[Tuple[float, float]]] = defaultdict(lambda: deque(maxlen=window))
        self.reprofiles = 0
        self.history: List[dict] = []  # one entry per refit (last 16)

    def _monitor(self, key: str, what: str) -> DriftMonitor:
        mon = self._monitors.get((key, what))
        if mon is None:

            def predict(batch: int, k: str = key, f: str = what) -> float:  # reads the current (refitted) model
                return self.model.step_s(k, batch) if f == "cost" else self.model.accept_length(k, batch)

            # step costs: median relative error (one slow step never counts); acceptance: window means
            statistic = "median" if what == "cost" else "mean"
            mon = DriftMonitor(predict, self.threshold, self.window, self.min_samples, statistic=statistic)
            self._monitors[(key, what)] = mon
        return mon

    def drift(self) -> Dict[str, float]:
        """Current relative drift per ``state/cost`` (median) and ``state/tokens`` (window means) window."""
        return {f"{k}/{w}": round(m.drift, 4) for (k, w), m in self._monitors.items()}

    def observe(self, key: Optional[str], batch: int, step_s: float, tokens_per_step: float) -> Optional[Plan]:
        """Record one decode step of state ``key`` (None = plain); a new plan when the profile was refitted."""
        key = key or PLAIN
        if key not in self.model.profile.points or batch <= 0 or step_s <= 0:
            return None
        self._samples[(key, batch)].append((step_s, tokens_per_step))
        drifted = self._monitor(key, "cost").observe(batch, step_s)
        if key != PLAIN:
            drifted = self._monitor(key, "tokens").observe(batch, tokens_per_step) or drifted
        if not drifted:
            return None
        return self._refit(key)

    def _refit(self, trigger: str) -> Plan:
        before = self.drift()
        cost = 1.0 + self._monitor(trigger, "cost").drift
        tokens = 1.0 + (self._monitor(trigger, "tokens").drift if trigger != PLAIN else 0.0)
        # step-cost drift is the machine's (load, clocks, threads): every state's curve scales alike, so a uniform
        # slowdown never flips the plan; acceptance drift is the workload's or the drafter's: the trigger's only
        for key, pts in self.profile.points.items():
            for b, p in list(pts.items()):
                scale = tokens if key == trigger and key != PLAIN else 1.0
                self.profile.add(key, _scaled(p, cost, scale))
        # the trigger's batch sizes seen live often enough: measured step cost, acceptance moved by the measured ratio
        updated = []
        for (key, batch), samples in self._samples.items():
            if key != trigger or len(samples) < self.min_point_samples or batch not in self.profile.points[key]:
                continue
            p = self.profile.points[key][batch]
            step_s = statistics.median(s for s, _ in samples)
            ratio = statistics.fmean(t for _, t in samples) / (p.accept_length or p.tokens_per_step)
            self.profile.add(key, _scaled(p, step_s / p.step_s, ratio if key != PLAIN else 1.0))
            updated.append(f"{key}@{batch}")
            samples.clear()
        self.model = SpeedupModel(self.profile)
        for mon in self._monitors.values():
            mon.reset()
        self.reprofiles += 1
        plan = solve(self.profile, max_batch=self.max_batch, configs=self.configs)
        self.history = (
            self.history + [{"trigger": trigger, "drift": before, "points": updated, "plan": plan.summary()}]
        )[-16:]
        return plan

    def info(self) -> dict:
        return {
            "reprofiles": self.reprofiles,
            "drift": self.drift(),
            "threshold": self.threshold,
            "history": self.history[-4:],
        }
