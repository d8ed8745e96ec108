"""Review 39 of the roofline profile: each wall's fastest repeat counts, the cache key's flags, ordered batch sizes,
no caching of a request's own sweep, one measurement at a time, failures that are reported, malformed cache files
and the temp file of a failed write (fake engine in virtual time, fake tokenizer manager; no server)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from types import SimpleNamespace
from typing import Any, Dict, List

import httpx
import pytest
from fake_engine import Engine
from fastapi import FastAPI

from sglang_spex.profile import cache, manager, measure, routes
from sglang_spex.profile.cache import Profile
from sglang_spex.profile.drift import DriftMonitor
from sglang_spex.profile.manager import ProfileManager
from sglang_spex.profile.measure import ProfileSpec, ensure_profile, measure_profile
from sglang_spex.tot.validation import FieldError

KEY = {"model": "m", "hardware": "h", "flags": {}}
STEP = lambda b: 0.010 + 0.002 * b  # noqa: E731  (a line a + bB: its knee is a/b = 5)
TRUE_TIMES = [STEP(b) for b in (1, 2, 4, 8, 16)]
SPEC = ProfileSpec(
    batch_sizes=(1, 2, 4, 8, 16), short_tokens=2, long_tokens=6, ctx_prefix_words=0, prefill_words=0, max_batch=16
)
SMALL = {"short_tokens": 2, "long_tokens": 6, "ctx_prefix_words": 0, "prefill_words": 0, "repeats": 1}


# --- finding 1: a slowed short wall reads too fast ---------------------------------------------------------


@pytest.mark.parametrize("factor", [1.8, 2.5])
@pytest.mark.parametrize("wall", [(16, 2, 1), (16, 2, 2), (16, 6, 2)], ids=["short-first", "short-last", "long-last"])
def test_one_slowed_wall_moves_neither_the_step_time_nor_the_knee(clock, factor, wall):
    # one repeat's wall at B=16 is slowed (a slowed short wall read (long - short) too fast, the knee went to 16):
    # each wall's fastest repeat counts, whichever repeat was slowed
    engine = Engine(clock, step=STEP, slow=lambda b, tokens, n: factor if (b, tokens, n) == wall else 1.0)
    prof = asyncio.run(ensure_profile(engine, KEY, SPEC, progress=False))
    assert prof.step_times == pytest.approx(TRUE_TIMES)
    assert prof.k_total == 5 and not prof.measured_under_load
    assert cache.load(KEY).k_total == 5


def test_a_remeasurement_adds_its_walls_to_the_earlier_ones(clock):
    """B=4's first two long walls are slowed (+60 %: it reads above B=8, so it is measured again), and the
    re-measurement's first short wall is slowed (x1.5). Its own walls alone read too fast; with the earlier ones
    each wall's fastest is clean."""

    def slow(b, tokens, n):
        if b == 4 and tokens == 6 and n <= 2:
            return 1.6
        return 1.5 if (b, tokens, n) == (4, 2, 3) else 1.0

    spec = ProfileSpec(**{**SPEC.__dict__, "batch_sizes": (1, 2, 4, 8), "max_batch": 8})
    prof = asyncio.run(measure_profile(Engine(clock, step=STEP, slow=slow), KEY, spec, False))
    assert prof.meta["load"]["remeasured"] == [4]
    assert prof.step_times == pytest.approx(TRUE_TIMES[:4])


# --- finding 2: the cache key ------------------------------------------------------------------------------

NEW_FLAGS: Dict[str, Any] = {
    "revision": "v2",
    "pp_size": 2,
    "attn_dp_size": 2,
    "disable_decode_cuda_graph": True,
    "cuda_graph_backend_decode": "breakable",
    "cuda_graph_max_bs_decode": 8,
    "cuda_graph_bs_decode": [1, 2, 4],
    "enable_torch_compile": True,
    "torch_compile_max_bs": 8,
    "max_total_tokens": 4096,
    "mem_fraction_static": 0.2,
    "page_size": 64,
    "speculative_algorithm": "EAGLE3",
    "speculative_draft_model_path": "/d",
    "speculative_draft_model_revision": "v2",
    "speculative_num_steps": 5,
    "speculative_eagle_topk": 4,
    "speculative_num_draft_tokens": 8,
}
BASE_ARGS = {"model_path": "/m/SmolLM2", "device": "cpu", "dtype": "bfloat16", "attention_backend": "spex_cpu"}


@pytest.mark.parametrize("flag", sorted(NEW_FLAGS))
def test_a_step_time_flag_gets_its_own_cache_file(flag):
    base = measure.profile_key(BASE_ARGS, device="h")
    changed = measure.profile_key({**BASE_ARGS, flag: NEW_FLAGS[flag]}, device="h")
    assert cache.path_for(changed) != cache.path_for(base)


