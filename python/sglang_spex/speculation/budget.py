"""T2 budget: split the global speculative budget k_total across live queries.

Per query q (paper §4.3, eqs. 1–2; the exact score is our reading of the summary):
    score_q = P_q · (S_w + S_KV(q)) / (S_w + KV_q)
P_q is the running hit rate (with a prior), S_w the weight bytes every decode step reads anyway (shared by
all sequences), S_KV(q) the prefix KV bytes a speculative branch of q shares with what the radix cache holds,
KV_q the KV bytes a branch of q reads in total. Bytes come from the model config (:func:`model_bytes`: parameter
bytes, K+V bytes per token); prefix lengths are tokens. Over the queries with work (C_q > 0, the speculative
branches q can issue right now), with w_q = softmax(score/τ) over those queries, a query gets
    x_q = min(C_q, max(m_q, λ·w_q)),    λ such that Σ_q x_q = min(k_total, Σ_q C_q)
(water-filling: λ·w_q is the softmax share of k_total while no minimum or cap binds; what capped queries cannot
take and what minimums take is re-spread over the others, proportionally to w_q). The minimum m_q (``min_share``,
at least 1 for a query past the starvation bound, at most C_q) is a floor, not an addition: a query whose softmax
share is above it gets just that share. When k_total cannot give every query its minimum, the queries that waited
longest with work and no share keep theirs first (:class:`SpecBudget`'s ``max_wait_s``), then the best scores; the
others' minimum is 0. Integer shares use largest remainders.

Scores lie in [0, 1], so τ sets how sharply the split follows them: at τ = 1 a query with P_q = 0.9 gets
e^0.8 ≈ 2.2× the weight of one with P_q = 0.1; at τ = 0.1 about 3000×.
"""

from __future__ import annotations

import asyncio
import math
import operator
import time
from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.payoff import Payoff, PoolRow, cost_ratio

DEFAULT_K_TOTAL = 8
DEFAULT_MAX_WAIT_S = 2.0  # starvation bound (SpexConfig.budget_max_wait_s, --tot-budget-max-wait-s)
# Pay-off entries kept (one per DP rank, policy with its knobs, step tokens: :meth:`SpecBudget.payoff`). A client
# picks the knobs, so each distinct one made an entry that was never dropped; past this many, the least recently
# used entries that no live search uses are dropped (a later search with that key starts again from the prior).
PAYOFF_POOL_MAX = 256


@dataclass
class QueryDemand:
    """What a live query could do with speculative budget right now."""

    query_id: str
    candidates: int  # C_q: non-duplicate speculative branches it can issue
    hit_rate: float = 0.5  # P_q, running estimate
    shared_kv: float = 0.0  # S_KV(q): prefix KV bytes its branches share with the radix cache
    total_kv: float = 0.0  # KV_q: KV bytes one of its branches reads


@dataclass(frozen=True)
class ModelBytes:
    """What a decode step of the served model reads: S_w and the KV bytes of one token."""

    weight_bytes: float
    kv_bytes_per_token: float


# Unknown model (a client-side budget without a config): S_w = 1 byte, 1 byte per token, i.e. scores see tokens.
UNKNOWN_MODEL = ModelBytes(1.0, 1.0)
_DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2}


def dtype_bytes(dtype: Any, default: int = 2) -> int:
    """Bytes per element of a dtype name (``bfloat16``, ``torch.float32``, ``fp8_e4m3``…); ``default`` if unknown."""
    name = str(dtype or "").lower().replace("torch.", "")
    if name.startswith(("fp8", "float8")):
        return 1
    return _DTYPE_BYTES.get(name, default)


