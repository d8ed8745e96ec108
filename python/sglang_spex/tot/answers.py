"""Answers: extraction from a step, normalisation, aggregation over terminal nodes, and checking.

Aggregation (as in REBASE's evaluation): ``majority`` vote, ``weighted`` (reward-weighted majority: each
answer's votes weighted by its path score), or ``best_of_n`` (the answer of the best-scoring path). A path
score aggregates the step rewards by ``last``, ``min``, ``mean`` or ``prod``. Checking against a reference
compares numbers directly and otherwise uses ``math-verify``.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Union

import regex

from sglang_spex.tot.answer_key import normalize
from sglang_spex.tot.math_check import CHECKER
from sglang_spex.tot.tree import Node

logger = logging.getLogger(__name__)

Extractor = Union[str, Callable[[str], Optional[str]]]
PATTERN_TIMEOUT_S = 0.25  # the most one answer pattern may take on one step's text (``regex``'s timeout)
PATTERN_BUDGET_S = 1.0  # the most it may take over all of one search's steps (it runs on the event loop)
MAX_PATTERN_CHARS = 1000


class PatternTooSlow(RuntimeError):
    """A search's answer pattern has used its time budget: its later steps fail instead of running it."""


def extract_answer(text: str, pattern: Extractor, timeout_s: float = PATTERN_TIMEOUT_S) -> Optional[str]:
    """The answer stated in ``text`` (regex group 1 or the whole match, or a callable), else None (also when the
    pattern runs past ``timeout_s``)."""
    if callable(pattern):
        return pattern(text)
    try:  # a client's pattern: a catastrophic one must not hold the event loop
        m = regex.search(pattern, text, timeout=timeout_s)
    except TimeoutError:
        logger.warning("answer pattern %r timed out after %gs; no answer taken", pattern[:80], timeout_s)
        return None
    if m is None:
        return None
    ans = (m.group(1) if m.groups() else m.group(0)).strip()
    return clean_answer(ans)


class PatternBudget:
    """One search's answer extraction under :data:`PATTERN_BUDGET_S` in all: a client's pattern that backtracks
    badly stalls the server's event loop for at most that long over the whole search, not per step."""

    def __init__(self, budget_s: float = PATTERN_BUDGET_S):
        self.left_s = budget_s

    def extract(self, text: str, pattern: Extractor) -> Optional[str]:
        """:func:`extract_answer` within what is left; raises :class:`PatternTooSlow` once nothing is."""
        if callable(pattern):
            return pattern(text)
        if self.left_s <= 0:
            raise PatternTooSlow(f"answer.pattern: used its {PATTERN_BUDGET_S:g}s budget on this search's steps")
        t0 = time.perf_counter()
        try:
            return extract_answer(text, pattern, min(PATTERN_TIMEOUT_S, self.left_s))
        finally:
            self.left_s -= time.perf_counter() - t0


def clean_answer(ans: str) -> str:
    ans = ans.strip().rstrip(".").strip().strip("$").strip()
    boxed = re.fullmatch(r"\\boxed\{(.*)\}", ans)
    if boxed:
        ans = boxed.group(1)
    if ans.endswith("}") and ans.count("}") > ans.count("{"):
        ans = ans[:-1]
    return ans.strip().strip("$").strip()


def path_score(rewards: Sequence[float], how: str = "last") -> float:
    if not rewards:
        return 0.0
    if how == "last":
        return float(rewards[-1])
    if how == "min":
        return float(min(rewards))
    if how == "mean":
        return float(sum(rewards) / len(rewards))
    if how == "prod":
        return float(math.prod(rewards))
    raise ValueError(f"unknown score aggregation {how!r}")


@dataclass
class Candidate:
    answer: str
    path: str
    score: float


def candidates(nodes: Sequence[Node], score: str = "last") -> List[Candidate]:
    return [Candidate(n.answer, n.path, path_score(n.step_rewards(), score)) for n in nodes if n.answer is not None]


def aggregate(cands: Sequence[Candidate], how: str = "weighted") -> Optional[str]:
    """The winning answer (ties go to the answer seen first), or None without candidates."""
    if not cands:
        return None
    if how == "best_of_n":
        return max(cands, key=lambda c: c.score).answer  # max keeps the first of equal scores
    tally: "OrderedDict[str, float]" = OrderedDict()
    first: Dict[str, str] = {}
    for c in cands:
        key = normalize(c.answer)
        first.setdefault(key, c.answer)
        tally[key] = tally.get(key, 0.0) + (1.0 if how == "majority" else c.score)
    best = max(tally, key=lambda k: tally[k])
    return first[best]


def _as_number(s: str) -> Optional[float]:
    try:
        return float(s.strip().replace(",", "").rstrip("."))
    except ValueError:
        return None


def check_answer(answer: Optional[str], reference: str) -> bool:
    """Whether ``answer`` matches ``reference``: numerically when both are numbers, else by math-verify (in a child
    process it may kill: :mod:`~sglang_spex.tot.math_check`), else, where math-verify gave no verdict, by
    :func:`normalize`. It can take ``math_check.VERIFY_TIMEOUT_S``: call it off the event loop."""
    if answer is None:
        return False
    a, r = _as_number(answer), _as_number(str(reference))
    if a is not None and r is not None:
        return math.isclose(a, r, rel_tol=1e-6, abs_tol=1e-9)
    verdict = CHECKER.equal(answer, str(reference))
    return verdict if verdict is not None else normalize(answer) == normalize(str(reference))