def test_flags_are_read_from_server_args_and_a_tuple_flag_still_hits_the_cache(tmp_path):
    args = SimpleNamespace(**{**BASE_ARGS, "cuda_graph_bs_decode": (1, 2, 4), "speculative_algorithm": "NGRAM"})
    key = measure.profile_key(measure.server_args_dict(args), device="h")
    assert key["flags"]["speculative_algorithm"] == "NGRAM" and key["flags"]["cuda_graph_bs_decode"] == [1, 2, 4]
    prof = Profile.from_points(key, [1, 2, 4, 8], [0.010, 0.011, 0.013, 0.017], context_len=10)
    cache.save(prof, tmp_path)
    assert cache.load(key, tmp_path) is not None  # the key read back from JSON equals the fresh one


# --- the route (findings 3, 4, 5, 9) -----------------------------------------------------------------------


def _app(mgr: ProfileManager) -> FastAPI:
    app = FastAPI()
    state = SimpleNamespace(
        profile=mgr,
        tokenizer_manager=SimpleNamespace(context_len=2048, tokenizer=None),
        cfg=SimpleNamespace(enabled=False, k_total=1, max_body_bytes=1 << 20),
    )
    app.state.spex = state
    routes.install(app, state)
    return app


def _post_all(mgr: ProfileManager, bodies: List[Dict[str, Any]], together: bool = False) -> List[httpx.Response]:
    async def go():
        transport = httpx.ASGITransport(app=_app(mgr))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            if together:
                return list(await asyncio.gather(*(client.post("/spex/profile", json=b) for b in bodies)))
            return [await client.post("/spex/profile", json=b) for b in bodies]

    return asyncio.run(go())


def _manager(clock) -> ProfileManager:
    return ProfileManager(Engine(clock, step=STEP), KEY, ProfileSpec(ctx_prefix_words=0, prefill_words=0, max_batch=16))


@pytest.mark.parametrize("sizes, field", [([16, 8, 4, 2, 1], "batch_sizes[1]"), ([1, 2, 2, 4], "batch_sizes[2]")])
def test_batch_sizes_out_of_order_are_refused_and_nothing_changes(clock, sizes, field):
    mgr = _manager(clock)
    spec_before = mgr.spec
    (r,) = _post_all(mgr, [{**SMALL, "batch_sizes": sizes}])
    assert r.status_code == 400 and r.json()["error"]["field"] == field
    assert mgr.port.walls == 0  # nothing measured
    assert mgr.spec is spec_before and mgr.profile is None


def test_measure_profile_refuses_batch_sizes_out_of_order(clock):
    with pytest.raises(FieldError) as e:
        asyncio.run(measure_profile(Engine(clock), KEY, ProfileSpec(batch_sizes=(4, 2)), False))
    assert e.value.field == "batch_sizes[1]"


def test_a_requests_own_sweep_serves_this_server_but_is_not_cached(clock):
    mgr = _manager(clock)
    (r,) = _post_all(mgr, [{**SMALL, "batch_sizes": [1, 2]}])
    assert r.status_code == 200 and r.json()["k_total"] == 2 and mgr.k_total == 2  # in use here
    assert cache.load(KEY) is None and not list(cache.CACHE_DIR.glob("*.json"))
    assert ProfileManager(Engine(clock), KEY).k_total is None  # a later start measures its own sweep


def test_the_managers_own_sweep_is_cached(clock):
    mgr = _manager(clock)
    (r,) = _post_all(mgr, [{}])
    assert r.status_code == 200 and r.json()["k_total"] == 5
    assert cache.load(KEY).k_total == 5


def test_concurrent_posts_join_one_sweep(clock):
    mgr = _manager(clock)
    one = _manager(clock)
    _post_all(one, [{}])  # one sweep alone, for its number of walls
    rs = _post_all(mgr, [{}] * 5, together=True)
    assert [r.status_code for r in rs] == [200] * 5
    assert len({r.json()["created_at"] for r in rs}) == 1  # one profile: the sweep they all joined
    assert mgr.port.walls == one.port.walls


def test_a_post_with_settings_while_a_sweep_runs_gets_409_and_changes_nothing(clock):
    mgr = _manager(clock)
    first, second = _post_all(mgr, [{}, {**SMALL, "batch_sizes": [1, 4]}], together=True)
    assert first.status_code == 200 and second.status_code == 409
    assert second.json()["error"]["field"] == "profile" and int(second.headers["Retry-After"]) >= 1
    assert mgr.spec == _manager(clock).spec and mgr.profile.batch_sizes == [1, 2, 4, 8, 16, 32]  # its own sweep


