"""Back-pressure from SGLang's request queue (``--max-queued-requests N``): its refusals are not node failures.

SGLang refuses a request with 503 "The request queue is full." when ``N`` requests wait (and, under priority
scheduling, evicts a waiting lower-priority one with 503 "The request is aborted by a higher priority request."). A
search's own fan-out (a width-``w`` expansion plus its speculative requests) reaches the scheduler in one burst, so
it alone can overflow a small queue. The rules, per engine port (every search of a server shares one
:class:`QueueGate`):

- a *primary* request refused for load is sent again after each wait of ``QUEUE_FULL_BACKOFF_S`` in turn (with
  jitter, so searches refused together do not return together); one still refused after the last wait fails its
  node with :class:`QueueFull` (a clear error, not SGLang's bare 503). This is the one place a refusal is sent
  again, for both ports: the in-process port raises SGLang's ``HTTPException``,
  :class:`~sglang_spex.tot.http_port.HttpPort` its ``WorkerBusy``; neither retries on its own;
- a *speculative* request refused for load is a miss: dropped, neither retried nor a failure (SPEX's runner);
- no speculative request is issued while a primary of the port waits to be sent again, nor for ``SPEC_HOLD_S``
  after any refusal: the queue was at its cap, and speculation must not take the places primaries (or other
  clients' requests) need. Without a cap (``max_queued_requests`` None in the server's args) SGLang never
  refuses for a full queue and the gate stays open.

Speculative requests already waiting take no place from later arrivals: under the launcher's priority scheduling
SGLang evicts the least preferred waiting request (a speculative one, ``spec_priority``) for an arriving primary or
another client's request instead of refusing it; the evicted one is a miss.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Callable, Optional

from sglang_spex.tot.engine import EnginePort, GenRequest, GenResult

logger = logging.getLogger(__name__)

QUEUE_FULL_STATUS = 503  # SGLang's status for a request its full queue refused (or a higher priority one evicted)
# The waits before each new try of a refused primary (about 30 s in all, then its node fails): the queue drains
# at the scheduler's pace, a step or a few, so the first waits are short; the later ones ride out a busy spell.
QUEUE_FULL_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 6.0, 8.0, 8.0)
BACKOFF_JITTER = 0.5  # each wait is drawn from [1 - BACKOFF_JITTER, 1] x its value
SPEC_HOLD_S = 1.0  # after a refusal, how long no speculative request is issued (the queue was at its cap)


class QueueFull(RuntimeError):
    """A primary request SGLang's full queue still refused after every back-off: its node fails."""


# What SGLang's 503s for load say (scheduler.py, schedule_batch.py): its queue is full, a higher priority request
# took the place, or a running request was retracted under memory pressure ("Retry later."). Its other 503s are not
# load and are not sent again: a waiting or running timeout, "Using priority is disabled for this server".
LOAD_MESSAGES = ("queue is full", "higher priority", "retry later")


def refused_for_load(exc: BaseException) -> bool:
    """``exc`` is an engine's refusal for load (a 503 saying one of ``LOAD_MESSAGES``), in-process
    (``HTTPException.status_code``) or over HTTP (the response's)."""
    status = getattr(exc, "status_code", None)
    if status is None:
        status = getattr(getattr(exc, "response", None), "status_code", None)
    said = str(getattr(exc, "detail", "") or exc).lower()
    return status == QUEUE_FULL_STATUS and any(m in said for m in LOAD_MESSAGES)


def queue_cap(port: EnginePort) -> Optional[int]:
    """SGLang's ``--max-queued-requests`` for the in-process port (its TokenizerManager's server args); None where
    there is no cap or the port cannot say (HttpPort, the simulator)."""
    args = getattr(getattr(port, "tm", None), "server_args", None)
    cap = getattr(args, "max_queued_requests", None)
    return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None


class QueueGate:
    """One engine port's back-pressure state: primaries waiting to be sent again, and the last refusal."""

    def __init__(self, capped: bool = True, clock: Callable[[], float] = time.monotonic):
        self.capped = capped  # False: SGLang has no queue cap (the gate stays open)
        self.clock = clock
        self.backing_off = 0  # primaries waiting to be sent again
        self.refused_at: Optional[float] = None
        self.rng = random.Random()  # the jitter (not any search's random stream)

    def note_refused(self) -> None:
        """A request of the port was refused for load (the queue is at its cap)."""
        self.refused_at = self.clock()

    def spec_ok(self) -> bool:
        """Whether a speculative request may be issued now (no primary waits to get in, no recent refusal)."""
        if not self.capped:
            return True
        if self.backing_off:
            return False
        return self.refused_at is None or self.clock() - self.refused_at >= SPEC_HOLD_S

    async def generate_primary(
        self,
        port: EnginePort,
        req: GenRequest,
        cancelled: Callable[[], bool] = lambda: False,
        waiting: Optional[Callable[[bool], None]] = None,
    ) -> GenResult:
        """``port.generate(req)``, sent again after each back-off while the engine refuses it for load; raises
        :class:`QueueFull` when it is refused after the last. ``cancelled()`` is asked after each wait (True: the
        request is not sent again and returns aborted); ``waiting(True)``/``waiting(False)`` bracket each wait
        (nothing of the request is in the engine meanwhile)."""
        for wait_s in (*QUEUE_FULL_BACKOFF_S, None):
            try:
                return await port.generate(req)
            except Exception as e:
                if not refused_for_load(e):
                    raise
                self.note_refused()
                if wait_s is None:
                    raise QueueFull(
                        f"the engine's request queue stayed full: refused {len(QUEUE_FULL_BACKOFF_S) + 1} times, "
                        f"backing off up to {sum(QUEUE_FULL_BACKOFF_S):g} s in all ({getattr(e, 'detail', e)})"
                    ) from e
            logger.info("%s refused (queue full): sent again in %.1fs", req.rid, wait_s)
            await self._wait(wait_s, waiting)
            if cancelled():
                break
        return GenResult(rid=req.rid, text="", output_ids=[], finish_reason="abort")

    async def _wait(self, wait_s: float, waiting: Optional[Callable[[bool], None]]) -> None:
        self.backing_off += 1
        if waiting is not None:
            waiting(True)
        try:
            await asyncio.sleep(wait_s * self.rng.uniform(1.0 - BACKOFF_JITTER, 1.0))
        finally:
            self.backing_off -= 1
            if waiting is not None:
                waiting(False)


GATE_ATTR = "queue_gate"  # where a port keeps its QueueGate


def gate_for(port: EnginePort) -> QueueGate:
    """The port's :class:`QueueGate`, kept on the port (one per port, so every search on a server shares it)."""
    gate = getattr(port, GATE_ATTR, None)
    if gate is None:
        in_process = getattr(port, "tm", None) is not None
        gate = QueueGate(capped=queue_cap(port) is not None or not in_process)
        setattr(port, GATE_ATTR, gate)
    return gate
