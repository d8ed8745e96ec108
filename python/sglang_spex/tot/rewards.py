"""Rewards behind one interface: ``await reward.score(node, question) -> float`` (higher is better).

- ``logprob``: intrinsic; exp(mean log-probability of the step's tokens) from SGLang's ``return_logprob``,
  in (0, 1].
- ``prm``: a process reward model served by a second SGLang server. Mode ``token`` (default, the
  math-shepherd convention): append the step tag after the steps and read the PRM's next-token
  distribution; score = P(good) / (P(good) + P(bad)) over the top-20 logprobs (P(good) alone when the bad
  token is absent, 0 when the good one is). Mode ``mean_logprob``: exp(mean log-probability the PRM
  assigns to the last step's tokens).
- ``verifier``: a rule-based checker registered by name on the server (:data:`VERIFIERS`); ``arith``
  checks every ``a op b = c`` in the step.
- ``callback``: POST the node as JSON to the client's URL; the reply is ``{"reward": number}``.

A reward that raises or times out marks the node failed (done by the search context, not here); an HTTP reward's
error answer fails it with the start of the answer's body (the scorer's or PRM server's reason).
"""

from __future__ import annotations

import abc
import ast
import math
import operator
import re
import string
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import httpx

from sglang_spex.tot.http_port import check_status, pool_limits
from sglang_spex.tot.tree import Node
from sglang_spex.tot.validation import SearchSpecError, check, is_http_url

REWARD_TYPES = ("logprob", "prm", "verifier", "callback")
PRM_FIELDS = ("question", "steps")  # what PRMReward formats prm_template with
MAX_TEMPLATE_FIELDS = 8  # placeholders in a template: a rendered prompt is at most this many copies of the values
MAX_TAG_CHARS = 64  # a PRM's good/bad token and step tag
VerifierFn = Callable[[str, List[str]], float]
VERIFIERS: Dict[str, VerifierFn] = {}


@dataclass
class RewardConfig:
    """Which reward scores a node (the ``reward`` section of a search spec)."""

    type: str = "logprob"  # logprob | prm | verifier | callback
    url: Optional[str] = None  # prm: the PRM's SGLang server; callback: the client's scoring URL
    name: Optional[str] = None  # verifier: a name registered on the server
    mode: str = "token"  # prm: "token" (P(good) vs P(bad) at the step tag) | "mean_logprob"
    good_token: str = "+"
    bad_token: str = "-"
    step_tag: str = "\n"
    prm_template: str = "{question}\n{steps}"

    def validate(self, p: str = "reward") -> None:
        check(self.type in REWARD_TYPES, f"{p}.type", f"must be one of {list(REWARD_TYPES)}")
        check(self.url is None or isinstance(self.url, str), f"{p}.url", "must be a string")
        check(self.name is None or isinstance(self.name, str), f"{p}.name", "must be a string")
        if self.type in ("prm", "callback"):
            check(
                is_http_url(self.url),
                f"{p}.url",
                f"a {self.type} reward needs an http(s) URL",
            )
        if self.type == "prm":
            check(self.mode in ("token", "mean_logprob"), f"{p}.mode", "must be 'token' or 'mean_logprob'")
        if self.type == "verifier":
            check(
                self.name in VERIFIERS, f"{p}.name", f"unknown verifier {self.name!r}; registered: {sorted(VERIFIERS)}"
            )
        for name in ("step_tag", "good_token", "bad_token"):
            value = getattr(self, name)
            ok = isinstance(value, str) and 0 < len(value) <= MAX_TAG_CHARS
            check(ok, f"{p}.{name}", f"must be a string of 1 to {MAX_TAG_CHARS} characters")
            # the tokens are compared whitespace-stripped with the PRM's top tokens
            check(name == "step_tag" or value.strip() != "", f"{p}.{name}", "must not be only whitespace")
        check_template(self.prm_template, PRM_FIELDS, f"{p}.prm_template")


def check_template(template: Any, names: Tuple[str, ...], field_name: str, required: Optional[str] = None) -> None:
    """``template`` is a ``str.format`` template of at most :data:`MAX_TEMPLATE_FIELDS` fields, each a plain
    ``{name}`` of ``names`` (no format spec, conversion, attribute or index), so its rendering is bounded by the
    values' lengths; it contains ``{required}`` when given."""
    check(isinstance(template, str), field_name, "must be a string")
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise SearchSpecError(field_name, f"not a valid template ({e}); write {{{{ and }}}} for literal braces")
    check(len(fields) <= MAX_TEMPLATE_FIELDS, field_name, f"has {len(fields)} fields; at most {MAX_TEMPLATE_FIELDS}")
    for name, spec, conv in fields:
        shown = f"{{{name}{'!' + conv if conv else ''}{':' + spec if spec else ''}}}"
        check(
            name in names and not spec and conv is None,
            field_name,
            f"{shown[:60]!r}: only the plain fields {', '.join(f'{{{n}}}' for n in names)} are allowed (no format "
            "spec, conversion, attribute or index); write {{ and }} for literal braces",
        )
    check(required is None or required in (f[0] for f in fields), field_name, f"must contain {{{required}}}")


def reward_section(name: str) -> Dict[str, Any]:
    """A search spec's ``reward`` section from a short name: a reward type (``logprob``) or ``verifier:NAME``."""
    if name.startswith("verifier:"):
        return {"type": "verifier", "name": name.split(":", 1)[1]}
    return {"type": name}


