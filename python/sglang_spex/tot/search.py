"""The search driver (baseline mode): run one question or many, with the same result format as the server.

Baseline = exactly what each policy issues itself: BFS policies send all branches of a depth at once, MCTS
policies one rollout at a time per question; ``run_batch`` runs many questions concurrently. Pass
``context_factory`` to run a :class:`SearchContext` subclass (SPEX does).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, List, Optional, Sequence, Union

from sglang_spex.tot.context import ProgressFn, SearchContext
from sglang_spex.tot.engine import EnginePort
from sglang_spex.tot.limits import SearchLimits
from sglang_spex.tot.result import SearchResult, judge
from sglang_spex.tot.search_spec import SearchSpec

__all__ = ["ContextFactory", "SearchResult", "judge", "run_batch", "run_search"]

ContextFactory = Callable[..., SearchContext]


async def run_search(
    spec: SearchSpec,
    question: str,
    port: EnginePort,
    *,
    reference: Optional[str] = None,
    search_id: Optional[str] = None,
    progress: Optional[ProgressFn] = None,
    context_factory: ContextFactory = SearchContext,
    limits: Optional[SearchLimits] = None,
    **ctx_kwargs: Any,
) -> SearchResult:
    """Search one question through ``port`` (client-side with HttpPort, server-side with TokenizerManagerPort);
    the spec is checked against ``limits`` (default: :class:`SearchLimits`'s defaults) first."""
    spec.validate()
    (limits or SearchLimits()).check_spec(spec)
    ctx = context_factory(
        spec, question, port, reference=reference, search_id=search_id, progress=progress, **ctx_kwargs
    )
    return await ctx.run()


async def run_batch(
    spec: Union[SearchSpec, Sequence[SearchSpec]],
    questions: Sequence[str],
    port: EnginePort,
    *,
    concurrency: int = 8,
    references: Optional[Sequence[Optional[str]]] = None,
    context_factory: ContextFactory = SearchContext,
    on_result: Optional[Callable[[int, SearchResult], None]] = None,
    limits: Optional[SearchLimits] = None,
    **ctx_kwargs: Any,
) -> List[SearchResult]:
    """Search many questions, at most ``concurrency`` at once; results in question order (``limits`` as in
    :func:`run_search`). ``spec``: one for every question, or a sequence with one per question (searches of
    different programs sharing one engine and one concurrency limit)."""
    specs = [spec] * len(questions) if isinstance(spec, SearchSpec) else list(spec)
    if len(specs) != len(questions):
        raise ValueError(f"spec: {len(specs)} specs for {len(questions)} questions")
    for distinct in {id(x): x for x in specs}.values():  # every spec checked before any search starts
        distinct.validate()
        (limits or SearchLimits()).check_spec(distinct)
    sem = asyncio.Semaphore(concurrency)
    refs = list(references) if references is not None else [None] * len(questions)

    async def one(i: int) -> SearchResult:
        async with sem:
            res = await run_search(
                specs[i],
                questions[i],
                port,
                reference=refs[i],
                context_factory=context_factory,
                limits=limits,
                **ctx_kwargs,
            )
        if on_result is not None:
            on_result(i, res)
        return res

    return list(await asyncio.gather(*(one(i) for i in range(len(questions)))))
