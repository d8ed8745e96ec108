"""GRPO loop: advantages and the policy step in isolation, then against a live CPU SGLang server (tiny Llama,
EAGLE3 with our drafter, the online learner inside): a diverged learner update is rolled back while the old
drafter keeps serving, and one GRPO step changes the policy, the push changes what the server computes (its
prompt log-probs equal the client's new weights, not the old ones) and the learner's policy copy follows."""

from __future__ import annotations

import json
import math
import time

import pytest
import requests
import torch

from sglang_spex.respec.grpo import GRPOConfig, GRPOLoop, ServerClient, accept_length, extract_number, group_advantages
from sglang_spex.respec.grpo_setup import EAGLE_ARGS
from sglang_spex.respec.policy import Policy
from sglang_spex.serve import ServerProcess
from sglang_spex.tot.tasks import ToyAdd

PROBE_IDS = [1, 17, 42, 99, 7, 230, 5, 61, 12, 300, 44, 9]


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5], 4)
    assert adv[:4] == pytest.approx([1.0, -1.0, 1.0, -1.0])
    assert adv[4:] == [0.0] * 4  # a group without reward spread carries no signal
    a = group_advantages([3.0, 1.0, 2.0], 3)
    assert sum(a) == pytest.approx(0.0) and a[0] > a[2] > a[1]
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1.0, 2.0, 3.0], 4)
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, math.nan], 2)
    with pytest.raises(ValueError):
        GRPOConfig(temperature=0).validate()


def test_extract_number_and_accept_length():
    assert extract_number("3 + 4 = 7. The answer is 7.") == "7"
    assert extract_number("so 12 then 19") == "19"
    assert extract_number("no digits") is None
    metas = [{"completion_tokens": 10, "spec_verify_ct": 4}, {"completion_tokens": 6, "spec_verify_ct": 4}]
    assert accept_length(metas) == 2.0 and accept_length([{"completion_tokens": 5}]) is None


def _fresh_policy(tiny_model, lr=1e-2) -> Policy:
    return Policy.from_pretrained(tiny_model, lr=lr)


def test_grpo_step_moves_logprobs_with_the_advantage(tiny_model):
    pol = _fresh_policy(tiny_model, lr=1e-3)
    pairs = [([1, 5, 6], [7, 8, 9, 10]), ([1, 5, 6], [11, 12, 13, 14])]
    with torch.no_grad():
        before, mask = pol.token_logprobs(pairs)
    emb = pol.model.get_input_embeddings().weight.clone()
    out = pol.grpo_step(pairs, [1.0, -1.0], inner_steps=2)
    with torch.no_grad():
        after, _ = pol.token_logprobs(pairs)
    gain = ((after - before) * mask).sum(-1)
    assert gain[0] > 0 > gain[1] and out["version"] == 1
    assert torch.equal(emb, pol.model.get_input_embeddings().weight)  # frozen (the drafter reads it)
    assert "model.embed_tokens.weight" not in dict(pol.named_tensors())
    with pytest.raises(ValueError, match="advantages"):
        pol.grpo_step(pairs, [1.0])


class _RecordingClient(ServerClient):
    """Pure loop logic: canned completions, and every learner call recorded; the learner answers ``training``."""

    def __init__(self, training):
        super().__init__("http://unused")
        self.training = list(training)
        self.calls = []

    def generate(self, input_ids, params, concurrency=0, extra=None):
        self.calls.append(("generate", bool(extra and extra.get("return_logprob"))))
        return [{"output_ids": [5, 6, 7], "meta_info": {}} for _ in input_ids]

    def weight_version(self):
        return "0"

    def post_policy(self, version, named):
        self.calls.append(("policy", version))
        return {}

    def post_rollouts(self, rollouts):
        self.calls.append(("rollouts", len(rollouts)))
        return {"training": self.training.pop(0)}


