"""A roofline sweep stops when the server shuts down: SGLang's SIGTERM drain waits for every request, so a batch
in flight is aborted and no further batch starts (a sweep up to batch 512 held a server for minutes)."""

from __future__ import annotations

import asyncio
import time

import pytest
from fake_engine import HeldPort

from sglang_spex.profile import measure


def test_a_batch_in_flight_is_aborted_and_the_sweep_stops(monkeypatch):
    monkeypatch.setattr(measure, "STOP_POLL_S", 0.05)

    async def main():
        port = HeldPort(stop_after_s=0.2)  # the server starts shutting down 0.2 s into the first batch
        t0 = time.monotonic()
        with pytest.raises(measure.ProfileStopped):
            await measure.measure_profile(port, {"flags": {}}, measure.ProfileSpec(batch_sizes=(1, 2)), progress=False)
        return port, time.monotonic() - t0

    port, took = asyncio.run(main())
    assert took < 5 and port.submitted == 1  # the warm-up request only: no batch started after the shutdown
    assert port.aborted and all(p.startswith(measure.PROFILE_RID_PREFIX) for p in port.aborted)


def test_no_batch_starts_once_the_server_is_stopping():
    async def main():
        port = HeldPort(stop_after_s=-1.0)
        with pytest.raises(measure.ProfileStopped):
            await measure._batch_wall(port, ["a", "b"], 4)
        return port

    assert asyncio.run(main()).submitted == 0
