"""ReSpec adaptive server with EAGLE3 on real CPU SGLang (tiny Llama, float32, spex_cpu, a drafter of ours).

The ReSpec runtime is SGLang's ``AdaptiveSpecPolicy`` (hooks R3/R4): with a hand-made profile whose plan is
``B=1: EAGLE3:s3t1n4; B=2..3: EAGLE3:s1t1n2; B>=4: no speculation`` and no hysteresis, each decode batch runs the
(s, t, n) state its size asks for, switching at run time as requests join and finish. Greedy output must equal
plain SGLang's, every state must have run, a request with ``custom_params={"respec": "off"}`` never speculates,
the KV pool returns to its start, and the state is on ``/spex/info`` and ``/metrics``.

A second server forces ``alternate:3`` with the default ``--respec-eagle-off plain``: every request switches
between true plain steps (no drafter work) and speculation mid-generation, so the drafter's KV is caught up
(replayed from the ledger) at every resume. Greedy output must still equal plain SGLang's and the KV pool return
to its start. Every off step must have run the target in ``ForwardMode.DECODE`` (every speculative one in
``TARGET_VERIFY``), timed by the runtime's step clock under that mode, with no per-step copy of its outputs; a
batch of opted-out requests then runs only DECODE steps and no drafter work, with greedy output = plain. This
second server runs once per scheduler mode (``EAGLE_MODES``: overlap and non-overlap; on CPU the overlap loop's
draft-state relay runs through hook V2 and the launcher keeps overlap, L1), so R4/R5 and the catch-up are tested in
both loops; the first (the planned switching) runs in SGLang's default loop, overlap.
"""

from __future__ import annotations

import pytest
import requests
from conftest import make_drafter
from respec_servers import EAGLE_MODES, RespecServer
from server_modes import DEFAULT_MODE
from workloads import BATCHES, COMMON, N, assert_same_logprobs, collect, generate, idle_state, logprob_outputs

from sglang_spex.respec.profiler import PLAIN, Point, Profile

EAGLE = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
S3, S1 = "EAGLE3:s3t1n4", "EAGLE3:s1t1n2"


def _profile() -> Profile:
    """Plain 10 ms a step; s3 pays off only alone, s1 up to B=3, nothing from B=4 (see module doc)."""
    prof = Profile("tiny", "test", "cpu")
    for b in (1, 2, 4, 8):
        prof.add(PLAIN, Point(b, 0.010, 1.0, b / 0.010))
        s3 = (3.0, 0.015) if b == 1 else (1.2, 0.015) if b == 2 else (1.0, 0.020)
        s1 = (1.5, 0.012) if b <= 2 else (1.0, 0.012)
        for key, (tps, step) in ((S3, s3), (S1, s1)):
            prof.add(key, Point(b, step, tps, b * tps / step, tps))
    return prof


@pytest.fixture(scope="module", params=[DEFAULT_MODE])
def run(request, tiny_model, tiny_target, tiny_seqs, respec_reference, tmp_path_factory):  # one server at a time
    tmp = tmp_path_factory.mktemp("respec-eagle")
    drafter = make_drafter(tiny_target, tiny_seqs).save_pretrained(tmp / "drafter")
    profile = _profile().save(tmp / "profile.json")
    spec = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter), *EAGLE]
    respec = [
        "--respec-adaptive",
        "--respec-profile",
        str(profile),
        "--respec-hysteresis",
        "0,0,1",
        "--respec-drift",
        "0",
    ]
    args = ["--model-path", tiny_model, *COMMON, *spec, *respec, "--enable-metrics"]
    with RespecServer(args, request.param) as srv:
        before = idle_state(srv.url)["respec"]
        out = collect(srv.url, BATCHES)
        mid = idle_state(srv.url)["respec"]
        out["opt_out"] = [x["output_ids"] for x in generate(srv.url, BATCHES["b1"], custom={"respec": "off"})]
        after = idle_state(srv.url)["respec"]
        info = requests.get(srv.url + "/spex/info", timeout=60).json()
        metrics = requests.get(srv.url + "/metrics", timeout=60).text
        return dict(out=out, before=before, mid=mid, after=after, info=info, metrics=metrics)


@pytest.fixture(scope="module", params=EAGLE_MODES)
def alternating(request, tiny_model, tiny_target, tiny_seqs, respec_reference, tmp_path_factory):
    drafter = make_drafter(tiny_target, tiny_seqs).save_pretrained(tmp_path_factory.mktemp("respec-eagle-alt"))
    spec = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter), *EAGLE]
    args = ["--model-path", tiny_model, *COMMON, *spec, "--respec-adaptive", "--respec-force", "alternate:3"]
    with RespecServer(args, request.param) as srv:
        before = idle_state(srv.url)["respec"]
        out = collect(srv.url, BATCHES)
        after = idle_state(srv.url)["respec"]
        off = [x["output_ids"] for x in generate(srv.url, BATCHES["b6"], custom={"respec": "off"})]
        off_after = idle_state(srv.url)["respec"]
        lp_off = logprob_outputs(srv.url, custom={"respec": "off"})
        lp_off_after = idle_state(srv.url)["respec"]
        lp_mixed = logprob_outputs(srv.url)
        lp_after = idle_state(srv.url)["respec"]
        return dict(
            out=out,
            before=before,
            after=after,
            off=off,
            off_after=off_after,
            lp_off=lp_off,
            lp_off_after=lp_off_after,
            lp_mixed=lp_mixed,
            lp_after=lp_after,
        )


