"""A drifted roofline profile is re-measured only when the engine is idle, never under live searches (no server)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from sglang_spex.config import SpexConfig
from sglang_spex.profile import measure
from sglang_spex.profile.cache import Profile
from sglang_spex.profile.drift import DriftMonitor
from sglang_spex.srt import spex_wiring
from sglang_spex.srt.spex_wiring import SpexWiring

PROFILE = Profile.from_points({"model": "m"}, [1, 2, 4, 8], [0.010, 0.011, 0.012, 0.014], context_len=10)


def drifted_manager(monkeypatch, calls):
    async def fake_ensure(port, key, spec=None, force=False, progress=True, **kw):
        calls.append(force)
        return PROFILE

    monkeypatch.setattr(measure, "ensure_profile", fake_ensure)
    mgr = measure.ProfileManager(port=None, key={"model": "never-cached-test-model"})
    mgr.profile, mgr.monitor = PROFILE, DriftMonitor(PROFILE.predict, 0.2)
    became = [mgr.observe(4, PROFILE.predict(4) * 1.5) for _ in range(10)]
    assert became.count(True) == 1 and mgr.due
    return mgr


def test_drift_makes_a_reprofile_due_but_starts_nothing(monkeypatch):
    calls = []

    async def go():
        mgr = drifted_manager(monkeypatch, calls)
        await asyncio.sleep(0)
        assert mgr.reprofiles == 0 and not calls  # nothing measured under the traffic that showed the drift
        assert mgr.reprofile_if_due() and not mgr.due
        await mgr._task
        assert calls == [True] and mgr.reprofiles == 1
        assert not mgr.reprofile_if_due()  # once

    asyncio.run(go())


def finished_search(inflight):
    async def stats():
        return {"inflight": inflight}

    return SimpleNamespace(
        extra_result=lambda: {}, num_requests=1, tokens_generated=1, dp_rank=None, port=SimpleNamespace(stats=stats)
    )


def test_the_last_search_ending_on_an_idle_engine_starts_it(monkeypatch):
    calls = []

    async def go():
        mgr = drifted_manager(monkeypatch, calls)
        wiring = SpexWiring(SpexConfig(enabled=True, k_total=None), lambda: mgr)
        other = object()
        wiring.budget.contexts[other] = None
        monkeypatch.setattr(spex_wiring, "QUIET_S", 0.05)
        quiet = 0.2
        await wiring._on_finish(finished_search(0))  # another search is still live
        await asyncio.sleep(quiet)
        assert mgr.due and not calls
        wiring.budget.contexts.pop(other, None)
        await wiring._on_finish(finished_search(3))  # no search, but requests in flight (plain /generate traffic)
        await asyncio.sleep(quiet)
        assert mgr.due and not calls
        await wiring._on_finish(finished_search(0))
        wiring._finished_at = None  # what make_context does: a search started within the quiet period
        await asyncio.sleep(quiet)
        assert mgr.due and not calls
        await wiring._on_finish(finished_search(0))  # quiet at last
        await asyncio.sleep(quiet)
        await mgr._task
        assert not mgr.due and calls == [True]

    asyncio.run(go())


def test_a_new_spec_is_kept_only_once_its_measurement_succeeded(monkeypatch):
    """``POST /spex/profile`` with settings: they are measured now; a measurement that fails leaves the old spec."""
    used = []

    async def fake_ensure(port, key, spec=None, force=False, progress=True, **kw):
        used.append(spec)
        if spec.repeats == 3:
            raise RuntimeError("profile request stopped early")
        return PROFILE

    monkeypatch.setattr(measure, "ensure_profile", fake_ensure)
    mgr = measure.ProfileManager(port=None, key={"model": "never-cached-test-model"})
    old, bad, good = mgr.spec, measure.ProfileSpec(repeats=3), measure.ProfileSpec(repeats=1)

    async def go():
        try:
            await mgr.get(force=True, spec=bad)
        except RuntimeError:
            pass
        assert mgr.spec is old and used == [bad]
        assert await mgr.get(spec=good) is PROFILE  # measured although not forced: the settings are new
        assert mgr.spec is good and used == [bad, good]

    asyncio.run(go())
