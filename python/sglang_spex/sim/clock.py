"""Virtual time for asyncio: an event loop whose clock jumps to the next timer instead of sleeping.

``asyncio.sleep``, ``wait_for`` timeouts and ``loop.call_later`` all run on ``loop.time()``, so code
written for a real engine (the search, SPEX's runner) runs unchanged; a simulated run that spans hours of
engine time finishes in the wall time its Python work takes, and — with no real I/O — deterministically.

Work handed to threads (``asyncio.to_thread``, e.g. ETS's ILP solve) takes zero virtual time: the loop runs it
inline when it is handed over, so a run does not depend on how fast a thread finishes (deterministic given the
seed).
"""

from __future__ import annotations

import asyncio
import math
import selectors
from typing import Any, Awaitable, Callable, Optional, TypeVar

T = TypeVar("T")
DEADLOCK_WALL_S = 120.0  # real seconds to wait with no timer, no ready task and no thread before giving up


class SimulationDeadlock(RuntimeError):
    """Nothing can ever run again: every task waits on something no timer or thread will set."""


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.loop: Optional["VirtualTimeLoop"] = None

    def select(self, timeout: Optional[float] = None):
        ready = super().select(0)
        if ready or timeout == 0 or self.loop is None:
            return ready
        if timeout is None:  # no timer at all: only real I/O could wake us
            ready = super().select(DEADLOCK_WALL_S)
            if not ready:
                raise SimulationDeadlock("no timers, no threads and no I/O: the simulation cannot progress")
            return ready
        self.loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop on a virtual clock starting at ``start``."""

    def __init__(self, start: float = 0.0):
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = float(start)

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self._now += seconds

    def call_at(
        self, when: float, callback: Callable[..., Any], *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        """Schedule ``callback`` at virtual time ``when``; a non-finite time (``sleep(inf)``, NaN) is a ValueError:
        the clock would jump to it forever instead of finding the deadlock."""
        if not math.isfinite(when):
            raise ValueError(f"VirtualTimeLoop: a timer at a non-finite time ({when}) would never fire")
        return super().call_at(when, callback, *args, context=context)

    def run_in_executor(self, executor, func, *args) -> "asyncio.Future[Any]":
        """Run ``func`` here, now, and return its finished future: work handed to a thread takes no virtual time,
        and nothing else at the same virtual instant runs before it, whatever the thread's real speed."""
        fut = self.create_future()
        try:
            fut.set_result(func(*args))
        except Exception as e:  # the awaiting task sees it, as from a thread
            fut.set_exception(e)
        return fut


def run_virtual(main: Callable[[], Awaitable[T]], start: float = 0.0) -> T:
    """Run ``main()`` to completion on a fresh :class:`VirtualTimeLoop` and close it."""
    loop = VirtualTimeLoop(start)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main())
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def now() -> float:
    """The running loop's clock (virtual under :func:`run_virtual`, monotonic otherwise)."""
    return asyncio.get_running_loop().time()