def test_a_post_joins_a_pending_reprofile(clock):
    mgr = _manager(clock)
    one = _manager(clock)
    _post_all(one, [{}])

    async def go():
        mgr.due = True
        assert mgr.reprofile_if_due()  # started, not yet run
        transport = httpx.ASGITransport(app=_app(mgr))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post("/spex/profile", json={})
        return r, await mgr._task

    r, prof = asyncio.run(go())
    assert r.status_code == 200 and r.json()["created_at"] == prof.created_at
    assert mgr.port.walls == one.port.walls  # the re-profile's sweep only


def test_calls_that_join_a_failed_measurement_get_its_error(monkeypatch):
    calls = []

    async def failing_ensure(*a, **kw):
        calls.append(1)
        await asyncio.sleep(0.01)
        raise RuntimeError("profile request stopped early (3 != 20 tokens)")

    monkeypatch.setattr(measure, "ensure_profile", failing_ensure)

    async def go():
        mgr = ProfileManager(port=None, key={"model": "never-cached-test-model"})
        return await asyncio.gather(*(mgr.get(force=True, join=True) for _ in range(3)), return_exceptions=True)

    errors = asyncio.run(go())
    assert len(calls) == 1 and all(isinstance(e, RuntimeError) and "stopped early" in str(e) for e in errors)


def test_settings_with_force_false_are_measured_and_returned(clock):
    mgr = _manager(clock)
    first, second = _post_all(mgr, [{}, {**SMALL, "batch_sizes": [1, 4], "force": False}])
    assert first.status_code == 200 and second.status_code == 200
    assert second.json()["batch_sizes"] == [1, 4] and second.json()["created_at"] != first.json()["created_at"]
    assert mgr.spec.batch_sizes == (1, 4) and mgr.profile.batch_sizes == [1, 4]


# --- findings 6, 7: failures are reported ------------------------------------------------------------------


def _measure_on_with(get, caplog) -> List[logging.LogRecord]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        with caplog.at_level(logging.INFO, logger=routes.logger.name):
            routes._measure_on(loop, SimpleNamespace(profile=SimpleNamespace(get=get)))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    return [r for r in caplog.records if r.name == routes.logger.name]


def test_a_failed_auto_profile_is_logged_as_a_failure(caplog):
    async def failing_get(force=False):
        raise RuntimeError("profile: fewer than two batch sizes up to the sweep's limit 512 gave a step time")

    (rec,) = _measure_on_with(failing_get, caplog)
    assert rec.levelno == logging.ERROR and rec.exc_info and "failed" in rec.getMessage()


def test_an_auto_profile_stopped_by_the_shutdown_is_logged_as_such(caplog):
    async def stopped_get(force=False):
        raise measure.ProfileStopped("the server is shutting down")

    (rec,) = _measure_on_with(stopped_get, caplog)
    assert rec.levelno == logging.INFO and "stopped with the server" in rec.getMessage()


def test_a_failed_reprofile_is_logged_and_in_the_status(monkeypatch, caplog):
    prof = Profile.from_points({"model": "m"}, [1, 2, 4, 8], [0.010, 0.011, 0.012, 0.014], context_len=10)

    async def failing_ensure(*a, **kw):
        raise RuntimeError("profile request stopped early (3 != 20 tokens)")

    monkeypatch.setattr(measure, "ensure_profile", failing_ensure)

    async def go():
        mgr = ProfileManager(port=None, key={"model": "never-cached-test-model"})
        mgr.profile, mgr.monitor, mgr.due = prof, DriftMonitor(prof.predict, 0.2), True
        with caplog.at_level(logging.ERROR, logger=manager.logger.name):
            assert mgr.reprofile_if_due()
            await asyncio.wait([mgr._task])
            await asyncio.sleep(0)  # the done callback
        return mgr

    mgr = asyncio.run(go())
    status = mgr.status()
    assert not status["measuring"] and "stopped early" in status["last_error"] and status["k_total"] == 8
    assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records if r.name == manager.logger.name)


# --- findings 8, 10: the cache files -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "doc",
    [
        {"points": [], "model": "m"},
        {"points": {"none": []}, "model": "m"},
        {"points": {}, "fit": [1], "model": "m"},
        [1, 2],
        {"key": KEY, "batch_sizes": [1, 2], "step_times": [0.01, 0.02], "created_at": "yesterday", "meta": []},
    ],
)
def test_a_malformed_cache_file_counts_as_missing(clock, doc):
    cache.path_for(KEY).write_text(json.dumps(doc))
    assert cache.load(KEY, max_age_s=1e12) is None and cache.latest_profile() is None
    assert ProfileManager(Engine(clock), KEY).profile is None  # /spex/stats and /spex/profile keep working


def test_a_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    prof = Profile.from_points(KEY, [1, 2, 4, 8], [0.010, 0.011, 0.013, 0.017], context_len=10)

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache.os, "replace", full)
    with pytest.raises(OSError):
        cache.save(prof, tmp_path)
    assert list(tmp_path.iterdir()) == []
