"""ReSpec runtime logic without a server: request opt-out, online re-profiling on drift, EAGLE candidate steps."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from sglang_spex.config import RespecConfig
from sglang_spex.respec.adaptive import Runtime, runnable_configs
from sglang_spex.respec.drift import OnlineReprofiler
from sglang_spex.respec.eagle_catchup import DraftLedger
from sglang_spex.respec.eagle_policy import RespecStepPolicy, candidate_steps
from sglang_spex.respec.profiler import PLAIN, Point, Profile
from sglang_spex.respec.solver import solve

KEY = "NGRAM:s4t1n4"


def _profile(spec_tps: float = 2.0) -> Profile:
    """Plain 10 ms/step; NGRAM 12 ms/step gaining ``spec_tps`` tokens: speculation wins at every batch size."""
    prof = Profile("m", "d", "cpu")
    for b in (1, 4, 16):
        prof.add(PLAIN, Point(b, 0.010, 1.0, b / 0.010))
        prof.add(KEY, Point(b, 0.012, spec_tps, b * spec_tps / 0.012, spec_tps))
    return prof


def test_opt_out_forces_plain_and_is_counted():
    rt = Runtime(RespecConfig(enabled=True, force="spec", server_key=KEY), None)
    assert rt.decide(4) == KEY
    assert rt.decide(4, opted_out=True) is None
    assert (rt.spec_steps, rt.plain_steps, rt.opt_out_steps) == (1, 1, 1)
    assert rt.info()["state"] == "none"


def test_reprofiler_ignores_steps_that_match_and_single_outliers():
    rp = OnlineReprofiler(_profile(), [KEY], max_batch=16, min_samples=8)
    rng = random.Random(0)
    for i in range(200):
        slow = 10.0 if i % 17 == 0 else 1.0  # an occasional very slow step (another process took the CPU)
        assert rp.observe(KEY, 4, 0.012 * slow * rng.uniform(0.95, 1.05), 2.0 * rng.uniform(0.9, 1.1)) is None
    assert rp.reprofiles == 0


def test_acceptance_drift_refits_the_profile_and_changes_the_plan():
    prof = _profile()
    assert solve(prof, max_batch=16, configs=[KEY]).choose(4) == KEY
    rp = OnlineReprofiler(prof, [KEY], max_batch=16, min_samples=8)
    plan = None
    for i in range(40):  # the policy moved: drafts are no longer accepted (1 token per step instead of 2)
        plan = rp.observe(KEY, 4, 0.012, 1.0) or plan
        if plan is not None:
            break
    assert plan is not None and i == 7  # the 8th sample completes the window: median error -50% > 20%
    assert all(plan.choose(b) is None for b in range(1, 17))  # 1 token per 12 ms loses to 1 per 10 ms everywhere
    assert rp.profile.points[KEY][4].tokens_per_step == 1.0 and prof.points[KEY][4].tokens_per_step == 2.0
    assert rp.reprofiles == 1 and rp.info()["history"][0]["points"] == [f"{KEY}@4"]


def test_runtime_follows_the_refitted_plan():
    prof = _profile()
    cfg = RespecConfig(enabled=True, hysteresis="0,0,1", server_key=KEY, algorithm="NGRAM")
    rt = Runtime(cfg, solve(prof, max_batch=16, configs=[KEY]), prof)
    states = []
    for _ in range(80):  # the default window needs 64 steps
        state = rt.decide(4)
        states.append(state)
        rt.record(state, 4, 0.012 if state else 0.010, 1.0)  # as profiled, but no draft is ever accepted
    assert states[0] == KEY and states[-1] is None
    assert rt.info()["reprofile"]["reprofiles"] == 1 and rt.info()["fsm"]["switches"] == 1


def test_runnable_configs_and_eagle_candidates():
    prof = _profile()
    for key in ("NGRAM:s8t1n8", "EAGLE3:s1t1n2", "EAGLE3:s5t1n6", "EAGLE3:s3t2n6"):
        prof.add(key, Point(1, 0.012, 2.0, 166.0, 2.0))
    assert runnable_configs(prof, RespecConfig(algorithm="NGRAM", server_key="NGRAM:s8t1n8")) == ["NGRAM:s8t1n8"]
    eagle = RespecConfig(algorithm="EAGLE3", server_key="EAGLE3:s3t1n4")
    assert runnable_configs(prof, eagle) == ["EAGLE3:s1t1n2", "EAGLE3:s5t1n6"]  # chains only (SGLang's states)
    rt = Runtime(eagle, solve(prof, max_batch=4, configs=runnable_configs(prof, eagle)), prof)
    assert rt.configs == ["EAGLE3:s1t1n2", "EAGLE3:s5t1n6"]  # a re-plan may pick any runnable config
    assert candidate_steps(rt.configs, 3) == [0, 1, 3, 5]


class _SGLangPolicy:
    def set_cuda_graph_bs(self, bs):
        self.bs = bs


def test_step_policy_maps_states_to_steps():
    rt = Runtime(RespecConfig(enabled=True, force="alternate:1", algorithm="EAGLE3", server_key="EAGLE3:s3t1n4"), None)
    pol = RespecStepPolicy(rt, 3, _SGLangPolicy())
    assert pol.candidate_steps == [0, 3]
    steps = []
    for _ in range(4):
        pol.decide(2)
        steps.append(pol.get_steps_for_batch(2))
    assert steps == [3, 0, 3, 0]
    pol.decide(2, opted_out=True)
    assert pol.get_steps_for_batch(2) == 0 and rt.opt_out_steps == 1
    assert pol.on_verify_complete([1, 2], 2) is None


def test_uniform_slowdown_refits_costs_but_keeps_the_plan():
    prof = _profile()
    plan0 = solve(prof, max_batch=16, configs=[KEY])
    rp = OnlineReprofiler(prof, [KEY], max_batch=16, min_samples=8)
    plan = None
    for _ in range(8):  # another process halves the CPU: plain steps take twice as long as profiled
        plan = rp.observe(None, 4, 0.020, 1.0) or plan
    assert plan is not None and rp.reprofiles == 1
    assert rp.profile.points[KEY][16].step_s == 0.024  # the unobserved spec curve slowed down alike
    assert plan.choices == plan0.choices  # ratios unchanged: same choice at every batch size


@pytest.mark.parametrize("graphs", [False, True])
def test_draft_ledger_records_prunes_and_caps(graphs):
    """Eager outputs are fresh tensors, kept by reference (no per-step copy); a graph replay reuses its output
    buffers, so those steps are copied."""
    ledger = DraftLedger(max_positions=3)
    batch = SimpleNamespace(reqs=[SimpleNamespace(rid="a"), SimpleNamespace(rid="b")])
    for step in range(4):
        hidden = torch.full((2, 6), float(step))
        result = SimpleNamespace(
            next_token_ids=torch.tensor([10 + step, 20 + step]),
            logits_output=SimpleNamespace(hidden_states=hidden),
            can_run_cuda_graph=graphs,
        )
        ledger.record(batch, result)
        if graphs:
            hidden.fill_(-1.0)  # the next replay overwrites the graph's buffers
        if step == 1:
            tokens, flat_hidden, index = ledger.flat(["a", "b"])
            assert [int(tokens[i]) for i in index[0]] == [10, 11] and [int(tokens[i]) for i in index[1]] == [20, 21]
            assert flat_hidden[index[1][1], 0].item() == 1.0
            ledger.keep_only(["a", "b"])
            assert ledger.info()["pending_positions"] == 4
    assert ledger.info()["overflowed_requests"] == 2 and not ledger.pending  # past 3 positions: resume cold
    assert ledger.info()["copied_steps"] == (4 if graphs else 0)
    ledger.keep_only(["a"])
    assert ledger.lost == {"a"} and ledger.info()["skipped_positions"] == 8


def test_draft_ledger_drops_a_step_once_nothing_points_into_it():
    """A plain step's outputs stay while any pending position uses them and go with the last one, whichever way
    it leaves (finished, caught up, overflowed)."""
    ledger = DraftLedger(max_positions=4)

    def step(rids, k):
        batch = SimpleNamespace(reqs=[SimpleNamespace(rid=r) for r in rids])
        out = SimpleNamespace(
            next_token_ids=torch.arange(len(rids)) + 10 * k,
            logits_output=SimpleNamespace(hidden_states=torch.zeros(len(rids), 2)),
            can_run_cuda_graph=False,
        )
        ledger.record(batch, out)

    step(["a", "b", "c"], 0)
    step(["a", "b"], 1)
    assert ledger.info()["kept_steps"] == 2
    ledger.keep_only(["a", "b"])  # c finished: step 0 still holds a's and b's first positions
    assert ledger.info()["kept_steps"] == 2 and ledger.info()["pending_positions"] == 4
    ledger.pop(["a"])  # a caught up
    assert ledger.info()["kept_steps"] == 2
    tokens, _, index = ledger.flat(["b"])
    assert [int(tokens[i]) for i in index[0]] == [1, 11]
    ledger.pop(["b"])
    assert ledger.info()["kept_steps"] == 0 and not ledger.pending
    for k in range(5):  # d overflows at its fifth position: its four steps go with it
        step(["d"], k)
    assert ledger.info()["kept_steps"] == 0 and ledger.lost == {"d"}


def test_acceptance_is_compared_in_means_not_medians():
    prof = _profile(spec_tps=1.4)  # a chain accepting its draft 40 % of the time: mean 1.4 tokens per step
    rp = OnlineReprofiler(prof, [KEY], max_batch=16, min_samples=8)
    for i in range(100):  # 1, 2, 1, 1, 2, ...: median 1 (-29 % "drift"), mean 1.4 (no drift)
        assert rp.observe(KEY, 4, 0.012, 2.0 if i % 5 in (1, 4) else 1.0) is None
    assert rp.reprofiles == 0


class _Copy:
    """Stand-in for a result's ``copy_done`` event (SGLang records one behind its host copy)."""

    def __init__(self) -> None:
        self.finished = False

    def query(self) -> bool:
        return self.finished