@pytest.mark.parametrize("batch", list(BATCHES))
def test_plain_steps_and_drafter_catch_up_keep_greedy_output(respec_reference, alternating, batch):
    assert alternating["out"][batch] == respec_reference["batches"][batch]


def test_drafter_caught_up_at_every_resume(alternating):
    after = alternating["after"]
    ledger = after["drafter_ledger"]
    assert after["config"]["eagle_off"] == "plain" and after["plain_steps"] > 0 and after["spec_steps"] > 0
    assert ledger["catch_ups"] > 0 and ledger["replayed_positions"] >= 3 * ledger["catch_ups"]
    assert ledger["pending_positions"] == 0 or after["pool"]["running"] == 0
    b, a = alternating["before"]["pool"], after["pool"]
    assert a["kv_available"] + a["kv_evictable"] == b["kv_available"] + b["kv_evictable"]


def test_off_state_is_a_plain_decode_step(alternating):
    after = alternating["after"]
    modes, timed = after["target_forward_modes"], after["step_time_by_mode"]
    assert modes["plain"] == {"DECODE": after["plain_steps"]} and after["plain_steps"] > 0, modes
    assert modes["spec"] == {"TARGET_VERIFY": after["spec_steps"]} and after["spec_steps"] > 0, modes
    assert timed["DECODE"]["steps"] > 0 and timed["TARGET_VERIFY"]["steps"] > 0, timed
    assert after["drafter_ledger"]["copied_steps"] == 0  # device references, no per-step copy (no graphs on CPU)


def test_off_batch_runs_only_decode_steps_and_no_drafter_work(respec_reference, alternating):
    assert alternating["off"] == respec_reference["batches"]["b6"]
    a, b = alternating["after"], alternating["off_after"]
    steps = b["plain_steps"] - a["plain_steps"]
    assert steps >= N - 1 and b["spec_steps"] == a["spec_steps"]
    assert b["target_forward_modes"]["plain"]["DECODE"] - a["target_forward_modes"]["plain"]["DECODE"] == steps
    assert b["step_time_by_mode"]["DECODE"]["steps"] > a["step_time_by_mode"]["DECODE"]["steps"]
    la, lb = a["drafter_ledger"], b["drafter_ledger"]
    assert lb["catch_ups"] == la["catch_ups"] and lb["replayed_positions"] == la["replayed_positions"]
    assert lb["skipped_positions"] - la["skipped_positions"] >= (N - 1) * len(BATCHES["b6"])
    p0, p1 = alternating["before"]["pool"], b["pool"]
    assert p1["kv_available"] + p1["kv_evictable"] == p0["kv_available"] + p0["kv_evictable"]
    assert p1["req_slots_free"] == p0["req_slots_free"]


def test_logprob_batches_take_the_plain_step(respec_reference, alternating):
    """A batch asking for log-probs runs ReSpec's plain DECODE step too; its served log-probs are plain SGLang's."""
    want = respec_reference["logprobs"]
    assert_same_logprobs(alternating["lp_off"], want)
    assert_same_logprobs(alternating["lp_mixed"], want)  # plain and speculative steps alternate (alternate:3)
    a, b, c = alternating["off_after"], alternating["lp_off_after"], alternating["lp_after"]
    assert b["plain_steps"] - a["plain_steps"] >= N - 1 and b["spec_steps"] == a["spec_steps"]
    assert c["plain_steps"] > b["plain_steps"] and c["spec_steps"] > b["spec_steps"]
    assert c["target_forward_modes"]["plain"] == {"DECODE": c["plain_steps"]}, c["target_forward_modes"]


@pytest.mark.parametrize("batch", list(BATCHES))
def test_runtime_switching_keeps_greedy_output(respec_reference, run, batch):
    assert run["out"][batch] == respec_reference["batches"][batch]


def test_every_planned_state_ran(run):
    fsm = run["mid"]["fsm"]
    assert run["mid"]["plan"] == f"B=1: {S3} (x2.00); B=2..3: {S1} (x1.25); B=4..256: no-spec (x1.00)"
    assert all(fsm["steps_per_state"].get(k, 0) > 0 for k in (S3, S1, "none")), fsm
    assert fsm["switches"] >= 2


def test_opt_out_request_never_speculates(respec_reference, run):
    assert run["out"]["opt_out"] == respec_reference["batches"]["b1"]
    mid, after = run["mid"], run["after"]
    assert after["opt_out_steps"] - mid["opt_out_steps"] >= N - 1  # every decode step of that request
    assert after["spec_steps"] == mid["spec_steps"]


def test_kv_returns_to_start(run):
    b, a = run["before"]["pool"], run["after"]["pool"]
    assert a["kv_available"] + a["kv_evictable"] == b["kv_available"] + b["kv_evictable"]
    assert a["req_slots_free"] == b["req_slots_free"]


def test_state_on_info_and_metrics(run):
    assert run["info"]["respec"]["config"]["server_key"] == "EAGLE3:s3t1n4"
    assert run["info"]["respec"]["decode_steps"] > 0
    m = run["metrics"]
    assert 'respec_decode_steps_total{mode="plain"}' in m and 'respec_decode_steps_total{mode="spec"}' in m
    assert "respec_switches_total" in m and "respec_accept_length" in m
