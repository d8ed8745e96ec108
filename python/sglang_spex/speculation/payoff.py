"""Whether speculation pays on this engine, measured: the pay-off gate.

On an engine whose decode step costs ``t(B) = a + b·B`` (the scheduler's live fit, :class:`LiveCurve`), a search's
wall time is ``a·S + b·N``: ``S`` decode steps, ``N`` sequence-steps (tokens decoded). Speculation changes both:
a hit moves tokens the search would decode anyway (``N`` unchanged) and can take steps off the critical path
(``S`` smaller); a miss adds its tokens to ``N``. It pays iff ``a · saved steps > b · wasted tokens``.

Both sides are measured per search and pooled per (DP rank, policy with its knobs, step tokens) on the server:

- **saved steps** (:class:`WaveMeter`): the nodes a search asks for in one event-loop round form a *wave* (a BFS
  depth, an MCTS expansion, a rollout's samples; the policy gathers them). When the wave has resolved, its
  baseline length is ``max L_i`` (every node decoded from the request on) and its length with speculation is
  ``max r_i``: ``r_i = L_i`` for a node generated on request, 0 for a hit finished before it, and for a hit still
  in flight the part of its tokens decoded after the request (its decode time after the request over its whole
  decode time, times ``L_i``). Saved = ``max L_i - max r_i``.
- **wasted tokens**: a cancelled or never-adopted speculative node's decoded tokens, plus the prompt tokens it
  prefilled that the radix cache did not hold (:func:`wasted_tokens`; a prefilled token is counted like a decoded
  one, about what it costs a compute-bound step; measured on the CPU server, misses' prefill was most of the waste).

With ``C`` searches sharing the engine, a step one search saves lets the engine finish the whole load about
``1/C`` of a step sooner (the others keep it busy), while a wasted token slows every search's step: a candidate
adopted with probability ``u`` (its expected use) is worth issuing iff
``u · a · (saved per hit) >= C · (1 - u) · b · (wasted per miss)``, i.e. ``u >= r / (1 + r)`` with
``r = C · b · wasted-per-miss / (a · saved-per-hit)`` (:meth:`Payoff.min_use`). A flat curve (``b = 0``: speculation
rides steps that cost the same) admits everything; a compute-bound one admits only near-certain work, and the
bar falls again when the curve flattens. The estimates start from a prior of one step's tokens saved per hit and
wasted per miss that ages like the measurements (``decay`` per event), so a changed workload moves them.

**Auto-off** (:meth:`Payoff.pays`, on by default): a search that speculated reports, when it ends, the steps its
hits saved and the tokens its misses wasted; summed over the last few such searches (decayed by ``SEARCH_DECAY``
each), speculation paid iff ``a · (steps saved) >= C · b · (tokens wasted)``. Whole searches, because a miss is
priced when it happens but a hit's saving only when its wave ends: sums taken mid-search lean towards waste. Once a
search has reported and that fails, the policy's searches issue nothing (they run as the baseline would), except
one search in ``PROBE_EVERY`` of those that find it failing: a probe speculates as usual and reports, so
speculation comes back when the workload or the step curve changes. A BFS search at its critical path (every
branch as long as the longest) saves nothing; the per-candidate gate above cannot see that.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from sglang_spex.speculation.accounting import MIN_DEEP_HIT_RATE, DistanceRates, SpecAccounting

DECAY = 0.995  # per recorded event: a half-life of ~140 events (a few searches: BFS savings come in rare, large waves)
PRIOR_EVENTS = 1.0  # the prior's weight at the start: one hit that saved a step's tokens, one miss that wasted them
SEARCH_DECAY = 0.8  # auto-off: weight left to a finished search's report after each later one (~5 searches)
PROBE_EVERY = 4  # auto-off: while speculation does not pay, one search in this many still speculates (a probe)


@dataclass
class Payoff:
    """Decayed sums of what speculation saved and wasted on one engine, for one policy. They start from the prior
    (one step's tokens saved per hit and wasted per miss), which ages like every measured event: speculation starts
    optimistic and then follows what it measures."""

    prior_tokens: float
    decay: float = DECAY
    saved: float = 0.0  # decode steps taken off critical paths
    hits: float = 0.0
    wasted: float = 0.0  # tokens of speculative nodes never adopted
    misses: float = 0.0
    prior_weight: float = PRIOR_EVENTS  # what is left of the prior in ``hits`` and ``misses``
    distances: DistanceRates = field(default_factory=DistanceRates)  # DFS predictions' hit rates by distance
    off_draws: int = 0  # auto-off: searches that found speculation not paying (every PROBE_EVERY-th probes)
    search_saved: float = 0.0  # auto-off: steps saved by finished searches that speculated (decayed per search)
    search_wasted: float = 0.0  # ... tokens they wasted
    searches: float = 0.0  # ... their decayed count

    def __post_init__(self) -> None:
        self.saved = self.wasted = PRIOR_EVENTS * self.prior_tokens
        self.hits = self.misses = PRIOR_EVENTS

    def _age(self) -> None:
        self.prior_weight *= self.decay
        self.saved, self.hits = self.saved * self.decay, self.hits * self.decay
        self.wasted, self.misses = self.wasted * self.decay, self.misses * self.decay

    def record_wave(self, saved_steps: float, hits: int) -> None:
        if hits <= 0:
            return
        self._age()
        self.saved += max(float(saved_steps), 0.0)
        self.hits += hits

    def record_miss(self, tokens: int) -> None:
        self._age()
        self.wasted += max(int(tokens), 0)
        self.misses += 1

    def saved_per_hit(self) -> float:
        return self.saved / self.hits

    def measured_saved_per_hit(self) -> float:
        """Steps saved per hit without the prior (0 before a hit was measured): what a speculative request's worth
        is priced at, so speculation never claims a saving it has not shown on this engine."""
        hits = self.hits - self.prior_weight
        if hits < 0.5:
            return 0.0
        return max(self.saved - self.prior_weight * self.prior_tokens, 0.0) / hits

    def record_search(self, saved_steps: float, wasted_tokens: float) -> None:
        """A search that speculated ended: the steps its hits saved and the tokens its misses wasted."""
        d = SEARCH_DECAY
        self.search_saved = self.search_saved * d + max(float(saved_steps), 0.0)
        self.search_wasted = self.search_wasted * d + max(float(wasted_tokens), 0.0)
        self.searches = self.searches * d + 1.0

    def pays(self, line: Optional[Tuple[float, float]], searches: int = 1) -> Optional[bool]:
        """Auto-off's test: whether what finished searches saved (``a`` per step) outweighs what they wasted (``b``
        per token, times the ``searches`` sharing the engine) on the step curve ``line`` = (a, b); None while
        unknown (no curve, or no search has reported)."""
        if line is None or self.searches <= 0:
            return None
        a, b = line
        return a * self.search_saved >= max(searches, 1) * b * self.search_wasted

    def report(self, line: Optional[Tuple[float, float]], searches: int = 1) -> dict:
        """JSON-ready state (``/spex/stats`` → ``payoff``): the finished searches' sums, auto-off's verdict on
        ``line`` with ``searches`` sharing the engine, the searches that found it not paying (every ``PROBE_EVERY``-th
        probed), and the per-candidate gate's floor."""
        return {
            "searches": round(self.searches, 3),
            "steps_saved": round(self.search_saved, 2),
            "tokens_wasted": round(self.search_wasted, 1),
            "pays": self.pays(line, searches),
            "off_draws": self.off_draws,
            "gate_min_use": None if line is None else round(self.min_use(*line, searches=searches), 4),
        }

    def draw_probe(self) -> bool:
        """A search found speculation not paying: whether it speculates anyway, to keep measuring (one in
        ``PROBE_EVERY``: the ``PROBE_EVERY``-th, then every ``PROBE_EVERY`` after)."""
        self.off_draws += 1
        return self.off_draws % PROBE_EVERY == 0

    def wasted_per_miss(self) -> float:
        return self.wasted / self.misses

    def min_use(self, a: float, b: float, searches: int = 1) -> float:
        """The smallest expected use worth issuing on an engine with step time ``a + b·B`` shared by ``searches``."""
        if b <= 0:
            return 0.0
        saving = a * self.saved_per_hit()
        if saving <= 0:
            return 1.0
        r = max(searches, 1) * b * self.wasted_per_miss() / saving
        return r / (1.0 + r)


