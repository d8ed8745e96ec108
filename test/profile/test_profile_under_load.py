"""A roofline profile measured while other requests ran, or with a disturbed sweep, serves its run but is never
cached; a quiet one is; an out-of-order point is measured again (fake engine in virtual time, no server)."""

from __future__ import annotations

import asyncio
from typing import List

import pytest
from fake_engine import Engine

from sglang_spex.profile import cache
from sglang_spex.profile.cache import Profile
from sglang_spex.profile.manager import ProfileManager
from sglang_spex.profile.measure import ProfileSpec, ensure_profile
from sglang_spex.profile.roofline import monotone_envelope, out_of_order, worst_dip

KEY = {"model": "m", "hardware": "h", "flags": {}}
SPEC = ProfileSpec(
    batch_sizes=(1, 2, 4, 8), short_tokens=2, long_tokens=6, ctx_prefix_words=0, prefill_words=0, max_batch=8
)


def profile_of(engine: Engine) -> Profile:
    return asyncio.run(ensure_profile(engine, KEY, SPEC, progress=False))


def test_a_quiet_measurement_is_cached(clock):
    prof = profile_of(Engine(clock, others=lambda wall: ["HEALTH_CHECK_abc"]))  # SGLang's health checks aside
    load = prof.meta["load"]
    assert not prof.measured_under_load and load["others_in_flight"] == 0 and load["checks"] > 2 * 4 * 2
    assert load["remeasured"] == [] and load["worst_dip"] == 0.0
    cached = cache.load(KEY)
    assert cached is not None and cached.created_at == prof.created_at


@pytest.mark.parametrize("busy", [lambda wall: wall == 0, lambda wall: 10 <= wall < 12, lambda wall: wall >= 17])
def test_other_requests_in_flight_at_start_mid_sweep_or_end_keep_it_out_of_the_cache(clock, busy):
    prof = profile_of(Engine(clock, others=lambda wall: ["user:1", "user:2"] if busy(wall) else []))
    assert prof.measured_under_load and prof.load_why == ["requests in flight"]
    assert prof.meta["load"]["others_in_flight"] == 2
    assert prof.k_total is not None  # still a profile for this run
    assert cache.load(KEY) is None and not list(cache.CACHE_DIR.glob("*.json"))


def test_a_port_that_counts_requests_in_flight_is_read_too(clock):
    class Counting(Engine):
        rids = None  # a port without rid lookup: stats()["inflight"] (read between the profile's own batches)

        async def stats(self):
            return {"inflight": 1}

    assert profile_of(Counting(clock)).measured_under_load and cache.load(KEY) is None


def test_manager_uses_a_loaded_profile_marks_it_and_measures_again_when_idle(clock):
    others: List[str] = ["user:1"]

    async def go():
        mgr = ProfileManager(Engine(clock, others=lambda wall: others), KEY, SPEC)
        prof = await mgr.get(progress=False)
        status = mgr.status()
        assert status["measured_under_load"] and status["k_total"] == prof.k_total and status["reprofile_due"]
        others.clear()  # the engine went idle: the due re-profile measures a clean curve and caches it
        assert mgr.reprofile_if_due()
        await mgr._task
        return mgr

    mgr = asyncio.run(go())
    assert mgr.status()["measured_under_load"] is False and not mgr.due
    assert cache.load(KEY) is not None


def test_an_out_of_order_point_is_measured_again(clock):
    """B=4's first long runs hit a slow spell (+60%): it reads above B=8; measured once more, the curve is sound."""
    engine = Engine(clock, slow=lambda b, tokens, n: 1.6 if (b, tokens) == (4, 6) and n <= 2 else 1.0)
    prof = profile_of(engine)
    load = prof.meta["load"]
    assert load["remeasured"] == [4] and load["worst_dip"] == pytest.approx(0.0)
    assert prof.step_times == pytest.approx([0.012, 0.014, 0.018, 0.026])
    assert not prof.measured_under_load and cache.load(KEY) is not None


def test_a_curve_still_out_of_order_is_not_cached_and_its_knee_read_from_the_envelope(clock):
    """B=2 always reads +80% (above B=4 and B=8 even measured twice): the sweep was disturbed."""
    prof = profile_of(Engine(clock, slow=lambda b, tokens, n: 1.8 if (b, tokens) == (2, 6) else 1.0))
    load = prof.meta["load"]
    assert load["remeasured"] == [2] and load["worst_dip"] > SPEC.max_dip
    assert prof.measured_under_load and prof.load_why == ["non-monotone"] and cache.load(KEY) is None
    raw = prof.step_times
    assert raw[1] > raw[3]  # the points keep what was measured
    assert prof.fit.step_time(2) <= prof.fit.step_time(8)


def test_max_dip_one_never_judges_the_curve(clock):
    spec = ProfileSpec(**{**SPEC.__dict__, "max_dip": 1.0})
    engine = Engine(clock, slow=lambda b, tokens, n: 1.8 if (b, tokens) == (2, 6) else 1.0)
    prof = asyncio.run(ensure_profile(engine, KEY, spec, progress=False))
    assert not prof.measured_under_load and cache.load(KEY) is not None


def test_the_cache_refuses_a_profile_marked_under_load(tmp_path):
    prof = Profile.from_points(KEY, [1, 2, 4], [0.01, 0.011, 0.013], 10, meta={"load": {"under_load": True}})
    assert cache.save(prof, tmp_path) is None and not list(tmp_path.glob("*.json"))
    prof.save(cache.path_for(KEY, tmp_path))  # written by an older version, or by hand
    assert cache.load(KEY, tmp_path) is None
    prof.meta["load"]["under_load"] = False
    assert cache.save(prof, tmp_path) is not None and cache.load(KEY, tmp_path) is not None


def test_order_helpers():
    times = [0.10, 0.145, 0.099, 0.15]  # the start-up profile on the 2-core host: B=4 read above B=8
    assert out_of_order(times, 0.1) == [1] and out_of_order(times, 0.5) == []
    assert worst_dip(times) == pytest.approx(1 - 0.099 / 0.145)
    assert monotone_envelope(times) == [0.099, 0.099, 0.099, 0.15]
    assert worst_dip([1.0, 2.0, 3.0]) == 0.0 and monotone_envelope([1.0, 2.0]) == [1.0, 2.0]