def register_verifier(name: str) -> Callable[[VerifierFn], VerifierFn]:
    """Register ``fn(question, steps) -> float`` (``steps``: the trajectory's step texts, last = the node)."""

    def deco(fn: VerifierFn) -> VerifierFn:
        VERIFIERS[name] = fn
        return fn

    return deco


_NUM = r"-?\d+(?:\.\d+)?"
_EQUATION = re.compile(rf"((?:{_NUM}\s*[-+*/x×]\s*)+{_NUM})\s*=\s*({_NUM})")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval_arith(expr: str) -> float:
    def ev(n: ast.AST) -> float:
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)):
            return float(n.value)
        raise ValueError(f"not arithmetic: {expr!r}")

    return ev(ast.parse(expr.replace("×", "*").replace("x", "*"), mode="eval").body)


def check_arith_equations(text: str) -> List[bool]:
    """Truth of each ``a op b [op c ...] = d`` in ``text``."""
    out = []
    for lhs, rhs in _EQUATION.findall(text):
        try:
            out.append(math.isclose(_eval_arith(lhs), float(rhs), rel_tol=1e-9, abs_tol=1e-9))
        except (ValueError, ZeroDivisionError, SyntaxError):
            out.append(False)
    return out


@register_verifier("arith")
def arith_verifier(question: str, steps: List[str]) -> float:
    """Fraction of correct arithmetic equations in the last step; 0.5 when it states none."""
    checks = check_arith_equations(steps[-1] if steps else "")
    return sum(checks) / len(checks) if checks else 0.5


class Reward(abc.ABC):
    needs_logprobs: bool = False

    @abc.abstractmethod
    async def score(self, node: Node, question: str, search_id: str = "") -> float:
        """The node's reward (higher is better); raise on failure."""

    async def close(self) -> None:
        pass


class LogprobReward(Reward):
    needs_logprobs = True

    async def score(self, node: Node, question: str, search_id: str = "") -> float:
        if not node.logprobs:
            return 0.0
        return math.exp(sum(node.logprobs) / len(node.logprobs))


class VerifierReward(Reward):
    def __init__(self, name: str):
        if name not in VERIFIERS:
            raise KeyError(f"unknown verifier {name!r}")
        self.fn = VERIFIERS[name]

    async def score(self, node: Node, question: str, search_id: str = "") -> float:
        return float(self.fn(question, [n.text for n in node.trajectory()]))


class _HttpReward(Reward):
    def __init__(self, url: str, client: Optional[httpx.AsyncClient] = None):
        self.url = url.rstrip("/")
        self._own = client is None
        self.client = client or httpx.AsyncClient(timeout=None, limits=pool_limits())

    async def close(self) -> None:
        if self._own:
            await self.client.aclose()


class PRMReward(_HttpReward):
    def __init__(self, cfg: RewardConfig, client: Optional[httpx.AsyncClient] = None):
        super().__init__(cfg.url, client)
        self.cfg = cfg

    def _prompt(self, question: str, steps: List[str]) -> str:
        tag = self.cfg.step_tag
        return self.cfg.prm_template.format(question=question, steps=tag.join(s.strip() for s in steps)) + tag

    async def _generate(self, text: str, **extra: Any) -> Dict[str, Any]:
        body = {"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, **extra}
        r = await self.client.post(self.url + "/generate", json=body)
        check_status(r, "prm")
        return r.json()

    async def score(self, node: Node, question: str, search_id: str = "") -> float:
        steps = [n.text for n in node.trajectory()]
        if self.cfg.mode == "mean_logprob":
            prefix = await self._generate(self._prompt(question, steps[:-1]))
            full = await self._generate(self._prompt(question, steps), return_logprob=True, logprob_start_len=0)
            n_step = full["meta_info"]["prompt_tokens"] - prefix["meta_info"]["prompt_tokens"]
            lps = [x[0] for x in full["meta_info"]["input_token_logprobs"] if x[0] is not None]
            lps = lps[-n_step:] if n_step > 0 else []
            return math.exp(sum(lps) / len(lps)) if lps else 0.0
        out = await self._generate(
            self._prompt(question, steps), return_logprob=True, top_logprobs_num=20, return_text_in_logprobs=True
        )
        top = out["meta_info"]["output_top_logprobs"][0]
        by_text: Dict[str, float] = {}
        for lp, _tid, text in top:
            key = (text or "").strip()
            by_text.setdefault(key, lp)
        good, bad = by_text.get(self.cfg.good_token.strip()), by_text.get(self.cfg.bad_token.strip())
        if good is None:
            return 0.0
        if bad is None:
            return math.exp(good)
        return 1.0 / (1.0 + math.exp(bad - good))


class CallbackReward(_HttpReward):
    async def score(self, node: Node, question: str, search_id: str = "") -> float:
        body = {
            "search_id": search_id,
            "question": question,
            "path": node.path,
            "depth": node.depth,
            "text": node.text,
            "trajectory": [n.text for n in node.trajectory()],
            "answer": node.answer,
            "terminal": node.is_terminal,
        }
        r = await self.client.post(self.url, json=body)
        check_status(r, "callback")  # the scorer's reason (its error body) goes into the node's failure
        value = r.json().get("reward")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"callback returned no finite 'reward': {r.text[:200]!r}")
        return float(value)


def build_reward(cfg: RewardConfig, client: Optional[httpx.AsyncClient] = None) -> Reward:
    if cfg.type == "logprob":
        return LogprobReward()
    if cfg.type == "verifier":
        return VerifierReward(cfg.name)
    if cfg.type == "prm":
        return PRMReward(cfg, client)
    if cfg.type == "callback":
        return CallbackReward(cfg.url, client)
    raise ValueError(f"unknown reward type {cfg.type!r}")
