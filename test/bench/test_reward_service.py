"""The emulated external PRM (benchmark/reward_service.py): the verifier's score, after its latency, concurrently."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import bench_tot  # noqa: E402
from reward_service import delayed_verifier  # noqa: E402

BODY = {"question": "What is 2 + 3?", "trajectory": ["2 + 3 = 5"]}


@pytest.fixture
def prm():
    svc = delayed_verifier("arith", latency_s=0.3)
    yield svc
    svc.close()


def test_scores_with_the_verifier_after_the_latency(prm):
    t0 = time.monotonic()
    good = httpx.post(prm.url, json=BODY, timeout=10).json()
    assert time.monotonic() - t0 >= 0.3
    bad = httpx.post(prm.url, json={**BODY, "trajectory": ["2 + 3 = 7"]}, timeout=10).json()
    assert good["reward"] > bad["reward"]


def test_concurrent_scores_wait_concurrently():
    """A wave of reward calls is taken in at once: none waits in the listen backlog (socketserver's default of 5
    dropped connections the kernel retried 1 s later, and a wave of 8 already hit it on a busy host)."""
    n = 32
    svc = delayed_verifier("arith", latency_s=1.0)  # each request is counted on arrival, answered 1 s later

    with httpx.Client(limits=httpx.Limits(max_connections=n), timeout=30) as client:

        def score(_: int) -> tuple:
            reward = client.post(svc.url, json=BODY).json()["reward"]
            return reward, svc.calls  # requests the service had taken in when this answer came

        try:
            with ThreadPoolExecutor(n) as pool:
                out = list(pool.map(score, range(n)))
        finally:
            svc.close()
    assert len({r for r, _ in out}) == 1
    assert [c for _, c in out] == [n] * n  # no answer waited for another: all were in before the first left


def test_a_bad_body_is_a_500_naming_the_error_and_the_service_lives_on(prm):
    r = httpx.post(prm.url, json={"question": "q"}, timeout=10)
    assert r.status_code == 500 and "trajectory" in r.json()["error"]
    assert httpx.post(prm.url, json=BODY, timeout=10).status_code == 200


def test_unknown_verifier_and_bench_flag_checks():
    with pytest.raises(KeyError, match="nope"):
        delayed_verifier("nope", 0.1)
    with pytest.raises(SystemExit):
        bench_tot.parse_args(["--reward", "logprob", "--reward-latency-ms", "500"])
    args = bench_tot.parse_args(["--reward", "verifier:arith", "--reward-latency-ms", "500"])
    assert args.reward_latency_ms == 500
    spec = bench_tot.build_spec("rebase-8", 2, 8, 0, reward={"type": "callback", "url": "http://127.0.0.1:1/score"})
    assert spec.reward.type == "callback"
