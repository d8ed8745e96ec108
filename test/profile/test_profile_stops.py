"""A roofline sweep stops when the server shuts down: SGLang's SIGTERM drain waits for every request, so a batch
in flight is aborted and no further batch starts (a sweep up to batch 512 held a server for minutes)."""

from __future__ import annotations

import asyncio
import time

import pytest

from sglang_spex.profile import measure
from sglang_spex.tot.engine import EnginePort, GenResult


class ShuttingDownPort(EnginePort):
    """Requests run until aborted; the server starts shutting down ``after_s`` into the first batch."""

    def __init__(self, after_s: float):
        self.after_s, self.t0 = after_s, time.monotonic()
        self.aborted, self.submitted = [], 0
        self._abort = asyncio.Event()

    def stopping(self) -> bool:
        return time.monotonic() - self.t0 > self.after_s

    async def generate(self, req):
        self.submitted += 1
        await self._abort.wait()
        return GenResult(rid=req.rid, text="", output_ids=[], finish_reason="abort")

    async def abort(self, rid_or_prefix: str) -> None:
        self.aborted.append(rid_or_prefix)
        self._abort.set()


def test_a_batch_in_flight_is_aborted_and_the_sweep_stops(monkeypatch):
    monkeypatch.setattr(measure, "STOP_POLL_S", 0.05)

    async def main():
        port = ShuttingDownPort(after_s=0.2)
        t0 = time.monotonic()
        with pytest.raises(measure.ProfileStopped):
            await measure.measure_profile(port, {"flags": {}}, measure.ProfileSpec(batch_sizes=(1, 2)), progress=False)
        return port, time.monotonic() - t0

    port, took = asyncio.run(main())
    assert took < 5 and port.submitted == 1  # the warm-up request only: no batch started after the shutdown
    assert port.aborted and all(p.startswith(measure.PROFILE_RID_PREFIX) for p in port.aborted)


def test_no_batch_starts_once_the_server_is_stopping():
    async def main():
        port = ShuttingDownPort(after_s=-1.0)
        with pytest.raises(measure.ProfileStopped):
            await measure._batch_wall(port, ["a", "b"], 4)
        return port

    assert asyncio.run(main()).submitted == 0
