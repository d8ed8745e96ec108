"""T2 budget: split the global speculative budget k_total across live queries.

Per query q (paper §4.3, eqs. 1–2; the exact score is our reading of the summary):
    score_q = P_q · (S_w + S_KV(q)) / (S_w + KV_q)
P_q is the running hit rate (with a prior), S_w the weight bytes every decode step reads anyway (shared by
all sequences), S_KV(q) the prefix KV bytes a speculative branch of q shares with its parent, KV_q the KV
bytes a branch of q reads in total. Shares are softmax(score/τ)·k_total, capped at C_q (the speculative
branches q can issue right now), with the excess re-spread over uncapped queries (water-filling), and a
minimum share so no query with work starves. Integer shares use largest remainders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol, Set

import numpy as np

from sglang_spex.config import SpexConfig

DEFAULT_K_TOTAL = 8


@dataclass
class QueryDemand:
    """What a live query could do with speculative budget right now."""

    query_id: str
    candidates: int  # C_q: non-duplicate speculative branches it can issue
    hit_rate: float = 0.5  # P_q, running estimate
    shared_kv: float = 0.0  # S_KV(q): prefix KV bytes shared by its branches
    total_kv: float = 0.0  # KV_q: KV bytes one of its branches reads


def running_hit_rate(hits: int, issued: int, prior: float = 0.5, prior_weight: float = 4.0) -> float:
    """Beta-prior smoothed hit rate, so a query with no history gets ``prior``."""
    return (hits + prior * prior_weight) / (issued + prior_weight)


def scores(demands: List[QueryDemand], weight_bytes: float) -> np.ndarray:
    return np.array(
        [d.hit_rate * (weight_bytes + d.shared_kv) / max(weight_bytes + d.total_kv, 1e-9) for d in demands],
        dtype=float,
    )


def _water_fill(weights: np.ndarray, caps: np.ndarray, total: float) -> np.ndarray:
    """Split ``total`` proportionally to ``weights`` with per-item caps; excess goes to uncapped items."""
    alloc = np.zeros_like(weights)
    free = caps > 0
    remaining = float(total)
    while remaining > 1e-9 and free.any():
        w = np.where(free, weights, 0.0)
        if w.sum() <= 0:
            w = free.astype(float)
        want = remaining * w / w.sum()
        room = caps - alloc
        give = np.minimum(want, room)
        alloc += give
        remaining -= give.sum()
        free = free & (caps - alloc > 1e-9)
    return alloc


def _round(alloc: np.ndarray, caps: np.ndarray, total: int) -> np.ndarray:
    base = np.floor(alloc + 1e-9).astype(int)
    left = min(total, int(caps.sum())) - int(base.sum())
    order = np.argsort(-(alloc - base), kind="stable")
    for i in order:
        if left <= 0:
            break
        if base[i] < caps[i]:
            base[i] += 1
            left -= 1
    return base


def split_budget(
    demands: List[QueryDemand],
    k_total: int,
    temperature: float = 1.0,
    min_share: int = 1,
    weight_bytes: float = 1.0,
) -> Dict[str, int]:
    """Integer speculative shares per query: sum ≤ k_total, share_q ≤ C_q, min_share for those with work."""
    if not demands or k_total <= 0:
        return {d.query_id: 0 for d in demands}
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    caps = np.array([max(0, d.candidates) for d in demands], dtype=float)
    s = scores(demands, weight_bytes) / temperature
    w = np.exp(s - s.max())
    floor = np.minimum(caps, float(min_share))
    if floor.sum() > k_total:  # not enough for every minimum: best scores first
        floor = np.zeros_like(caps)
        for i in np.argsort(-s, kind="stable"):
            if floor.sum() + min(caps[i], min_share) <= k_total:
                floor[i] = min(caps[i], min_share)
    rest = _water_fill(w, caps - floor, k_total - floor.sum())
    shares = _round(floor + rest, caps, k_total)
    return {d.query_id: int(x) for d, x in zip(demands, shares)}


def effective_k_total(k_total: int, primary_batch: int, knee: Optional[int]) -> int:
    """Beyond the paper: speculation only fills the room below the knee that primary work leaves.

    Once the primary batch alone reaches the knee the engine is compute-bound and speculation stops.
    """
    if knee is None:
        return max(0, k_total)
    return max(0, min(k_total, knee - primary_batch))


class BudgetClient(Protocol):
    """A live search as the budget sees it (``speculation.runner.SpexContext``)."""

    search_id: str
    inflight: Set[str]

    def should_stop(self) -> bool: ...

    def demand(self) -> QueryDemand: ...


class SpecBudget:
    """T2 across the live searches of one server (or one client-side batch)."""

    def __init__(
        self,
        k_total: Optional[int],
        temperature: float = 1.0,
        min_share: int = 1,
        use_t2: bool = True,
        engine_primary: Optional[Callable[[], Optional[int]]] = None,
    ):
        self.k_total = DEFAULT_K_TOTAL if k_total is None else int(k_total)
        self.engine_primary = engine_primary  # live primary load of the engine (other clients' traffic too)
        self.temperature = temperature
        self.min_share = min_share
        self.use_t2 = use_t2
        self.contexts: Set[BudgetClient] = set()

    def register(self, ctx: BudgetClient) -> None:
        self.contexts.add(ctx)

    def unregister(self, ctx: BudgetClient) -> None:
        self.contexts.discard(ctx)

    def available(self) -> int:
        """k_total is the knee concurrency: speculation fills what primary work leaves below it."""
        primary = sum(len(c.inflight) for c in self.contexts)
        if self.engine_primary is not None:
            live = self.engine_primary()
            primary = max(primary, live) if live is not None else primary
        return effective_k_total(self.k_total, primary, knee=self.k_total)

    def share(self, ctx: BudgetClient) -> int:
        live = [c for c in self.contexts if not c.should_stop()]
        if ctx not in live:
            return 0
        total = self.available()  # the speculative allowance below the knee, running speculation included
        if not self.use_t2:  # T1 only: an even split
            return total // len(live) + (1 if live.index(ctx) < total % len(live) else 0) if live else 0
        demands = [c.demand() for c in live]
        return split_budget(demands, total, self.temperature, self.min_share).get(ctx.search_id, 0)


def make_budget(settings: SpexConfig) -> SpecBudget:
    return SpecBudget(settings.k_total, settings.budget_temperature, settings.min_share, use_t2=settings.has("t2"))