def test_grpo_loop_skips_logprobs_and_policy_copies_while_the_learner_is_not_training(tiny_model):
    from transformers import AutoTokenizer

    client = _RecordingClient([True, False, False, True, True])
    cfg = GRPOConfig(prompts_per_step=1, group_size=2, max_new_tokens=3, seed=0)
    loop = GRPOLoop(client, _fresh_policy(tiny_model), AutoTokenizer.from_pretrained(tiny_model), ToyAdd(), cfg)
    loop.swaps = [type("NoSwap", (), {"push": lambda self, version, named: None})()]
    steps = list(loop.run(5, progress=False))
    # step 2's answer (False) arrives with step 3 in the background; step 3's (True) is read before step 4 samples
    assert [c[1] for c in client.calls if c[0] == "generate"] == [True, True, False, False, True]
    assert [c[1] for c in client.calls if c[0] == "policy"] == [1, 2, 5]  # policy versions pushed to the copy
    assert [c for c in client.calls if c[0] == "rollouts"] == [("rollouts", 2)] * 5  # every batch is posted
    # each step reports the last answer it has: step 2's post is still in flight, step 3 reports step 2's answer
    assert [s.learner["training"] if s.learner else None for s in steps] == [True, False, None, False, True]
    assert loop._pending_post is None  # run() waits for the last background post


# -- live server ------------------------------------------------------------------------------------------------


def _server(tiny_model, drafter_dir, learner: dict):
    spec = {"drafter": str(drafter_dir), "target": tiny_model, "learner": learner}
    args = ["--model-path", tiny_model, "--dtype", "float32", "--speculative-algorithm", "EAGLE3"]
    args += ["--speculative-draft-model-path", str(drafter_dir), *EAGLE_ARGS]
    return ServerProcess([*args, "--respec-learner", json.dumps(spec)])


@pytest.fixture(scope="module")
def live(tiny_model, drafter_dir):
    """EAGLE3 server whose learner diverges on every update (lr 1e30, sync: the POST returns after it)."""
    with _server(tiny_model, drafter_dir, {"variant": "reward", "mode": "sync", "lr": 1e30, "train_steps": 3}) as srv:
        yield srv


@pytest.fixture(scope="module")
def healthy(tiny_model, drafter_dir, live):  # after the diverging server stopped (module order)
    with _server(tiny_model, drafter_dir, {"variant": "reward", "mode": "async", "lr": 1e-3, "train_steps": 2}) as srv:
        yield srv


