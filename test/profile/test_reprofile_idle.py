"""A drifted roofline profile is re-measured only once the engine is quiet, never under live searches or other\nrequests (no server)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from sglang_spex.config import SpexConfig
from sglang_spex.profile import manager, measure
from sglang_spex.profile.cache import Profile
from sglang_spex.profile.drift import DriftMonitor
from sglang_spex.srt.spex_wiring import SpexWiring

PROFILE = Profile.from_points({"model": "m"}, [1, 2, 4, 8], [0.010, 0.011, 0.012, 0.014], context_len=10)


def drifted_manager(monkeypatch, calls):
    async def fake_ensure(port, key, spec=None, force=False, progress=True, **kw):
        calls.append(force)
        return PROFILE

    monkeypatch.setattr(measure, "ensure_profile", fake_ensure)
    mgr = manager.ProfileManager(port=None, key={"model": "never-cached-test-model"})
    mgr.profile, mgr.monitor = PROFILE, DriftMonitor(PROFILE.predict, 0.2)
    became = [mgr.observe(4, PROFILE.predict(4) * 1.5) for _ in range(10)]
    assert became.count(True) == 1 and mgr.due
    return mgr


def test_drift_within_the_cooldown_after_a_measurement_makes_nothing_due(monkeypatch):
    """A re-profile measured ``cooldown_s`` ago or less is not made due again by drift; past it, drift counts."""
    now = [1000.0]
    monkeypatch.setattr(manager, "time", SimpleNamespace(monotonic=lambda: now[0]))
    mgr = manager.ProfileManager(port=None, key={"model": "never-cached-test-model"}, cooldown_s=300.0)
    mgr.profile, mgr.monitor, mgr._last_measure = PROFILE, DriftMonitor(PROFILE.predict, 0.2), 900.0
    assert not any(mgr.observe(4, PROFILE.predict(4) * 1.5) for _ in range(10)) and not mgr.due
    now[0] = 1201.0  # 301 s after the measurement
    assert any(mgr.observe(4, PROFILE.predict(4) * 1.5) for _ in range(10)) and mgr.due


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


class CountingPort:
    """Answers ``stats()`` with ``inflight`` requests (the in-process port's count)."""

    def __init__(self):
        self.inflight = 0

    async def stats(self):
        return {"inflight": self.inflight}


def test_a_due_reprofile_starts_once_the_engine_is_quiet(monkeypatch):
    """Not while a search is live (between its requests nothing may be in flight), not while other requests are in
    flight (plain ``/generate`` traffic, client-side searches): only after ``QUIET_S`` of neither."""
    monkeypatch.setattr(manager, "QUIET_POLL_S", 0.01)
    monkeypatch.setattr(manager, "QUIET_S", 0.1)
    calls, port, live = [], CountingPort(), [object()]

    async def go():
        mgr = drifted_manager(monkeypatch, calls)
        mgr.port, mgr.in_use = port, lambda: bool(live)
        await asyncio.sleep(0.3)
        assert mgr.due and not calls  # a live search
        live.clear()
        port.inflight = 3
        await asyncio.sleep(0.3)
        assert mgr.due and not calls  # requests in flight
        port.inflight = 0
        await asyncio.sleep(0.06)
        port.inflight = 1  # a request before the quiet spell was long enough
        await asyncio.sleep(0.03)
        port.inflight = 0
        await asyncio.sleep(0.06)
        assert mgr.due and not calls  # the spell started again
        for _ in range(100):
            await asyncio.sleep(0.01)
            if calls:
                break
        await mgr._task
        assert not mgr.due and calls == [True] and mgr.reprofiles == 1

    asyncio.run(go())


def test_live_searches_keep_the_engine_from_being_quiet(monkeypatch):
    """``SpexWiring`` tells the profile manager about its live searches before the first profile is measured."""
    calls = []

    async def go():
        mgr = drifted_manager(monkeypatch, calls)
        wiring = SpexWiring(SpexConfig(enabled=True, k_total=None), lambda: mgr)
        await wiring._resolve_k_total()
        assert wiring.budget.k_total == PROFILE.k_total and not mgr.in_use()
        wiring.budget.contexts[object()] = None
        assert mgr.in_use()

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
    mgr = manager.ProfileManager(port=None, key={"model": "never-cached-test-model"})
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