def policy_key(name: str, params: Dict[str, Any]) -> str:
    """What pools pay-off measurements: the policy and its knobs (REBASE at width 8 and at width 16 save differently;
    ``rebase{"max_depth": 4, "width": 8}``)."""
    return name + (json.dumps(params, sort_keys=True, default=str) if params else "")


# A pooled pay-off entry as ``/spex/stats`` reports it: ((rank, policy, step tokens), its Payoff, the rank's step
# curve (a, b) or None, the searches on the rank) (``SpecBudget.payoff_snapshot``)
PoolRow = Tuple[Tuple[Any, str, int], Payoff, Optional[Tuple[float, float]], int]


def pool_report(snapshot: Sequence[PoolRow]) -> List[dict]:
    """``/spex/stats`` → ``payoff``: one row per pooled entry of ``snapshot`` (``SpecBudget.payoff_snapshot``: key
    (rank, policy, step tokens), its Payoff, its rank's step curve and searches), sorted by key; it only reads the
    entries, so it may run off the event loop."""
    return [
        {"rank": rank, "policy": policy, "step_tokens": step, **p.report(line, searches)}
        for (rank, policy, step), p, line, searches in sorted(snapshot, key=lambda row: str(row[0]))
    ]


def wasted_tokens(decoded: int, prompt_tokens: int, cached_tokens: int) -> int:
    """What a speculative node that is never adopted cost: its decoded tokens and, if it was prefilled (it decoded
    at least one token), its prompt tokens the radix cache did not hold."""
    decoded = max(int(decoded), 0)
    return decoded + (max(int(prompt_tokens) - int(cached_tokens), 0) if decoded > 0 else 0)


