"""A drifted roofline profile is re-measured only once the engine is quiet, never under live searches or other
requests (no server)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from sglang_spex.config import SpexConfig
from sglang_spex.profile import manager, measure
from sglang_spex.profile.cache import Profile
from sglang_spex.profile.drift import DriftMonitor
from sglang_spex.srt.http_state import SpexHttpState

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


def test_server_side_searches_keep_the_engine_from_being_quiet_in_every_mode():
    """The HTTP state wires ``in_use`` when it makes the manager, with or without ``--tot-speculation`` and whatever
    ``--tot-k-total`` says (a ``POST /spex/profile`` under traffic makes a re-profile due in any mode)."""
    tm = SimpleNamespace(server_args={"model_path": "never-cached-test-model"}, rid_to_state={})
    for cfg in (SpexConfig(), SpexConfig(enabled=True, k_total=8), SpexConfig(enabled=True, k_total=None)):
        state = SpexHttpState(cfg, lambda: SimpleNamespace(tokenizer_manager=tm))
        counts = {"running": 0, "queued": 0}
        state.searches.counts = lambda: counts
        mgr = state.profile
        assert not mgr.in_use()
        counts["queued"] = 1
        assert mgr.in_use()


def test_a_clean_measurement_answers_a_due_reprofile(monkeypatch):
    """A ``POST /spex/profile`` that measures a clean profile while a re-profile is due clears it (else the watch
    would sweep again for nothing)."""
    calls = []

    async def go():
        mgr = drifted_manager(monkeypatch, calls)
        await mgr.get(force=True)
        await asyncio.sleep(0)
        return mgr

    mgr = asyncio.run(go())
    assert calls == [True] and not mgr.due and mgr.status()["reprofile_due"] is False


def test_each_yield_doubles_the_quiet_spell_and_a_completed_measurement_resets_it(monkeypatch):
    calls, outcomes = [], [measure.ProfileYielded("1 other request(s) in flight"), None]

    async def ensure(port, key, spec=None, force=False, progress=True, **kw):
        calls.append(force)
        if outcomes and outcomes[0] is not None:
            raise outcomes.pop(0)
        return PROFILE

    async def go():
        mgr = drifted_manager(monkeypatch, [])
        monkeypatch.setattr(measure, "ensure_profile", ensure)
        assert mgr.quiet_needed_s() == manager.QUIET_S
        assert mgr.reprofile_if_due()
        try:
            await mgr._task
        except measure.ProfileYielded:
            pass
        assert mgr.due and mgr.quiet_needed_s() == 2 * manager.QUIET_S
        assert mgr._quiet_watch is not None and not mgr._quiet_watch.done()  # armed again: it restarts later
        mgr._yields = 30
        assert mgr.quiet_needed_s() == manager.QUIET_MAX_S
        outcomes.pop(0)
        assert mgr.reprofile_if_due()
        await mgr._task
        return mgr

    mgr = asyncio.run(go())
    assert not mgr.due and mgr.quiet_needed_s() == manager.QUIET_S


def test_the_watch_ends_when_the_server_stops(monkeypatch):
    monkeypatch.setattr(manager, "QUIET_POLL_S", 0.01)
    monkeypatch.setattr(manager, "QUIET_S", 0.02)
    port = CountingPort()
    port.stopping = lambda: True

    async def go():
        mgr = drifted_manager(monkeypatch, [])
        mgr.port = port
        await asyncio.wait_for(mgr._quiet_watch, 1.0)  # ended on its own
        return mgr

    mgr = asyncio.run(go())
    assert mgr.due and mgr.reprofiles == 0  # nothing started during the shutdown


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
