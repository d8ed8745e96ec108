"""The learner's payback gate on a real CPU SGLang server: an adaptive EAGLE3 server (tiny Llama) whose profile
says speculation could reach at most 1.5x at full acceptance, with a sync online learner inside. The first posted
batch trains (no update measured yet); the next, posted right after it, is skipped: an update costs about the
whole interval, more than the third of it that speculation could save. The state names the gate's reading."""

from __future__ import annotations

import json

import pytest
import requests

from sglang_spex.respec.grpo import ServerClient
from sglang_spex.respec.grpo_setup import EAGLE_ARGS
from sglang_spex.respec.profiler import PLAIN, Point, Profile
from sglang_spex.serve import ServerProcess

KEY = "EAGLE3:s3t1n4"  # EAGLE_ARGS
IDS = [1, 17, 42, 99, 7, 230, 5, 61, 12, 300, 44, 9]
POST_LIMIT = 1 << 16  # the learner's largest rollouts body: a 2,048-token context fits, a big RL step does not


def _profile() -> Profile:
    """Plain 10 ms a step; EAGLE3 s3 26.7 ms: 4 tokens at full acceptance would be 1.5x, 2 measured are 0.75x."""
    prof = Profile("tiny", "test", "cpu")
    for b in (1, 4, 16):
        prof.add(PLAIN, Point(b, 0.010, 1.0, b / 0.010))
        prof.add(KEY, Point(b, 0.040 / 1.5, 2.0, b * 2.0 / (0.040 / 1.5), 2.0))
    return prof


@pytest.fixture(scope="module")
def server(tiny_model, drafter_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("payback")
    learner = {"variant": "reward", "mode": "sync", "lr": 1e-3, "train_steps": 2, "max_post_bytes": POST_LIMIT}
    spec = {"drafter": str(drafter_dir), "target": tiny_model, "learner": learner}
    args = ["--model-path", tiny_model, "--dtype", "float32", "--speculative-algorithm", "EAGLE3"]
    args += ["--speculative-draft-model-path", str(drafter_dir), *EAGLE_ARGS, "--respec-adaptive"]
    args += ["--respec-profile", str(_profile().save(tmp / "profile.json")), "--respec-learner", json.dumps(spec)]
    with ServerProcess(args) as srv:
        yield srv


def _post(url: str) -> dict:
    rollouts = [{"prompt_ids": IDS[:6], "response_ids": IDS[6:], "reward": float(i % 2)} for i in range(4)]
    r = requests.post(url + "/respec/rollouts", json={"rollouts": rollouts}, timeout=300)
    r.raise_for_status()
    return r.json()


def test_an_update_that_costs_more_than_speculation_could_save_is_skipped(server):
    url = server.url
    first = _post(url)
    assert first["update_due"] is True and first["training"] is True  # nothing measured yet: it trains
    second = _post(url)  # sync: the first post returned after its update, so the gap is about one update
    state = requests.get(url + "/respec/state", timeout=60).json()
    gate = state["payback"]
    assert gate["best_speedup"] == pytest.approx(1.5)  # the profile's best case, read by the routes at install
    assert second["update_due"] is False and second["training"] is False, (second, gate)
    assert gate["pays"] is False and gate["saving_bound_seconds"] < gate["update_seconds"]
    assert state["skipped_updates"] == 1 and state["version"] == 1 and state["buffer_size"] == 4


def test_a_rollout_past_the_context_is_refused_and_changes_nothing(server, tiny_model):
    """The learner inside a real server refuses a rollout longer than the model's context (its copy would run on
    it) with a 400 naming the field; the buffer and the steps are unchanged."""
    from transformers import AutoConfig

    url = server.url
    ctx = AutoConfig.from_pretrained(tiny_model).max_position_embeddings
    before = requests.get(url + "/respec/state", timeout=60).json()
    long = {"prompt_ids": [IDS[0]] * ctx, "response_ids": IDS[:1], "reward": 1.0}
    r = requests.post(url + "/respec/rollouts", json={"rollouts": [long]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["field"] == "rollouts[0].response_ids", r.text
    after = requests.get(url + "/respec/state", timeout=60).json()
    assert (after["buffer_size"], after["steps"]) == (before["buffer_size"], before["steps"])
    assert requests.get(url + "/health", timeout=60).status_code == 200


def test_an_rl_step_over_the_body_limit_goes_in_parts_and_counts_once(server):
    """One body past the learner's ``max_post_bytes`` is a 413 naming it, and nothing is stored; the GRPO client
    posts the same step in parts (``more``) that the learner stores and counts as one step."""
    url = server.url
    step = [{"prompt_ids": IDS[:6], "response_ids": IDS * 20, "reward": float(i % 2)} for i in range(150)]
    before = requests.get(url + "/respec/state", timeout=60).json()
    assert before["max_post_bytes"] == POST_LIMIT
    r = requests.post(url + "/respec/rollouts", json={"rollouts": step}, timeout=60)
    assert r.status_code == 413 and "learner.max_post_bytes" in r.json()["error"]["reason"], r.text
    same = requests.get(url + "/respec/state", timeout=60).json()
    assert (same["rollouts_received"], same["steps"]) == (before["rollouts_received"], before["steps"])
    posts = []
    client = ServerClient(url)
    post = client._post
    client._post = lambda u, body=None, content=None: posts.append(len(content)) or post(u, body, content)
    answer = client.post_rollouts(step)
    after = requests.get(url + "/respec/state", timeout=60).json()
    assert len(posts) >= 2 and max(posts) <= POST_LIMIT and answer["accepted"] == len(step)
    assert after["rollouts_received"] == before["rollouts_received"] + len(step)
    assert after["steps"] == before["steps"] + 1  # one RL step, whatever the number of parts
