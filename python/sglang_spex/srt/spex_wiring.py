"""SPEX for server-side searches: one T2 budget shared by every search of the server, fed with the engine's live
primary load (the batch-stats ring written by hook H13), and ``--tot-k-total auto`` resolved from the roofline
profile. Decode step times go to the profile's drift monitor. Used by :mod:`sglang_spex.srt.search_service`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional

from sglang_spex.config import SpexConfig
from sglang_spex.profile.measure import ProfileManager
from sglang_spex.speculation.runner import SpexContext, context_factory, make_budget
from sglang_spex.srt import metrics
from sglang_spex.srt.batch_stats import StatsReader

logger = logging.getLogger(__name__)

DECODE_MODE = 2  # batch-stats rows of decode steps hold the whole running batch


class SpexWiring:
    """SPEX for server-side searches: one T2 budget for all of them, fed with the engine's live primary load
    (batch-stats ring, H13); decode step times go to the profile's drift monitor."""

    def __init__(self, cfg: SpexConfig, profile: Callable[[], ProfileManager]):
        self.cfg = cfg
        self.budget = make_budget(cfg)
        self.budget.engine_primary = self.engine_primary
        self._profile = profile
        self._factory = context_factory(cfg, self.budget, on_finish=self._on_finish)
        self._reader: Optional[StatsReader] = None
        self._last_row_time = 0.0
        self._k_total_pending = cfg.k_total is None  # --tot-k-total auto: resolved once, on the first search
        self.k_total_task: Optional[asyncio.Task] = None

    def make_context(self, *args: Any, **kwargs: Any) -> SpexContext:
        """The service's ``context_factory``."""
        if self._k_total_pending:
            self._k_total_pending = False
            self.k_total_task = asyncio.ensure_future(self._resolve_k_total())
        return self._factory(*args, **kwargs)

    async def _resolve_k_total(self) -> None:
        try:
            self.budget.k_total = (await self._profile().get()).k_total
            logger.info("spex: k_total=%d from the roofline profile", self.budget.k_total)
        except Exception:
            logger.exception("spex: roofline profile failed; keeping k_total=%d", self.budget.k_total)

    @staticmethod
    async def _on_finish(ctx: SpexContext) -> None:
        metrics.record_search(ctx.extra_result(), ctx.num_requests, ctx.tokens_generated)

    def engine_primary(self) -> Optional[int]:
        """Primary requests running or waiting in the scheduler (None while no decode step was recorded)."""
        try:
            if self._reader is None:
                self._reader = StatsReader()
            row = self._reader.latest()
        except (OSError, ValueError):  # no stats ring (yet)
            return None
        if not row or row.get("mode") != DECODE_MODE:
            return None
        step_s = row.get("step_s")
        if step_s is not None and step_s == step_s and row.get("time") != self._last_row_time:
            self._last_row_time = row["time"]
            try:  # the drift monitor may re-profile in the background; it must never break the budget
                self._profile().observe(int(row.get("batch_size", 0)), step_s)
            except Exception:
                logger.debug("spex: drift observation failed", exc_info=True)
        return int((row.get("n_primary") or 0) + (row.get("waiting") or 0) - (row.get("waiting_spec") or 0))