def _greedy(url: str) -> list:
    body = {"input_ids": [PROBE_IDS, PROBE_IDS[:5]], "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
    out = requests.post(url + "/generate", json=body, timeout=300)
    out.raise_for_status()
    return [(x["output_ids"], x["meta_info"]["spec_verify_ct"]) for x in out.json()]


def _server_prompt_logprobs(url: str) -> torch.Tensor:
    body = {
        "input_ids": PROBE_IDS,
        "sampling_params": {"temperature": 0, "max_new_tokens": 1},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    r = requests.post(url + "/generate", json=body, timeout=300)
    r.raise_for_status()
    vals = [v for v, _, _ in r.json()["meta_info"]["input_token_logprobs"]][1:]  # the first token has none
    return torch.tensor(vals, dtype=torch.float32)


def _client_prompt_logprobs(pol: Policy) -> torch.Tensor:
    with torch.no_grad():
        lp, _ = pol.token_logprobs([(PROBE_IDS[:1], PROBE_IDS[1:])], temperature=1.0)
    return lp[0]


def test_diverged_update_rolled_back_old_drafter_keeps_serving(live):
    url = live.url
    before = _greedy(url)
    assert all(verify > 0 for _, verify in before)  # the EAGLE3 draft/verify path serves these
    rollouts = [{"prompt_ids": PROBE_IDS[:6], "response_ids": PROBE_IDS[6:], "reward": float(i)} for i in range(4)]
    r = requests.post(url + "/respec/rollouts", json={"rollouts": rollouts}, timeout=300)
    assert r.status_code == 200 and r.json()["update_due"] is True
    state = requests.get(url + "/respec/state", timeout=60).json()
    last = state["last_update"]
    assert last["outcome"] == "rolled_back" and last["reason"].startswith("nan_"), last
    assert state["version"] == 0
    assert requests.get(url + "/model_info", timeout=60).json()["weight_version"] == "default"  # nothing pushed
    # same greedy tokens and the same number of verify passes: the very same drafter still drafts
    assert _greedy(url) == before


def test_grpo_step_push_changes_what_the_server_computes(healthy, tiny_model):
    live = healthy
    from transformers import AutoTokenizer

    pol = _fresh_policy(tiny_model)
    old = _client_prompt_logprobs(pol)
    served = _server_prompt_logprobs(live.url)
    assert torch.allclose(served, old, atol=2e-3), (served - old).abs().max()

    def reward(text, q):  # varies between samples of a random model, so every group has a signal
        return (sum(map(ord, text)) % 7) / 7.0

    tok = AutoTokenizer.from_pretrained(tiny_model)
    # with the served top-k log-probs: the learner's KD target comes from SGLang's real meta_info through EAGLE3
    cfg = GRPOConfig(prompts_per_step=2, group_size=3, max_new_tokens=8, inner_steps=2, top_logprobs_num=4)
    before = {n: t.clone() for n, t in pol.named_tensors()}
    loop = GRPOLoop(ServerClient(live.url), pol, tok, ToyAdd(2, 10), cfg, reward_fn=reward)
    (stats,) = list(loop.run(1, progress=False))
    assert stats.policy_version == 1 and stats.weight_version in ("policy-1", "respec-1")
    assert stats.rollout_tokens > 0 and stats.accept_length is not None and stats.accept_length >= 1.0
    assert any(not torch.equal(before[n], t) for n, t in pol.named_tensors())
    new = _client_prompt_logprobs(pol)
    served = _server_prompt_logprobs(live.url)
    assert (new - old).abs().max() > 1e-2  # the step moved the policy visibly
    assert torch.allclose(served, new, atol=2e-3), (served - new).abs().max()  # and the server now runs it
    for _ in range(600):  # the async learner trains on the posted rollouts and pushes drafter version 1
        state = requests.get(live.url + "/respec/state", timeout=60).json()
        if not state["updating"] and state["version"] >= 1:
            break
        time.sleep(0.2)
    assert state["policy_version"] == 1 and state["rollouts_received"] == 6  # the loop posted its rollouts
    assert state["version"] == 1 and state["updates"][-1]["outcome"] == "published", state["updates"]
    update = state["updates"][-1]
    # served KD target; the copy was synced to the new policy before the rollouts (sampled from the old one) came
    assert update["target_source"] == "served" and 0 < update["target_logp_gap"] < 5, update
    # the learner's push reached this very server (the drafter changed under the served policy), and the drafter's
    # version is kept apart from the policy's (SGLang's weight_version)
    assert requests.get(live.url + "/model_info", timeout=60).json()["weight_version"] == "policy-1"
    assert requests.get(live.url + "/respec/drafter", timeout=60).json()["drafter_version"] == 1


def test_fit_drafter_keeps_a_given_vocabulary(tiny_target):
    from sglang_spex.respec.ttt import fit_drafter

    pairs = [([1, 5, 6, 7], [8, 9, 10, 11, 12, 13]), ([1, 20, 21], [22, 23, 24, 25])]
    served = torch.zeros(tiny_target.config.vocab_size, dtype=torch.bool)
    served[100:164] = True  # none of the sampled tokens: their own counts would pick another set
    d = fit_drafter(tiny_target, pairs, 64, iters=2, steps=2, t2d=served)
    assert torch.equal(d.t2d, served)
    assert not torch.equal(fit_drafter(tiny_target, pairs, 64, iters=1, steps=1).t2d, served)
