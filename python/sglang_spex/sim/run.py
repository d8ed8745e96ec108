"""Run the real search code on the simulator, in virtual time.

>>> from sglang_spex.sim.run import simulate
>>> from sglang_spex.tot.search_spec import PolicyConfig, SearchSpec
>>> run = simulate(SearchSpec(policy=PolicyConfig("rebase-8")), cost=("A100-80G", "Llemma-7B"), questions=4)
>>> run.questions_per_min, run.accuracy, run.engine["mean_batch"]

``driver`` swaps the baseline ``run_batch`` for another runner with the same shape (SPEX's), so baseline and
speculative runs share the engine, workload, reward and clock — and every line of policy code.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple, Union

from sglang_spex.config import SpexConfig, replace
from sglang_spex.sim.clock import run_virtual
from sglang_spex.sim.cost import CostModel, RooflineCost, make_cost
from sglang_spex.sim.engine import SimPort
from sglang_spex.sim.workload import AnyWorkload, MixedWorkload, workload_for
from sglang_spex.speculation.budget import UNKNOWN_MODEL, ModelBytes, make_budget
from sglang_spex.speculation.runner import context_factory
from sglang_spex.tot.context import SearchContext
from sglang_spex.tot.rewards import Reward
from sglang_spex.tot.search import SearchResult, run_batch
from sglang_spex.tot.search_spec import SearchSpec
from sglang_spex.tot.tree import Node

CostSpec = Union[CostModel, Tuple[str, str], str]
# driver(spec, questions, references, port, concurrency, **ctx_kwargs) -> results in question order
Driver = Callable[..., Awaitable[List[SearchResult]]]


class SimReward(Reward):
    """The workload's reward for a node (a PRM that costs ``latency_s`` of virtual time per call)."""

    def __init__(self, workload: AnyWorkload, latency_s: float = 0.0):
        self.workload = workload
        self.latency_s = latency_s
        self.calls = 0

    async def score(self, node: Node, question: str, search_id: str = "") -> float:
        self.calls += 1
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        qid = self.workload.question_id(question)
        if qid is None:
            raise ValueError(
                f"SimReward: {question[:60]!r} is not one of the workload's questions ('Problem <id>: ...')"
            )
        return self.workload.reward(qid, node.path)


@dataclass
class SimRun:
    results: List[SearchResult]
    virtual_time: float  # simulated seconds from the first submission to the last result
    engine: Dict[str, Any]
    wall_time: float  # real seconds the simulation took (each result's ``wall_time``: its virtual latency)
    config: Dict[str, Any] = field(default_factory=dict)

    @property
    def questions_per_min(self) -> float:
        return 60.0 * len(self.results) / self.virtual_time if self.virtual_time > 0 else float("inf")

    @property
    def accuracy(self) -> float:
        judged = [r.correct for r in self.results if r.correct is not None]
        return sum(judged) / len(judged) if judged else float("nan")

    @property
    def answers(self) -> List[Optional[str]]:
        return [r.answer for r in self.results]

    def summary(self) -> Dict[str, Any]:
        return {
            "questions": len(self.results),
            "virtual_time_s": self.virtual_time,
            "questions_per_min": self.questions_per_min,
            "accuracy": self.accuracy,
            "tokens": sum(r.tokens_generated for r in self.results),
            "requests": sum(r.num_requests for r in self.results),
            "wall_time_s": self.wall_time,
            "engine": self.engine,
        }


def resolve_cost(cost: CostSpec, profile=None) -> CostModel:
    if isinstance(cost, CostModel):
        return cost
    if isinstance(cost, tuple):
        return RooflineCost(*cost)
    return make_cost(cost, profile=profile)


async def baseline_driver(
    spec: Union[SearchSpec, Sequence[SearchSpec]],
    questions: Sequence[str],
    references: Sequence[str],
    port: SimPort,
    concurrency: int,
    **kw: Any,
) -> List[SearchResult]:
    """``run_batch``, with each result's ``wall_time`` in virtual seconds: from its search's start (when a
    concurrency slot took it) to its result, the latency a client of a real server would see."""
    loop = asyncio.get_running_loop()
    factory = kw.pop("context_factory", SearchContext)
    started: Dict[str, float] = {}

    def timed_factory(*args: Any, **ctx_kw: Any) -> SearchContext:
        ctx = factory(*args, **ctx_kw)
        started[ctx.search_id] = loop.time()
        return ctx

    def on_result(_: int, res: SearchResult) -> None:
        res.wall_time = loop.time() - started.pop(res.search_id)

    return await run_batch(
        spec,
        questions,
        port,
        concurrency=concurrency,
        references=references,
        context_factory=timed_factory,
        on_result=on_result,
        **kw,
    )


