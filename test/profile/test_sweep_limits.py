"""The profiler's sweep never measures a batch past the server's ``max_running_requests``, and an impossible step
time (not positive) is measured again, and if it stays so the profile is disturbed: used, not cached (fake engine
in virtual time, no server)."""

from __future__ import annotations

import asyncio
from typing import Callable

import pytest
from fake_engine import Engine

from sglang_spex.profile import cache, measure
from sglang_spex.profile.measure import ProfileSpec, ensure_profile, measure_profile, sweep_limit

QUIET = dict(short_tokens=3, long_tokens=6, ctx_prefix_words=0, prefill_words=0)  # warm-up walls use 2 tokens


def _key(mrr=None):
    return {"model": "m", "hardware": "h", "flags": {"max_running_requests": mrr}}


# --- the limit ---------------------------------------------------------------------------------------------


def test_sweep_limit_caps_the_default_sizes_at_max_running_requests():
    assert sweep_limit(ProfileSpec(), _key(2)) == 2  # not the default sizes' 32
    assert sweep_limit(ProfileSpec(batch_sizes=(1, 2, 4), max_batch=2), _key(3)) == 3
    assert sweep_limit(ProfileSpec(), _key(None)) == 512  # no cap: as before
    assert sweep_limit(ProfileSpec(batch_sizes=(1, 2, 4), max_batch=2), {}) == 4


def test_sweep_limit_caps_at_max_queued_requests_which_keys_only_a_capped_server():
    # a burst past SGLang's queue cap is refused (503): the sweep stops at the cap, and a capped server's profile
    # (fewer points, a capped knee) is cached apart, while an uncapped server's key is what it was
    args = {"model_path": "m", "max_running_requests": 48}
    assert measure.profile_key(args, device="h") == {
        "model": "m",
        "hardware": "h",
        "flags": {k: args.get(k) for k in measure.KEY_FLAGS},
    }
    capped = measure.profile_key({**args, "max_queued_requests": 6}, device="h")
    assert capped["flags"]["max_queued_requests"] == 6 and cache.key_id(capped) != cache.key_id(
        measure.profile_key(args, device="h")
    )
    assert sweep_limit(ProfileSpec(), capped) == 6
    assert sweep_limit(ProfileSpec(), measure.profile_key({**args, "max_queued_requests": 64}, device="h")) == 48
    assert measure.profile_key({**args, "max_queued_requests": 4096}, device="h") == measure.profile_key(args, "h")


def test_spec_within_keeps_sizes_and_ctx_batch_to_the_limit():
    spec = ProfileSpec().within(2)
    assert spec.batch_sizes == (1, 2) and spec.ctx_batch == 2
    assert ProfileSpec().within(512) == ProfileSpec()


@pytest.mark.parametrize("mrr, sizes", [(2, [1, 2]), (3, [1, 2, 3]), (12, [1, 2, 4, 8, 12])])
def test_sweep_never_measures_past_max_running_requests(clock, mrr, sizes):
    engine = Engine(clock, step=lambda b: 0.010)  # memory-bound everywhere: uncapped, the sweep would go on to 512
    spec = ProfileSpec(short_tokens=3, long_tokens=6, ctx_prefix_words=8, prefill_words=0, repeats=1)
    prof = asyncio.run(measure_profile(engine, _key(mrr), spec, False))
    assert prof.batch_sizes == sizes and engine.most <= mrr
    assert prof.meta["sweep_limit"] == mrr and prof.meta["ctx_probe"]["batch"] == min(4, mrr)


def test_sweep_without_a_cap_keeps_extending(clock):
    spec = ProfileSpec(batch_sizes=(1, 2, 4), max_batch=32, repeats=1, **QUIET)
    prof = asyncio.run(measure_profile(Engine(clock, step=lambda b: 0.010), _key(None), spec, False))
    assert prof.batch_sizes == [1, 2, 4, 8, 16, 32]


# --- impossible step times ---------------------------------------------------------------------------------


def _short_slow_at(batch: int, walls: Callable[[int], bool]):
    """The short walls at ``batch`` (the n-th where ``walls(n)``) take 3x the long one: a negative step time."""
    return lambda b, tokens, n: 6.0 if (b, tokens) == (batch, QUIET["short_tokens"]) and walls(n) else 1.0


def test_impossible_step_time_is_measured_again(clock):
    engine = Engine(clock, step=lambda b: 0.010 + 0.001 * b, slow=_short_slow_at(1, lambda n: n == 1))
    spec = ProfileSpec(batch_sizes=(1, 2, 4), max_batch=4, repeats=1, **QUIET)
    prof = asyncio.run(ensure_profile(engine, _key(), spec, progress=False))
    assert engine.seen[(1, 3)] == 2  # measured again once
    assert prof.batch_sizes == [1, 2, 4] and prof.step_times[0] == pytest.approx(0.011)
    assert not prof.measured_under_load and cache.load(_key()) is not None


def test_an_impossible_repeat_gives_way_to_a_possible_one(clock):
    engine = Engine(clock, step=lambda b: 0.010 + 0.001 * b, slow=_short_slow_at(2, lambda n: n == 1))
    spec = ProfileSpec(batch_sizes=(1, 2, 4), max_batch=4, repeats=2, **QUIET)
    prof = asyncio.run(measure_profile(engine, _key(), spec, False))
    assert engine.seen[(2, 3)] == 2  # the two repeats, no re-measurement
    assert prof.step_times[1] == pytest.approx(0.012) and not prof.measured_under_load


def test_a_step_time_that_stays_impossible_is_not_cached(clock):
    engine = Engine(clock, step=lambda b: 0.010 + 0.001 * b, slow=_short_slow_at(1, lambda n: True))
    spec = ProfileSpec(batch_sizes=(1, 2, 4), max_batch=4, repeats=1, **QUIET)
    prof = asyncio.run(ensure_profile(engine, _key(), spec, progress=False))
    assert cache.load(_key()) is None and not list(cache.CACHE_DIR.glob("*.json"))
    assert prof.measured_under_load and prof.load_why == ["impossible step time"]
    assert prof.batch_sizes == [2, 4] and min(prof.step_times) > 0.01  # the impossible point left out
    assert prof.meta["load"]["impossible"] == [1]
    assert engine.seen[(1, 3)] == 1 + measure.BAD_TIME_RETRIES
