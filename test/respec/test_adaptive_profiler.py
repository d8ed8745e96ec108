"""ReSpec profiler against one real CPU SGLang server (tiny Llama, spex_cpu attention, NGRAM speculation).

One module-scoped server: the measurement loop runs through ``profile_configs`` with a factory that hands out
the already started server, so the whole path (warm-up, batches, acceptance from meta_info and
``/get_server_info``, JSON profile, solver) is exercised without a second server. No timing asserts.
"""

from __future__ import annotations

import contextlib

import pytest

from sglang_spex.respec.profiler import PLAIN, Profile, SpecConfig, measure_point, profile_configs
from sglang_spex.respec.solver import solve
from sglang_spex.serve import ServerProcess

CONFIG = SpecConfig.parse("NGRAM:s4t1n4")
pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def ngram_server(tiny_model):
    args = ["--model-path", tiny_model, "--dtype", "float32", "--attention-backend", "spex_cpu", *CONFIG.server_args()]
    with ServerProcess(args) as srv:
        yield srv


def test_measure_point_reads_acceptance(ngram_server):
    p = measure_point(ngram_server.url, 2, n_short=4, n_long=12, repeats=1)
    assert p.batch_size == 2 and p.step_s > 0 and p.throughput > 0
    assert p.verify_ct is not None and p.verify_ct > 0
    assert p.accept_length is not None and 1.0 <= p.accept_length <= CONFIG.num_draft_tokens + 1
    assert 1.0 <= p.tokens_per_step <= CONFIG.num_draft_tokens + 1


def test_measure_point_samples_at_the_temperature_it_is_given(ngram_server):
    """At T=1 a draft token is accepted with its target probability (the tiny model's rows are nearly flat), not
    whenever it is the argmax: the profile of a T=1 workload must be measured at T=1."""
    greedy = measure_point(ngram_server.url, 2, n_short=4, n_long=12, repeats=1)
    sampled = measure_point(ngram_server.url, 2, n_short=4, n_long=12, repeats=1, temperature=1.0)
    print(f"accept length greedy {greedy.accept_length:.2f}, T=1 {sampled.accept_length:.2f}")
    assert sampled.accept_length < greedy.accept_length


def test_profile_configs_end_to_end(ngram_server, tmp_path):
    # The same server stands in for both the baseline and the config: the loop, not the numbers, is tested.
    prof = profile_configs(
        "tiny",
        [None, CONFIG],
        [1, 3],
        n_short=2,
        n_long=6,
        repeats=1,
        server_factory=lambda args: contextlib.nullcontext(ngram_server),
        temperature=0.5,
    )
    assert prof.meta["temperature"] == 0.5
    assert set(prof.points) == {PLAIN, CONFIG.key} and set(prof.points[CONFIG.key]) == {1, 3}
    # SGLang's windowed average may be empty (None) right after a read; the per-request one is always there
    assert CONFIG.key in prof.meta["avg_spec_accept_length"]
    assert all(p.accept_length >= 1.0 for p in prof.points[CONFIG.key].values())
    again = Profile.load(prof.save(tmp_path / "p.json"))
    assert again.points == prof.points
    plan = solve(again, max_batch=8)
    assert set(plan.choices) == set(range(1, 9))
    assert all(c.config in (None, CONFIG.key) for c in plan.choices.values())