def model_bytes(hf_config: Any, dtype: Any = "auto", kv_cache_dtype: Any = "auto") -> ModelBytes:
    """S_w and K+V bytes per token of a decoder-only transformer from its HF config (attributes or a dict).

    Parameters are counted from the architecture (embeddings, untied lm_head, per layer Q/K/V/O, a gated MLP,
    two norms); ``dtype``/``kv_cache_dtype`` "auto" fall back to the config's ``torch_dtype``.
    """
    get = hf_config.get if isinstance(hf_config, dict) else lambda k, d=None: getattr(hf_config, k, d)
    hidden, layers = int(get("hidden_size")), int(get("num_hidden_layers"))
    heads = int(get("num_attention_heads"))
    kv_heads = int(get("num_key_value_heads") or heads)
    head_dim = int(get("head_dim") or hidden // heads)
    inter = int(get("intermediate_size") or 4 * hidden)
    vocab = int(get("vocab_size") or 0)
    w_bytes = dtype_bytes(get("torch_dtype") if dtype in (None, "auto") else dtype)
    kv_bytes = w_bytes if kv_cache_dtype in (None, "auto") else dtype_bytes(kv_cache_dtype, w_bytes)
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter + 2 * hidden
    params = vocab * hidden * (1 if get("tie_word_embeddings", True) else 2) + layers * per_layer + hidden
    return ModelBytes(float(params * w_bytes), float(2 * layers * kv_heads * head_dim * kv_bytes))


def running_hit_rate(hits: int, issued: int, prior: float = 0.5, prior_weight: float = 4.0) -> float:
    """Beta-prior smoothed hit rate, so a query with no history gets ``prior``."""
    return (hits + prior * prior_weight) / (issued + prior_weight)


def scores(demands: List[QueryDemand], weight_bytes: float) -> List[float]:
    # max(kv, 1e-9) written out: the same value (NaN included), without a builtin call per query per split
    return [
        d.hit_rate * (weight_bytes + d.shared_kv) / (1e-9 if 1e-9 > (kv := weight_bytes + d.total_kv) else kv)
        for d in demands
    ]


# The split runs on every refill that changes a round's demands: plain lists, no numpy (its per-call overhead
# dominates at a few dozen queries).
def _fill(weights: List[float], floors: List[float], caps: List[float], total: float) -> List[float]:
    """Water-filling between floors and caps: ``x_j = min(caps_j, max(floors_j, λ·weights_j))`` with the λ that makes
    ``Σ x = min(total, Σ caps)`` (needs ``0 <= floors_j <= caps_j`` and ``Σ floors <= total``). Σ x is piecewise
    linear in λ, bending where an item starts to grow (floor / weight) or stops (cap / weight): one walk over those
    points in order, O(n log n). The slope (the growing items' summed weight) is kept as a running sum and summed
    afresh when it falls far below what was added to it (1 + 1e-35 - 1 is 0 in floats). An item whose weight is 0
    (or NaN) stays at its floor while an item with a positive weight can still grow; what is left once those are all
    capped is spread evenly over the others (unit weights)."""
    x = list(floors)
    left = total - sum(floors)
    if left <= 1e-9:
        return x
    # a weight so small (a denormal at a tiny τ) that cap / weight overflows counts as 0; False for NaN too
    grow = [j for j, wj in enumerate(weights) if wj > 0 and caps[j] > floors[j] and caps[j] / wj < math.inf]
    if grow:
        events = sorted([(floors[j] / weights[j], 0, j) for j in grow] + [(caps[j] / weights[j], 1, j) for j in grow])
        on = [False] * len(x)
        lam = rate = added = 0.0  # rate: the weight of the items growing between ``lam`` and the next point
        growing = 0
        for at, stops, j in events:
            if rate > 0 and (at - lam) * rate >= left:  # λ lies before this point
                lam += left / rate
                for i in grow:
                    x[i] = min(caps[i], max(floors[i], lam * weights[i]))
                return x
            left -= (at - lam) * rate
            lam = at
            on[j] = not stops
            growing += -1 if stops else 1
            if not stops:
                rate += weights[j]
                added += weights[j]
            elif not growing:
                rate = added = 0.0
            elif rate - weights[j] < 1e-7 * added:  # cancellation: sum what still grows afresh
                rate = added = sum(weights[i] for i in grow if on[i])
            else:
                rate -= weights[j]
        for i in grow:  # every item with a weight is capped
            x[i] = caps[i]
        left = total - sum(x)
    rest = [j for j, (xj, cj) in enumerate(zip(x, caps)) if cj > xj]
    if rest and left > 1e-9:
        even = _fill([1.0] * len(rest), [x[j] for j in rest], [caps[j] for j in rest], left + sum(x[j] for j in rest))
        for j, v in zip(rest, even):
            x[j] = v
    return x


def _round(alloc: List[float], caps: List[float], total: int) -> List[int]:
    base = [math.floor(a + 1e-9) for a in alloc]
    left = min(total, int(sum(caps))) - sum(base)
    order = sorted(range(len(alloc)), key=lambda i: -(alloc[i] - base[i]))  # stable: ties keep demand order
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
    waited: Optional[Sequence[float]] = None,
) -> Dict[str, int]:
    """Integer speculative shares per query: sum ≤ k_total, share_q ≤ C_q, and, for a query with work, at least
    ``min_share`` (a floor: ``max(min_share, its softmax share)``, water-filled, see the module docstring) whenever
    k_total covers every such minimum. A query without candidates gets 0; a negative ``min_share`` counts as 0.

    ``waited`` (seconds per demand past the starvation bound, 0 = not starving): a starving query's minimum is at
    least 1 even with ``min_share`` 0, and when k_total cannot cover every minimum, the minimums go to the
    longest-waiting queries first, then to the best scores (the others' minimum is 0)."""
    if not demands or k_total <= 0:
        return {d.query_id: 0 for d in demands}
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    s = [x / temperature for x in scores(demands, weight_bytes)]
    # a query without candidates gets 0 whatever its score or wait (cap 0, minimum 0): the split runs over the
    # others only, in the same order, so every sum, sort and rounding step sees what it saw over all of them
    work = [i for i, d in enumerate(demands) if d.candidates > 0]
    got = [0] * len(demands)
    if not work:
        return {d.query_id: 0 for d in demands}
    # softmax relative to the best score among the queries with work: an idle query's higher score would push
    # every working query's weight to 0 at a small τ (the split would then be even)
    top = max(s[i] for i in work)
    caps = [float(demands[i].candidates) for i in work]
    w = [math.exp(s[i] - top) for i in work]
    wait = [0.0] * len(work) if waited is None else [float(waited[i]) for i in work]
    least = max(min_share, 0)
    minimum = [min(c, float(max(least, 1) if wt > 0 else least)) for c, wt in zip(caps, wait)]
    floor = minimum
    if sum(floor) > k_total:  # not enough for every minimum: longest starved, then best scores first
        floor = [0.0] * len(caps)
        used = 0.0
        for j in sorted(range(len(caps)), key=lambda j: (-wait[j], -s[work[j]])):
            if used + minimum[j] <= k_total:
                floor[j] = minimum[j]
                used += minimum[j]
    shares = _round(_fill(w, floor, caps, k_total), caps, k_total)
    for i, x in zip(work, shares):
        got[i] = int(x)
    return {d.query_id: x for d, x in zip(demands, got)}


