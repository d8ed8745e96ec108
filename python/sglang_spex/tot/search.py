"""The search driver (baseline mode): run one question or many, with the same result format as the server.

Baseline = exactly what each policy issues itself: BFS policies send all branches of a depth at once, MCTS
policies one rollout at a time per question; ``run_batch`` runs many questions concurrently. Pass
``context_factory`` to run a :class:`SearchContext` subclass (SPEX does).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from sglang_spex.tot.answers import aggregate, candidates, check_answer
from sglang_spex.tot.context import ProgressFn, SearchContext
from sglang_spex.tot.engine import EnginePort
from sglang_spex.tot.policies import POLICIES
from sglang_spex.tot.search_spec import SearchSpec
from sglang_spex.tot.tree import FAILED

ContextFactory = Callable[..., SearchContext]


@dataclass
class SearchResult:
    search_id: str
    question: str
    policy: str
    status: str  # done | cancelled | failed
    answer: Optional[str]
    correct: Optional[bool]
    reference: Optional[str]
    answers: List[Dict[str, Any]]
    nodes: List[Dict[str, Any]]
    tokens_generated: int
    num_requests: int
    wall_time: float
    failures: List[Dict[str, str]] = field(default_factory=list)
    stop_reason: Optional[str] = None
    error: Optional[str] = None
    speculation: Optional[Dict[str, Any]] = None  # SPEX accounting (None for a baseline search)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "SearchResult":
        return cls(**d)


def judge(answer: Optional[str], reference: Optional[str], task: Optional[str]) -> Optional[bool]:
    if reference is None:
        return None
    if task is not None:
        from sglang_spex.tot.tasks import Question, get_task

        return get_task(task).check_answer(answer, Question("", "", str(reference)))
    return check_answer(answer, str(reference))


def build_result(ctx: SearchContext, status: str, error: Optional[str] = None) -> SearchResult:
    ctx.sync_stats()
    cands = candidates(ctx.tree.terminals(), ctx.spec.answer.score)
    answer = aggregate(cands, ctx.spec.answer.aggregate)
    return SearchResult(
        search_id=ctx.search_id,
        question=ctx.question,
        policy=ctx.spec.policy.name,
        status=status,
        answer=answer,
        correct=judge(answer, ctx.reference, ctx.spec.task),
        reference=ctx.reference,
        answers=[asdict(c) for c in cands],
        nodes=[n.to_dict() for n in ctx.tree],
        tokens_generated=ctx.tokens_generated,
        num_requests=ctx.num_requests,
        wall_time=time.monotonic() - ctx.started,
        failures=[{"path": n.path, "error": n.error or ""} for n in ctx.tree if n.status == FAILED],
        stop_reason=ctx.stop_reason,
        error=error,
        speculation=ctx.extra_result(),
    )


async def run_context(ctx: SearchContext) -> SearchResult:
    """Run the spec's policy on a prepared context; cancellation (task cancel) aborts its requests."""
    status, error = "done", None
    try:
        await POLICIES[ctx.policy_name].run(ctx)
        if ctx.cancelled:
            status = "cancelled"
    except asyncio.CancelledError:
        await asyncio.shield(ctx.cancel("cancelled"))
        raise
    except Exception as e:  # the policy itself broke: report, and abort what it left running
        status, error = "failed", repr(e)
        await ctx.cancel("error")
    finally:
        await ctx.close()
    return build_result(ctx, status, error)


async def run_search(
    spec: SearchSpec,
    question: str,
    port: EnginePort,
    *,
    reference: Optional[str] = None,
    search_id: Optional[str] = None,
    progress: Optional[ProgressFn] = None,
    context_factory: ContextFactory = SearchContext,
    **ctx_kwargs: Any,
) -> SearchResult:
    """Search one question through ``port`` (client-side with HttpPort, server-side with TokenizerManagerPort)."""
    spec.validate()
    ctx = context_factory(
        spec, question, port, reference=reference, search_id=search_id, progress=progress, **ctx_kwargs
    )
    return await run_context(ctx)


async def run_batch(
    spec: SearchSpec,
    questions: Sequence[str],
    port: EnginePort,
    *,
    concurrency: int = 8,
    references: Optional[Sequence[Optional[str]]] = None,
    context_factory: ContextFactory = SearchContext,
    on_result: Optional[Callable[[int, SearchResult], None]] = None,
    **ctx_kwargs: Any,
) -> List[SearchResult]:
    """Search many questions, at most ``concurrency`` at once; results in question order."""
    spec.validate()
    sem = asyncio.Semaphore(concurrency)
    refs = list(references) if references is not None else [None] * len(questions)

    async def one(i: int) -> SearchResult:
        async with sem:
            res = await run_search(
                spec, questions[i], port, reference=refs[i], context_factory=context_factory, **ctx_kwargs
            )
        if on_result is not None:
            on_result(i, res)
        return res

    return list(await asyncio.gather(*(one(i) for i in range(len(questions)))))
