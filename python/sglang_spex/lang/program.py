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
``run`` and ``run_batch`` block; inside a running event loop (Jupyter, async code) await ``arun`` / ``arun_batch``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import httpx

from sglang_spex.speculation.settings import check_override_names
from sglang_spex.tot.http_port import HttpPort, check_search_answer
from sglang_spex.tot.rewards import reward_section
from sglang_spex.tot.search import SearchResult, check_batch_text, check_text, gather_or_cancel, run_batch
from sglang_spex.tot.search_spec import AnswerConfig, PolicyConfig, RewardConfig, SearchSpec, SearchSpecError
from sglang_spex.tot.validation import MAX_JSON_DEPTH, check, check_int, from_dict, is_http_url, is_num

# what a prm reward takes besides its URL
PRM_OPTIONS = tuple(f.name for f in dataclasses.fields(RewardConfig) if f.name not in ("type", "url", "name"))
# keywords arun_batch passes on to a client-side run (tot.search.run_batch and the search context)
CLIENT_KEYWORDS = ("context_factory", "limits", "progress", "reward", "reward_timeout")

# ---- declarations -------------------------------------------------------------------------------------


def plain(value: Any, name: str = "value", _depth: int = 0) -> Any:
    """``value`` as JSON holds it: numeric scalars of other types (numpy's ``int64``, ``float32``, ...) become Python
    ints and floats, tuples become lists, and dicts and lists are copied. Nesting past ``MAX_JSON_DEPTH`` below
    ``value`` raises :class:`SearchSpecError` naming ``name`` (a bound against RecursionError; the server counts its
    bound from the body's root, so a value a few levels shallower than this is the most it takes)."""
    if isinstance(value, (dict, list, tuple)):
        check(_depth < MAX_JSON_DEPTH, name, f"nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(value, dict):
            return {k: plain(v, name, _depth + 1) for k, v in value.items()}
        return [plain(v, name, _depth + 1) for v in value]
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def policy(name: str, **knobs: Any) -> PolicyConfig:
    """Any policy or preset by name (``"rebase-16"``, ``"rest-5"``) with knob overrides."""
    return PolicyConfig(name=name, params=plain(knobs, "policy"))


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
    prm_template); another option raises :class:`SearchSpecError` naming it."""
    for name in options:
        check(name in PRM_OPTIONS, f"reward.{name}", f"not a prm option; choose from {list(PRM_OPTIONS)}")
    return from_dict(RewardConfig, {"type": "prm", "url": url, **options}, "reward")


def verifier(name: str) -> RewardConfig:
    return RewardConfig(type="verifier", name=name)


def callback(url: str) -> RewardConfig:
    return RewardConfig(type="callback", url=url)


@dataclass
class Endpoint:
    """Where a program runs: our launcher's server (``server_side=True``) or any SGLang endpoint. ``api_key`` (a
    server started with ``--api-key``) is sent as ``Authorization: Bearer`` on both paths."""

    url: str
    server_side: bool = True
    timeout: float = 3600.0
    api_key: Optional[str] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check(is_http_url(self.url), "url", f"must be an http(s) URL, not {self.url!r}")
        check(isinstance(self.server_side, bool), "server_side", "must be true or false")
        number = is_num(self.timeout) and not isinstance(self.timeout, bool)
        check(
            self.timeout is None
            or isinstance(self.timeout, httpx.Timeout)
            or (number and math.isfinite(self.timeout) and self.timeout > 0),
            "timeout",
            "must be a finite number of seconds > 0, an httpx.Timeout or None",
        )
        check(self.api_key is None or isinstance(self.api_key, str), "api_key", "must be a string or None")


def _unjsonable(value: Any, name: str = "") -> str:
    """The dotted name of the first field of ``value`` that JSON cannot hold (``name`` itself when none below)."""
    if isinstance(value, dict):
        for key, item in value.items():
            try:
                json.dumps(item, allow_nan=False)
            except (TypeError, ValueError):
                return _unjsonable(item, f"{name}.{key}" if name else str(key))
    return name or "spec"


# ---- the program --------------------------------------------------------------------------------------


class Program:
    """A declared search; chainable setters mirror the ``@search`` builder."""

    def __init__(self, fn: Optional[Callable[["Program"], None]] = None):
        self._spec = SearchSpec()
        self.__name__ = getattr(fn, "__name__", "program")
        if fn is not None:
            fn(self)

    def policy(self, p: Union[PolicyConfig, str], **knobs: Any) -> "Program":
        """The policy: a :class:`PolicyConfig` (``tot.rebase(width=8)``) or a name; ``knobs`` override its own."""
        if isinstance(p, PolicyConfig):
            self._spec.policy = PolicyConfig(name=p.name, params=plain({**p.params, **knobs}, "policy"))
        else:
            self._spec.policy = policy(p, **knobs)
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
        fields = {f.name for f in dataclasses.fields(self._spec.step)}
        for name in more:
            check(name in fields, f"step.{name}", f"not a step field; choose from {sorted(fields)}")
        changes = plain(more, "step")
        if stop is not None:
            check(
                isinstance(stop, str) or (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)),
                "step.stop",
                "must be a string or a list of strings",
            )
            changes["stop"] = [stop] if isinstance(stop, str) else list(stop)
        if max_tokens is not None:
            changes["max_tokens"] = plain(max_tokens, "step.max_tokens")
        if temperature is not None:
            changes["temperature"] = plain(temperature, "step.temperature")
        try:
            self._spec.step = dataclasses.replace(self._spec.step, **changes)
        except TypeError as e:
            raise SearchSpecError("step", str(e))
        if seed is not None:
            self._spec.seed = plain(seed, "seed")
        return self

    def prompt(self, template: str) -> "Program":
        """How the question becomes the prompt (must contain ``{question}``), e.g. a chat template."""
        return self.step(prompt_template=template)

    def reward(self, r: Union[RewardConfig, str], timeout: Optional[float] = None) -> "Program":
        """The reward: a :class:`RewardConfig` (``tot.logprob()``, ``tot.prm(url)``, ...) or a short name
        (``"logprob"``, ``"verifier:arith"``); ``timeout`` in seconds."""
        if isinstance(r, str):
            r = from_dict(RewardConfig, reward_section(r), "reward")
        check(
            isinstance(r, RewardConfig),
            "reward",
            f"must be a reward (tot.logprob(), tot.prm(url), ...) or its name, not {type(r).__name__}",
        )
        self._spec.reward = r
        if timeout is not None:
            self._spec.reward_timeout = plain(timeout, "reward_timeout")
        return self

    def answer(
        self, pattern: Optional[str] = None, aggregate: Optional[str] = None, score: Optional[str] = None
    ) -> "Program":
        cur = self._spec.answer
        self._spec.answer = AnswerConfig(
            pattern=cur.pattern if pattern is None else pattern,
            aggregate=cur.aggregate if aggregate is None else aggregate,
            score=cur.score if score is None else score,
        )
        return self

    def task(self, name: str) -> "Program":
        """Judge answers with this task set's checker (default: math-verify / numeric)."""
        self._spec.task = name
        return self

    def speculation(self, **overrides: Any) -> "Program":
        """Per-search SPEX overrides (``speculation.settings.OVERRIDABLE``). Server-side the server applies them
        (and refuses all but ``enabled=False`` without ``--tot-speculation``). Client-side they apply only when the
        run passes SPEX's context factory (``context_factory=speculation.runner.context_factory(cfg)``); otherwise
        the search does not speculate, and they are only checked as a server checks them."""
        self._spec.speculation = {**(self._spec.speculation or {}), **plain(overrides, "speculation")}
        return self

    def priority(self, value: int) -> "Program":
        self._spec.priority = plain(value, "priority")
        return self

    # -- serialisation --

    def spec(self) -> SearchSpec:
        """The validated spec (a copy: later changes to the program do not affect it); raises
        :class:`SearchSpecError` naming a bad field (and an unknown ``speculation`` override: their values are checked
        by the server, against its own settings)."""
        spec = SearchSpec.from_dict(json.loads(self.to_json()))
        check_override_names(spec.speculation or {})
        return spec

    def to_dict(self) -> Dict[str, Any]:
        return self._spec.to_dict()

    def to_json(self, validate: bool = True, **kw: Any) -> str:
        """The spec as JSON (validated first unless ``validate`` is false); a value JSON cannot hold (a ``Decimal``,
        an array, NaN) raises :class:`SearchSpecError` naming its field."""
        if validate:
            self._spec.validate()
        d = self._spec.to_dict()
        try:
            return json.dumps(d, allow_nan=False, **kw)
        except (TypeError, ValueError) as e:
            raise SearchSpecError(_unjsonable(d), f"cannot be sent as JSON ({e})") from None

    @classmethod
    def from_json(cls, text: Union[str, Dict[str, Any]]) -> "Program":
        """A program with the spec ``text`` holds (JSON text or its decoded dict); raises :class:`SearchSpecError`
        naming the field, ``spec`` for text that is not JSON or nests past ``MAX_JSON_DEPTH``."""
        if isinstance(text, str):
            try:
                text = json.loads(text)
            except (ValueError, RecursionError) as e:  # (RecursionError: nesting too deep for the decoder)
                raise SearchSpecError("spec", f"must be JSON text ({type(e).__name__}: {e})") from None
        p = cls()
        p._spec = SearchSpec.from_dict(plain(text, "spec"))
        return p

    # -- execution --

    async def arun(
        self, question: str, backend: Union[Endpoint, str], reference: Optional[str] = None, **kw: Any
    ) -> SearchResult:
        """Search one question; returns a SearchResult."""
        check_text(question, "question")
        if reference is not None:
            check_text(reference, "reference", empty_ok=True)
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
        """Search many questions, at most ``concurrency`` at once, server- or client-side; results in order.
        ``client_kw`` (:data:`CLIENT_KEYWORDS`) go to a client-side run. The first search that fails (or an
        ``on_result`` that raises) cancels the others, which abort their requests, before its error is raised."""
        spec = self.spec()
        check(isinstance(backend, (Endpoint, str)), "backend", "must be an Endpoint or a server URL")
        ep = Endpoint(backend) if isinstance(backend, str) else backend
        check(on_result is None or callable(on_result), "on_result", "must be callable (index, result) or None")
        refs = check_batch_text(questions, references)
        check_int(concurrency, "concurrency", 1)
        check_client_keywords(client_kw, ep.server_side)
        port = HttpPort(ep.url, timeout=ep.timeout, api_key=ep.api_key)  # server-side only its client (and key) is used
        try:
            if not ep.server_side:
                return await run_batch(
                    spec, questions, port, concurrency=concurrency, references=refs, on_result=on_result, **client_kw
                )
            sem = asyncio.Semaphore(concurrency)
            body = spec.to_dict()

            async def one(i: int) -> SearchResult:
                async with sem:
                    res = await post_search(port.client, ep.url, {"spec": body, "question": questions[i]}, refs[i])
                if on_result is not None:
                    on_result(i, res)
                return res

            return await gather_or_cancel(one(i) for i in range(len(questions)))
        finally:
            await port.close()

    def run(
        self, question: str, backend: Union[Endpoint, str], reference: Optional[str] = None, **kw: Any
    ) -> SearchResult:
        """Search one question (blocking); returns a SearchResult. In a running event loop: ``await`` :meth:`arun`."""
        _outside_event_loop("run", "arun")
        return asyncio.run(self.arun(question, backend, reference, **kw))

    def run_batch(self, questions: Sequence[str], backend: Union[Endpoint, str], **kw: Any) -> List[SearchResult]:
        """Search many questions concurrently (blocking); results in question order. In a running event loop:
        ``await`` :meth:`arun_batch`."""
        _outside_event_loop("run_batch", "arun_batch")
        return asyncio.run(self.arun_batch(questions, backend, **kw))


