"""ReSpec FSM: hysteresis keeps a batch size oscillating around the threshold from switching every step."""

from __future__ import annotations

import pytest

from sglang_spex.respec.fsm import AdaptiveFSM, Hysteresis, two_state_thresholds
from sglang_spex.respec.solver import Choice, Plan

SPEC = "NGRAM:s4t1n4"
BIG = "NGRAM:s8t1n8"


def _plan(threshold: int = 8, max_batch: int = 32) -> Plan:
    """Speculate for B < threshold, plain decode from it on."""
    return Plan(
        {b: Choice(SPEC if b < threshold else None, 1.5 if b < threshold else 1.0) for b in range(1, max_batch + 1)}
    )


@pytest.mark.parametrize("pattern", [[7, 8], [8, 7, 9, 6], [7, 8, 8, 7, 9]])
def test_oscillating_batch_size_does_not_flap(pattern):
    fsm = AdaptiveFSM(_plan(8), Hysteresis(margin=1, min_dwell=4, confirm=2), initial=SPEC)
    states = [fsm.observe(pattern[i % len(pattern)]) for i in range(200)]
    assert fsm.switches <= 1
    assert sum(a != b for a, b in zip(states, states[1:])) <= 1


def test_without_hysteresis_the_same_pattern_flaps():
    fsm = AdaptiveFSM(_plan(8), Hysteresis(margin=0, min_dwell=0, confirm=1), initial=SPEC)
    for i in range(100):
        fsm.observe([7, 8][i % 2])
    assert fsm.switches == 99  # switches every step (the first 7 keeps SPEC): what the guards are for


def test_dwell_and_confirm_bound_the_switch_rate():
    # outside the band on both sides every 3 steps, but not a factor of 2 away: the band rule does not help, dwell does
    fsm = AdaptiveFSM(_plan(8), Hysteresis(margin=1, min_dwell=10, confirm=2), initial=SPEC)
    for i in range(300):
        fsm.observe(5 if (i // 3) % 2 == 0 else 12)
    assert 0 < fsm.switches <= 300 // 10


def test_a_jump_far_across_the_threshold_switches_without_waiting_out_the_dwell():
    # a small-batch tail left speculation on; the next burst of requests lands at B=64 (the plan: plain from 8 on)
    fsm = AdaptiveFSM(_plan(8, max_batch=64), Hysteresis(margin=1, min_dwell=8, confirm=2), initial=SPEC)
    states = [fsm.observe(b) for b in [2] * 3 + [64] * 4]
    assert states == [SPEC] * 4 + [None] * 3  # switched on the second vote (confirm), not after 8 steps
    # and back: the tail drops to B=1 (far below the threshold), speculation resumes after two votes
    assert [fsm.observe(1) for _ in range(3)] == [None, SPEC, SPEC]
    # a batch inside a factor of 2 of the threshold still waits out the dwell
    fsm = AdaptiveFSM(_plan(8, max_batch=64), Hysteresis(margin=1, min_dwell=8, confirm=2), initial=SPEC)
    assert [fsm.observe(b) for b in [2] * 3 + [12] * 6] == [SPEC] * 7 + [None] * 2


def test_leaves_and_reenters_speculation_with_the_batch():
    fsm = AdaptiveFSM(_plan(8), Hysteresis(margin=1, min_dwell=3, confirm=2), initial=None)
    trace = [16] * 5 + [2] * 5 + [32] * 5 + [1] * 5 + [0] * 5
    states = [fsm.observe(b) for b in trace]
    assert states[4] is None and states[9] == SPEC and states[14] is None and states[19] == SPEC
    assert states[-1] == SPEC and fsm.switches == 3  # B=0 (idle) changes nothing
    info = fsm.info()
    assert info["state"] == SPEC and info["switches"] == 3 and info["steps"] == 20
    assert [t["to"] for t in info["recent_transitions"]] == [SPEC, "none", SPEC]


def test_switches_among_configs():
    plan = Plan({b: Choice(BIG if b <= 2 else SPEC if b <= 8 else None, 1.2) for b in range(1, 17)})
    fsm = AdaptiveFSM(plan, Hysteresis(margin=0, min_dwell=1, confirm=1))
    assert [fsm.observe(b) for b in (1, 5, 12, 1)] == [BIG, SPEC, None, BIG]


def test_two_state_thresholds_and_parse():
    h = Hysteresis.parse("2,16")
    assert h == Hysteresis(2, 16, 2) and Hysteresis.parse("0,0,1") == Hysteresis(0, 0, 1)
    assert two_state_thresholds(_plan(8), h) == (5, 10)
    for bad in ("x", "1", "1,2,3,4", "-1,2"):
        with pytest.raises(ValueError):
            Hysteresis.parse(bad)


def test_first_step_adopts_the_plan_without_dwell():
    fsm = AdaptiveFSM(_plan(8), Hysteresis(margin=1, min_dwell=50, confirm=5))
    assert fsm.observe(2) == SPEC and fsm.switches == 0
    assert AdaptiveFSM(_plan(8), Hysteresis(1, 50, 5)).observe(30) is None


def test_near_a_boundary_between_two_configs_plain_decode_is_not_held():
    """The plan: BIG for B <= 2, SPEC for 3..5, plain from 6. Back at B=2 after a large batch, B=2's band [1, 3]
    holds BIG and SPEC but not plain: the band must not keep the machine in plain decode (it did, for good)."""
    plan = Plan({b: Choice(BIG if b <= 2 else SPEC if b <= 5 else None, 1.2) for b in range(1, 65)})
    fsm = AdaptiveFSM(plan, Hysteresis(margin=1, min_dwell=8, confirm=2), initial=None)
    states = [fsm.observe(2) for _ in range(12)]
    assert states[-1] == BIG and fsm.switches == 1
    fsm = AdaptiveFSM(plan, Hysteresis(margin=1, min_dwell=0, confirm=1), initial=BIG)
    assert [fsm.observe(b) for b in (3, 3, 4, 3, 2)] == [BIG, BIG, SPEC, SPEC, SPEC]  # near 2|3 each holds its own


def test_a_batch_alternating_between_two_configs_regions_leaves_plain_decode():
    """Review of session 34: B alternating 2, 3 (plan: BIG at <= 2, SPEC at 3..5) voted BIG, SPEC, BIG, ... so the
    same-state confirm count never reached 2 and plain decode held for good."""
    plan = Plan({b: Choice(BIG if b <= 2 else SPEC if b <= 5 else None, 1.2) for b in range(1, 65)})
    fsm = AdaptiveFSM(plan, Hysteresis(margin=1, min_dwell=8, confirm=2), initial=None)
    states = [fsm.observe(2 + i % 2) for i in range(40)]
    assert states[-1] in (BIG, SPEC) and fsm.switches >= 1
