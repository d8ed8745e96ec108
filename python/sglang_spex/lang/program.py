"""A small frontend for tree searches that reads like SGLang's: declare, then run a question or a batch.

    import sglang_spex.lang as tot

    @tot.search
    def solve(s):
        s.policy(tot.rebase(width=8))
        s.step(stop=["\\n\\n"], max_tokens=128, temperature=1.0, seed=0)
        s.reward(tot.verifier("arith"))
        s.answer(r"The answer is (.*)", aggregate="weighted", score="last")

    result = solve.run("What is 2 + 3?", backend=tot.Endpoint("http://127.0.0.1:30000"))          # server-side
    results = solve.run_batch(questions, backend=tot.Endpoint(url, server_side=False))  # client-side

A program serialises to a validated JSON spec (:meth:`Program.spec`, :meth:`Program.to_json`). Server-side
runs ``POST /tot/search`` on our launcher's server (the loop runs inside SGLang); client-side runs the same
search loop here against any SGLang endpoint. Both return :class:`~sglang_spex.tot.search.SearchResult`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import httpx

from sglang_spex.tot.http_port import HttpPort
from sglang_spex.tot.search import SearchResult, run_batch
from sglang_spex.tot.search_spec import AnswerConfig, PolicyConfig, RewardConfig, SearchSpec, SearchSpecError

# ---- declarations -------------------------------------------------------------------------------------


def policy(name: str, **knobs: Any) -> PolicyConfig:
    """Any policy or preset by name (``"rebase-16"``, ``"rest-5"``) with knob overrides."""
    return PolicyConfig(name=name, params=dict(knobs))


def rebase(**knobs: Any) -> PolicyConfig:
    """REBASE; ``knobs`` are ``RebaseParams`` fields (width, softmax_temperature, max_depth), unset = default."""
    return policy("rebase", **knobs)


def ets(**knobs: Any) -> PolicyConfig:
    """ETS; ``knobs`` are ``EtsParams`` fields (REBASE's plus lambda_c, lambda_s, cluster_threshold, embedder)."""
    return policy("ets", **knobs)


def rstar(**knobs: Any) -> PolicyConfig:
    """rSTAR-MCTS; ``knobs`` are ``RStarParams`` fields (num_rollouts, max_depth, branch, exploration_weight,
    target_answers)."""
    return policy("rstar", **knobs)


def rest(**knobs: Any) -> PolicyConfig:
    """REST-MCTS*; ``knobs`` are ``RestParams`` fields (iterations, branch, exploration_constant, end_gate, …)."""
    return policy("rest", **knobs)


def logprob() -> RewardConfig:
    return RewardConfig(type="logprob")


def prm(url: str, **options: Any) -> RewardConfig:
    """A process reward model on another SGLang server (options: mode, good_token, bad_token, step_tag,
    prm_template)."""
    return RewardConfig(type="prm", url=url, **options)


def verifier(name: str) -> RewardConfig:
    return RewardConfig(type="verifier", name=name)


def callback(url: str) -> RewardConfig:
    return RewardConfig(type="callback", url=url)


@dataclass
class Endpoint:
    """Where a program runs: our launcher's server (``server_side=True``) or any SGLang endpoint."""

    url: str
    server_side: bool = True
    timeout: float = 3600.0


# ---- the program --------------------------------------------------------------------------------------


class Program:
    """A declared search; chainable setters mirror the ``@search`` builder."""

    def __init__(self, fn: Optional[Callable[["Program"], None]] = None):
        self._spec = SearchSpec()
        self.__name__ = getattr(fn, "__name__", "program")
        if fn is not None:
            fn(self)

    def policy(self, p: Union[PolicyConfig, str], **knobs: Any) -> "Program":
        self._spec.policy = p if isinstance(p, PolicyConfig) else policy(p, **knobs)
        return self

    def step(
        self,
        stop: Union[str, Sequence[str], None] = None,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        seed: Optional[int] = None,
        **more: Any,
    ) -> "Program":
        """Step config: stop strings, max tokens per step, sampling temperature, search seed, and any other
        StepConfig field (top_p, max_total_tokens, prompt_template)."""
        changes = dict(more)
        if stop is not None:
            changes["stop"] = [stop] if isinstance(stop, str) else list(stop)
        if max_tokens is not None:
            changes["max_tokens"] = max_tokens
        if temperature is not None:
            changes["temperature"] = temperature
        try:
            self._spec.step = dataclasses.replace(self._spec.step, **changes)
        except TypeError as e:
            raise SearchSpecError("step", str(e))
        if seed is not None:
            self._spec.seed = seed
        return self

    def prompt(self, template: str) -> "Program":
        """How the question becomes the prompt (must contain ``{question}``), e.g. a chat template."""
        return self.step(prompt_template=template)

    def reward(self, r: RewardConfig, timeout: Optional[float] = None) -> "Program":
        self._spec.reward = r
        if timeout is not None:
            self._spec.reward_timeout = timeout
        return self

    def answer(
        self, pattern: Optional[str] = None, aggregate: Optional[str] = None, score: Optional[str] = None
    ) -> "Program":
        cur = self._spec.answer
        self._spec.answer = AnswerConfig(
            pattern=pattern or cur.pattern, aggregate=aggregate or cur.aggregate, score=score or cur.score
        )
        return self

    def task(self, name: str) -> "Program":
        """Judge answers with this task set's checker (default: math-verify / numeric)."""
        self._spec.task = name
        return self

    def speculation(self, **overrides: Any) -> "Program":
        """Per-search SPEX overrides, passed to the server untouched."""
        self._spec.speculation = {**(self._spec.speculation or {}), **overrides}
        return self

    def priority(self, value: int) -> "Program":
        self._spec.priority = value
        return self

    # -- serialisation --

    def spec(self) -> SearchSpec:
        """The validated spec (a copy: later changes to the program do not affect it)."""
        return SearchSpec.from_dict(json.loads(self.to_json(validate=False)))

    def to_dict(self) -> Dict[str, Any]:
        return self._spec.to_dict()

    def to_json(self, validate: bool = True, **kw: Any) -> str:
        if validate:
            self._spec.validate()
        return json.dumps(self._spec.to_dict(), **kw)

    @classmethod
    def from_json(cls, text: Union[str, Dict[str, Any]]) -> "Program":
        p = cls()
        p._spec = SearchSpec.from_dict(json.loads(text) if isinstance(text, str) else text)
        return p

    # -- execution --

    async def arun(
        self, question: str, backend: Union[Endpoint, str], reference: Optional[str] = None, **kw: Any
    ) -> SearchResult:
        """Search one question; returns a SearchResult."""
        return (await self.arun_batch([question], backend, references=[reference], **kw))[0]

    async def arun_batch(
        self,
        questions: Sequence[str],
        backend: Union[Endpoint, str],
        references: Optional[Sequence[Optional[str]]] = None,
        concurrency: int = 8,
        on_result: Optional[Callable[[int, SearchResult], None]] = None,
        **client_kw: Any,
    ) -> List[SearchResult]:
        """Search many questions, at most ``concurrency`` at once, server- or client-side; results in order."""
        spec = self.spec()
        ep = Endpoint(backend) if isinstance(backend, str) else backend
        refs = list(references) if references is not None else [None] * len(questions)
        if not ep.server_side:
            port = HttpPort(ep.url, timeout=ep.timeout)
            try:
                return await run_batch(
                    spec, questions, port, concurrency=concurrency, references=refs, on_result=on_result, **client_kw
                )
            finally:
                await port.close()
        sem = asyncio.Semaphore(concurrency)
        body = spec.to_dict()
        async with httpx.AsyncClient(timeout=ep.timeout) as client:

            async def one(i: int) -> SearchResult:
                async with sem:
                    payload = {"spec": body, "question": questions[i]}
                    if refs[i] is not None:
                        payload["reference"] = refs[i]
                    r = await client.post(ep.url.rstrip("/") + "/tot/search", json=payload)
                    if r.status_code == 400:
                        err = r.json().get("error", {})
                        raise SearchSpecError(err.get("field", "spec"), err.get("reason", r.text))
                    r.raise_for_status()
                    res = SearchResult.from_dict(r.json())
                if on_result is not None:
                    on_result(i, res)
                return res

            return list(await asyncio.gather(*(one(i) for i in range(len(questions)))))

    def run(
        self, question: str, backend: Union[Endpoint, str], reference: Optional[str] = None, **kw: Any
    ) -> SearchResult:
        """Search one question (blocking); returns a SearchResult."""
        return asyncio.run(self.arun(question, backend, reference, **kw))

    def run_batch(self, questions: Sequence[str], backend: Union[Endpoint, str], **kw: Any) -> List[SearchResult]:
        """Search many questions concurrently (blocking); results in question order."""
        return asyncio.run(self.arun_batch(questions, backend, **kw))


def search(fn: Callable[[Program], None]) -> Program:
    """Decorator: the function receives a :class:`Program` builder and declares the search on it."""
    return Program(fn)
