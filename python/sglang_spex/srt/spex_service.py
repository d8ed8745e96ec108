"""SPEX in the server: server-side searches run as SpexContexts sharing one T2 budget.

Installed by ``routes.install`` under ``--tot-speculation``. ``--tot-k-total auto`` starts at the runner's
default and takes the roofline knee once the profile is ready (cached, or measured when the first search
arrives — the profiler also starts measuring in the background once the server is healthy). At the end of
each search its accounting goes to ``/metrics`` (the runner itself releases its radix-cache protection).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.runner import SpecBudget, SpexContext, context_factory, make_budget
from sglang_spex.srt import metrics

logger = logging.getLogger(__name__)

_budget: Optional[SpecBudget] = None
_reader = None
_last_step = [0.0]


def engine_primary() -> Optional[int]:
    """Primary requests running or waiting in the scheduler, from the batch-stats ring (H13); feeds the latest
    step time to the profile's drift monitor (re-profiles in the background when it drifts > 20%)."""
    global _reader
    try:
        if _reader is None:
            from sglang_spex.srt.batch_stats import StatsReader

            _reader = StatsReader()
        row = _reader.latest()
    except Exception:
        return None
    if not row or row.get("mode") != 2:  # decode rows hold the whole running batch
        return None
    step_s, batch = row.get("step_s", float("nan")), int(row.get("batch_size", 0))
    if row.get("mode") == 2 and step_s == step_s and row.get("time", 0.0) != _last_step[0]:
        _last_step[0] = row["time"]
        try:
            from sglang_spex.profile.routes import manager

            manager().observe(batch, step_s)
        except Exception:
            pass
    return int(row.get("n_primary", 0) + row.get("waiting", 0) - row.get("waiting_spec", 0))


def budget() -> Optional[SpecBudget]:
    return _budget


async def _on_finish(ctx: SpexContext) -> None:
    metrics.record_search(ctx.extra_result(), ctx.num_requests, ctx.tokens_generated)


async def _resolve_auto_k_total(cfg: SpexConfig, b: SpecBudget) -> None:
    from sglang_spex.profile.routes import server_k_total

    try:
        b.k_total = await server_k_total(cfg)
        logger.info("spex: k_total=%d from the roofline profile", b.k_total)
    except Exception:
        logger.exception("spex: roofline profile failed; keeping k_total=%d", b.k_total)


def install(app, cfg: SpexConfig) -> None:
    """Make the search service run SPEX contexts (no-op without --tot-speculation)."""
    global _budget
    if not cfg.enabled:
        return
    from sglang_spex.srt import search_routes

    _budget = b = make_budget(cfg)
    b.engine_primary = engine_primary
    factory = context_factory(cfg, b, on_finish=_on_finish)
    pending = [cfg.k_total is None]

    def make(*args, **kwargs) -> SpexContext:
        if pending[0]:  # --tot-k-total auto: resolve once, in the background, on the first search
            pending[0] = False
            asyncio.ensure_future(_resolve_auto_k_total(cfg, b))
        return factory(*args, **kwargs)

    search_routes.service().context_factory = make
