"""Foundation acceptance: the launcher starts real SGLang with the plugin, inert without --tot-speculation."""

from __future__ import annotations

import concurrent.futures as cf

import requests

PROMPTS = ["Step 1: add the numbers.", "Let us think step by step", "0 1 2 3"]


def greedy(url: str, text: str, n: int = 16):
    r = requests.post(
        url + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    )
    r.raise_for_status()
    return r.json()["output_ids"]


def test_generate_and_info_from_scheduler(spex_server):
    out = greedy(spex_server.url, PROMPTS[0])
    assert len(out) > 0
    info = requests.get(spex_server.url + "/spex/info").json()
    assert info["sglang_version"] == "0.5.23"
    assert info["plugin_loaded_in_scheduler"] is True
    sched = info["scheduler"]
    assert sched["process"] == "scheduler"
    assert sched["pid"] != info["http_server_pid"]  # reported from another process than the HTTP server
    assert info["speculation"] is True and info["config"]["k_total"] == 8


def test_plain_launcher_is_inert_and_identical(spex_server, plain_server):
    info = requests.get(plain_server.url + "/spex/info").json()
    assert info["speculation"] is False
    assert info["scheduler"]["config"]["enabled"] is False
    for p in PROMPTS:
        assert greedy(spex_server.url, p) == greedy(plain_server.url, p)


def test_a_plain_server_refuses_speculation_a_search_asks_for(plain_server):
    """Without --tot-speculation a search's ``speculation`` may only turn it off: the rest would do nothing."""
    spec = {"policy": {"name": "rebase", "width": 2, "max_depth": 1}, "step": {"max_tokens": 4}}
    for overrides, field in (
        ({"enabled": True}, "speculation.enabled"),
        ({"early_stop": True}, "speculation.early_stop"),
    ):
        body = {"spec": {**spec, "speculation": overrides}, "question": "1+1?"}
        r = requests.post(plain_server.url + "/tot/search", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["field"] == field
    body = {"spec": {**spec, "speculation": {"enabled": False}}, "question": "1+1?"}
    r = requests.post(plain_server.url + "/tot/search", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "done" and r.json()["nodes"]


def test_sampling_seed_is_batch_independent(spex_server):
    def sample(seed):
        body = {
            "text": PROMPTS[1],
            "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": seed},
        }
        return requests.post(spex_server.url + "/generate", json=body).json()["output_ids"]

    alone = sample(11)
    with cf.ThreadPoolExecutor(6) as ex:
        crowd = list(ex.map(sample, [11, None, 12, 11, None, 13]))
    assert crowd[0] == alone and crowd[3] == alone
    assert crowd[2] != alone  # another seed gives another sample


def test_min_p_beside_seeded_requests_keeps_the_server_up(spex_server):
    """SGLang's sampler asserts on a seeded batch that needs min-p; H2 seeds a whole batch once one request has a
    seed, so an unseeded min_p request beside a seeded one killed the scheduler. H2c samples such steps unseeded."""

    def post(params):
        body = {"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, **params}}
        return requests.post(spex_server.url + "/generate", json=body, timeout=120)

    def unseeded() -> dict:
        r = requests.get(spex_server.url + "/spex/stats", timeout=60)
        return r.json()["scheduler"]["unseeded_sampling"]

    seeded = {"temperature": 1.0, "sampling_seed": 21}
    alone = post(seeded).json()["output_ids"]
    before = unseeded()
    mixes = [seeded, {"temperature": 0.8, "min_p": 0.1}, {"temperature": 0.8, "min_p": 0.2, "sampling_seed": 5}] * 2
    with cf.ThreadPoolExecutor(len(mixes)) as ex:
        replies = list(ex.map(post, mixes))
    assert [r.status_code for r in replies] == [200] * len(mixes)
    after = unseeded()  # every min_p request decodes 24 steps, each beside a seeded one or seeded itself
    assert after["steps"] >= before["steps"] + 24 and after["rows"] > before["rows"], (before, after)
    assert all(len(r.json()["output_ids"]) == 24 for r in replies)
    assert requests.get(spex_server.url + "/health_generate", timeout=60).status_code == 200
    assert post(seeded).json()["output_ids"] == alone  # seeds still decide the sample once min_p has left
