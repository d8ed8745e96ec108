"""Prompt sets and request helpers shared by the real-server ReSpec tests (speculative vs plain greedy)."""

import time
from typing import Dict, List, Optional

import requests

BASE = "The history of the old harbour town begins with a small settlement near the river, where farmers"
REPEAT = "a b c a b c a b c a b c a b c a b c"
WORKLOADS = {
    "b1": [BASE],
    "b4_mixed": [BASE + " grew", REPEAT, "Hi", BASE + " sang in winter"],
    "b2_repetitive": [REPEAT, REPEAT + " a b"],
}
BATCHES = {  # EAGLE3 tests: each sent as one /generate call; all requests run N tokens, so the batch stays this size
    "b1": [BASE],
    "b2": [REPEAT, BASE + " grew"],
    "b6": [BASE + f" ({i})" for i in range(5)] + [REPEAT + " a"],
}
LOAD = [BASE + " traded wheat", REPEAT + " a", "Once upon a time"]  # streamed across the drafter hot-swap
LOGPROB_SET = [BASE + " (lp)", REPEAT + " c"]  # sent with return_logprob and the top-TOP_K log-probs
TOP_K = 5
N = 24  # new tokens per request
N_LOAD = 160
COMMON = ["--dtype", "float32", "--attention-backend", "spex_cpu"]  # tiny model: batch-independent greedy


def generate(
    url: str, texts: List[str], n: int = N, custom: Optional[dict] = None, top_logprobs: int = 0
) -> List[dict]:
    """Greedy ``n`` tokens per text (EOS ignored), optionally with ``custom_params`` and served log-probs."""
    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    if custom:
        params["custom_params"] = custom
    body = {"text": texts, "sampling_params": params}
    if top_logprobs:
        body.update(return_logprob=True, top_logprobs_num=top_logprobs)
    r = requests.post(url + "/generate", json=body, timeout=300)
    r.raise_for_status()
    return r.json()


def collect(url: str, sets: Dict[str, List[str]], n: int = N) -> Dict[str, List[List[int]]]:
    """Greedy output ids of every prompt set, one ``/generate`` call per set."""
    return {k: [x["output_ids"] for x in generate(url, texts, n)] for k, texts in sets.items()}


def logprob_outputs(url: str, custom: Optional[dict] = None) -> List[dict]:
    """``LOGPROB_SET`` with its served log-probs: per request the ids, each output token's log p and top-k."""
    out = generate(url, LOGPROB_SET, custom=custom, top_logprobs=TOP_K)
    return [
        {
            "ids": x["output_ids"],
            "logp": [e[0] for e in x["meta_info"]["output_token_logprobs"]],
            "top": [[(t, lp) for lp, t, *_ in row] for row in x["meta_info"]["output_top_logprobs"]],
        }
        for x in out
    ]


def assert_same_logprobs(got: List[dict], want: List[dict], tol: float = 1e-3) -> None:
    """Same ids and top-k ids; log-probs equal within ``tol`` (float32 on one host)."""
    assert [g["ids"] for g in got] == [w["ids"] for w in want]
    for g, w in zip(got, want):
        assert len(g["logp"]) == len(w["logp"]) == len(g["ids"])
        assert all(abs(a - b) <= tol for a, b in zip(g["logp"], w["logp"])), (g["logp"], w["logp"])
        assert [[t for t, _ in row] for row in g["top"]] == [[t for t, _ in row] for row in w["top"]]
        assert all(abs(a[1] - b[1]) <= tol for ra, rb in zip(g["top"], w["top"]) for a, b in zip(ra, rb))


def reference_outputs(url: str) -> Dict[str, Dict[str, List[List[int]]]]:
    """Everything the ReSpec server tests compare against, from one plain server."""
    return {
        "workloads": collect(url, WORKLOADS),
        "batches": collect(url, BATCHES),
        "load": collect(url, {"load": LOAD}, N_LOAD)["load"],
        "logprobs": logprob_outputs(url),
    }


def idle_state(url: str) -> dict:
    """The scheduler's internal state once no request is running (the ReSpec report's pool figures)."""
    for _ in range(50):
        st = requests.get(url + "/get_server_info", timeout=60).json()["internal_states"][0]
        if st["respec"]["pool"]["running"] == 0:
            return st
        time.sleep(0.2)
    return st
