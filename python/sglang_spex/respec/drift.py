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

A refit is driven only by steps of the state it refits, so a plan that drift took a config away from would never
measure that config again (a drafter that later improves, or a workload that moves back, would stay unused).
:class:`DriftProbe` re-explores it: while the live plan runs something else at a batch size where the offline plan
runs config k, it has the FSM follow the offline plan restricted to k for ``PROBE_STEPS`` speculative steps, first
``PROBE_GAP`` decode steps after the refit, then after a gap that doubles each time a probe confirms the refit (at
most ``PROBE_MAX_GAP``). A probe whose mean accept length beats the refitted prediction by more than the threshold
refits k by the measured ratio, up to k's offline profile (16 steps are evidence enough to undo a refit, not to
credit k with more than the offline profile measured); the plan comes back if k then pays. Batch sizes where the
offline plan runs no config are never probed.
"""

from __future__ import annotations

import copy
import statistics
from collections import defaultdict, deque
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

from sglang_spex.profile.drift import DriftMonitor
from sglang_spex.respec.profiler import PLAIN, Point, Profile
from sglang_spex.respec.solver import Plan, SpeedupModel, solve

PROBE_STEPS = 16  # speculative steps of one probe (and probe samples per verdict)
PROBE_GAP = 128  # decode steps from a refit that drops a config (or a probe) to the next probe, before backoff
PROBE_MAX_GAP = 4096  # cap of the doubling gap: a long "off" spends about PROBE_STEPS / PROBE_MAX_GAP on probes


def _scaled(p: Point, cost: float, tokens: float) -> Point:
    """``p`` with its step cost times ``cost`` and its tokens per step / accept length times ``tokens``."""
    tps = max(1.0, p.tokens_per_step * tokens)
    acc = None if p.accept_length is None else max(1.0, p.accept_length * tokens)
    step = p.step_s * cost
    return Point(p.batch_size, step, tps, p.batch_size * tps / step, acc, p.verify_ct)


def _accept(p: Point) -> float:
    return p.accept_length or p.tokens_per_step


class DriftProbe:
    """When to probe a config that a refit took away from batch sizes where the offline plan ``base`` runs it.

    :meth:`begin` counts decode steps and starts a probe where one is due, :meth:`count` ends it once ``steps``
    steps of the probed config ran and their verdict is in (or after ``4 * steps`` decode steps, when batch sizes,
    opt-outs or unread steps keep it from that), :meth:`judged` takes the verdict and :meth:`replanned` every new
    plan. The gap to the next probe doubles with each verdict that confirms the refit, up to ``max_gap``; it starts
    over at ``gap`` when a config is dropped again at least ``max_gap`` steps after a probe brought one back (and
    doubles when sooner).
    """

    def __init__(self, base: Plan, steps: int = PROBE_STEPS, gap: int = PROBE_GAP, max_gap: int = PROBE_MAX_GAP):
        if steps < 1 or not 1 <= gap <= max_gap:
            raise ValueError(f"bad probe schedule: steps {steps} >= 1, 1 <= gap {gap} <= max_gap {max_gap}")
        self.base = base
        self.steps, self.min_gap, self.max_gap, self.gap = steps, gap, max_gap, gap
        self.step = 0  # decode steps counted
        self.next_at: Optional[int] = None  # step from which a probe may start; None: the live plan drops nothing
        self.running: Optional[str] = None  # config of the probe in progress
        self.pending: Optional[str] = None  # probed config whose verdict is still to come
        self._began = self._ran = 0
        self._back_at: Optional[int] = None  # step of the last verdict that brought a config back
        self.probes = self.probe_steps = self.confirmed = self.comebacks = 0

    def dropped(self, live: Plan) -> bool:
        """Whether ``live`` runs something other than the offline plan's config at a batch size where it has one."""
        return any(self.base.choose(b) not in (None, live.choose(b)) for b in range(1, self.base.max_batch + 1))

    def probe_plan(self, key: str) -> Callable[[int], Optional[str]]:
        """The offline plan restricted to ``key`` (plain decode wherever it runs anything else or nothing)."""
        return lambda b: key if self.base.choose(b) == key else None

    def begin(
        self, batch: int, state: Optional[str], live: Plan, vote: Callable[[int, Callable], Optional[str]]
    ) -> Optional[Callable[[int], Optional[str]]]:
        """Count one decode step of ``batch`` sequences (FSM in ``state``, live plan ``live``); the plan the FSM
        follows from this step when a probe starts here, else None. A probe starts only where the FSM's band vote
        under that plan, ``vote(batch, plan)``, is the probed config."""
        if batch <= 0:
            return None
        self.step += 1
        if self.running is not None or self.next_at is None or self.step < self.next_at:
            return None
        key = self.base.choose(batch)
        if key is None or key == state or live.choose(batch) == key:
            return None
        choose = self.probe_plan(key)
        if vote(batch, choose) != key:
            return None
        self.running = self.pending = key
        self._began, self._ran = self.step, 0
        self.probes += 1
        return choose

    def count(self, batch: int, state: Optional[str]) -> bool:
        """The step :meth:`begin` counted ran ``state``; True when the probe in progress ends with it (the FSM
        then follows the live plan again)."""
        if batch <= 0 or self.running is None:
            return False
        if state == self.running:
            self._ran += 1
            self.probe_steps += 1
        verdict_due = self._ran < self.steps or self.pending == self.running  # its last samples read ~2 steps late
        if verdict_due and self.step - self._began < 4 * self.steps:
            return False
        self._end()
        return True

    def _end(self) -> None:
        self.running = None
        self.next_at = self.step + self.gap

    def judged(self, back: bool) -> None:
        """The verdict on the pending probe: ``back`` when the refitted plan runs its config again."""
        self.pending = None
        if back:
            self.comebacks += 1
            self._back_at = self.step
            return
        self.confirmed += 1
        self.gap = min(self.max_gap, 2 * self.gap)
        if self.next_at is not None and self.running is None:
            self.next_at = self.step + self.gap

    def replanned(self, live: Plan) -> None:
        """A refit made ``live`` the plan: a probe in progress ends; probes are scheduled while it drops a config."""
        if not self.dropped(live):
            self.running = self.pending = self.next_at = None
            return
        if self.running is not None:
            self._end()
        elif self.next_at is None:  # newly dropped
            if self._back_at is not None and self.step - self._back_at < self.max_gap:
                self.gap = min(self.max_gap, 2 * self.gap)  # dropped again soon after a comeback
            else:
                self.gap = self.min_gap
            self.next_at = self.step + self.gap

    def info(self) -> dict:
        return {
            "probes": self.probes,
            "probe_steps": self.probe_steps,
            "confirmed": self.confirmed,
            "comebacks": self.comebacks,
            "gap": self.gap,
            "next_in": None if self.next_at is None else max(0, self.next_at - self.step),
            "running": self.running,
        }


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
        base: Optional[Plan] = None,
    ):
        """``base``: the offline plan probes follow (default: solved from ``profile`` for ``configs``)."""
        self.profile = copy.deepcopy(profile)
        self.offline = SpeedupModel(copy.deepcopy(profile))  # what a probe may restore a config to, at most
        self.configs = list(configs)
        self.max_batch = max_batch
        self.threshold, self.window, self.min_samples = threshold, window, min_samples
        self.min_point_samples = min_point_samples
        self.model = SpeedupModel(self.profile)
        self._monitors: Dict[Tuple[str, str], DriftMonitor] = {}
        self._samples: Dict[Tuple[str, int], Deque[Tuple[float, float]]] = defaultdict(lambda: deque(maxlen=window))
        self.reprofiles = 0
        self.history: List[dict] = []  # one entry per refit (last 16)
        self.probe = DriftProbe(base if base is not None else solve(self.profile, max_batch, configs=self.configs))
        self._probe_key: Optional[str] = None
        self._probe_samples: List[Tuple[int, float]] = []  # (batch, accept length) of the pending probe's config

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
        probed = key != PLAIN and key == self.probe.pending
        if probed:
            if self._probe_key != key:
                self._probe_key, self._probe_samples = key, []
            self._probe_samples.append((batch, tokens_per_step))
        drifted = self._monitor(key, "cost").observe(batch, step_s)
        if key != PLAIN:
            drifted = self._monitor(key, "tokens").observe(batch, tokens_per_step) or drifted
        if drifted:
            return self._refit(key)
        if probed and len(self._probe_samples) >= self.probe.steps:
            return self._judge_probe(key)
        return None

    def _judge_probe(self, key: str) -> Optional[Plan]:
        """Verdict on a probe's samples: a refit of ``key`` by the measured/predicted accept-length ratio when it
        beats the prediction by more than the threshold, else a confirmation (no refit). The ratio never lifts the
        config above its offline profile: a probe undoes a drift refit, and ``PROBE_STEPS`` steps of one batch size
        are too few to claim more (acceptance that high, sustained, is the drift monitor's to find)."""
        predicted = statistics.fmean(self.model.accept_length(key, b) for b, _ in self._probe_samples)
        offline = statistics.fmean(self.offline.accept_length(key, b) for b, _ in self._probe_samples)
        ratio = min(statistics.fmean(t for _, t in self._probe_samples), offline) / predicted
        if ratio - 1.0 <= self.threshold:
            self._probe_samples = []
            self.probe.judged(False)
            return None
        return self._refit(key, tokens=ratio)

    def _capped(self, cause: str, key: str, p: Point, scale: float) -> float:
        """A probe's acceptance ``scale`` for point ``p`` of ``key``, raised at most to the offline point's."""
        offline = self.offline.profile.points[key].get(p.batch_size)
        if cause != "probe" or scale <= 1.0 or offline is None:
            return scale
        return max(1.0, min(scale, _accept(offline) / _accept(p)))

    def _refit(self, trigger: str, tokens: Optional[float] = None) -> Plan:
        """Refit from the trigger's windows, or for a probe verdict (``tokens``: its accept-length ratio, no cost
        scaling); then re-plan and pass the plan to :attr:`probe`."""
        before = self.drift()
        cause = "drift" if tokens is None else "probe"
        cost = 1.0 + self._monitor(trigger, "cost").drift if tokens is None else 1.0
        if tokens is None:
            tokens = 1.0 + (self._monitor(trigger, "tokens").drift if trigger != PLAIN else 0.0)
        # step-cost drift is the machine's (load, clocks, threads): every state's curve scales alike, so a uniform
        # slowdown never flips the plan; acceptance drift is the workload's or the drafter's: the trigger's only
        for key, pts in self.profile.points.items():
            for b, p in list(pts.items()):
                scale = tokens if key == trigger and key != PLAIN else 1.0
                self.profile.add(key, _scaled(p, cost, self._capped(cause, key, p, scale)))
        # the trigger's batch sizes seen live often enough: measured step cost, acceptance moved by the measured ratio
        updated = []
        for (key, batch), samples in self._samples.items():
            if key != trigger or len(samples) < self.min_point_samples or batch not in self.profile.points[key]:
                continue
            p = self.profile.points[key][batch]
            step_s = statistics.median(s for s, _ in samples)
            ratio = self._capped(cause, key, p, statistics.fmean(t for _, t in samples) / _accept(p))
            self.profile.add(key, _scaled(p, step_s / p.step_s, ratio if key != PLAIN else 1.0))
            updated.append(f"{key}@{batch}")
            samples.clear()
        self.model = SpeedupModel(self.profile)
        for mon in self._monitors.values():
            mon.reset()
        self.reprofiles += 1
        plan = solve(self.profile, max_batch=self.max_batch, configs=self.configs)
        if trigger == self.probe.pending:  # the probed config's verdict: back where its probe ran?
            self.probe.judged(any(plan.choose(b) == trigger for b, _ in self._probe_samples))
            self._probe_samples = []
        self.probe.replanned(plan)
        if self.probe.pending is None:
            self._probe_samples = []
        entry = {"trigger": trigger, "cause": cause, "drift": before, "points": updated, "plan": plan.summary()}
        self.history = (self.history + [entry])[-16:]
        return plan

    def info(self) -> dict:
        return {
            "reprofiles": self.reprofiles,
            "drift": self.drift(),
            "threshold": self.threshold,
            "history": self.history[-4:],
            "probe": self.probe.info(),
        }