def effective_k_total(k_total: int, primary_batch: int, knee: Optional[int]) -> int:
    """Beyond the paper: speculation only fills the room below the knee that primary work leaves.

    Once the primary batch alone reaches the knee the engine is compute-bound and speculation stops.
    """
    if knee is None:
        return max(0, k_total)
    return max(0, min(k_total, knee - primary_batch))


@dataclass
class _RoundSplit:
    """One T2 split, kept for the rest of an event-loop round."""

    total: int  # the allowance it split
    shares: Dict[str, int]
    keys: Dict[str, Any]  # each search's demand key when split (None: T1's even split)
    caps: Dict[str, int]  # each search's C_q when split (empty: T1's even split, never re-split)


class BudgetClient(Protocol):
    """A live search as the budget sees it (``speculation.runner.SpexContext``)."""

    search_id: str
    inflight: Set[str]

    def should_stop(self) -> bool: ...

    def demand(self) -> QueryDemand: ...


Rank = Optional[int]  # a search's DP rank (``SearchContext.dp_rank``); None without data parallelism


_INFLIGHT = operator.attrgetter("inflight")
_DEMAND_VALUES = operator.attrgetter("query_id", "candidates", "hit_rate", "shared_kv", "total_kv")  # a split's input


def _rank(ctx: BudgetClient) -> Rank:
    return getattr(ctx, "dp_rank", None)


