"""Task sets behind one small interface: generate questions by seed (dev/test splits), check an answer,
optionally check a step.

Bundled: ``toy_add`` (two-number additions, built in) and ``rg:<dataset>`` for any generator of the PyPI
package ``reasoning_gym`` (e.g. ``rg:chain_sum``, ``rg:basic_arithmetic``, ``rg:gsm_symbolic``), which also
scores answers where its scorer evaluates no text as code (:class:`ReasoningGymTask`). Splits come from disjoint
seed streams, so dev and test never share a generator seed.
"""

from __future__ import annotations

import abc
import inspect
import logging
import random
import re
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from sglang_spex.tot import math_check
from sglang_spex.tot.answers import check_answer as default_check
from sglang_spex.tot.rewards import arith_verifier

logger = logging.getLogger(__name__)

SPLITS = ("dev", "test")


@dataclass
class Question:
    id: str
    text: str
    reference: str
    meta: Dict[str, Any] = field(default_factory=dict)


class TaskSet(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def questions(self, n: int, split: str = "dev", seed: int = 0) -> List[Question]:
        """``n`` questions of ``split``, deterministic in (split, seed)."""

    def check_answer(self, answer: Optional[str], question: Question) -> bool:
        return default_check(answer, question.reference)

    def check_step(self, step: str, question: Question) -> Optional[float]:
        """A step score in [0, 1] where the task can judge a step, else None."""
        return None


def _split_seed(split: str, seed: int) -> int:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return 2 * int(seed) + SPLITS.index(split)


class ToyAdd(TaskSet):
    """``What is a + b?`` with a, b in [lo, hi]; steps are checked by the ``arith`` verifier."""

    name = "toy_add"

    def __init__(self, lo: int = 2, hi: int = 50):
        self.lo, self.hi = lo, hi

    def questions(self, n: int, split: str = "dev", seed: int = 0) -> List[Question]:
        rng = random.Random(f"toy_add:{_split_seed(split, seed)}")
        out = []
        for i in range(n):
            a, b = rng.randint(self.lo, self.hi), rng.randint(self.lo, self.hi)
            out.append(Question(f"toy_add-{split}-{seed}-{i}", f"What is {a} + {b}?", str(a + b), {"a": a, "b": b}))
        return out

    def check_step(self, step: str, question: Question) -> Optional[float]:
        return arith_verifier(question.text, [step])


# What marks a reasoning_gym scorer's module as one that may evaluate text as code: Python's evaluating builtins,
# sympy's string parsers (and any use of sympy at all, since nearly every sympy function sympifies a string
# argument), and forwarding to another dataset's scorer (``composite``). Conservative: a false match only means
# the default comparison instead of the dataset's own.
_EVALUATING = re.compile(
    r"\b(?:eval|exec|compile|sympify|parse_expr|parse_latex|simplify|nsimplify|latex2sympy|S)\s*\("
    r"|\bsympy\b|(?<!super\(\))\.score_answer\s*\("
)
_SCORER_SAFE: Dict[str, bool] = {}  # verdicts by dataset name


def rg_scorer_is_safe(dataset: str) -> bool:
    """Whether ``reasoning_gym`` dataset ``dataset``'s ``score_answer`` may run on a client's or a model's text
    (cached; the rule is :class:`ReasoningGymTask`'s)."""
    if dataset not in _SCORER_SAFE:
        _SCORER_SAFE[dataset] = _rg_scorer_is_safe(dataset)
        if not _SCORER_SAFE[dataset]:
            logger.info("rg:%s's scorer may evaluate text as code: answers use the default comparison", dataset)
    return _SCORER_SAFE[dataset]


def _rg_scorer_is_safe(dataset: str) -> bool:
    try:
        import reasoning_gym.factory as rgf
        from reasoning_gym.dataset import ProceduralDataset

        cls = rgf.DATASETS[dataset][0]
        if cls.score_answer is ProceduralDataset.score_answer:
            return True  # the base class's string comparison
        base = inspect.getmodule(ProceduralDataset)
        # the modules of the dataset's classes and scorer, and the reasoning_gym modules they import from
        mods = {
            inspect.getmodule(k) for k in cls.__mro__ if issubclass(k, ProceduralDataset) and k is not ProceduralDataset
        }
        mods.add(inspect.getmodule(cls.score_answer))
        for m in list(mods):
            if m is None:
                return False
            for obj in vars(m).values():
                dep = obj if isinstance(obj, types.ModuleType) else inspect.getmodule(obj) if callable(obj) else None
                if dep is not None and dep is not base and dep.__name__.split(".")[0] == "reasoning_gym":
                    mods.add(dep)
        return not any(_EVALUATING.search(inspect.getsource(m)) for m in mods)
    except Exception:  # e.g. no source to read: unsafe
        return False


class ReasoningGymTask(TaskSet):
    """A ``reasoning_gym`` generator; its own ``score_answer`` judges answers where that is safe.

    A scorer runs on a client's reference and a model's answer, and several of reasoning_gym's evaluate them as
    code (``eval``, ``exec``, sympy's ``parse_expr`` / ``sympify``). The rule, decided once per dataset: a dataset
    that keeps the base class's ``score_answer`` (a string comparison) is safe; one that overrides it is safe only
    where the source of its classes' modules (and the reasoning_gym modules they import from) shows no evaluating
    call, no sympy and no forwarding to another scorer (:data:`_EVALUATING`); a source that cannot be read is
    unsafe. A safe scorer runs in :mod:`~sglang_spex.tot.math_check`'s killable child, under its time limit (past
    it: not correct); an unsafe dataset's answers, and those a scorer raised on (e.g. a client's reference without
    the metadata it needs), use the default comparison (:func:`~sglang_spex.tot.answers.check_answer`).
    """

    def __init__(self, dataset: str, **config: Any):
        self.dataset, self.config = dataset, config
        self.name = f"rg:{dataset}"

    def _dataset(self, size: int, seed: int):
        import reasoning_gym

        return reasoning_gym.create_dataset(self.dataset, size=max(size, 1), seed=seed, **self.config)

    def questions(self, n: int, split: str = "dev", seed: int = 0) -> List[Question]:
        ds = self._dataset(n, 1000 + _split_seed(split, seed))
        return [
            Question(f"{self.name}-{split}-{seed}-{i}", e["question"], str(e["answer"]), {"entry": e})
            for i, e in enumerate(ds[j] for j in range(n))
        ]

    def check_answer(self, answer: Optional[str], question: Question) -> bool:
        if answer is None:
            return False
        if rg_scorer_is_safe(self.dataset):
            entry = question.meta.get("entry") or {"answer": question.reference, "metadata": {}}
            try:
                score = math_check.CHECKER.rg_score(self.dataset, self.config, answer, entry)
            except math_check.ScorerRaised:
                pass
            else:
                return score is not None and score >= 1.0
        return default_check(answer, question.reference)


_FACTORIES: Dict[str, Callable[[], TaskSet]] = {"toy_add": ToyAdd}


def register_task(name: str, factory: Callable[[], TaskSet]) -> None:
    _FACTORIES[name] = factory


def get_task(name: str) -> TaskSet:
    """A task set by name: a registered one or ``rg:<reasoning_gym dataset>``; KeyError otherwise."""
    if name in _FACTORIES:
        return _FACTORIES[name]()
    if name.startswith("rg:"):
        try:
            import reasoning_gym.factory as rgf
        except ImportError:
            raise KeyError(f"task {name!r} needs the reasoning_gym package")
        if name[3:] not in rgf.DATASETS:
            raise KeyError(f"unknown reasoning_gym dataset {name[3:]!r}")
        return ReasoningGymTask(name[3:])
    raise KeyError(f"unknown task {name!r}; registered: {sorted(_FACTORIES)} or rg:<reasoning_gym dataset>")
