"""A background re-profile yields to traffic (first-hour review: a re-profile that started in a quiet spell kept
sweeping batches of 16-32 while a new search's request waited in the queue for minutes): the first other request
seen stops the sweep -- between batches, or during one (its requests aborted) -- the profile in use stays, nothing is
cached, and the re-profile stays due for the next quiet spell (fake engines, no server)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from fake_engine import Engine, HeldPort

from sglang_spex.profile import cache, manager, measure
from sglang_spex.profile.cache import Profile
from sglang_spex.profile.manager import ProfileManager
from sglang_spex.profile.measure import ProfileSpec, ProfileYielded, measure_profile

KEY = {"model": "m", "hardware": "h", "flags": {}}
SPEC = ProfileSpec(
    batch_sizes=(1, 2, 4, 8, 16), short_tokens=2, long_tokens=6, ctx_prefix_words=0, prefill_words=0, max_batch=16
)
IN_USE = Profile.from_points(KEY, [1, 2, 4, 8], [0.010, 0.011, 0.012, 0.014], context_len=10)


def _engine(clock, from_wall: int) -> Engine:
    """Another request is in flight from the profile's ``from_wall``-th wall on."""
    return Engine(clock, others=lambda wall: ["search-req"] if wall >= from_wall else [])


def test_a_yielding_sweep_stops_at_the_first_other_request(clock):
    engine = _engine(clock, from_wall=4)
    with pytest.raises(ProfileYielded, match="1 other request"):
        asyncio.run(measure_profile(engine, KEY, SPEC, progress=False, yields=True))
    assert engine.walls == 4  # old: every batch measured under load (and the profile marked so)
    measured = asyncio.run(measure_profile(_engine(clock, from_wall=4), KEY, SPEC, progress=False))
    assert measured.measured_under_load  # a sweep that does not yield still measures, as before


def test_a_reprofile_that_yields_keeps_the_profile_and_stays_due(clock, caplog):
    async def go() -> ProfileManager:
        mgr = ProfileManager(_engine(clock, from_wall=3), KEY, spec=SPEC)
        mgr.profile, mgr.due = IN_USE, True
        assert mgr.reprofile_if_due()
        with pytest.raises(ProfileYielded):
            await mgr._task
        await asyncio.sleep(0)
        return mgr

    with caplog.at_level(logging.INFO, logger=manager.__name__):
        mgr = asyncio.run(go())
    assert mgr.profile is IN_USE and mgr.due and mgr.last_error is None and not mgr.measuring
    assert cache.load(KEY) is None  # nothing measured under the traffic is cached
    assert any("stays due" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)


def test_a_request_arriving_during_a_batch_aborts_it(monkeypatch):
    monkeypatch.setattr(measure, "STOP_POLL_S", 0.01)

    async def go(yields: bool) -> HeldPort:
        port = HeldPort()
        watch = measure._LoadWatch(port, yields)
        batch = asyncio.ensure_future(measure._batch_wall(port, ["a", "b"], 32, watch))
        await asyncio.sleep(0.05)
        port.arrive.set()
        if yields:
            with pytest.raises(ProfileYielded):
                await asyncio.wait_for(batch, 5)
        else:
            await asyncio.sleep(0.2)
            assert not batch.done() and not port.aborted  # a sweep that does not yield keeps its batch running
            batch.cancel()
        return port

    port = asyncio.run(go(True))
    assert len(port.aborted) == 1 and port.aborted[0].startswith(measure.PROFILE_RID_PREFIX)
    asyncio.run(go(False))


def test_a_post_that_joined_a_yielding_reprofile_gets_the_profile_in_use(clock):
    """The diff review: a ``POST /spex/profile`` joining a background re-profile got its ``ProfileYielded`` (a 500)."""

    async def go():
        mgr = ProfileManager(_engine(clock, from_wall=3), KEY, spec=SPEC)
        mgr.profile, mgr.due = IN_USE, True
        assert mgr.reprofile_if_due()
        joined = await mgr.get(join=True)  # as the route's POST without settings
        return mgr, joined

    mgr, joined = asyncio.run(go())
    assert joined is IN_USE and mgr.due
