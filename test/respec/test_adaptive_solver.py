"""ReSpec solver on hand-made profiles: plain decode when drafting costs more than it saves, else the best config."""

from __future__ import annotations

import pytest

from sglang_spex.respec.profiler import PLAIN, Point, Profile, SpecConfig, default_profile_path, ngram
from sglang_spex.respec.solver import Plan, SpeedupModel, best_case_speedup, solve


def _profile(curves):
    """curves: key -> {batch: (step_s, tokens_per_step)}."""
    prof = Profile("m", "d", "cpu")
    for key, pts in curves.items():
        for b, (step, tps) in pts.items():
            prof.add(key, Point(b, step, tps, b * tps / step))
    return prof


# Plain decode: 50 ms + 4 ms per sequence (the measured SmolLM2 shape on this CPU).
PLAIN_CURVE = {b: (0.050 + 0.004 * b, 1.0) for b in (1, 4, 16, 32)}


def test_no_speculation_when_drafting_costs_more_than_it_saves():
    # accepts 1.3 tokens per step but each step costs 1.6x a plain one: slower at every batch size
    costly = {b: (1.6 * (0.050 + 0.004 * b), 1.3) for b in (1, 4, 16, 32)}
    plan = solve(_profile({PLAIN: PLAIN_CURVE, "NGRAM:s4t1n4": costly}), max_batch=32)
    assert all(plan.choose(b) is None for b in range(1, 40))
    assert plan.spec_max_batch() == 0 and plan.boundaries() == []


def test_picks_best_config_per_batch_size():
    # small drafts: cheap, modest acceptance; big drafts: more tokens, verify cost grows fast with the batch
    small = {1: (0.060, 1.8), 4: (0.080, 1.8), 16: (0.150, 1.8), 32: (0.360, 1.8)}
    big = {1: (0.070, 2.6), 4: (0.110, 2.6), 16: (0.400, 2.6), 32: (0.900, 2.6)}
    prof = _profile({PLAIN: PLAIN_CURVE, "NGRAM:s4t1n4": small, "NGRAM:s8t1n8": big})
    plan = solve(prof, max_batch=32)
    model = SpeedupModel(prof)
    for b in range(1, 33):
        best = max(["NGRAM:s4t1n4", "NGRAM:s8t1n8"], key=lambda k: model.speedup(k, b))
        want = best if model.speedup(best, b) >= 1.02 else None
        assert plan.choose(b) == want, b
    assert plan.choose(1) == "NGRAM:s8t1n8"  # 2.6 * 54 / 70 = 2.0x
    assert plan.choose(16) == "NGRAM:s4t1n4"  # 1.8 * 114 / 150 = 1.37x vs 2.6 * 114 / 400 = 0.74x
    assert plan.choose(32) is None  # 1.8 * 178 / 360 = 0.89x, 2.6 * 178 / 900 = 0.51x
    assert plan.boundaries() == sorted(plan.boundaries()) and len(plan.boundaries()) >= 2


def test_interpolation_between_profiled_batch_sizes():
    prof = _profile({PLAIN: {1: (0.1, 1.0), 9: (0.5, 1.0)}, "X:s1t1n2": {1: (0.2, 1.5), 9: (0.6, 2.5)}})
    m = SpeedupModel(prof)
    assert m.step_s(PLAIN, 5) == pytest.approx(0.3)
    assert m.tokens_per_step("X:s1t1n2", 5) == pytest.approx(2.0)
    assert m.tokens_per_step("X:s1t1n2", 20) == pytest.approx(2.5)  # held beyond the last point
    assert m.step_s(PLAIN, 17) == pytest.approx(0.9)  # cost extrapolated linearly
    assert m.speedup("X:s1t1n2", 5) == pytest.approx(2.0 * 0.3 / 0.4)


