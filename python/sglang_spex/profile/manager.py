"""The server's roofline profile over time (:class:`ProfileManager`): one measurement at a time, later callers joining
it; a re-profile becomes *due* when a profile was measured with other requests in flight, a re-profile yielded to
traffic, or step times drifted, and starts on its own once the engine has been quiet for ``QUIET_S`` (no request in
flight, no live search, polled every ``QUIET_POLL_S``; the spell doubles with each yield, up to ``QUIET_MAX_S``): its
sweep never runs under live traffic, and it yields to the first request that arrives
(:class:`~sglang_spex.profile.measure.ProfileYielded`; it stays due). A measurement that completes clean answers a
due re-profile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Dict, Optional

from sglang_spex.profile import cache, measure
from sglang_spex.profile.cache import Profile
from sglang_spex.profile.drift import DriftMonitor
from sglang_spex.profile.measure import ProfileSpec, ProfileStopped, ProfileYielded, others_in_flight
from sglang_spex.tot.engine import EnginePort

logger = logging.getLogger(__name__)

QUIET_S = 10.0  # a due re-profile starts once the engine has been quiet this long (doubled per yield)
QUIET_MAX_S = 600.0  # the longest quiet spell a due re-profile waits for, however often it yielded
QUIET_POLL_S = 1.0  # how often the quiet watch looks (a request that starts and ends between two looks is not seen)


class ProfileBusy(RuntimeError):
    """A measurement runs already, and one with other settings cannot join it (:meth:`ProfileManager.get`)."""


class ProfileManager:
    """Holds a server's current profile; re-measures in the background, once the engine is idle, when observations
    drift.

    ``SpexWiring.engine_primary`` calls :meth:`observe` with the decode step times the scheduler measured (its
    batch-stats rows' ``step_s``, at ``batch_size × dp_size``); the budget reads :attr:`k_total`. ``in_use``: True
    while the engine has work besides its requests in flight (``SpexWiring``: live searches, which wait for rewards
    between their requests); a due re-profile waits for it to be False as well. The cache under
    ``key`` gets only profiles measured with the manager's own ``spec`` (what a later start with that key measures);
    one measured with another spec (``POST /spex/profile`` settings) serves this manager only.
    """

    def __init__(
        self,
        port: EnginePort,
        key: Dict[str, Any],
        spec: Optional[ProfileSpec] = None,
        threshold: float = 0.2,
        cooldown_s: float = 300.0,
        on_update: Optional[Callable[[Profile], None]] = None,
    ):
        self.port, self.key, self.spec = port, key, spec
        self.threshold, self.cooldown_s, self.on_update = threshold, cooldown_s, on_update
        self.profile: Optional[Profile] = cache.load(key)
        self.monitor: Optional[DriftMonitor] = DriftMonitor(self.profile.predict, threshold) if self.profile else None
        self._own_spec = spec or ProfileSpec()
        self._task: Optional[asyncio.Task] = None  # the last re-profile
        self._running: Optional[asyncio.Future] = None  # the outcome of the last measurement (joined by ``get``)
        self._lock = asyncio.Lock()
        self._last_measure = 0.0
        self.reprofiles = 0
        self.due = False  # re-profile when the engine is next quiet (:meth:`_mark_due`)
        self.in_use: Callable[[], bool] = lambda: False
        self._yields = 0  # re-profiles that yielded since the last measurement that completed
        self._quiet_watch: Optional[asyncio.Task] = None
        self.last_error: Optional[str] = None  # why the last measurement failed (None once one succeeded)

    @property
    def k_total(self) -> Optional[int]:
        return self.profile.k_total if self.profile else None

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    @property
    def measuring(self) -> bool:
        """A measurement runs now, or a started re-profile is yet to run."""
        return self.busy or (self._task is not None and not self._task.done())

    async def get(
        self,
        force: bool = False,
        progress: bool = True,
        spec: Optional[ProfileSpec] = None,
        join: bool = False,
        yields: bool = False,
    ) -> Profile:
        """The profile (measured now if none, stale or ``force``). ``spec``: measure with it now instead of
        ``self.spec``, which becomes it once that measurement succeeded (a failed one leaves the spec in use).
        ``join``: while a measurement runs, answer with its outcome (profile or error) instead of measuring again
        after it; with a ``spec`` raise :class:`ProfileBusy` instead (the running one has other settings).
        ``yields``: the sweep stops at the first other request (:class:`ProfileYielded`; a re-profile stays due)."""
        if join and self.measuring:
            if spec is not None:
                raise ProfileBusy("a profile measurement is running")
            running = self._task if self._task is not None and not self._task.done() else self._running
            try:
                return await asyncio.shield(running)
            except ProfileYielded:  # a re-profile that gave way to traffic: answered as if none had run
                pass
        async with self._lock:
            if self.profile is None or force or spec is not None or self.profile.is_stale():
                self._running = asyncio.get_running_loop().create_future()
                try:
                    use = spec if spec is not None else self.spec
                    await self._measure(use, force or spec is not None, progress, yields)
                except BaseException as e:
                    _fail(self._running, e)
                    raise
                self._running.set_result(self.profile)
            return self.profile

    async def _measure(self, use: Optional[ProfileSpec], force: bool, progress: bool, yields: bool) -> None:
        """:func:`~sglang_spex.profile.measure.ensure_profile` with ``use`` (cached only when it is the manager's own
        spec), kept as the profile in use (and ``use`` as the spec) once it succeeded; a failure is kept in
        :attr:`last_error`."""
        save = (use or ProfileSpec()) == self._own_spec
        try:
            self.profile = await measure.ensure_profile(
                self.port, self.key, use, force=force, progress=progress, save=save, yields=yields
            )
        except ProfileYielded:
            self._yields += 1  # each yield doubles the quiet spell the next start waits for
            self._mark_due()  # measured at a later quiet spell instead
            raise
        except Exception as e:
            self.last_error = f"{type(e).__name__}: {e}"
            raise
        self.spec, self.last_error = use, None
        self._last_measure = time.monotonic()
        self.due, self._yields = False, 0  # a clean measurement answers a due re-profile
        if "requests in flight" in self.profile.load_why:  # measure again once the engine is quiet
            self._mark_due()
        self.monitor = DriftMonitor(self.profile.predict, self.threshold)
        if self.on_update:
            self.on_update(self.profile)

    def observe(self, batch: int, step_time: float) -> bool:
        """Feed one observed step time; on drift (past the cooldown) a re-profile becomes *due*. It runs when the
        engine is next quiet (:meth:`_mark_due`), never under live traffic: its sweep fills the batch up to the knee,
        which would stall live requests for minutes and change their batch shapes. True when one became due."""
        if self.monitor is None or not self.monitor.observe(batch, step_time):
            return False
        if self.due or self.measuring:
            return False
        if time.monotonic() - self._last_measure < self.cooldown_s and self._last_measure:
            return False
        self.monitor.reset()
        self._mark_due()
        return True

    def _mark_due(self) -> None:
        """A re-profile is due: watch for a quiet spell (a task on the running loop; none outside one)."""
        self.due = True
        if self._quiet_watch is not None and not self._quiet_watch.done():
            return
        try:
            self._quiet_watch = asyncio.get_running_loop().create_task(self._start_when_quiet())
        except RuntimeError:  # no running loop: the caller starts it (:meth:`reprofile_if_due`)
            self._quiet_watch = None

    def quiet_needed_s(self) -> float:
        """How long the engine must stay quiet before a due re-profile starts: ``QUIET_S``, doubled for each
        re-profile that yielded to traffic since the last one completed, at most ``QUIET_MAX_S``."""
        return min(QUIET_S * 2 ** min(self._yields, 16), QUIET_MAX_S)

    async def _start_when_quiet(self) -> None:
        """While a re-profile is due, start it once the engine has had no request in flight (the profile's own and
        health checks aside; unknown counts as busy) and nothing ``in_use`` for :meth:`quiet_needed_s`. Ends when
        the server is stopping."""
        quiet_since: Optional[float] = None
        while self.due:
            await asyncio.sleep(QUIET_POLL_S)
            stopping = getattr(self.port, "stopping", None)
            if callable(stopping) and stopping():
                return
            try:
                busy = self.measuring or self.in_use() or (await others_in_flight(self.port)) != 0
            except Exception:  # a port that fails to answer: not known to be quiet
                logger.debug("spex: quiet watch could not read the engine's load", exc_info=True)
                busy = True
            now = time.monotonic()
            if busy:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= self.quiet_needed_s() and self.reprofile_if_due():
                return

    def status(self) -> Dict[str, Any]:
        """Whether a measurement runs now, whether a re-profile is due, how many started (one that yielded to
        traffic counts), the knee's budget, whether the profile in use was measured under load (so not cached;
        None: no profile yet), and why the last measurement failed (None: it did not)."""
        return {
            "measuring": self.measuring,
            "reprofile_due": self.due,
            "reprofiles": self.reprofiles,
            "k_total": self.k_total,
            "measured_under_load": self.profile.measured_under_load if self.profile else None,
            "last_error": self.last_error,
        }

    def reprofile_if_due(self) -> bool:
        """Start a due re-profile in the background now (the quiet watch calls it once the engine is quiet). True if
        one started. Its sweep yields to traffic: the first other request stops it (its batch aborted) and it stays
        due."""
        if not self.due or self.measuring:
            return False
        self.due = False
        self.reprofiles += 1
        self._task = asyncio.ensure_future(self.get(force=True, progress=False, yields=True))
        self._task.add_done_callback(_log_reprofile_failure)
        return True


def _fail(outcome: asyncio.Future, error: BaseException) -> None:
    """Hand a failed measurement's error to the calls that joined it (a cancellation as a RuntimeError); marked as
    retrieved, so none joining is no error."""
    if not isinstance(error, Exception):
        error = RuntimeError(f"the profile measurement was stopped ({type(error).__name__})")
    outcome.set_exception(error)
    outcome.exception()


def _log_reprofile_failure(task: asyncio.Future) -> None:
    """Log a background re-profile that failed (``status()["last_error"]`` keeps why); the profile in use stays."""
    if not task.cancelled() and isinstance(task.exception(), ProfileYielded):
        logger.info("spex: background re-profile stopped (%s); it stays due", task.exception())
    elif not task.cancelled() and isinstance(task.exception(), ProfileStopped):
        logger.info("spex: background re-profile stopped with the server")
    elif not task.cancelled() and task.exception() is not None:
        logger.error("spex: background re-profile failed; keeping the profile in use", exc_info=task.exception())
