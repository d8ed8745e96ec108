"""The SPEX runner: a SearchContext that produces speculative nodes while the primary search waits.

When the policy asks for a node (``generate_node``) the context adopts a speculative node already made for that
path (or awaits one in flight) instead of regenerating it; every time a node finishes it refills the idle
speculative slots its T2 share allows: best expected use first (BFS: a child's chance to stay inside its
parent's real width; DFS: the hit rate resolved at its prediction distance on this engine; REST's partial
rollouts: ``rest_rollouts``), then the nearer, then work whose prefix the radix cache holds (a child of a
finished node, the most recently finished first). A request measured likely enough to be used is marked sure:
the scheduler lets it run above the knee.

With T3 off, speculation only computes earlier what the baseline computes anyway: a node's prompt, seed and
rid (up to its role suffix) are functions of its tree path, so the search returns exactly the baseline's tree.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Awaitable, Callable, Dict, List, Optional, Set, Tuple

from sglang_spex.config import SpexConfig
from sglang_spex.speculation import bfs_early, dfs_lookahead, rest_rollouts
from sglang_spex.speculation.accounting import SpecAccounting
from sglang_spex.speculation.budget import QueryDemand, SpecBudget, make_budget, running_hit_rate
from sglang_spex.speculation.candidates import CachedPrefixes, Candidate, refill_key
from sglang_spex.speculation.early_stop import EarlyStop
from sglang_spex.speculation.payoff import Payoff, SearchPayoff, WaveMeter, policy_key, truncate_at
from sglang_spex.speculation.settings import resolve
from sglang_spex.speculation.store import CANCELLED as SPEC_CANCELLED
from sglang_spex.speculation.store import READY, RUNNING, SpecEntry, SpecStore, adopt
from sglang_spex.tot.backpressure import gate_for, refused_for_load
from sglang_spex.tot.context import SearchContext
from sglang_spex.tot.engine import ROLE_SPEC, node_rid
from sglang_spex.tot.policies.base import Stat
from sglang_spex.tot.policies.mcts import MCTSPolicy
from sglang_spex.tot.policies.rebase import Rebase
from sglang_spex.tot.tree import (
    CANCELLED,
    DONE,
    FAILED,
    GENERATING,
    KIND_STEP,
    PENDING,
    Node,
    child_path,
    node_seed,
)

logger = logging.getLogger(__name__)

__all__ = ["SpecBudget", "SpexContext", "context_factory", "make_budget"]

CANDIDATE_LIMIT = 64  # speculative candidates planned per search (C_q is capped here)
T2_SAMPLE = 8  # candidates whose prefix KV feeds the T2 score


class SpexContext(SearchContext):
    """SearchContext with T1 (DFS lookahead / BFS early expansion), T2 shares and T3 early stop."""

    def __init__(
        self,
        *args: Any,
        settings: SpexConfig,
        budget: SpecBudget,
        on_finish: Optional[Callable[["SpexContext"], Awaitable[None]]] = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.on_finish = on_finish
        self.settings = resolve(settings, self.spec.speculation)
        self.budget = budget
        self.clock = budget.clock  # the engine's clock: monotonic on a server, virtual time in the simulator
        self.store = SpecStore(self.clock)
        self.acc = SpecAccounting(clock=self.clock)
        self.early = EarlyStop(
            alpha=self.settings.early_stop_alpha,
            min_answers=self.settings.early_stop_min_answers,
            enabled=self.settings.has("t3") and self.settings.early_stop,
        )
        self.t1 = self.settings.has("t1")
        self.bfs: Optional[Rebase] = self.policy if isinstance(self.policy, Rebase) else None
        self.mcts: Optional[MCTSPolicy] = self.policy if isinstance(self.policy, MCTSPolicy) else None
        self.next_rollout = 0
        self._bfs_targets: bfs_early.Chances = {}  # BFS: planned parent -> chance its child i is in the tree
        self._bfs_depth = 1  # BFS: the depth being generated (its frontier is not decided yet)
        self._cancels: List["asyncio.Future"] = []
        self._finalized = False
        self._version = 0  # bumped whenever a node finishes or speculation is issued/cancelled
        self._cand: Tuple[int, List[Candidate], List[float]] = (-1, [], [])  # (version, best first, their uses)
        self._demand: Optional[Tuple[Tuple[Any, ...], QueryDemand]] = None  # (state key, T2 demand)
        self.prefixes = CachedPrefixes()  # what this search's nodes left in the radix cache (prefix-aware refill)
        self._bfs_epoch = 0  # bumped when a BFS frontier is decided
        self._predictions: Set["asyncio.Task"] = set()  # BFS predictions running in threads (ETS's ILP)
        self._predicting: Optional[bool] = None  # one in a thread: whether another was asked for meanwhile
        self._promotions: Set["asyncio.Future"] = set()  # promote messages still being sent
        self._expanding: Optional[str] = None  # the node whose children the policy asked for last (REST rollouts)
        self.pay = SearchPayoff(
            budget,
            lambda: self.dp_rank,
            policy_key(self.spec.policy.name, self.spec.policy.params),
            self.spec.step.max_tokens,
            self.acc,
            gate=self.settings.payoff_gate,
            auto_off=self.settings.auto_off,
        )
        self.meter = WaveMeter(self.pay.on_wave, self.clock)  # steps speculation took off the critical path
        self._spec_done: Dict[str, float] = {}  # speculative node path -> when its generation returned
        self.queue_gate = gate_for(self.port)  # SGLang's request-queue back-pressure, shared by the port's searches
        budget.register(self)
        self._dues = dfs_lookahead.DuePredictions(lambda: self.payoff().distances)  # DFS: each prediction's rollout

    # ---- consumer: serve the policy's requests from the store ---------------------------------------

    async def generate_node(self, parent: Node, index: int, kind: str = KIND_STEP) -> Node:
        if not self.t1:
            return await super().generate_node(parent, index, kind)
        wave, node, span = self.meter.ask(), None, None
        try:
            node, span = await self._serve(parent, index, kind)
            return node
        finally:
            ok = node is not None and node.status == DONE
            self.meter.resolved(wave, node.num_tokens if ok else 0, span, ok)

    async def _serve(self, parent: Node, index: int, kind: str) -> Tuple[Node, Optional[Tuple[float, float]]]:
        """The node at (parent, index, kind), adopted if speculated, else generated; with the hit's (issued, done)
        times (None if generated on request)."""
        self._version += 1  # the policy moved on (backups, a new rollout): plan again
        if kind == KIND_STEP:
            self._expanding = parent.path
        node = self.tree.child(parent, index, kind)
        entry = self.store.pop(node.path) if node.status == PENDING and node.path not in self._running else None
        if entry is not None:
            in_flight = entry.state == RUNNING
            if entry.task is not None and not entry.task.done():
                self._promote(entry.node.rid)  # the search waits on it now: primary rank
                await asyncio.shield(entry.task)
            if entry.node.status not in (CANCELLED, PENDING, GENERATING):
                self._adopt(node, entry, in_flight)
                self._after(node)
                return node, (entry.issued_at, self._spec_done.get(node.path, entry.issued_at))
            self._count_failed(entry.node)  # it ended without a result: generated on request below
        self.pump()  # the primary is about to wait on the engine: fill idle producers
        node = await super().generate_node(parent, index, kind)
        self._after(node)
        return node, None

    def _promote(self, rid: str) -> None:
        """Give the request ``rid`` primary rank without waiting for the scheduler's acknowledgement (a control
        round trip, serialised with every other one, would delay the node by a scheduler step or more)."""

        async def promote() -> None:
            try:
                await self.port.promote(rid)
            except Exception:
                logger.warning("spex: promoting %s failed", rid, exc_info=True)

        task = asyncio.ensure_future(promote())
        self._promotions.add(task)
        task.add_done_callback(self._promotions.discard)

    def _adopt(self, node: Node, entry: SpecEntry, in_flight: bool) -> None:
        adopt(node, entry.node)
        self._dues.adopted(node.path)
        self.acc.on_hit(entry.distance, in_flight, depth=node.depth)
        self.tokens_generated += node.num_tokens
        if node.kind == KIND_STEP:  # rollout samples are no tree children: no MCTS statistic, no answer
            self.stats.setdefault(node.path, Stat(node.path, node.parent.path, node.depth))
            self._update_stat(node)
        self._emit_node(node)
        if node.ok and node.answer is not None and node.kind == KIND_STEP:
            self.on_answer(node)

    def _after(self, node: Node) -> None:
        self._version += 1
        self._note_finished(node)
        if node.status == DONE and not node.is_terminal and self.bfs is not None and self.t1:
            self._bfs_early(self.bfs)
        self.pump()

    # ---- producers: what to speculate ---------------------------------------------------------------

    def demand_key(self) -> Tuple[Any, ...]:
        """What :meth:`demand` depends on: it is recomputed only when this changes."""
        acc = self.acc
        return (self._version, len(self.store.running()), acc.hits, acc.issued, acc.failed, self.budget.model)

    def demand(self) -> QueryDemand:
        """T2 inputs: C_q (what could be issued now), P_q (running hit rate), and in bytes the prefix KV the next
        branches share with the radix cache (S_KV) vs the KV one branch reads (KV_q), over the best candidates.
        Cached until the search's state changes (T2 asks every live search for it when it splits)."""
        key = self.demand_key()
        if self._demand is not None and self._demand[0] == key:
            return self._demand[1]
        cands = self._t2_candidates()
        sample = [self.child_prefix(c.parent) for c in cands[:T2_SAMPLE]]
        n = max(1, len(sample))
        kv = self.budget.model.kv_bytes_per_token
        step = self.spec.step.max_tokens
        demand = QueryDemand(
            query_id=self.search_id,
            candidates=len(cands) + key[1],  # C_q: plannable + running
            hit_rate=running_hit_rate(self.acc.hits, self.acc.ran),  # a failed request is no miss
            shared_kv=kv * sum(c for _, c in sample) / n,
            total_kv=kv * (sum(t for t, _ in sample) / n + step),
        )
        self._demand = (key, demand)
        return demand

    def _t2_candidates(self) -> List[Candidate]:
        """The candidates T2 sees: a DFS search's last plan, less what was issued since, so that splitting the
        budget never re-plans every live search (its own refill plans afresh). Planned here only when nothing
        is left of that plan (a search that never gets a share would otherwise never plan again); BFS plans are cheap.
        """
        version, last, uses = self._cand
        if self.mcts is not None and version != self._version and not (self.should_stop() or self.pay.switched_off()):
            left = [c for c in last[: truncate_at(uses, self.pay.min_use())] if not self._taken(c.path)]
            if left:
                return left
        return self._candidates(limit=CANDIDATE_LIMIT)

    # ---- prefix-aware refill ------------------------------------------------------------------------

    def _note_finished(self, node: Node) -> None:
        self.prefixes.finished(node, self.tree.root.path)

    def child_prefix(self, parent: Node) -> Tuple[int, int]:
        return self.prefixes.child_prefix(parent, self.prompt_for)

    def _expected_use(self, cand: Candidate) -> float:
        """How likely the primary search adopts this candidate (see the module docstring)."""
        if cand.use is not None:
            return cand.use
        parent, index, distance = cand.parent, cand.index, cand.distance
        if self.bfs is not None:  # below the next depth, the hit rate measured at that distance caps the chance
            chances = self._bfs_targets.get(parent.path, ())
            use = chances[index] if index < len(chances) else 0.0
            return use if distance < 2 else min(use, running_hit_rate(*self.acc.resolved(distance)))
        # DFS: the resolved hit rate pooled on this engine, never above a nearer distance's (a prediction further
        # ahead rests on the nearer ones)
        rates = self.payoff().distances
        return min(running_hit_rate(*rates.resolved(d), prior=1.0 / d) for d in range(1, max(1, distance) + 1))

    def _measured_use(self, cand: Candidate, use: float) -> float:
        """``use`` backed by measurement: DFS uses are measured rates; an (optimistic) BFS chance is capped by the hit
        rate this search resolved at its distance."""
        return use if self.bfs is None else min(use, running_hit_rate(*self.acc.resolved(cand.distance)))

    def _refill_order(self, cands: List[Candidate]) -> Tuple[List[Candidate], List[float]]:
        """``cands`` best first, and their expected uses."""
        keys = [
            refill_key(
                self._expected_use(c),
                c.distance,
                self.child_prefix(c.parent)[1],
                self.prefixes.recency(c.parent.path),
            )
            for c in cands
        ]
        order = sorted(range(len(cands)), key=keys.__getitem__)  # stable: equal keys keep the plan's order
        return [cands[i] for i in order], [-keys[i][0] for i in order]

    # ---- the pay-off gate and auto-off (speculation/payoff.py) -------------------------------------

    def payoff(self) -> Payoff:
        """What speculation saved and wasted for this policy on this search's engine (pooled over searches)."""
        return self.pay.pooled()

    def _missed(self, node: Node) -> None:
        self.pay.missed(node.num_tokens, node.prompt_tokens, node.cached_tokens)

    def on_rollout(self, index: int) -> None:
        self.next_rollout = max(self.next_rollout, index + 1)
        self._dues.passed(index, self.store.__contains__)

    def _taken(self, path: str) -> bool:
        return path in self.tree.nodes or path in self.store or path in self.store.barred

    def _expansion(self, parent: Node, width: int, distance: int) -> List[Candidate]:
        start = len(parent.children) if parent.path in self.tree.nodes else 0
        return [
            Candidate(parent, i, distance) for i in range(start, width) if not self._taken(child_path(parent.path, i))
        ]

    def _candidates(self, limit: int) -> List[Candidate]:
        """(parent, child index, distance) to generate speculatively, best first (cached until something changes:
        T2 asks every live search for its demand on each refill)."""
        if not self.t1 or self.should_stop() or self.pay.switched_off():
            return []
        if self._cand[0] != self._version:
            self._cand = (self._version, *self._refill_order(self._plan(CANDIDATE_LIMIT)))
        _, cands, uses = self._cand
        return cands[: min(limit, truncate_at(uses, self.pay.min_use()))]

    def _plan(self, limit: int) -> List[Candidate]:
        out: List[Candidate] = []
        if self.bfs is not None:
            for path, chances in self._bfs_targets.items():
                parent = self._finished(path)
                if parent is not None:
                    out += self._expansion(parent, len(chances), parent.depth - self._bfs_depth + 1)
            return out[:limit]
        policy = self.mcts
        if policy is None:
            return out
        out += self._rollout_candidates()
        busy = {  # parents of the primary steps being generated (the running futures, not a scan of the tree)
            n.parent.path
            for p in self._running
            if (n := self.tree.nodes.get(p)) is not None and n.kind == KIND_STEP and n.status == GENERATING
        }
        busy |= {e.node.parent.path for e in self.store if e.state == RUNNING}
        # the current rollout (its simulation path is replayed exactly) and the next ones the measured rates allow
        start = max(0, self.next_rollout - 1)
        ahead = dfs_lookahead.planned_distance(
            self.settings.lookahead,
            self.settings.max_lookahead,
            self.payoff().distances.resolved,
            self.pay.deep_floor(),
        )
        rngs = [policy.rollout_rng(self.rng, i) for i in range(start, min(start + ahead, policy.num_rollouts))]
        for exp in dfs_lookahead.predict_expansions(
            self.stats, self.tree.root.path, policy, rngs, busy, lookup=self._facts, limit=4 * limit
        ):
            node = self._available(exp.path)
            if node is not None:
                out += self._expansion(node, policy.branch, exp.distance)
            if len(out) >= limit:
                break
        return out[:limit]

    def _rollout_candidates(self) -> List[Candidate]:
        """REST-MCTS: the partial rollout that follows the running expansion (``speculation/rest_rollouts.py``)."""
        leaf = self.tree.nodes.get(self._expanding or "")
        group = [c.path for c in leaf.children if (st := self.stats.get(c.path)) and st.visits == 0] if leaf else []
        return list(rest_rollouts.rollout_candidates(self.mcts.params, group, self._scored, self._taken))

    def _finished(self, path: str) -> Optional[Node]:
        """The finished node at ``path``: in the primary tree or a ready speculative one."""
        node = self.tree.nodes.get(path)
        if node is None:
            e = self.store.get(path)
            node = e.node if e is not None and e.state == READY else None
        return node if node is not None and node.status == DONE else None

    def _scored(self, path: str) -> Optional[Node]:
        """The finished node at ``path`` if it has a reward."""
        node = self._finished(path)
        return node if node is not None and node.reward is not None else None

    def _facts(self, path: str) -> Optional[dfs_lookahead.NodeFacts]:
        """Facts of the finished node at ``path``: the primary tree's (a terminal not yet backed up) or a spec one."""
        n = self.tree.nodes.get(path)
        if n is None or n.status not in (DONE, FAILED):
            e = self.store.get(path)
            if e is None or e.state == RUNNING:
                return None
            n = e.node
        reward = self.mcts.terminal_reward(n) if self.mcts is not None else None
        return dfs_lookahead.NodeFacts(terminal=n.is_terminal, failed=n.status != DONE, reward=reward)

    def _available(self, path: str) -> Optional[Node]:
        """The finished, non-terminal node at ``path`` (primary tree or a ready speculative one), if any."""
        node = self._finished(path)
        return None if node is None or node.is_terminal else node

    def _bfs_early(self, policy: Rebase) -> None:
        """A node of the undecided depth (or a speculative one below it) is scored: predict the widths from the
        scores known so far. A solver-based prediction (ETS's ILP) runs in a thread, one at a time per search (a
        request while one runs starts one more when it returns, from the state then); it applies only if the
        frontier is still undecided, else it is made again."""
        if self._predicting is not None:
            self._predicting = True
            return
        depth = self._bfs_depth
        finished = sum(1 for n in self.tree if 0 < n.depth < depth and n.status == DONE and n.is_terminal)
        width = bfs_early.remaining_width(policy.width, finished)
        level = list(self.tree.at_depth(depth))
        below: Dict[str, List[Node]] = {}
        for e in self.store:
            if e.node.kind == KIND_STEP and e.node.depth > depth and e.state != SPEC_CANCELLED:
                below.setdefault(e.node.parent.path, []).append(e.node)
        # extra worlds add unlikely children, which only a large share reaches: fewer with more searches
        worlds = max(1, bfs_early.WORLDS // max(1, len(self.budget.on_rank(self.dp_rank))))
        known = sum(1 for n in level if n.status == DONE)
        seed = f"{self.tree.search_seed}:{depth}:{known}:{len(below)}"
        levels = bfs_early.planned_levels(
            self.settings.bfs_lookahead,
            lambda d: running_hit_rate(*self.acc.resolved(d)),
            max_levels=policy.max_depth - depth,
        )
        args = (policy, level, below, width, levels, worlds, seed)
        if not bfs_early.predict_is_costly(policy):
            self._set_bfs_targets(bfs_early.use_chances(*args))
            return
        epoch, self._predicting = self._bfs_epoch, False

        async def predict() -> None:
            try:
                predicted = await asyncio.to_thread(bfs_early.use_chances, *args)
            finally:
                again, self._predicting = self._predicting, None
            stale = epoch != self._bfs_epoch  # the frontier was decided meanwhile: predict from the new one
            if not stale and not self._finalized:
                self._set_bfs_targets(predicted)
                self.pump()
            if (again or stale) and not self._finalized:
                self._bfs_early(policy)

        task = asyncio.ensure_future(predict())
        self._predictions.add(task)
        task.add_done_callback(self._predictions.discard)

    def _set_bfs_targets(self, predicted: bfs_early.Chances) -> None:
        self._bfs_targets = {p: c for p, c in predicted.items() if c}
        self._version += 1

    def pump(self) -> None:
        """Refill idle speculative producers up to this search's T2 share."""
        if not self.t1 or self.should_stop() or self._finalized:
            return
        if not self.queue_gate.spec_ok():  # SGLang's queue is at its cap: its places are the primaries'
            return
        share = self.budget.share(self)
        self.acc.on_share(share)
        room = share - len(self.store.running())
        if room <= 0:
            return
        for cand in self._candidates(limit=room):
            path = cand.path
            if self._taken(path):
                continue
            node = Node(path=path, parent=cand.parent, kind=cand.kind, seed=node_seed(self.tree.search_seed, path))
            use = self._expected_use(cand)
            sure = self._measured_use(cand, use) >= self.settings.sure_use  # may run above the knee
            spec = functools.partial(self._generate_spec, worth_s=self.pay.worth_s(use), sure=sure)
            self.store.issue(node, cand.distance, spec)
            if self.mcts is not None and cand.use is None:  # a DFS lookahead prediction: for a known rollout
                self._dues.issued(path, max(0, self.next_rollout - 1) + cand.distance - 1, cand.distance)
            self.acc.on_issue(cand.distance, depth=node.depth)
            self._version += 1

    async def _generate_spec(self, node: Node, worth_s: Optional[float] = None, sure: bool = False) -> None:
        node.status, node.rid = GENERATING, node_rid(self.search_id, node.path, ROLE_SPEC)
        req = self.request_for(node)
        req.role, req.priority, req.search_priority = ROLE_SPEC, self.settings.spec_priority, req.priority
        req.worth_s, req.sure = worth_s, sure
        try:
            res = await self.port.generate(req)
        except Exception as e:  # never a failure of the search; refused for load (503, queue full): not sent again
            node.status, node.error = CANCELLED, f"speculative generate: {e!r}"
            refused = refused_for_load(e)
            if refused:
                self.queue_gate.note_refused()  # no speculation until the primaries got in
            self._failed(node, release=refused)
            return
        self._spec_done[node.path] = self.clock()
        if res.aborted:
            node.status = CANCELLED
            node.num_tokens = res.completion_tokens  # decoded before the abort: the cancel counts them as wasted
            node.prompt_tokens, node.cached_tokens = res.prompt_tokens, res.cached_tokens
            self.acc.spec_tokens += res.completion_tokens
            self._failed(node, release=False)  # aborted by the engine, not by a cancel of ours (that popped it)
            return
        before = self.tokens_generated
        self.apply_result(node, res)
        self.tokens_generated = before  # counted when (if) the primary search adopts it
        self.acc.spec_tokens += node.num_tokens
        applied = node.status == DONE  # (a step whose answer pattern ran out of time fails, and stops the search)
        await self.score_node(node)
        if applied and node.status == FAILED:  # its reward failed: no result; the search generates and scores it
            node.status = CANCELLED
            self._failed(node, release=False)
        else:
            self._version += 1
            self._note_finished(node)
            bfs = self.bfs
            if bfs is not None and node.kind == KIND_STEP and node.status == DONE and not node.is_terminal:
                self._bfs_early(bfs)  # a node below the undecided depth: predict its width too
        if self.t1:  # a slot is free either way: refill it
            asyncio.get_running_loop().call_soon(self.pump)

    # ---- BFS strict cancel, T3, end of search -------------------------------------------------------

    def on_frontier_decided(self, depth: int, chosen: List[Tuple[Node, int]]) -> None:
        super().on_frontier_decided(depth, chosen)
        if not self.t1:
            return
        widths = {n.path: w for n, w in chosen}
        level = [e for e in self.store if e.node.parent is not None and e.node.parent.depth == depth]
        keep, cancel = bfs_early.split_on_frontier(
            [(e.path, e.node.parent.path, bfs_early.child_index(e.path)) for e in level], widths
        )
        self._bfs_targets = {}
        self._bfs_depth = depth + 1
        self._bfs_epoch += 1  # predictions still running for the decided depth are stale
        self._version += 1
        dropped = tuple(p + "." for p in cancel)
        for path in cancel + [e.path for e in self.store if e.path.startswith(dropped)]:
            self._cancel(self.store.pop(path))  # a cancelled child and everything speculated below it

    def _failed(self, node: Node, release: bool) -> None:
        """A speculative request still in the store ended without a result (refused, failed, or aborted by the
        engine): ``failed``, not a miss of the prediction. ``release``: its path may be speculated again (refused
        for load: the queue gate holds speculation meanwhile); else it stays barred (not sent over and over)."""
        if self.store.drop(node, bar=not release):
            self._count_failed(node)

    def _count_failed(self, node: Node) -> None:
        self.acc.failed += 1
        self._dues.dropped(node.path)  # a DFS prediction that failed is not judged
        if node.num_tokens:  # decoded before an abort: wasted
            self.acc.wasted_tokens += node.num_tokens
            self._missed(node)

    def _cancel(self, entry: Optional[SpecEntry]) -> None:
        if entry is None:
            return
        self.acc.on_miss(entry.distance)
        t0 = self.clock()
        if entry.state == RUNNING and entry.task is not None:
            entry.cancel_requested_at = t0

            async def _abort() -> None:
                await self.port.abort(entry.node.rid or node_rid(self.search_id, entry.path, ROLE_SPEC))
                await asyncio.wait([entry.task], timeout=30)
                self.acc.on_cancel(entry.node.num_tokens, (self.clock() - t0) * 1000.0)
                self._missed(entry.node)

            self._cancels.append(asyncio.ensure_future(_abort()))
        else:
            self.acc.on_cancel(entry.node.num_tokens, None)
            self._missed(entry.node)
        entry.state = SPEC_CANCELLED

    def on_answer(self, node: Node) -> None:
        super().on_answer(node)
        if self.early.add(node.answer, node.reward) and self.stop_reason is None:
            self.acc.early_stopped = True
            self.request_stop("early_stop")
            for e in self.store:
                if e.state == RUNNING:
                    self._cancel(self.store.pop(e.path))

    async def finalize(self) -> None:
        """Cancel what still runs, wait for it, and count what was never used."""
        if self._finalized:
            return
        self._finalized = True
        for task in list(self._predictions):
            task.cancel()
        for e in self.store:
            if e.state == RUNNING:
                self._cancel(self.store.pop(e.path))
        if self._cancels or self._promotions:
            await asyncio.gather(*self._cancels, *self._promotions, return_exceptions=True)
        self._dues.ended()
        for e in self.store:
            self.acc.never_used += 1
            self.acc.wasted_tokens += e.node.num_tokens
            self._missed(e.node)
        self.pay.finish()
        if self.acc.early_stopped:
            self.acc.early_stop_skipped_nodes = sum(1 for n in self.tree if n.status == CANCELLED)
        self.acc.primary_tokens = self.tokens_generated - sum(
            n.num_tokens for n in self.tree if n.extra.get("speculative")
        )
        self.acc.primary_requests = self.num_requests
        self.budget.unregister(self)  # (SearchContext.close then releases the search's protected prefixes)
        if self.on_finish is not None:
            try:
                await self.on_finish(self)
            except Exception:  # reporting must never fail a search
                logger.exception("spex: on_finish callback failed for search %s", self.search_id)

    async def close(self) -> None:
        try:
            await self.finalize()
        finally:
            await super().close()

    def extra_result(self) -> Optional[Dict[str, Any]]:
        d = self.acc.to_dict()
        d["settings"] = {
            "enabled": self.settings.enabled,
            "components": list(self.settings.components),
            "lookahead": self.settings.lookahead,
            "max_lookahead": self.settings.max_lookahead,
            "early_stop": self.early.enabled,
            "k_total": self.budget.k_total,
        }
        return d


def context_factory(settings: SpexConfig, budget: Optional[SpecBudget] = None, on_finish=None):
    """A ``context_factory`` for ``run_search``/``run_batch``: SPEX contexts sharing one T2 budget."""
    return functools.partial(
        SpexContext, settings=settings, budget=budget or make_budget(settings), on_finish=on_finish
    )