def test_plan_and_profile_round_trip(tmp_path):
    prof = _profile({PLAIN: PLAIN_CURVE, "NGRAM:s4t1n4": {1: (0.05, 1.5), 32: (0.4, 1.5)}})
    path = prof.save(tmp_path / "p.json")
    again = Profile.load(path)
    assert again.points == prof.points and again.configs == ["NGRAM:s4t1n4"]
    plan = solve(again, max_batch=16)
    assert Plan.from_json(plan.to_json()).choices == plan.choices
    assert "no-spec" in plan.summary() or plan.spec_max_batch() == 16


def test_spec_config_keys_and_flags():
    c = SpecConfig.parse("NGRAM:s4t2n8")
    assert c == SpecConfig("NGRAM", 4, 2, 8) and c.key == "NGRAM:s4t2n8" and ngram(8, 2) == c
    assert c.server_args()[-2:] == ["--speculative-ngram-max-bfs-breadth", "2"]
    assert "--speculative-eagle-topk" in SpecConfig("EAGLE3", 3, 1, 4).server_args()
    with pytest.raises(ValueError):
        SpecConfig.parse("NGRAM-4")


def test_profile_without_baseline_is_rejected():
    with pytest.raises(ValueError, match="baseline"):
        solve(_profile({"NGRAM:s4t1n4": PLAIN_CURVE}))


def test_best_case_speedup_bounds_what_any_drafter_could_reach(tmp_path):
    """A chain of s steps gains at most s + 1 tokens per step: where its step costs more than that many plain
    steps, no training makes it pay, and the learner is told so (adaptive.drafter_never_pays)."""
    from sglang_spex.config import RespecConfig
    from sglang_spex.respec.adaptive import best_case, drafter_never_pays

    slow = {b: (4.5 * (0.050 + 0.004 * b), 2.2) for b in (1, 4, 16, 32)}  # the tiny model's EAGLE3 s3: 4.5x a step
    hopeless = _profile({PLAIN: PLAIN_CURVE, "EAGLE3:s3t1n4": slow})
    speedup, key, _ = best_case_speedup(hopeless, max_batch=32)
    assert key == "EAGLE3:s3t1n4" and speedup == pytest.approx(4 / 4.5)
    cheap = {1: (1.5 * 0.054, 1.2), 32: (4.5 * (0.050 + 0.004 * 32), 1.0)}  # pays at B=1 if drafts were accepted
    hopeful = _profile({PLAIN: PLAIN_CURVE, "EAGLE3:s3t1n4": cheap})
    assert best_case_speedup(hopeful, max_batch=32)[:3:2] == (pytest.approx(4 / 1.5), 1)
    assert solve(hopeful, max_batch=32).spec_max_batch() == 0  # today's acceptance does not pay: the plan is plain

    # a noisy spec curve that falls with the batch: its line extrapolated to B=64 would claim far more
    falling = {1: (4.5 * 0.054, 2.2), 4: (4.5 * 0.066, 2.2), 16: (4.5 * 0.060, 2.2)}
    noisy = _profile({PLAIN: PLAIN_CURVE, "EAGLE3:s3t1n4": falling})
    speedup, _, batch = best_case_speedup(noisy, max_batch=64)
    assert batch <= 16 and speedup == pytest.approx(max(4 * PLAIN_CURVE[b][0] / falling[b][0] for b in falling))
    on = RespecConfig(enabled=True, profile=str(hopeless.save(tmp_path / "hopeless.json")))
    assert "x0.89 at B=" in drafter_never_pays(on)
    assert drafter_never_pays(RespecConfig(enabled=True, profile=str(hopeful.save(tmp_path / "hopeful.json")))) is None
    assert drafter_never_pays(RespecConfig(enabled=False, profile=on.profile)) is None  # no adaptive server
    assert drafter_never_pays(RespecConfig(enabled=True, profile=on.profile, force="spec")) is None
    hope = RespecConfig(enabled=True, profile=str(tmp_path / "hopeful.json"))
    assert best_case(hope)[0] == pytest.approx(4 / 1.5)  # what the learner's payback gate reads
    assert best_case(RespecConfig(enabled=False, profile=hope.profile)) is None