def test_accept_lengths_are_read_from_the_host_copy_once_done():
    rt = Runtime(RespecConfig(enabled=True, force="spec", server_key=KEY), None)
    copies = [_Copy() for _ in range(3)]
    for c, lens in zip(copies, ([1, 3], [2, 2], [4, 4])):
        rt.begin_step(True)
        rt.end_step(rt.decide(2), 2, SimpleNamespace(accept_lens=torch.tensor(lens), copy_done=c))
    rt.begin_step(True)  # closes the third step; no copy has finished: nothing read, nothing waited for
    assert rt.read_spec_steps == 0 and rt.accept_ewma is None
    copies[0].finished = copies[1].finished = True
    rt.read_finished()
    assert rt.read_spec_steps == 2 and rt.spec_tokens == 4.0  # means 2 and 2, in order; the third still in flight
    copies[2].finished = True
    assert rt.info()["mean_accept_length"] == (2 + 2 + 4) / 3


def test_a_result_without_a_host_copy_is_dropped_not_waited_for():
    rt = Runtime(RespecConfig(enabled=True, force="spec", server_key=KEY), None)
    for _ in range(6):
        rt.begin_step(True)
        rt.end_step(rt.decide(1), 1, SimpleNamespace(accept_lens=torch.tensor([2]), copy_done=None))
    assert rt.read_spec_steps == 0 and len(rt._unread) < 5  # bounded: old steps leave the queue unread
