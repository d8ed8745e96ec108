"""ReSpec's two lanes on a real CPU server (tiny Llama, NGRAM, overlap scheduler): with ``--respec-profile auto``
and two cached profiles of the model -- a greedy one where speculation pays at every batch size and one measured
at T = 1 where it never does -- greedy requests run speculative steps and T = 1 requests plain decode steps."""

from __future__ import annotations

import pytest
import requests
from respec_servers import RespecServer
from workloads import COMMON, WORKLOADS, N, generate, idle_state

from sglang_spex.config import CACHE_ENV_VAR
from sglang_spex.profile.cache import PLAIN, Point, Profile
from sglang_spex.respec.profiler import default_profile_path

pytestmark = pytest.mark.server

KEY = "NGRAM:s4t1n4"  # the server key of --speculative-num-draft-tokens 4


def _profile(tokens_per_step: float) -> Profile:
    prof = Profile("m", "d", "cpu")
    for b in (1, 4, 16, 64):
        prof.add(PLAIN, Point(b, 0.010, 1.0, b / 0.010))
        prof.add(KEY, Point(b, 0.012, tokens_per_step, b * tokens_per_step / 0.012, tokens_per_step))
    return prof


@pytest.fixture(scope="module")
def lanes(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("spex-cache")
    profiles = root / "profiles" / "respec"
    profiles.mkdir(parents=True)
    for temperature, tps in ((0.0, 3.0), (1.0, 1.0)):  # greedy: x2.5 everywhere; T = 1: x0.83 everywhere
        name = default_profile_path(tiny_model, "ngram", "cpu", temperature).name
        _profile(tps).save(profiles / name)
    spec = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"]
    args = ["--model-path", tiny_model, *COMMON, *spec, "--respec-adaptive", "--respec-hysteresis", "0,0,1"]
    server = RespecServer(args, "overlap")
    server.env[CACHE_ENV_VAR] = str(root)  # the scheduler looks for the model's profiles under this root
    with server as srv:
        yield srv


@pytest.fixture(scope="module")
def steps(lanes):
    url = lanes.url
    before = idle_state(url)["respec"]
    generate(url, WORKLOADS["b2_repetitive"])
    greedy = idle_state(url)["respec"]
    params = {"temperature": 1.0, "max_new_tokens": N, "ignore_eos": True, "sampling_seed": 0}
    r = requests.post(
        url + "/generate", json={"text": WORKLOADS["b2_repetitive"], "sampling_params": params}, timeout=300
    )
    r.raise_for_status()
    sampled = idle_state(url)["respec"]
    return before, greedy, sampled


def test_greedy_requests_follow_the_greedy_profile(steps):
    before, greedy, _ = steps
    assert greedy["spec_steps"] > before["spec_steps"] and greedy["plain_steps"] == before["plain_steps"]


def test_sampled_requests_follow_the_t1_profile(steps):
    _, greedy, sampled = steps
    assert sampled["plain_steps"] - greedy["plain_steps"] >= N - 2 and sampled["spec_steps"] == greedy["spec_steps"]
    assert "sampled_lane" in sampled and sampled["sampled_lane"]["plan"] != sampled["plan"]
