"""Review 31, finding 3: a plan that acceptance drift turned off is probed again and can come back (no server).

The runtime is driven as R4 drives it: ``decide`` per decode step, and each step's (state, batch, seconds, accept
length) recorded ``LAG`` steps later, as SGLang's host copy of the accept lengths arrives under overlap.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, List, Optional

from sglang_spex.config import RespecConfig
from sglang_spex.respec import drift
from sglang_spex.respec.adaptive import Runtime
from sglang_spex.respec.profiler import PLAIN, Point, Profile
from sglang_spex.respec.solver import solve

KEY = "NGRAM:s4t1n4"
LAG = 2


def _profile(pays_up_to: int = 16) -> Profile:
    """Plain 10 ms/step; KEY 12 ms/step at 2 tokens per step up to ``pays_up_to``, 1.1 beyond (never pays there)."""
    prof = Profile("m", "d", "cpu")
    for b in (1, 2, 4, 5, 8, 16):
        tps = 2.0 if b <= pays_up_to else 1.1
        prof.add(PLAIN, Point(b, 0.010, 1.0, b / 0.010))
        prof.add(KEY, Point(b, 0.012, tps, b * tps / 0.012, tps))
    return prof


def _runtime(prof: Profile, hysteresis: str = "1,8,2") -> Runtime:
    cfg = RespecConfig(enabled=True, hysteresis=hysteresis, server_key=KEY, algorithm="NGRAM", max_batch=16)
    return Runtime(cfg, solve(prof, max_batch=16, configs=[KEY]), prof)


class _Driver:
    """Decode steps of one batch size; ``accept(step)`` is the accept length a speculative step measures."""

    def __init__(self, rt: Runtime):
        self.rt, self.step, self.states = rt, 0, []
        self._unread: deque = deque()

    def run(self, n: int, batch: int, accept: Callable[[int], float]) -> List[Optional[str]]:
        out = []
        for _ in range(n):
            self.step += 1
            state = self.rt.decide(batch)
            out.append(state)
            self._unread.append((state, batch, 0.012 if state else 0.010, accept(self.step) if state else 1.0))
            if len(self._unread) > LAG:
                self.rt.record(*self._unread.popleft())
        self.states += out
        return out


def _spec_runs(states: List[Optional[str]]) -> List[tuple]:
    """(first index, length) of every run of speculative steps."""
    runs, start = [], None
    for i, s in enumerate(states + [None]):
        if s is not None and start is None:
            start = i
        elif s is None and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def _turn_off(drv: _Driver, batch: int = 4) -> int:
    """Speculate with an untrained drafter (1 token per step) until drift turns the plan off; the step it did."""
    rt = drv.rt
    for _ in range(200):
        if drv.run(1, batch, lambda s: 1.0)[0] is None:
            break
    assert rt.reprofiler.reprofiles == 1 and rt.plan.choose(batch) is None  # the report's "B=1..N: no-spec"
    return drv.step


def test_speculation_comes_back_after_the_drafter_improves():
    rt = _runtime(_profile())
    drv = _Driver(rt)
    off_at = _turn_off(drv)
    assert all(rt.plan.choose(b) is None for b in range(1, 17))
    # the learner publishes a drafter that is accepted as profiled: 2 tokens per step
    after = drv.run(1200, 4, lambda s: 2.0)
    spec = [i for i, s in enumerate(after) if s is not None]
    assert spec, "speculation never came back"
    first_spec = spec[0]
    assert first_spec <= drift.PROBE_GAP + 4  # the first probe: PROBE_GAP steps after the refit, FSM confirm
    assert all(s == KEY for s in after[first_spec + drift.PROBE_STEPS + LAG + 4 :])  # back, and staying
    assert rt.plan.choose(4) == KEY and rt.reprofiler.history[-1]["cause"] == "probe"
    probe = rt.info()["reprofile"]["probe"]  # in the R2 report (h_report_state reports rt.info())
    assert probe["probes"] == 1 and probe["comebacks"] == 1 and probe["next_in"] is None
    assert off_at < 100


def test_probes_back_off_while_acceptance_stays_bad():
    rt = _runtime(_profile())
    drv = _Driver(rt)
    _turn_off(drv)
    n = 30000
    after = drv.run(n, 4, lambda s: 1.0)
    runs = _spec_runs(after)
    starts = [i for i, _ in runs]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # each probe: PROBE_STEPS speculative steps, LAG more until their verdict is read, then the FSM's confirm (2)
    # on the way out (min dwell 8 holds)
    assert all(drift.PROBE_STEPS <= length <= drift.PROBE_STEPS + LAG + 2 for _, length in runs)
    # the gap doubles per confirming probe, up to the cap (each gap also holds the previous probe's steps)
    expected, gap = [], drift.PROBE_GAP
    for _ in gaps:
        gap = min(drift.PROBE_MAX_GAP, 2 * gap)
        expected.append(gap)
    assert all(e <= g <= e + drift.PROBE_STEPS + 4 for g, e in zip(gaps, expected)), (gaps, expected)
    assert expected[-1] == drift.PROBE_MAX_GAP and len(runs) >= 10
    spec = sum(length for _, length in runs)
    assert spec / n < 0.015  # the probes' share of the steps while the plan is off
    tail = after[-4 * drift.PROBE_MAX_GAP :]
    assert sum(s is not None for s in tail) <= 4 * (drift.PROBE_STEPS + LAG + 2)  # about PROBE_STEPS / PROBE_MAX_GAP
    probe = rt.reprofiler.probe
    assert probe.comebacks == 0 and probe.confirmed >= probe.probes - 1 and probe.gap == drift.PROBE_MAX_GAP
    assert rt.plan.choose(4) is None


def test_batch_sizes_the_offline_plan_never_speculates_are_never_probed():
    prof = _profile(pays_up_to=4)  # offline plan: KEY at B <= 4, plain decode at B >= 5
    rt = _runtime(prof)
    assert rt.plan.choose(4) == KEY and rt.plan.choose(5) is None
    drv = _Driver(rt)
    _turn_off(drv, batch=2)
    # B = 16: the offline plan itself says no; B = 4: it says KEY, but its band (4 +- margin 1) is mixed, so the
    # FSM's band vote stays plain there and no probe starts either
    assert all(s is None for s in drv.run(3000, 16, lambda s: 2.0))
    assert all(s is None for s in drv.run(3000, 4, lambda s: 2.0))
    assert rt.reprofiler.probe.probes == 0
    # back at a batch size where the offline plan speculates, the due probe runs at once and the plan comes back
    again = drv.run(200, 2, lambda s: 2.0)
    assert again[1] == KEY and rt.reprofiler.probe.probes == 1 and rt.plan.choose(2) == KEY


def test_a_profile_where_nothing_pays_is_never_probed():
    prof = _profile(pays_up_to=0)  # the drafter never pays at any batch size: nothing to drop, nothing to probe
    rt = _runtime(prof, hysteresis="0,1,1")
    assert all(rt.plan.choose(b) is None for b in range(1, 17))
    drv = _Driver(rt)
    for batch in (1, 4, 16):
        assert all(s is None for s in drv.run(3000, batch, lambda s: 3.0))
    assert rt.spec_steps == 0 and rt.reprofiler.probe.probes == 0 and rt.reprofiler.probe.next_at is None


def test_probe_schedule_gap_after_a_comeback():
    """A config dropped again soon after a comeback keeps backing off; after a long comeback the gap starts over."""
    plan = solve(_profile(), max_batch=16, configs=[KEY])
    off = solve(_profile(pays_up_to=0), max_batch=16, configs=[KEY])
    pr = drift.DriftProbe(plan, steps=2, gap=4, max_gap=32)

    def vote(batch, choose):
        return choose(batch)

    def steps(n, state=None):
        for _ in range(n):
            pr.begin(4, state, off, vote)

    pr.replanned(off)
    assert pr.next_at == 4
    steps(4)
    assert pr.running == KEY and pr.probes == 1
    pr.judged(True)  # its samples brought KEY back
    pr.replanned(plan)
    assert pr.next_at is None and pr.running is None and pr.comebacks == 1
    steps(3)
    pr.replanned(off)  # dropped again 3 steps later: the gap doubles
    assert pr.gap == 8 and pr.next_at == pr.step + 8
    pr.judged(True)
    pr.replanned(plan)
    steps(40)  # a comeback that held for max_gap steps
    pr.replanned(off)
    assert pr.gap == 4


def test_a_probe_never_credits_a_config_with_more_than_its_offline_profile():
    """Session 34: a 16-step probe that happened to accept 2x the offline profile scaled the config's acceptance at
    every batch size by its ratio, and the plan speculated up to B=60 where the offline profile says it never pays.
    A probe restores at most the offline profile: the comeback is where the offline plan speculated, no further."""
    rt = _runtime(_profile(pays_up_to=4))
    drv = _Driver(rt)
    _turn_off(drv, batch=2)
    refits = rt.reprofiler.reprofiles
    for _ in range(drift.PROBE_GAP + drift.PROBE_STEPS + 4 * LAG + 8):  # the probe accepts twice the profile
        drv.run(1, 2, lambda s: 4.0)
        if rt.reprofiler.reprofiles > refits:
            break
    assert rt.reprofiler.history[-1]["cause"] == "probe" and rt.plan.choose(2) == KEY  # came back ...
    assert [b for b in range(1, 17) if rt.plan.choose(b) == KEY] == [1, 2, 3, 4]  # ... where the offline plan was