class SpecBudget:
    """T2 across the live searches of one server (or one client-side batch), per DP rank.

    Under data parallelism every rank is its own engine with its own knee: the searches pinned to rank r
    (``dp_rank``) split rank r's budget, against rank r's primary load; without DP (every rank None) there is one
    budget. ``k_total`` is the knee of one rank. ``engine_primary(rank)``: the live primary load of a rank's
    engine (other clients' traffic too), called without an argument for rank None. ``model``: S_w and KV bytes
    per token of the served model (:func:`model_bytes`; the server sets it from SGLang's model config).
    ``max_wait_s``: the starvation bound: a query that has had speculative work but no share for longer gets at
    least one slot, ahead of better-scored queries when slots are short. ``step_cost(rank)``: a rank's live decode
    step curve ``(a, b)`` (``t = a + b·B``), for the pay-off gate (:mod:`.payoff`; None: unknown, nothing gated).

    Cost: a refill asks :meth:`share`; nothing is split while a rank has no room below its knee, the room (the
    searches' in-flight primaries and the engine's load) is read once per event-loop round, and a split is
    computed once per round and rank (again only for a search whose demand changed while its share was held by
    its C_q, and then, when every search's demand and wait is what the round's last split saw, answered from it);
    a split runs over the searches with candidates only.
    """

    def __init__(
        self,
        k_total: Optional[int],
        temperature: float = 1.0,
        min_share: int = 1,
        use_t2: bool = True,
        engine_primary: Optional[Callable[..., Optional[int]]] = None,
        model: ModelBytes = UNKNOWN_MODEL,
        max_wait_s: float = DEFAULT_MAX_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
        max_payoffs: int = PAYOFF_POOL_MAX,
    ):
        self.k_total = DEFAULT_K_TOTAL if k_total is None else int(k_total)
        self.engine_primary = engine_primary
        self.temperature = temperature
        self.min_share = min_share
        self.use_t2 = use_t2
        self.model = model
        self.max_wait_s = max_wait_s
        self.clock = clock
        # registered searches in registration order (a dict as an ordered set): ties in a split, and T1's remainder,
        # go the same way every run, not by object address
        self.contexts: Dict[BudgetClient, None] = {}
        self._starved_since: Dict[str, float] = {}  # query -> when it last had work and no share
        # cached for the current event-loop round, per rank: the split, the engine load, clocks started
        self._round: Dict[Rank, _RoundSplit] = {}
        self._last_split: Dict[Rank, Tuple[Any, Dict[str, int]]] = {}  # the round's last split per rank: (inputs, out)
        self._load: Dict[Rank, Optional[int]] = {}
        self._avail: Dict[Rank, int] = {}
        self._clocks_started: Set[Rank] = set()
        # ranks whose every search's starvation clock already runs: kept across rounds until a clock stops (a
        # split gives a share or sees no candidates), a search registers, unregisters or changes its rank
        self._clocks_running: Set[Rank] = set()
        self._by_rank: Optional[Dict[Rank, List[BudgetClient]]] = None
        # the searches grouped by rank, kept across rounds until one registers, unregisters or changes its rank;
        # only while every registered search reports a rank change (``rank_watchers``), else grouped every round
        self._groups: Optional[Dict[Rank, List[BudgetClient]]] = None
        self._untracked: Set[BudgetClient] = set()
        self._round_end_scheduled = False
        self.step_cost: Optional[Callable[..., Any]] = None
        self._cost: Dict[Rank, Any] = {}
        # (rank, policy, step tokens) -> what speculation saved and wasted; least recently used first
        self.payoffs: "OrderedDict[Any, Payoff]" = OrderedDict()
        self.max_payoffs = max_payoffs

    def payoff(self, rank: Rank, policy: str, step_tokens: int) -> Payoff:
        """The pooled pay-off estimate of ``policy``'s searches with steps of ``step_tokens`` on ``rank`` (created
        with one step's tokens as its prior). At most ``max_payoffs`` are kept (:meth:`_evict_payoffs`)."""
        key = (rank, policy, step_tokens)
        got = self.payoffs.get(key)
        if got is None:
            got = self.payoffs[key] = Payoff(prior_tokens=float(step_tokens))
            if len(self.payoffs) > self.max_payoffs:
                self._evict_payoffs(key)
        else:
            self.payoffs.move_to_end(key)
        return got

    def _evict_payoffs(self, keep: Any) -> None:
        """Drop the least recently used entries until ``max_payoffs`` are left, never ``keep`` (the one just made)
        nor one a registered search uses (its ``pay.pool_key()``): with more live keys than that, the pool holds them
        all until their searches end."""
        live = {keep}
        for c in self.contexts:
            pool_key = getattr(getattr(c, "pay", None), "pool_key", None)
            if pool_key is not None:
                live.add(pool_key())
        over = len(self.payoffs) - self.max_payoffs
        for key in list(islice((k for k in self.payoffs if k not in live), over)):
            del self.payoffs[key]

    def payoff_snapshot(self) -> List[PoolRow]:
        """Each pooled entry with its rank's live step curve and searches: ``(key, payoff, line, searches)``, read
        on the event loop (they are cached per round there); :func:`~.payoff.pool_report` formats it off the loop."""
        lines: Dict[Rank, Tuple[Optional[Tuple[float, float]], int]] = {}
        out = []
        for key, p in list(self.payoffs.items()):
            rank = key[0]
            if rank not in lines:
                lines[rank] = (self.step_line(rank), len(self.on_rank(rank)))
            out.append((key, p, *lines[rank]))
        return out

    def step_line(self, rank: Rank) -> Optional[Tuple[float, float]]:
        """``(a, b)`` of ``rank``'s live decode step curve (read once per event-loop round), or None if unknown."""
        if self.step_cost is None:
            return None
        if rank in self._cost:
            cost = self._cost[rank]
        else:
            raw = self.step_cost() if rank is None else self.step_cost(rank)
            cost = cost_ratio(*raw) if raw is not None else None
            if self._end_round_soon():
                self._cost[rank] = cost
        return cost

    def register(self, ctx: BudgetClient) -> None:
        self.contexts[ctx] = None
        watchers = getattr(ctx, "rank_watchers", None)
        if isinstance(watchers, list):
            if self._rank_changed not in watchers:
                watchers.append(self._rank_changed)
        else:
            self._untracked.add(ctx)
        self._groups = None
        self._round.clear()
        self._last_split.clear()
        self._avail.clear()
        self._by_rank = None
        self._clocks_running.clear()

    def unregister(self, ctx: BudgetClient) -> None:
        self.contexts.pop(ctx, None)
        self._untracked.discard(ctx)
        watchers = getattr(ctx, "rank_watchers", None)
        if isinstance(watchers, list) and self._rank_changed in watchers:
            watchers.remove(self._rank_changed)
        self._groups = None
        self._starved_since.pop(ctx.search_id, None)
        self._round.clear()
        self._last_split.clear()
        self._avail.clear()
        self._by_rank = None
        self._clocks_running.clear()

    def _rank_changed(self, ctx: BudgetClient) -> None:
        """A registered search was pinned to another rank: group again (this round keeps its grouping, as before)."""
        self._groups = None
        self._clocks_running.clear()

    def on_rank(self, rank: Rank) -> List[BudgetClient]:
        """The registered searches pinned to ``rank`` (grouped once per event-loop round, and kept across rounds
        while no search registers, unregisters or changes its rank)."""
        groups = self._by_rank
        if groups is None:
            groups = self._groups
            if groups is None:
                groups = {}
                for c in self.contexts:
                    groups.setdefault(_rank(c), []).append(c)
                if not self._untracked:
                    self._groups = groups
            if self._end_round_soon():
                self._by_rank = groups
        return groups.get(rank, [])

    def available(self, rank: Rank = None) -> int:
        """k_total is the knee concurrency: speculation fills what primary work leaves below it (on ``rank``).
        Read once per event-loop round, like the engine's load (a refill in the same round sees the same room)."""
        if rank in self._avail:
            return self._avail[rank]
        primary = sum(map(len, map(_INFLIGHT, self.on_rank(rank))))
        if self.engine_primary is not None:
            live = self._engine_load(rank)
            primary = max(primary, live) if live is not None else primary
        room = effective_k_total(self.k_total, primary, knee=self.k_total)
        if self._end_round_soon():
            self._avail[rank] = room
        return room

    def _engine_load(self, rank: Rank) -> Optional[int]:
        """A rank's live primary load, read once per event-loop round (it changes once per scheduler step)."""
        if rank in self._load:
            return self._load[rank]
        live = self.engine_primary() if rank is None else self.engine_primary(rank)
        if self._end_round_soon():
            self._load[rank] = live
        return live

    def _end_round_soon(self) -> bool:
        """Schedule the end of this event-loop round (what was cached for it is dropped); False without a loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if not self._round_end_scheduled:
            self._round_end_scheduled = True
            loop.call_soon(self._end_round)
        return True

    def _end_round(self) -> None:
        self._round.clear()
        self._last_split.clear()
        self._load.clear()
        self._avail.clear()
        self._cost.clear()
        self._clocks_started.clear()
        self._by_rank = None
        self._round_end_scheduled = False

    def shares(self, demands: List[QueryDemand], total: int, rank: Rank = None) -> Dict[str, int]:
        """T2 split of ``total`` over ``demands``, with the starvation bound (updates the wait clocks).

        Within an event-loop round, a split of ``rank`` asked again with the same inputs (demands, total, waits)
        as its last one answers from it: the same shares, the wait clocks already as that split left them."""
        now = self.clock()
        starved = self._starved_since
        waited = [  # a query without candidates gets 0 whatever its wait: not read
            max(0.0, now - starved[d.query_id] - self.max_wait_s) if d.candidates > 0 and d.query_id in starved else 0.0
            for d in demands
        ]
        inputs = (
            (total, self.temperature, self.min_share, self.model.weight_bytes),
            list(map(_DEMAND_VALUES, demands)),
            waited,
        )
        last = self._last_split.get(rank)
        if last is not None and last[0] == inputs:
            return last[1]
        out = split_budget(
            demands, total, self.temperature, self.min_share, weight_bytes=self.model.weight_bytes, waited=waited
        )
        stopped = False
        for d in demands:
            if d.candidates > 0 and out.get(d.query_id, 0) == 0:
                starved.setdefault(d.query_id, now)
            elif starved.pop(d.query_id, None) is not None:
                stopped = True
        if stopped:
            self._clocks_running.clear()
        if self._end_round_soon():
            self._last_split[rank] = (inputs, out)
        return out

    def share(self, ctx: BudgetClient) -> int:
        """``ctx``'s speculative share now, of its rank's budget."""
        if ctx not in self.contexts or ctx.should_stop():
            return 0
        rank = _rank(ctx)
        total = self.available(rank)  # the speculative allowance below the knee, running speculation included
        if total <= 0:  # no room: every search of the rank waits (its starvation clock runs), no demand asked
            if rank not in self._clocks_started:
                if rank not in self._clocks_running:  # else every setdefault below would find its clock
                    now = self.clock()
                    for c in self.on_rank(rank):
                        self._starved_since.setdefault(c.search_id, now)
                    if not self._untracked:  # searches without watchers may change rank unseen
                        self._clocks_running.add(rank)
                if self._end_round_soon():
                    self._clocks_started.add(rank)
            return 0
        key = _demand_key(ctx) if self.use_t2 else None
        r = self._round.get(rank)
        if r is not None and r.total == total and ctx.search_id in r.shares:
            got = r.shares[ctx.search_id]
            if r.keys[ctx.search_id] == key or got < r.caps[ctx.search_id]:  # unchanged, or not held by its C_q
                return got
        live = [c for c in self.on_rank(rank) if not c.should_stop()]
        if not self.use_t2:  # T1 only: an even split
            out = {c.search_id: total // len(live) + (1 if i < total % len(live) else 0) for i, c in enumerate(live)}
            self._keep_for_round(rank, _RoundSplit(total, out, {c.search_id: None for c in live}, {}))
            return out.get(ctx.search_id, 0)
        demands = [c.demand() for c in live]
        out = self.shares(demands, total, rank)
        keys = {c.search_id: _demand_key(c) for c in live}
        if all(k is not None for k in keys.values()):
            self._keep_for_round(rank, _RoundSplit(total, out, keys, {d.query_id: d.candidates for d in demands}))
        return out.get(ctx.search_id, 0)

    def _keep_for_round(self, rank: Rank, split: _RoundSplit) -> None:
        """Reuse ``split`` until the running event loop's next round (no loop: not reused; a query past the
        starvation bound that got its slot in it has its clock reset, so the next round splits without it). A
        search whose demand changed in the round still gets its share from it unless its share was held by its
        C_q (it may now be able to take more): then the round is split again."""
        if self._end_round_soon():
            self._round[rank] = split


def _demand_key(ctx: BudgetClient) -> Any:
    """A search's demand key (``SpexContext.demand_key``), or None for a client that has none (never cached)."""
    fn = getattr(ctx, "demand_key", None)
    return fn() if fn is not None else None


def make_budget(settings: SpexConfig, model: ModelBytes = UNKNOWN_MODEL) -> SpecBudget:
    return SpecBudget(
        settings.k_total,
        settings.budget_temperature,
        settings.min_share,
        use_t2=settings.has("t2"),
        model=model,
        max_wait_s=settings.budget_max_wait_s,
    )