def remaining_tokens(length: int, requested_at: float, span: Optional[Tuple[float, float]]) -> float:
    """Tokens of a node decoded after the search asked for it: all of them without speculation (``span`` None);
    for a hit issued at ``span[0]`` and finished at ``span[1]``, its share of decode time after the request."""
    if span is None:
        return float(length)
    issued, done = span
    if done <= requested_at:
        return 0.0
    whole = done - issued
    if whole <= 0:
        return float(length)
    return float(length) * min(1.0, (done - requested_at) / whole)


@dataclass
class _Wave:
    requested_at: float
    pending: int = 0
    longest: float = 0.0  # max L_i
    longest_left: float = 0.0  # max r_i
    hits: int = 0
    open: bool = True


class WaveMeter:
    """Groups a search's node requests by event-loop round and reports each finished wave's
    ``(saved steps, hits)`` to ``on_wave``."""

    def __init__(self, on_wave: Callable[[float, int], None], clock: Callable[[], float]):
        self.on_wave = on_wave
        self.clock = clock
        self._open: Optional[_Wave] = None
        self.saved = 0.0  # this search's total
        self.waves = 0

    def ask(self) -> _Wave:
        """The wave of the current event-loop round (a node request joins it; resolve it with :meth:`resolved`)."""
        wave = self._open
        if wave is None:
            wave = self._open = _Wave(self.clock())
            try:
                asyncio.get_running_loop().call_soon(self._close, wave)
            except RuntimeError:
                self._close(wave)
        wave.pending += 1
        return wave

    def _close(self, wave: _Wave) -> None:
        wave.open = False
        if self._open is wave:
            self._open = None
        self._finish_if_done(wave)

    def resolved(self, wave: _Wave, length: int, span: Optional[Tuple[float, float]], ok: bool) -> None:
        """One node of ``wave`` resolved: ``length`` tokens; ``span`` (issued, done) if it was a hit."""
        wave.pending -= 1
        if ok:
            wave.longest = max(wave.longest, float(length))
            wave.longest_left = max(wave.longest_left, remaining_tokens(length, wave.requested_at, span))
            wave.hits += span is not None
        self._finish_if_done(wave)

    def _finish_if_done(self, wave: _Wave) -> None:
        if wave.open or wave.pending > 0 or wave.hits == 0:
            return
        saved = max(wave.longest - wave.longest_left, 0.0)
        wave.hits, hits = 0, wave.hits  # reported once
        self.saved += saved
        self.waves += 1
        self.on_wave(saved, hits)