def _outside_event_loop(name: str, async_name: str) -> None:
    """Raise a RuntimeError pointing to ``async_name`` when called inside a running event loop, where the blocking
    ``name`` cannot run (``asyncio.run`` refuses to nest)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        f"Program.{name}() blocks and cannot run inside a running event loop (Jupyter, async code): "
        f"use `await program.{async_name}(...)` there"
    )


def check_client_keywords(kw: Dict[str, Any], server_side: bool) -> None:
    """Refuse a keyword :meth:`Program.arun_batch` does not take, and a client-side one on a server-side run (where
    it would do nothing), with a TypeError naming it."""
    for name in sorted(kw):
        if name not in CLIENT_KEYWORDS:
            raise TypeError(
                f"arun_batch: unknown keyword {name!r}; it takes (client-side only) {list(CLIENT_KEYWORDS)}"
            )
        if server_side:
            raise TypeError(f"arun_batch: {name!r} applies only client-side (Endpoint(url, server_side=False))")


async def post_search(
    client: httpx.AsyncClient, url: str, payload: Dict[str, Any], reference: Optional[str]
) -> SearchResult:
    """One ``POST /tot/search``; error answers raise as :func:`~sglang_spex.tot.http_port.check_search_answer` maps
    them (a 400 as :class:`SearchSpecError` naming the server's field)."""
    if reference is not None:
        payload["reference"] = reference
    r = await client.post(url.rstrip("/") + "/tot/search", json=payload)
    check_search_answer(r)
    return SearchResult.from_dict(r.json())


def search(fn: Callable[[Program], None]) -> Program:
    """Decorator: the function receives a :class:`Program` builder and declares the search on it."""
    return Program(fn)