def test_past_the_profile_speculation_never_gains_more_than_where_it_was_measured():
    """Two extrapolated lines can cross anywhere: a spec curve that falls at its end (noise) must not make speculation
    'pay' past the largest measured batch; a gain measured at that batch may still fade with the lines."""
    falling = {1: (4.0 * 0.054, 2.4), 4: (5.5 * 0.066, 2.4), 16: (3.0 * 0.114, 2.4)}  # x0.6, x0.44, x0.8: cheaper at 16
    noisy = _profile({PLAIN: {b: PLAIN_CURVE[b] for b in (1, 4, 16)}, "EAGLE3:s3t1n4": falling})
    model = SpeedupModel(noisy)
    assert model.speedup("EAGLE3:s3t1n4", 16) == pytest.approx(2.4 / 3.0)
    assert all(model.speedup("EAGLE3:s3t1n4", b) <= 2.4 / 3.0 + 1e-12 for b in (17, 32, 64, 256))
    lines = model.throughput("EAGLE3:s3t1n4", 64) / model.throughput(PLAIN, 64)
    assert lines > 2.0  # what the two lines alone would say at B=64
    assert solve(noisy, max_batch=256).spec_max_batch() == 0 and solve(noisy, max_batch=256).boundaries() == []
    fading = {1: (0.5 * 0.054, 2.0), 16: (0.5 * 0.114 * 1.6, 2.0)}  # x4 at B=1, x2.5 at 16, cost rising faster
    fades = _profile({PLAIN: {b: PLAIN_CURVE[b] for b in (1, 16)}, "EAGLE3:s3t1n4": fading})
    m2 = SpeedupModel(fades)
    assert m2.speedup("EAGLE3:s3t1n4", 64) < m2.speedup("EAGLE3:s3t1n4", 16)  # extrapolation still lowers it


def test_a_profile_at_t1_does_not_overwrite_the_greedy_one():
    greedy = default_profile_path("/m/SmolLM2", "/d/drafter", "cpu")
    hot = default_profile_path("/m/SmolLM2", "/d/drafter", "cpu", temperature=1.0)
    assert greedy != hot and hot.name == "SmolLM2__drafter__cpu__t1.json"
    assert greedy == default_profile_path("/m/SmolLM2", "/d/drafter", "cpu", temperature=0.0)


def test_auto_takes_a_greedy_profile_before_one_at_t1(tmp_path, monkeypatch):
    from sglang_spex.config import RespecConfig
    from sglang_spex.respec import adaptive

    monkeypatch.setattr(adaptive, "PROFILE_DIR", tmp_path)
    for name in ("SmolLM2__a-drafter__cpu__t1.json", "SmolLM2__b-drafter__cpu.json"):  # by name, t1 would be first
        (tmp_path / name).write_text("{}")
    found = adaptive.find_profile(RespecConfig(enabled=True, profile="auto"), "/m/SmolLM2")
    assert found == tmp_path / "SmolLM2__b-drafter__cpu.json"


def test_the_best_case_counts_at_most_n_tokens_per_step():
    """A chain of s drafts verifies at most n tokens per step, not s + 1: NGRAM s4t1n4 at 4.5 plain steps' cost
    gains at best 4 / 4.5 (the bound that tells the learner no drafter could pay)."""
    slow = {b: (4.5 * (0.050 + 0.004 * b), 2.2) for b in (1, 4, 16, 32)}
    speedup, key, _ = best_case_speedup(_profile({PLAIN: PLAIN_CURVE, "NGRAM:s4t1n4": slow}), max_batch=32)
    assert key == "NGRAM:s4t1n4" and speedup == pytest.approx(4 / 4.5)
