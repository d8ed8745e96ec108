"""The search driver (baseline mode): run one question or many, with the same result format as the server.

Baseline = exactly what each policy issues itself: BFS policies send all branches of a depth at once, MCTS
policies one rollout at a time per question; ``run_batch`` runs many questions concurrently. Pass
``context_factory`` to run a :class:`SearchContext` subclass (SPEX does).

Checked before a search starts, as ``POST /tot/search`` checks them: the question (a non-empty string of valid
Unicode), a given search id, the spec and its ``speculation`` overrides (``speculation.settings.resolve``; they take
effect only under SPEX's context factory), the spec against :class:`SearchLimits`, and, over an :class:`HttpPort`,
the prompt against the model's context as the server reports it; each search's context then ends a path at the
context as a server-side search does (``ctx.limits``). A batch stops at its first error: the other searches are
cancelled (their requests aborted) and awaited before the error is raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, List, Optional, Sequence, TypeVar, Union

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.settings import resolve
from sglang_spex.tot.context import ProgressFn, SearchContext
from sglang_spex.tot.engine import EnginePort
from sglang_spex.tot.http_port import HttpPort
from sglang_spex.tot.limits import SearchLimits
from sglang_spex.tot.result import SearchResult, judge
from sglang_spex.tot.search_spec import SearchSpec
from sglang_spex.tot.validation import SearchSpecError, check, check_int, check_search_id

__all__ = [
    "ClientLimits",
    "ContextFactory",
    "SearchResult",
    "check_batch_text",
    "check_text",
    "client_limits",
    "gather_or_cancel",
    "judge",
    "per_question",
    "run_batch",
    "run_search",
    "validate_spec",
]

ContextFactory = Callable[..., SearchContext]
T = TypeVar("T")


@dataclass(frozen=True)
class ClientLimits(SearchLimits):
    """The limits of a client-side search: :class:`SearchLimits`'s defaults (``limits=`` replaces them) with the
    model's context as the server reports it. Its errors name these client-side limits, not a server's flags."""

    WHERE = "the client-side"

    def source(self, limit_name: str) -> str:
        return f"SearchLimits.{limit_name}; pass limits= to change"


async def client_limits(port: EnginePort, limits: Optional[SearchLimits] = None) -> SearchLimits:
    """``limits`` (default: :class:`ClientLimits`) with the model's context an :class:`HttpPort`'s server reports
    where ``limits`` sets none (other ports report none: no context check)."""
    limits = limits if limits is not None else ClientLimits()
    if not isinstance(port, HttpPort) or limits.context_len is not None or limits.max_input_len is not None:
        return limits
    return dataclasses.replace(limits, **await port.capacity())


def check_text(value: Any, name: str, empty_ok: bool = False) -> None:
    """``value`` is a string (non-empty unless ``empty_ok``) that encodes as UTF-8 (no lone surrogate), as the
    server and its tokenizer need; else :class:`SearchSpecError` naming ``name``."""
    check(isinstance(value, str), name, "must be a string")
    check(empty_ok or value != "", name, "must be a non-empty string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SearchSpecError(name, f"is not valid Unicode: a lone surrogate at character {e.start}") from None


def per_question(values: Optional[Iterable[T]], n: int, name: str) -> List[Optional[T]]:
    """``values`` as a list with one entry per question (None: ``n`` Nones); a plain string or a list of another
    length raises :class:`SearchSpecError` naming ``name``."""
    if values is None:
        return [None] * n
    check(not isinstance(values, (str, bytes)), name, "must be a list with one entry per question, not a string")
    values = list(values)
    check(len(values) == n, name, f"{len(values)} given for {n} questions")
    return values


def check_batch_text(questions: Any, references: Optional[Iterable[Optional[str]]] = None) -> List[Optional[str]]:
    """Check a batch's ``questions`` (a list, not one string; each a non-empty string) and ``references`` (one per
    question, each a string or None); returns the references as a list."""
    check(
        isinstance(questions, Sequence) and not isinstance(questions, (str, bytes)),
        "questions",
        "must be a list of questions (one question is run with run/arun)",
    )
    for i, q in enumerate(questions):
        check_text(q, f"questions[{i}]")
    refs = per_question(references, len(questions), "references")
    for i, ref in enumerate(refs):
        if ref is not None:
            check_text(ref, f"references[{i}]", empty_ok=True)
    return refs


def validate_spec(spec: SearchSpec, limits: SearchLimits) -> None:
    """The spec is valid, within ``limits``, and its ``speculation`` overrides are ones a server takes (checked
    against the default :class:`SpexConfig`: they apply only under SPEX's context factory)."""
    spec.validate()
    limits.check_spec(spec)
    resolve(SpexConfig(), spec.speculation)


async def gather_or_cancel(aws: Iterable[Awaitable[T]]) -> List[T]:
    """The awaitables' results in order, run concurrently. At the first error (or a cancel) the others are cancelled
    and awaited — a search's cancel aborts its requests — before the error is raised, so none outlives the call."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


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
    the question, ``search_id`` (:func:`check_search_id`, the server's rule), the spec and the prompt are checked
    against ``limits`` (default: :func:`client_limits`) first."""
    check_text(question, "question")
    if search_id is not None:
        check_search_id(search_id)
    if reference is not None:
        check_text(reference, "reference", empty_ok=True)
    limits = await client_limits(port, limits)
    validate_spec(spec, limits)
    await check_prompt(spec, question, port, limits)
    ctx = context_factory(
        spec, question, port, reference=reference, search_id=search_id, progress=progress, **ctx_kwargs
    )
    ctx.limits = limits  # a path that fills the model's context ends there (as server-side)
    return await ctx.run()


async def check_prompt(spec: SearchSpec, question: str, port: EnginePort, limits: SearchLimits) -> None:
    """The search's prompt and one step fit the model (``limits``' context; counted by an :class:`HttpPort`'s
    server, not checked where nothing counts it)."""
    if isinstance(port, HttpPort) and (limits.context_len is not None or limits.max_input_len is not None):
        prompt = spec.step.prompt_template.format(question=question)
        limits.check_spec(spec, prompt_tokens=await port.count_tokens(prompt))


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
    different programs sharing one engine and one concurrency limit). A search that fails (or an ``on_result``
    that raises) cancels the others: see :func:`gather_or_cancel`."""
    refs = check_batch_text(questions, references)
    specs = [spec] * len(questions) if isinstance(spec, SearchSpec) else per_question(spec, len(questions), "spec")
    check_int(concurrency, "concurrency", 1)
    limits = await client_limits(port, limits)
    for distinct in {id(x): x for x in specs}.values():  # every spec checked before any search starts
        validate_spec(distinct, limits)
    sem = asyncio.Semaphore(concurrency)

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

    return await gather_or_cancel(one(i) for i in range(len(questions)))
