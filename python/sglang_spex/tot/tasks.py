"""Task sets behind one small interface: generate questions by seed (dev/test splits), check an answer,
optionally check a step.

Bundled: ``toy_add`` (two-number additions, built in) and ``rg:<dataset>`` for any generator of the PyPI
package ``reasoning_gym`` (e.g. ``rg:chain_sum``, ``rg:basic_arithmetic``, ``rg:gsm_symbolic``), which also
scores answers. Splits come from disjoint seed streams, so dev and test never share a generator seed.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from sglang_spex.tot.answers import check_answer as default_check
from sglang_spex.tot.rewards import arith_verifier

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


class ReasoningGymTask(TaskSet):
    """A ``reasoning_gym`` generator; its own ``score_answer`` judges answers."""

    def __init__(self, dataset: str, **config: Any):
        self.dataset, self.config = dataset, config
        self.name = f"rg:{dataset}"
        self._scorer = None

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
        entry = question.meta.get("entry") or {"answer": question.reference, "metadata": {}}
        try:
            if self._scorer is None:
                self._scorer = self._dataset(1, 0)
            return self._scorer.score_answer(answer, entry) >= 1.0
        except Exception:
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
