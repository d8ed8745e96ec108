"""SPEX for server-side searches: one T2 budget shared by every search of the server (split per DP rank), fed with
each rank's live primary load (the batch-stats ring its scheduler writes, hook H13) and the served model's byte
sizes (S_w, KV bytes per token, from SGLang's model config), and ``--tot-k-total auto`` resolved from the roofline
profile: once the knee is known (and again after each re-profile) it becomes both the HTTP-side budget and the
scheduler-side speculative admission cap (the ``budget`` control op). Under auto, decode step times go to the
profile's drift monitor (a re-profile moves the knee); a due re-profile starts only once the engine has been quiet
(:class:`~sglang_spex.profile.manager.ProfileManager`: no request in flight and no live search); a numeric k_total
never reads the profile.
Used by :mod:`sglang_spex.srt.search_service`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Dict, Optional, Tuple

from sglang_spex.config import SpexConfig
from sglang_spex.profile.cache import Profile
from sglang_spex.profile.manager import ProfileManager
from sglang_spex.speculation.budget import ModelBytes, model_bytes
from sglang_spex.speculation.runner import SpexContext, context_factory, make_budget
from sglang_spex.srt import control, metrics
from sglang_spex.srt.batch_stats import StatsReader
from sglang_spex.srt.dp_ranks import per_rank

logger = logging.getLogger(__name__)

DECODE_MODE = 2  # batch-stats rows of decode steps hold the whole running batch


class SpexWiring:
    """SPEX for server-side searches: one T2 budget for all of them, fed with the engine's live primary load
    (batch-stats ring, H13); under ``--tot-k-total auto`` decode step times go to the profile's drift monitor."""

    def __init__(self, cfg: SpexConfig, profile: Callable[[], ProfileManager]):
        self.cfg = cfg
        self.budget = make_budget(cfg)
        self.budget.engine_primary = self.engine_primary
        self.budget.step_cost = self.step_cost
        self._profile = profile
        self._factory = context_factory(cfg, self.budget, on_finish=self._on_finish)
        self._readers: Dict[Optional[int], StatsReader] = {}  # batch-stats ring per DP rank (None: no DP)
        self._last_row_time: Dict[Optional[int], float] = {}
        self._k_total_pending = cfg.k_total is None  # --tot-k-total auto: resolved once, on the first search
        self.k_total_task: Optional[asyncio.Task] = None
        self._tm: Any = None  # SGLang's TokenizerManager (from the first search's port)
        self.scheduler_cap: Optional[int] = None  # the cap last sent to the scheduler under auto

    def make_context(self, *args: Any, **kwargs: Any) -> SpexContext:
        """The service's ``context_factory`` (args as ``SearchContext``'s: spec, question, port, ...)."""
        if self._tm is None:
            self._attach(args[2] if len(args) > 2 else kwargs.get("port"))
        if self._k_total_pending:
            self._k_total_pending = False
            self.k_total_task = asyncio.ensure_future(self._resolve_k_total())
        return self._factory(*args, **kwargs)

    def _attach(self, port: Any) -> None:
        """Take the model's byte sizes from the engine behind ``port`` (a ``TokenizerManagerPort``)."""
        self._tm = getattr(port, "tm", None)
        found = served_model_bytes(self._tm)
        if found is not None:
            self.budget.model = found
            logger.info("spex: T2 S_w=%.3g B, KV %.0f B/token", found.weight_bytes, found.kv_bytes_per_token)

    async def _resolve_k_total(self) -> None:
        try:
            manager = self._profile()
            profile = await manager.get()
            manager.on_update = self._on_profile  # a re-profile (drift) moves the knee: follow it
            await self._set_k_total(profile)
        except Exception:
            logger.exception("spex: roofline profile failed; keeping k_total=%d", self.budget.k_total)

    def _on_profile(self, profile: Profile) -> None:
        asyncio.ensure_future(self._set_k_total(profile))

    def _dp_size(self) -> int:
        return int(getattr(getattr(self._tm, "server_args", None), "dp_size", 1) or 1)

    async def _set_k_total(self, profile: Profile) -> None:
        """The knee becomes the HTTP-side budget and the scheduler's speculative admission cap, both per rank
        (``SpecBudget``'s ``k_total`` is one rank's knee): under ``--dp-size N`` the profile measured the whole
        server, whose batches the DP controller splits over the ranks, so each rank takes ``ceil(knee / N)``."""
        self.budget.k_total = per_rank(int(profile.k_total), self._dp_size())
        logger.info("spex: k_total=%d from the roofline profile", self.budget.k_total)
        if self._tm is None:
            return
        try:
            await control.send(self._tm, control.SpexControlReq(op="budget", value=float(self.budget.k_total)))
            self.scheduler_cap = self.budget.k_total
        except Exception:
            logger.exception("spex: setting the scheduler-side budget failed")

    async def _on_finish(self, ctx: SpexContext) -> None:
        metrics.record_search(ctx.extra_result(), ctx.num_requests, ctx.tokens_generated, dp_rank=ctx.dp_rank)

    def _reader(self, rank: Optional[int]) -> StatsReader:
        reader = self._readers.get(rank)
        if reader is None:
            reader = self._readers[rank] = StatsReader(dp_rank=rank)
        return reader

    def step_cost(self, rank: Optional[int] = None) -> Optional[Tuple[float, float]]:
        """``(a, b)`` of rank ``rank``'s live decode step curve ``t = a + b·B`` (its scheduler's fit, published in
        the batch-stats counters; -1 before a fit, which the budget's ``cost_ratio`` refuses), or None without a
        ring: the pay-off gate's step cost."""
        try:
            reader = self._reader(rank)
            return reader.counter("curve_a_s"), reader.counter("curve_b_s")
        except (OSError, ValueError):  # no stats ring (yet)
            return None

    def engine_primary(self, rank: Optional[int] = None) -> Optional[int]:
        """Primary requests running, chunked or waiting in the scheduler of DP rank ``rank`` (None: the server's
        only scheduler, or rank 0's under DP), as its speculative gate counted them at the last step of any
        kind; None before the first step."""
        try:
            row = self._reader(rank).latest()
        except (OSError, ValueError):  # no stats ring (yet)
            return None
        if not row:
            return None
        step_s = row.get("step_s")
        decode = row.get("mode") == DECODE_MODE
        fresh = decode and step_s is not None and step_s == step_s and row.get("time") != self._last_row_time.get(rank)
        if fresh and self.cfg.k_total is None:  # a fixed k_total never reads the profile: no re-profiling
            self._last_row_time[rank] = row["time"]
            try:  # the drift monitor may re-profile in the background; it must never break the budget
                # the profile measured the whole server: a rank's batch b is its curve's b * dp_size (per_rank)
                self._profile().observe(int(row.get("batch_size", 0)) * self._dp_size(), step_s)
            except Exception:
                logger.debug("spex: drift observation failed", exc_info=True)
        live = row.get("primary_live")  # every row carries the gate's census (a ring of another version is refused)
        return None if live is None else int(live)


def served_model_bytes(tokenizer_manager: Any) -> Optional[ModelBytes]:
    """S_w and KV bytes per token of the model SGLang serves (None if its config cannot be read)."""
    mc = getattr(tokenizer_manager, "model_config", None)
    if mc is None:
        return None
    try:
        kv_dtype = getattr(getattr(tokenizer_manager, "server_args", None), "kv_cache_dtype", "auto")
        return model_bytes(mc.hf_text_config, getattr(mc, "dtype", "auto"), kv_dtype)
    except (AttributeError, TypeError, ValueError):
        logger.warning("spex: model config unreadable; T2 uses unit byte sizes", exc_info=True)
        return None