def simulate(
    spec: Union[SearchSpec, Sequence[SearchSpec]],
    *,
    cost: CostSpec,
    workload: Optional[AnyWorkload] = None,
    questions: Union[int, Sequence[Tuple[str, str]]] = 8,
    concurrency: int = 1,
    driver: Driver = baseline_driver,
    reward_latency_s: float = 0.0,
    engine_kwargs: Optional[Dict[str, Any]] = None,
    context_factory: Callable[..., SearchContext] = SearchContext,
    **ctx_kwargs: Any,
) -> SimRun:
    """Run ``questions`` searches (``concurrency`` at a time) on a fresh simulated engine, in virtual time.

    ``spec`` a sequence: a mix of programs on one engine. Question ``i`` runs ``spec[i % len(spec)]`` on the
    matching part of a :class:`MixedWorkload` (by default :func:`~sglang_spex.sim.workload.workload_for` of the specs' policies).
    ``questions`` as (text, reference) pairs must be the workload's own (``workload.questions(n)``: the text starts
    ``Problem <id>:``, which keys the simulated tree and rewards); other text is a ValueError. With a
    :class:`RooflineCost` and no ``kv_capacity`` in ``engine_kwargs``, a model that leaves no room for KV in the
    device's memory is a ValueError.
    """
    cost_model = resolve_cost(cost)
    specs = [spec] if isinstance(spec, SearchSpec) else list(spec)
    names = [s.policy.name for s in specs]
    seeds = [s.seed for s in specs]
    wl = (
        workload
        if workload is not None
        else workload_for(names[0] if isinstance(spec, SearchSpec) else names, seed=seeds)
    )
    if not isinstance(spec, SearchSpec) and (not isinstance(wl, MixedWorkload) or len(wl.parts) != len(specs)):
        raise ValueError(f"spec: {len(specs)} specs need a MixedWorkload of as many parts")
    qs = wl.questions(questions) if isinstance(questions, int) else list(questions)
    for i, (q, _) in enumerate(qs):
        if wl.question_id(q) is None:
            raise ValueError(
                f"questions[{i}]: the simulator only knows its workload's questions ('Problem <id>: ...'), "
                f"got {q[:60]!r}; use workload.questions(n)"
            )
    run_spec = spec if isinstance(spec, SearchSpec) else [specs[i % len(specs)] for i in range(len(qs))]
    reward = SimReward(wl, reward_latency_s)
    ekw = dict(engine_kwargs or {})
    if "kv_capacity" not in ekw and isinstance(cost_model, RooflineCost):
        ekw["kv_capacity"] = cost_model.max_kv_tokens()

    async def main() -> Tuple[List[SearchResult], float, Dict[str, Any]]:
        port = SimPort(cost_model, wl, **ekw)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            results = await driver(
                run_spec,
                [q for q, _ in qs],
                [a for _, a in qs],
                port,
                concurrency,
                context_factory=context_factory,
                reward=reward,
                **ctx_kwargs,
            )
            elapsed = loop.time() - t0
            return results, elapsed, port.metrics.to_dict()
        finally:
            await port.close()

    w0 = time.perf_counter()
    results, elapsed, engine = run_virtual(main)
    config = {
        "cost": cost_model.name,
        "workload": wl.describe(),
        "concurrency": concurrency,
        "spec": spec.to_dict() if isinstance(spec, SearchSpec) else [s.to_dict() for s in specs],
    }
    return SimRun(results, elapsed, engine, time.perf_counter() - w0, config)


def virtual_now() -> float:
    """The running (virtual-time) loop's clock."""
    return asyncio.get_running_loop().time()


def model_bytes_of(cost: Optional[CostModel]) -> ModelBytes:
    """T2's byte terms for the simulated model (S_w and K+V bytes per token), as a server reads them from its
    model config; unknown (scores then see tokens) for a cost model without them."""
    if cost is None or cost.weight_bytes <= 0 or cost.kv_bytes_per_token <= 0:
        return UNKNOWN_MODEL
    return ModelBytes(cost.weight_bytes, cost.kv_bytes_per_token)


def spex_factory(cfg: SpexConfig, cost: Optional[CostModel] = None) -> Callable[..., SearchContext]:
    """SPEX contexts for :func:`simulate` (``k_total=None`` takes the knee of ``cost``, as ``--tot-k-total auto``
    takes the live profile's)."""
    if cfg.k_total is None and cost is not None:
        cfg = replace(cfg, k_total=cost.k_total())
    budget = make_budget(cfg, model=model_bytes_of(cost))
    budget.clock = virtual_now  # the starvation bound, wave meter and hit spans run on the simulated clock
    if cost is not None:  # the pay-off gate's step line: the cost model's fit below its knee (the server: its live fit)
        fit = cost.knee()
        budget.step_cost = lambda *rank: (fit.a, max(fit.b1, 0.0))
    return context_factory(cfg, budget)


def compare(spec: SearchSpec, cfg: SpexConfig, *, cost: CostSpec, **kw: Any) -> Tuple[SimRun, SimRun]:
    """(baseline, SPEX) on the same simulated engine model, workload and questions."""
    cost_model = resolve_cost(cost)
    base = simulate(spec, cost=cost_model, **kw)
    spex = simulate(spec, cost=cost_model, context_factory=spex_factory(cfg, cost_model), **kw)
    return base, spex