def cost_ratio(a: Optional[float], b: Optional[float]) -> Optional[Tuple[float, float]]:
    """``(a, b)`` if both describe a measured curve (finite, ``a > 0``, ``b >= 0``), else None."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or a <= 0 or b < 0:
        return None
    return float(a), float(b)


def truncate_at(uses: List[float], floor: float) -> int:
    """How many of ``uses`` (sorted best first) reach ``floor``."""
    if floor <= 0:
        return len(uses)
    n = 0
    for u in uses:
        if u + 1e-9 < floor:
            break
        n += 1
    return n


class SearchPayoff:
    """One search's view of the pay-off pooled for its policy on its engine (``budget.payoff``): the gate's floor,
    auto-off, and what a candidate is worth. ``rank`` reads the search's DP rank (it may be re-pinned)."""

    def __init__(
        self,
        budget: Any,
        rank: Callable[[], Any],
        policy: str,
        step_tokens: int,
        acc: SpecAccounting,
        gate: bool,
        auto_off: bool,
    ):
        self.budget, self.rank, self.key = budget, rank, (policy, step_tokens)
        self.acc, self.gate, self.auto_off = acc, gate, auto_off
        self.probe: Optional[bool] = None  # auto-off: drawn the first time speculation was found not paying
        self.wasted = 0.0  # this search's tokens wasted as auto-off prices them (its steps saved: ``acc.saved_steps``)

    def pool_key(self) -> Tuple[Any, str, int]:
        """The key of the pooled entry this search uses now (``budget.payoffs``; kept while the search is live)."""
        return (self.rank(), *self.key)

    def pooled(self) -> Payoff:
        """What speculation saved and wasted for this policy on this search's engine (pooled over searches)."""
        return self.budget.payoff(self.rank(), *self.key)

    def line(self) -> Optional[Tuple[float, float]]:
        return self.budget.step_line(self.rank())

    def floor(self) -> float:
        """The use that pays on the live step curve with this many searches (0 while the curve is unknown)."""
        line = self.line()
        return 0.0 if line is None else self.pooled().min_use(*line, searches=len(self.budget.on_rank(self.rank())))

    def min_use(self) -> float:
        """The expected use a candidate needs to be issued now (0 with the gate off or the step curve unknown)."""
        floor = self.floor() if self.gate else 0.0
        self.acc.min_use, self.acc.step_line = floor, self.line()
        return floor

    def switched_off(self) -> bool:
        """Auto-off: speculation has not paid for this policy on this engine, and this search is no probe."""
        if self.probe or not self.auto_off:
            return False
        pays = self.pooled().pays(self.line(), len(self.budget.on_rank(self.rank())))
        if pays is False and self.probe is None:
            self.probe = self.pooled().draw_probe()
            self.acc.probes = int(self.probe)
        self.acc.switched_off = int(pays is False and not self.probe)
        return bool(self.acc.switched_off)

    def deep_floor(self) -> float:
        """The hit rate a DFS distance past the lookahead needs: 0.25, or what pays on the live curve if more."""
        return max(MIN_DEEP_HIT_RATE, self.floor())

    def worth_s(self, use: float) -> Optional[float]:
        """Seconds a candidate adopted with probability ``use`` is expected to save its search: the decode steps
        saved per hit measured on this engine (no prior) at the live step's fixed cost (None while the step curve
        is unknown)."""
        line = self.line()
        return None if line is None else use * self.pooled().measured_saved_per_hit() * line[0]

    def on_wave(self, saved_steps: float, hits: int) -> None:
        self.pooled().record_wave(saved_steps, hits)
        self.acc.saved_steps += saved_steps

    def missed(self, decoded: int, prompt_tokens: int, cached_tokens: int) -> None:
        """A speculative node will never be adopted: what it decoded and prefilled was for nothing."""
        tokens = wasted_tokens(decoded, prompt_tokens, cached_tokens)
        self.pooled().record_miss(tokens)
        self.wasted += tokens

    def finish(self) -> None:
        """The search ended (every speculative node resolved): report it to auto-off if it speculated."""
        if self.acc.issued:
            self.pooled().record_search(self.acc.saved_steps, self.wasted)
