"""A fake engine in virtual time for the profiler's sweep (no server): shared by the profile tests (the ``clock``
fixture that installs its :class:`Clock` is in ``conftest.py``)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from sglang_spex.profile.measure import PROFILE_RID_PREFIX
from sglang_spex.tot.engine import EnginePort, GenResult


class Clock:
    """Stands in for the profiler's ``time`` module: time moves only when the engine says so."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


class Engine(EnginePort):
    """Concurrent requests form one batch; a step takes ``step(B)`` times ``slow(B, tokens, n)`` for the n-th wall
    of ``tokens`` new tokens at batch B. ``others``: rids of other requests in flight, per profile wall started.
    Records the largest batch it ran (``most``), the walls started and the walls per (B, tokens)."""

    def __init__(
        self,
        clock: Clock,
        step: Callable[[int], float] = lambda b: 0.010 + 0.002 * b,
        slow: Callable[[int, int, int], float] = lambda b, tokens, n: 1.0,
        others: Callable[[int], Iterable[str]] = lambda wall: (),
    ):
        self.clock, self.step, self.slow, self.others = clock, step, slow, others
        self.live, self.walls, self.most = 0, 0, 0
        self.seen: Dict[Tuple[int, int], int] = {}

    async def generate(self, req):
        start = self.clock.now
        self.live += 1
        await asyncio.sleep(0)  # every request of the gather() has joined the batch
        batch, tokens = self.live, req.max_new_tokens
        self.most = max(self.most, batch)
        if req.rid.endswith(":0"):
            self.walls += 1
            self.seen[(batch, tokens)] = self.seen.get((batch, tokens), 0) + 1
        await asyncio.sleep(0)
        factor = self.slow(batch, tokens, self.seen[(batch, tokens)])
        self.clock.now = max(self.clock.now, start + tokens * self.step(batch) * factor)
        self.live -= 1
        return GenResult(rid=req.rid, text="x", output_ids=[0] * tokens, finish_reason="length")

    def rids(self, prefix: str) -> List[str]:
        """What SGLang's TokenizerManager tracks (the in-process port's view); the profile's own are done here."""
        return [r for r in [*self.others(self.walls), f"{PROFILE_RID_PREFIX}old:0"] if r.startswith(prefix)]

    async def abort(self, rid_or_prefix):
        pass


class HeldPort(EnginePort):
    """Requests run until aborted (in real time). The server starts stopping ``stop_after_s`` after creation (None:
    never); another request shows up in :meth:`rids` once ``arrive`` is set."""

    def __init__(self, stop_after_s: Optional[float] = None):
        self.stop_after_s, self.t0 = stop_after_s, time.monotonic()
        self.aborted: List[str] = []
        self.submitted = 0
        self.arrive = asyncio.Event()
        self._abort = asyncio.Event()

    def stopping(self) -> bool:
        return self.stop_after_s is not None and time.monotonic() - self.t0 > self.stop_after_s

    def rids(self, prefix: str) -> List[str]:
        return ["search-req"] if self.arrive.is_set() else []

    async def generate(self, req) -> GenResult:
        self.submitted += 1
        await self._abort.wait()
        return GenResult(rid=req.rid, text="", output_ids=[], finish_reason="abort")

    async def abort(self, rid_or_prefix: str) -> None:
        self.aborted.append(rid_or_prefix)
        self._abort.set()
