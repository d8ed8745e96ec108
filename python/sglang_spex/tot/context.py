"""SearchContext: one search's tree, policy, engine port, step config and reward — and the only place that
generates.

:meth:`SearchContext.run` runs the spec's policy object on it and returns the result. Policies never call the
port: they call :meth:`SearchContext.expand` / :meth:`SearchContext.generate_node` and consult
:meth:`SearchContext.should_stop` between steps. A subclass (SPEX) overrides ``generate_node`` (e.g. to serve
a node already produced speculatively) and the hooks ``on_rollout``, ``on_children_scored``,
``on_frontier_decided``, ``on_answer``, ``should_stop``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from sglang_spex.tot.answers import PatternBudget, PatternTooSlow, aggregate, candidates
from sglang_spex.tot.backpressure import gate_for
from sglang_spex.tot.engine import (
    ROLE_PRIMARY,
    EngineLost,
    EnginePort,
    GenRequest,
    GenResult,
    node_rid,
    search_rid_prefix,
)
from sglang_spex.tot.limits import SearchLimits
from sglang_spex.tot.policies.base import Policy, Stat, Stats
from sglang_spex.tot.result import SearchResult, judge
from sglang_spex.tot.rewards import Reward, build_reward
from sglang_spex.tot.search_spec import SearchSpec
from sglang_spex.tot.tree import (
    CANCELLED,
    DONE,
    FAILED,
    GENERATING,
    KIND_STEP,
    PENDING,
    Node,
    Tree,
    node_seed,
)
from sglang_spex.tot.validation import check_search_id

logger = logging.getLogger(__name__)

DEFAULT_REWARD_TIMEOUT = 120.0
RETOKENIZE_MARGIN = 8  # tokens a path's text may gain when re-tokenized whole (the stop string, merges)
# How long a search's end waits for the engine's release of its protection (acknowledged within a scheduler step
# or so): past it the wait is dropped, so a hung worker or a dead DP rank cannot hold the search's result. A release
# that never arrives leaves the protection to its lease (prefix_protection: ttl_s without the search's requests).
RELEASE_TIMEOUT_S = 3.0
ENGINE_ABORTED = "aborted by the engine"  # a node's error: its request was aborted, not by this search
STOP_PATTERN_BUDGET = "answer_pattern_budget"  # stop_reason: the answer pattern used its time on this search
ProgressFn = Callable[[Dict[str, Any]], None]


class SearchContext:
    """State and generation of one search (one question)."""

    def __init__(
        self,
        spec: SearchSpec,
        question: str,
        port: EnginePort,
        *,
        reward: Optional[Reward] = None,
        search_id: Optional[str] = None,
        reference: Optional[str] = None,
        progress: Optional[ProgressFn] = None,
        reward_timeout: Optional[float] = None,
        policy: Optional[Policy] = None,
    ):
        """``policy``: a policy object to run instead of the one the spec names (e.g. a subclass); ``search_id``:
        checked by :func:`check_search_id` (None: a random one)."""
        self.spec = spec
        self.policy = policy if policy is not None else spec.policy.build()
        self.question = question
        self.reference = reference
        self.port = port
        self.reward = reward or build_reward(spec.reward)
        self._own_reward = reward is None
        self.search_id = uuid.uuid4().hex[:16] if search_id is None else check_search_id(search_id)
        self.tree = Tree(spec.seed)
        self.stats: Stats = {self.tree.root.path: Stat(self.tree.root.path, None, 0)}
        self.prompt_prefix = spec.step.prompt_template.format(question=question)
        self.reward_timeout = spec.reward_timeout or reward_timeout or DEFAULT_REWARD_TIMEOUT
        self.progress = progress
        self.num_requests = 0
        self.tokens_generated = 0
        self.pattern_budget = PatternBudget()  # the answer pattern's time on this search's steps
        self.cancelled = False
        self.stop_reason: Optional[str] = None
        self.inflight: Set[str] = set()
        self.started = time.monotonic()
        self.limits: Optional[SearchLimits] = None  # the server's (server-side): a path that fills the context ends
        self.rank_watchers: List[Callable[["SearchContext"], None]] = []  # called after ``dp_rank`` is set
        self.dp_rank = None
        self._running: Dict[str, "asyncio.Future[Node]"] = {}

    @property
    def dp_rank(self) -> Optional[int]:
        """The DP rank every request of this search goes to (``--dp-size`` > 1); None without DP."""
        return self._dp_rank

    @dp_rank.setter
    def dp_rank(self, rank: Optional[int]) -> None:
        self._dp_rank = rank
        for fn in list(getattr(self, "rank_watchers", ())):  # e.g. SPEX's budget, which groups searches by rank
            fn(self)

    # ---- generation (the single path to the engine) -------------------------------------------------

    def prompt_for(self, parent: Node) -> str:
        return self.prompt_prefix + parent.trajectory_text()

    def request_for(self, node: Node) -> GenRequest:
        step = self.spec.step
        return GenRequest(
            prompt=self.prompt_for(node.parent),
            rid=node.rid,
            max_new_tokens=step.max_tokens,
            temperature=step.temperature,
            top_p=step.top_p,
            stop=list(step.stop),
            seed=node.seed,
            return_logprob=self.reward.needs_logprobs,
            role=ROLE_PRIMARY,
            search_id=self.search_id,
            node_path=node.path,
            priority=self.spec.priority,
            dp_rank=self.dp_rank,
        )

    async def generate_node(self, parent: Node, index: int, kind: str = KIND_STEP) -> Node:
        """Generate and score the ``index``-th child of ``parent`` (created if needed); idempotent per path."""
        node = self.tree.child(parent, index, kind)
        if node.path in self._running:
            return await asyncio.shield(self._running[node.path])
        if node.status in (DONE, FAILED) or (self.should_stop() and node.status == PENDING):
            if node.status == PENDING:
                node.status = CANCELLED
            return node
        fut: "asyncio.Future[Node]" = asyncio.get_running_loop().create_future()
        self._running[node.path] = fut
        try:
            await self._generate(node)
        finally:
            del self._running[node.path]
            fut.set_result(node)
        return node

    async def _generate(self, node: Node) -> None:
        node.status, node.error = GENERATING, None
        node.rid = node_rid(self.search_id, node.path)
        if node.kind == KIND_STEP:
            self.stats[node.path].generating = True
        self.inflight.add(node.rid)
        self.num_requests += 1
        try:
            res = await gate_for(self.port).generate_primary(
                self.port, self.request_for(node), lambda: self.cancelled, lambda w: self._backing_off(node.rid, w)
            )
        except asyncio.CancelledError:
            node.status = CANCELLED
            raise
        except EngineLost as e:  # the whole search fails (run() reports it and aborts what is left)
            self._fail(node, f"generate: {e!r}")
            raise
        except Exception as e:
            self._fail(node, f"generate: {e!r}")
            return
        finally:
            self.inflight.discard(node.rid)
            if node.kind == KIND_STEP:
                self.stats[node.path].generating = False
        if res.aborted:
            node.status = CANCELLED
            if not self.should_stop():  # nothing of this search asked for it: the engine (or an operator) did
                node.error = f"{ENGINE_ABORTED}: {res.abort_message}" if res.abort_message else ENGINE_ABORTED
            self._emit_node(node)
            return
        self.apply_result(node, res)
        await self.score_node(node)
        self._update_stat(node)
        self._emit_node(node)
        if node.ok and node.answer is not None and node.kind == KIND_STEP:
            self.on_answer(node)

    def _backing_off(self, rid: str, waiting: bool) -> None:
        """A primary refused for load waits to be sent again: nothing of it is in the engine meanwhile (a cancel
        need not wait for it; it is not sent again once cancelled)."""
        if waiting:
            self.inflight.discard(rid)
        else:
            self.inflight.add(rid)

    def apply_result(self, node: Node, res: GenResult) -> None:
        """Fill the node from the engine result; decide whether it is terminal and what it answers."""
        stop = res.matched_stop if res.finish_reason == "stop" and isinstance(res.matched_stop, str) else ""
        node.text = res.text + stop
        node.num_tokens = res.completion_tokens or len(res.output_ids)
        node.prompt_tokens, node.cached_tokens = res.prompt_tokens, res.cached_tokens
        node.logprobs, node.finish_reason, node.latency = list(res.logprobs), res.finish_reason, res.latency
        self.tokens_generated += node.num_tokens
        try:
            node.answer = self.pattern_budget.extract(res.text, self.spec.answer.pattern)
        except PatternTooSlow as e:  # the step fails, and the search stops: no step after it could state an answer
            node.answer, node.is_terminal, node.status, node.error = None, True, FAILED, str(e)
            self.request_stop(STOP_PATTERN_BUDGET)
            return
        eos = res.finish_reason == "stop" and res.matched_stop is None
        node.is_terminal = (
            node.answer is not None
            or eos
            or node.cum_tokens >= self.spec.step.max_total_tokens
            or node.depth >= self.policy.max_depth
            or self._context_full(node)
        )
        node.status = DONE

    def _context_full(self, node: Node) -> bool:
        """Another step below ``node`` would not fit the engine (SGLang would refuse the request)."""
        if self.limits is None or not node.prompt_tokens:
            return False
        next_prompt = node.prompt_tokens + node.num_tokens + RETOKENIZE_MARGIN
        return not self.limits.fits(next_prompt, self.spec.step.max_tokens)

    async def score_node(self, node: Node) -> None:
        """Reward the node; a reward that raises or times out marks the node failed."""
        if node.status != DONE:
            return
        try:
            node.reward = float(
                await asyncio.wait_for(self.reward.score(node, self.question, self.search_id), self.reward_timeout)
            )
        except asyncio.TimeoutError:
            self._fail(node, f"reward timed out after {self.reward_timeout:g}s")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._fail(node, f"reward: {e!r}")

    def _fail(self, node: Node, error: str) -> None:
        node.status, node.error, node.reward = FAILED, error, None
        if node.kind == KIND_STEP:
            self._update_stat(node)
        logger.info("search %s node %s failed: %s", self.search_id, node.path, error)

    def _update_stat(self, node: Node) -> None:
        st = self.stats.get(node.path) if node.kind == KIND_STEP and self.tree.nodes.get(node.path) is node else None
        if st is not None:  # the tree's own node only: a speculative one counts once adopted (``SpexContext._adopt``)
            self.policy.update_stat(st, node)

    async def expand(self, parent: Node, n: int, kind: str = KIND_STEP) -> List[Node]:
        """Create the next ``n`` children of ``parent`` and generate them concurrently (one batch)."""
        siblings = parent.children if kind == KIND_STEP else parent.rollouts
        start = len(siblings)
        nodes = [self.tree.child(parent, start + i, kind) for i in range(n)]
        if kind == KIND_STEP:
            pst = self.stats[parent.path]
            for c in nodes:
                self.stats.setdefault(c.path, Stat(c.path, parent.path, c.depth))
                if c.path not in pst.children:
                    pst.children.append(c.path)
        await asyncio.gather(*(self.generate_node(parent, start + i, kind) for i in range(n)))
        if kind == KIND_STEP and not self.should_stop():
            self.stats[parent.path].expanded = True
        self.on_children_scored(parent, nodes)
        return nodes

    # ---- hooks --------------------------------------------------------------------------------------

    def on_rollout(self, index: int) -> None:
        """MCTS: rollout ``index`` starts (its random stream is ``policy.rollout_rng(self.rng, index)``)."""

    def on_children_scored(self, parent: Node, children: List[Node]) -> None:
        """A batch of siblings has been generated and scored."""

    def on_frontier_decided(self, depth: int, chosen: List[Tuple[Node, int]]) -> None:
        """BFS: the policy chose to expand these nodes of ``depth`` with these widths."""
        self.emit({"event": "frontier", "depth": depth, "chosen": [[n.path, w] for n, w in chosen]})

    def on_answer(self, node: Node) -> None:
        """A step node stating an answer was produced."""
        self.emit({"event": "answer", "path": node.path, "answer": node.answer, "reward": node.reward})

    def should_stop(self) -> bool:
        """Policies check this between steps; SPEX's early stop overrides it."""
        return self.cancelled or self.stop_reason is not None

    def request_stop(self, reason: str) -> None:
        """Stop gracefully: the search returns what it has (not a cancel: running requests finish)."""
        self.stop_reason = self.stop_reason or reason

    # ---- helpers ------------------------------------------------------------------------------------

    def rng(self, label: str) -> random.Random:
        """A random stream that depends only on (search seed, label)."""
        return random.Random(node_seed(self.spec.seed, label))

    def sync_stats(self) -> None:
        """Copy MCTS statistics onto the nodes (for results and progress)."""
        for path, st in self.stats.items():
            node = self.tree.nodes[path]
            node.visits, node.value = st.visits, st.value

    def emit(self, event: Dict[str, Any]) -> None:
        if self.progress is not None:
            try:
                self.progress(event)
            except Exception:  # a progress consumer never breaks the search
                logger.exception("progress callback failed")

    def _emit_node(self, node: Node) -> None:
        self.emit(
            {
                "event": "node",
                "path": node.path,
                "parent": node.parent.path if node.parent is not None else None,
                "kind": node.kind,
                "status": node.status,
                "reward": node.reward,
                "terminal": node.is_terminal,
                "tokens": node.num_tokens,
                "text": node.text,
                "answer": node.answer,
                "speculative": bool(node.extra.get("speculative")),
            }
        )

    # ---- running and the result ---------------------------------------------------------------------

    async def run(self) -> SearchResult:
        """Run the policy to the end and return the result; a task cancel aborts the search's requests."""
        status, error = "done", None
        try:
            await self.policy.run(self)
            if self.cancelled:
                status = "cancelled"
            elif self._all_failed():  # e.g. every reward call raised: no result to speak of
                status, error = "failed", f"every node failed; the first: {self._first_failure()}"
        except asyncio.CancelledError:
            await asyncio.shield(self.cancel("cancelled"))
            raise
        except Exception as e:  # the policy itself broke: report, and abort what it left running
            status, error = "failed", repr(e)
            await self.cancel("error")
        finally:
            await self.close()
        return await self.finish(status, error)

    def _all_failed(self) -> bool:
        """No node has a result and one at least failed or was aborted by the engine (a search that stopped
        itself early is not a failure)."""
        nodes = [n for n in self.tree if n.parent is not None]
        return (
            bool(nodes)
            and all(n.status in (FAILED, CANCELLED) for n in nodes)
            and any(n.error is not None for n in nodes)
        )

    def _first_failure(self) -> str:
        return next((f"{n.path}: {n.error}" for n in self.tree if n.error is not None), "")

    async def finish(self, status: str, error: Optional[str] = None) -> SearchResult:
        """:meth:`result`, its answer judged off the event loop (math-verify may take seconds)."""
        res = self.result(status, error, judged=False)
        res.correct = await asyncio.to_thread(judge, res.answer, self.reference, self.spec.task)
        return res

    def result(self, status: str, error: Optional[str] = None, judged: bool = True) -> SearchResult:
        """The search's result as it stands: answers aggregated, every node, accounting (``correct`` left None
        unless ``judged``)."""
        self.sync_stats()
        cands = candidates(self.tree.terminals(), self.spec.answer.score)
        answer = aggregate(cands, self.spec.answer.aggregate)
        return SearchResult(
            search_id=self.search_id,
            question=self.question,
            policy=self.spec.policy.name,
            status=status,
            answer=answer,
            correct=judge(answer, self.reference, self.spec.task) if judged else None,
            reference=self.reference,
            answers=[asdict(c) for c in cands],
            nodes=[n.to_dict() for n in self.tree],
            tokens_generated=self.tokens_generated,
            num_requests=self.num_requests,
            wall_time=time.monotonic() - self.started,
            failures=[{"path": n.path, "error": n.error} for n in self.tree if n.error is not None],
            stop_reason=self.stop_reason,
            error=error,
            speculation=self.extra_result(),
        )

    async def cancel(self, reason: str = "cancelled", timeout: float = 10.0) -> None:
        """Stop the search and abort every request it has in the engine (one prefix abort, repeated until
        nothing of this search is in flight: a request submitted during the abort is caught by the next)."""
        self.cancelled = True
        self.stop_reason = self.stop_reason or reason
        deadline = time.monotonic() + timeout
        while True:
            await self.port.abort(search_rid_prefix(self.search_id))
            if not self.inflight or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)

    def extra_result(self) -> Optional[Dict[str, Any]]:
        """Extra result section a subclass reports (SPEX: its speculation accounting)."""
        return None

    async def close(self) -> None:
        """The search ended: the engine stops protecting its cached prefixes (the scheduler protects any live
        search's, baseline or SPEX, client- or server-side; waited for at most ``RELEASE_TIMEOUT_S``, a failure
        logged), and a reward client of its own closes."""
        try:
            await asyncio.wait_for(self.port.release(self.search_id), RELEASE_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.warning("releasing search %s: no answer within %.0f s", self.search_id, RELEASE_TIMEOUT_S)
        except Exception:
            logger.exception("releasing search %s failed", self.search_id)
        if self._own_reward:
            await self.reward.close()
