"""``--tot-k-total auto`` on a real server: once the roofline profile's knee is known, it becomes the HTTP-side T2
budget and the scheduler-side speculative admission cap, and the served model's byte sizes reach T2."""

from __future__ import annotations

import time

import requests

from sglang_spex.serve import ServerProcess

SEARCH = {
    "policy": {"name": "rstar", "num_rollouts": 2, "max_depth": 2, "branch": 2},
    "step": {"max_tokens": 4},
    "reward": {"type": "logprob"},
    "seed": 1,
}


def test_knee_sets_the_scheduler_cap(tiny_model, tmp_path):
    srv = ServerProcess(
        ["--dtype", "float32", "--model-path", tiny_model, "--tot-speculation", "--tot-k-total", "auto"],
        env={"SPEX_CACHE_DIR": str(tmp_path)},  # a fresh profile cache: the server measures its own knee
    ).start()
    try:
        before = requests.get(srv.url + "/spex/stats", timeout=60).json()["scheduler"]
        assert before["budget"] is None  # auto: no cap until the knee is known
        r = requests.post(srv.url + "/tot/search", json={"spec": SEARCH, "question": "What is 2 + 3?"}, timeout=900)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 900
        while True:  # the first search resolves k_total from the (background-measured) profile
            prof = requests.get(srv.url + "/spex/profile", timeout=60)
            sched = requests.get(srv.url + "/spex/stats", timeout=60).json()["scheduler"]
            if prof.status_code == 200 and sched["budget"] is not None or time.monotonic() > deadline:
                break
            time.sleep(2)
        k_total = prof.json()["k_total"]
        assert k_total >= 1 and sched["budget"] == k_total
        again = requests.post(srv.url + "/tot/search", json={"spec": SEARCH, "question": "1 + 1?"}, timeout=900)
        assert again.json()["speculation"]["settings"]["k_total"] == k_total
    finally:
        srv.stop()
    log = open(srv.log_path).read()
    assert "spex: T2 S_w=" in log and f"spex: k_total={k_total} from the roofline profile" in log
