"""ReSpec adaptive server on real CPU SGLang (tiny Llama, float32, spex_cpu attention, NGRAM speculation).

NGRAM with ``--respec-adaptive --respec-force alternate:3`` switches between true plain decode steps and
speculative steps every 3 decode steps, in the middle of every generation, once per scheduler mode (SGLang's
overlap loop, where the plain step's input comes from the relayed spec_info and its lengths are published
through ``on_publish``, and the non-overlap loop). Greedy token ids must equal plain SGLang's (nothing lost or
duplicated at a switch) and the KV pool must return to its starting level.
"""

from __future__ import annotations

import pytest
from respec_servers import NGRAM_MODES, RespecServer
from workloads import COMMON, WORKLOADS, N, assert_same_logprobs, collect, generate, idle_state, logprob_outputs

from sglang_spex.config import RespecConfig
from sglang_spex.respec.adaptive import Runtime
from sglang_spex.respec.solver import Choice, Plan


@pytest.fixture(scope="module", params=NGRAM_MODES)
def adaptive(request, tiny_model, respec_reference):  # after the reference server has stopped: one at a time
    spec = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"]
    respec = ["--respec-adaptive", "--respec-force", "alternate:3"]
    with RespecServer(["--model-path", tiny_model, *COMMON, *spec, *respec], request.param) as srv:
        before = idle_state(srv.url)
        out = collect(srv.url, WORKLOADS)
        out["meta"] = [x["meta_info"] for x in generate(srv.url, WORKLOADS["b2_repetitive"])]
        after = idle_state(srv.url)
        opt = generate(srv.url, WORKLOADS["b2_repetitive"], custom={"respec": "off"})
        out["opt_out"] = ([x["output_ids"] for x in opt], [x["meta_info"] for x in opt], idle_state(srv.url))
        out["lp_off"] = logprob_outputs(srv.url, custom={"respec": "off"})
        out["lp_off_after"] = idle_state(srv.url)
        out["lp_mixed"] = logprob_outputs(srv.url)
        out["lp_after"] = idle_state(srv.url)
        return out, before, after


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_switching_spec_on_off_keeps_greedy_output(respec_reference, adaptive, workload):
    out, _, _ = adaptive
    assert all(len(ids) == N for ids in out[workload])  # no token lost at a switch
    assert out[workload] == respec_reference["workloads"][workload]


def test_both_paths_ran_and_speculation_accepted(adaptive):
    out, _, after = adaptive
    rs = after["respec"]
    assert rs["plain_steps"] > 0 and rs["spec_steps"] > 0
    assert rs["config"]["force"] == "alternate:3"
    assert max(m["spec_accept_length"] for m in out["meta"]) > 1.0  # spec steps on repetitive text accept drafts
    assert rs["mean_accept_length"] > 1.0  # the runtime read the spec steps' accept lengths from SGLang's host copy


def test_kv_returns_to_start(adaptive):
    _, before, after = adaptive
    b, a = before["respec"]["pool"], after["respec"]["pool"]
    assert a["kv_available"] + a["kv_evictable"] == b["kv_available"] + b["kv_evictable"]
    assert a["req_slots_free"] == b["req_slots_free"]


def test_runtime_modes_without_server():
    plan = Plan({b: Choice("NGRAM:s4t1n4" if b <= 4 else None, 1.5) for b in range(1, 17)})
    rt = Runtime(RespecConfig(enabled=True, hysteresis="0,0,1"), plan)
    assert [rt.speculate(b) for b in (1, 8, 2, 16)] == [True, False, True, False]
    assert rt.info()["fsm"]["switches"] == 3 and rt.plain_steps == 2  # the first step adopts the plan
    alt = Runtime(RespecConfig(enabled=True, force="alternate:2"), None)
    assert [alt.speculate(1) for _ in range(6)] == [True, True, False, False, True, True]
    assert not Runtime(RespecConfig(enabled=True, force="plain"), None).speculate(1)


def test_opt_out_request_runs_plain(respec_reference, adaptive):
    out, _, after = adaptive
    ids, meta, later = out["opt_out"]
    assert ids == respec_reference["workloads"]["b2_repetitive"]
    assert later["respec"]["spec_steps"] == after["respec"]["spec_steps"]  # no speculative step since
    assert later["respec"]["opt_out_steps"] - after["respec"]["opt_out_steps"] >= (N - 1) // 2
    assert all(m.get("spec_accept_length", 1.0) <= N / (N - 1) + 1e-6 for m in meta)  # prefill token + 1 per step


def test_logprob_batches_take_the_plain_step(respec_reference, adaptive):
    """A batch asking for log-probs obeys the runtime (plain steps included); its log-probs are plain SGLang's."""
    out, _, _ = adaptive
    assert_same_logprobs(out["lp_off"], respec_reference["logprobs"])
    assert_same_logprobs(out["lp_mixed"], respec_reference["logprobs"])
    a, b, c = out["opt_out"][2]["respec"], out["lp_off_after"]["respec"], out["lp_after"]["respec"]
    assert b["plain_steps"] - a["plain_steps"] >= N - 1 and b["spec_steps"] == a["spec_steps"]
    assert c["plain_steps"] > b["plain_steps"] and c["spec_steps"] > b["spec_steps"]
