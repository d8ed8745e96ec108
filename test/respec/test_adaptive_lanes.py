"""ReSpec's greedy and sampled lanes: a decode batch that samples at T > 0 is decided by the plan of a profile
measured at T > 0 (its acceptance is lower), a greedy batch by the greedy profile's; one profile serves both."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from sglang_spex.adapters import spec_workers as sw
from sglang_spex.config import RespecConfig
from sglang_spex.respec import adaptive, eagle_policy
from sglang_spex.respec.adaptive import Runtime
from sglang_spex.respec.profiler import PLAIN, Point, Profile
from sglang_spex.respec.solver import solve

KEY = "NGRAM:s4t1n4"
CFG = RespecConfig(enabled=True, hysteresis="0,0,1", server_key=KEY, algorithm="NGRAM")


def _profile(spec_tps: float, temperature: float = 0.0) -> Profile:
    """Plain 10 ms/step; NGRAM 12 ms/step gaining ``spec_tps`` tokens per step."""
    prof = Profile("m", "d", "cpu", meta={"temperature": temperature})
    for b in (1, 4, 16):
        prof.add(PLAIN, Point(b, 0.010, 1.0, b / 0.010))
        prof.add(KEY, Point(b, 0.012, spec_tps, b * spec_tps / 0.012, spec_tps))
    return prof


def _runtime(cfg: RespecConfig = CFG) -> Runtime:
    greedy, hot = _profile(2.0), _profile(1.1, temperature=1.0)  # speculation pays greedily, loses at T = 1
    plan = solve(greedy, max_batch=16, configs=[KEY])
    return Runtime(cfg, plan, greedy, sampled=(hot, solve(hot, max_batch=16, configs=[KEY])))


def test_a_sampled_batch_follows_the_t_above_zero_plan_and_a_greedy_one_the_greedy_plan():
    rt = _runtime()
    assert [rt.decide(4, sampled=s) for s in (False, True, False, True)] == [KEY, None, KEY, None]
    assert rt.lanes[True] is not rt.lanes[False] and rt.plan is rt.lanes[True].plan
    info = rt.info()
    assert info["plan"] == rt.lanes[False].plan.summary() and info["sampled_lane"]["plan"] != info["plan"]


def test_one_profile_serves_both_kinds_of_batch():
    greedy = _profile(2.0)
    rt = Runtime(CFG, solve(greedy, max_batch=16, configs=[KEY]), greedy)
    assert rt.lanes[True] is rt.lanes[False] and rt.decide(4, sampled=True) == KEY
    assert "sampled_lane" not in rt.info()


def test_a_step_refits_the_lane_that_decided_it():
    rt = _runtime(RespecConfig(enabled=True, hysteresis="0,0,1", server_key=KEY, algorithm="NGRAM", drift=0.2))
    for i in range(200):  # greedy and sampled batches in turn; the greedy ones' drafts are never accepted
        sampled = i % 2 == 1
        state = rt.decide(4, sampled=sampled)
        if state is not None:
            rt.record(state, 4, 0.012, 1.1 if sampled else 1.0, rt.lane)
    assert rt.lanes[False].reprofiler.reprofiles == 1 and rt.lanes[True].reprofiler.reprofiles == 0
    assert rt.lanes[False].plan.choose(4) is None and rt.info()["reprofile"]["reprofiles"] == 1


def test_a_step_read_after_another_lane_decided_refits_the_lane_handed_to_record():
    """Under overlap a step is read one or two decisions later: a greedy step read after a sampled decision must
    refit the greedy lane, not the lane that decided last."""
    rt = _runtime(RespecConfig(enabled=True, hysteresis="0,0,1", server_key=KEY, algorithm="NGRAM", drift=0.2))
    greedy, sampled = rt.lanes[False], rt.lanes[True]
    assert rt.decide(4, sampled=False) == KEY and rt.decide(4, sampled=True) is None and rt.lane is sampled
    for _ in range(200):  # the greedy lane's drafts are never accepted (its profile says 2 tokens a step)
        rt.record(KEY, 4, 0.012, 1.0, greedy)
    assert greedy.reprofiler.reprofiles == 1 and greedy.plan.choose(4) is None
    assert sampled.reprofiler.reprofiles == 0 and sampled.reprofiler.drift() == {}  # it observed none of them


def test_the_step_clock_hands_each_step_to_the_lane_that_decided_it(monkeypatch):
    rt = _runtime()
    seen = []
    monkeypatch.setattr(rt, "record", lambda state, batch, step_s, tokens, lane=None: seen.append((state, lane)))
    done = SimpleNamespace(query=lambda: True)
    for sampled in (False, True, False):
        rt.begin_step(True)
        state = rt.decide(4, sampled=sampled)
        rt.end_step(state, 4, SimpleNamespace(accept_lens=torch.tensor([2, 2, 2, 2]), copy_done=done))
    rt.begin_step(True)  # closes the third step; every closed step has been read
    assert seen == [(KEY, rt.lanes[False]), (None, rt.lanes[True]), (KEY, rt.lanes[False])]


def test_auto_finds_a_profile_of_each_kind(tmp_path, monkeypatch):
    monkeypatch.setattr(adaptive, "PROFILE_DIR", tmp_path)
    monkeypatch.setattr(eagle_policy, "PROFILE_DIR", tmp_path)
    for name, tps, t in (("SmolLM2__a-drafter__cpu__t1.json", 1.1, 1.0), ("SmolLM2__b-drafter__cpu.json", 2.0, 0.0)):
        _profile(tps, t).save(tmp_path / name)
    auto = RespecConfig(enabled=True, profile="auto", server_key=KEY, algorithm="NGRAM", hysteresis="0,0,1")
    assert adaptive.find_profile(auto, "/m/SmolLM2").name == "SmolLM2__b-drafter__cpu.json"
    assert adaptive.find_profile(auto, "/m/SmolLM2", sampled=True).name == "SmolLM2__a-drafter__cpu__t1.json"
    lanes = adaptive.load_lanes(auto, "/m/SmolLM2")
    assert lanes[False][0].meta["temperature"] == 0.0 and lanes[True][0].meta["temperature"] == 1.0
    rt = Runtime(auto, lanes[False][1], lanes[False][0], sampled=lanes[True])
    assert (rt.decide(4), rt.decide(4, sampled=True)) == (KEY, None)
    # an explicit profile, or auto with one kind cached, is one lane
    assert list(adaptive.load_lanes(RespecConfig(enabled=True, profile=str(tmp_path / "x.json")), "/m/SmolLM2")) == [
        False
    ]
    (tmp_path / "SmolLM2__a-drafter__cpu__t1.json").unlink()
    assert list(adaptive.load_lanes(auto, "/m/SmolLM2")) == [False]


def test_eagle_candidate_steps_cover_both_lanes(tmp_path, monkeypatch):
    monkeypatch.setattr(adaptive, "PROFILE_DIR", tmp_path)
    monkeypatch.setattr(eagle_policy, "PROFILE_DIR", tmp_path)
    for name, key in (("M__d__cpu.json", "EAGLE3:s3t1n4"), ("M__d__cpu__t1.json", "EAGLE3:s1t1n2")):
        prof = Profile("m", "d", "cpu")
        for b in (1, 4):
            prof.add(PLAIN, Point(b, 0.010, 1.0, b / 0.010))
            prof.add(key, Point(b, 0.011, 2.0, b * 2.0 / 0.011, 2.0))
        prof.save(tmp_path / name)
    cfg = RespecConfig(enabled=True, profile="auto", algorithm="EAGLE3")
    args = ["--model-path", "/x/M", "--speculative-num-steps", "5"]
    path = eagle_policy.sglang_adaptive_args(cfg, args)[-1]
    assert json.loads(open(path).read())["1"]["candidate_steps"] == [0, 1, 3, 5]


def test_a_batch_samples_when_one_of_its_requests_does():
    def batch(*top_ks):
        reqs = [SimpleNamespace(sampling_params=SimpleNamespace(top_k=k)) for k in top_ks]
        return SimpleNamespace(reqs=reqs, sampling_info=SimpleNamespace(is_all_greedy=False))

    assert sw.samples(batch(1, 1 << 30)) and sw.samples(batch(40))
    # the sampling request left: SGLang's merged is_all_greedy still says False (filter_batch never recomputes it)
    assert not sw.samples(batch(1, 1)) and not sw.samples(batch())
