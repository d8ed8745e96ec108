"""Synthetic ToT workloads: what the simulated model "writes" and what the simulated reward model says.

Everything about a node is a pure function of ``(workload seed, question id, node path)`` — never of timing,
batch composition or the order requests arrive in — so a baseline run and a speculative run of the same
search see exactly the same tree. The question id is read from the prompt (``Problem <id>:``, which
:meth:`Workload.questions` writes); the node path comes with every request (``GenRequest.node_path``).

Model of one search tree (parameters in :class:`WorkloadParams`; where each default comes from is noted):

- **Latent quality** ``v``: a question starts at ``v_root ~ N(root_mean, root_std)`` (difficulty); each step
  adds ``N(drift, step_std)``. A negative drift makes long chains worse (errors compound), one reason most
  correct answers are shallow (SPEX §3, Obs. 4 / Fig. 7).
- **Reward** of a node: ``sigmoid(v + N(0, reward_noise))`` (``reward_noise_spread`` > 0: a per-question noise
  level around it); answer steps add ``± answer_signal`` for a right /
  wrong answer (a PRM partly sees correctness). ``reward_noise`` is the knob that makes short-term rankings
  more or less stable, which is what SPEX's lookahead bets on (Fig. 14's hit-rate decay).
- **Step length** (tokens): ``dfs`` nodes uniform in [50, 100] (SPEX §3.1: "a reasoning node usually has 50–100
  tokens"); ``bfs`` branches log-normal with median 60 and σ 0.7 (long-tailed; SPEX §3.2 describes the tail
  qualitatively — median and σ are our assumption), cut at the request's ``max_new_tokens`` (REBASE: 256).
- **Answer depth skew**: from ``min_answer_depth`` on, a step states an answer with hazard
  ``answer_hazard · answer_hazard_growth^(d − min_answer_depth)`` (capped at 1); defaults put the first answer
  of a path at depth 2–5 ~90% of the time ("most answers shallow", SPEX Fig. 7 — shape ours, not fitted to the paper's data).
- **Answers**: right with probability ``sigmoid(answer_sharpness · v)``; wrong answers come from a few
  distractors with weights ∝ 1/k², so wrong answers cluster and sometimes win a majority vote. With the
  defaults, accuracy lands at ~0.6 (rSTAR/REST) to ~0.85 (REBASE-16) on 60 questions (measured on this simulator);
  the paper's Table 2 has lower numbers for harder sets (e.g. 41.2% Llemma-34B REST-5 on MATH-500) —
  lower ``root_mean`` to match one. Accuracy only matters here for T3 (early stop changes answers).
"""

from __future__ import annotations

import hashlib
import math
import numbers
import random
import re
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from sglang_spex.tot.engine import GenRequest
from sglang_spex.tot.policies.registry import DFS_POLICIES, base_name

QUESTION_RE = re.compile(r"Problem (\d+):")
ANSWER_PHRASE = "The answer is"
_FILLER = ("so", "we", "get", "then", "let", "x", "=", "+", "2", "3", "and", "thus", "check", "value", "step")


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-max(min(x, 60.0), -60.0)))


@dataclass(frozen=True)
class WorkloadParams:
    lengths: str = "bfs"  # "dfs" (uniform 50–100) | "bfs" (log-normal, long tail)
    dfs_min_tokens: int = 50
    dfs_max_tokens: int = 100
    bfs_median_tokens: float = 60.0
    bfs_sigma: float = 0.7
    min_tokens: int = 8
    root_mean: float = -1.0
    root_std: float = 1.2
    drift: float = -0.15
    step_std: float = 0.8
    reward_noise: float = 0.5
    reward_noise_spread: float = 0.0  # per question: reward_noise x exp(N(0, this)) (0: the same for every question)
    answer_signal: float = 0.5
    answer_sharpness: float = 1.5
    min_answer_depth: int = 2
    answer_hazard: float = 0.3
    answer_hazard_growth: float = 1.3
    distractors: int = 3
    question_words: int = 40  # prompt length of a question (tokens)

    def __post_init__(self) -> None:
        """Refuse values the generator cannot use (ValueError naming the field)."""
        if self.lengths not in ("dfs", "bfs"):
            raise ValueError(f"WorkloadParams.lengths must be 'dfs' or 'bfs', got {self.lengths!r}")
        for name, value in asdict(self).items():
            if name == "lengths":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"WorkloadParams.{name} must be a finite number, got {value!r}")
        for name in ("dfs_min_tokens", "min_tokens", "distractors"):
            if getattr(self, name) < 1:
                raise ValueError(f"WorkloadParams.{name} must be >= 1, got {getattr(self, name)}")
        if self.dfs_min_tokens > self.dfs_max_tokens:
            raise ValueError(
                f"WorkloadParams.dfs_min_tokens ({self.dfs_min_tokens}) must be <= dfs_max_tokens "
                f"({self.dfs_max_tokens})"
            )
        if self.bfs_median_tokens <= 0:
            raise ValueError(f"WorkloadParams.bfs_median_tokens must be > 0, got {self.bfs_median_tokens}")


@dataclass(frozen=True)
class StepOutcome:
    """What the simulated model writes for one node (before ``max_new_tokens`` truncation)."""

    num_tokens: int  # including the step delimiter / EOS token
    answer: Optional[str]
    correct: Optional[bool]
    value: float  # latent quality after this step
    reward: float


@dataclass
class SimOutput:
    text: str
    completion_tokens: int
    finish_reason: str  # stop | length
    matched_stop: Optional[str]
    reward: float


class Workload:
    """A deterministic synthetic ToT workload (see the module docstring)."""

    def __init__(self, params: Optional[WorkloadParams] = None, seed: int = 0):
        self.params = params or WorkloadParams()
        self.seed = int(seed)
        self._values: Dict[Tuple[int, str], float] = {}
        self._outcomes: Dict[Tuple[int, str], StepOutcome] = {}

    @classmethod
    def for_policy(cls, policy: str, seed: int = 0, **overrides) -> "Workload":
        """DFS-style lengths for rSTAR/REST, long-tailed BFS lengths for REBASE/ETS."""
        lengths = "dfs" if base_name(policy) in DFS_POLICIES else "bfs"
        return cls(WorkloadParams(**{"lengths": lengths, **overrides}), seed)

    def describe(self) -> Dict:
        return {"seed": self.seed, **asdict(self.params)}

    # ---- deterministic randomness -----------------------------------------------------------------

    def _rng(self, qid: int, path: str, label: str) -> random.Random:
        h = hashlib.blake2b(f"{self.seed}|{qid}|{path}|{label}".encode(), digest_size=8).digest()
        return random.Random(int.from_bytes(h, "big"))

    # ---- questions ---------------------------------------------------------------------------------

    def reference(self, qid: int) -> str:
        return str(10 + self._rng(qid, "", "ref").randrange(990))

    def question(self, qid: int) -> str:
        rng = self._rng(qid, "", "qtext")
        words = " ".join(rng.choice(_FILLER) for _ in range(max(self.params.question_words - 2, 0)))
        return f"Problem {qid}: {words}"

    def questions(self, n: int, start: int = 0) -> List[Tuple[str, str]]:
        """``n`` (question text, reference answer) pairs."""
        return [(self.question(q), self.reference(q)) for q in range(start, start + n)]

    @staticmethod
    def question_id(prompt: str) -> Optional[int]:
        m = QUESTION_RE.search(prompt)
        return int(m.group(1)) if m else None

    # ---- the tree ----------------------------------------------------------------------------------

    @staticmethod
    def depth(path: str) -> int:
        return path.count(".")

    def value(self, qid: int, path: str) -> float:
        """Latent quality of the node at ``path`` (root: the question's difficulty)."""
        key = (qid, path)
        if key in self._values:
            return self._values[key]
        p = self.params
        if "." not in path:
            v = self._rng(qid, path, "root").gauss(p.root_mean, p.root_std)
        else:
            parent = path.rsplit(".", 1)[0]
            v = self.value(qid, parent) + self._rng(qid, path, "step").gauss(p.drift, p.step_std)
        self._values[key] = v
        return v

    def _length(self, rng: random.Random) -> int:
        p = self.params
        if p.lengths == "dfs":
            return rng.randint(p.dfs_min_tokens, p.dfs_max_tokens)
        return max(p.min_tokens, int(round(rng.lognormvariate(math.log(p.bfs_median_tokens), p.bfs_sigma))))

    def hazard(self, depth: int) -> float:
        p = self.params
        if depth < p.min_answer_depth:
            return 0.0
        return min(1.0, p.answer_hazard * p.answer_hazard_growth ** (depth - p.min_answer_depth))

    def outcome(self, qid: int, path: str) -> StepOutcome:
        """The node at ``path``: length, answer (if it states one), latent value and reward."""
        key = (qid, path)
        if key in self._outcomes:
            return self._outcomes[key]
        p = self.params
        rng = self._rng(qid, path, "outcome")
        n = self._length(rng)
        v = self.value(qid, path)
        answer, correct, bonus = None, None, 0.0
        if rng.random() < self.hazard(self.depth(path)):
            correct = rng.random() < _sigmoid(p.answer_sharpness * v)
            if correct:
                answer = self.reference(qid)
            else:
                weights = [1.0 / (i + 1) ** 2 for i in range(p.distractors)]
                k = rng.choices(range(p.distractors), weights=weights)[0]
                answer = str(int(self.reference(qid)) + 7 * (k + 1))
            bonus = p.answer_signal if correct else -p.answer_signal
        reward = _sigmoid(v + bonus + self._rng(qid, path, "reward").gauss(0.0, self.reward_noise(qid)))
        out = StepOutcome(num_tokens=n, answer=answer, correct=correct, value=v, reward=reward)
        self._outcomes[key] = out
        return out

    def reward(self, qid: int, path: str) -> float:
        return self.outcome(qid, path).reward

    def reward_noise(self, qid: int) -> float:
        """The question's reward noise: ``reward_noise``, or with ``reward_noise_spread`` > 0 a log-normal draw
        around it per question (questions whose rankings are more or less predictable: different hit rates)."""
        p = self.params
        if p.reward_noise_spread <= 0:
            return p.reward_noise
        return p.reward_noise * math.exp(self._rng(qid, "", "noise").gauss(0.0, p.reward_noise_spread))

    # ---- text --------------------------------------------------------------------------------------

    def generate(self, req: GenRequest) -> SimOutput:
        """What the simulated model returns for ``req`` (truncated at ``max_new_tokens``)."""
        qid = self.question_id(req.prompt)
        if qid is None:  # not one of our questions: key on the prompt itself
            qid = int.from_bytes(hashlib.blake2b(req.prompt[:256].encode(), digest_size=4).digest(), "big")
        path = req.node_path or req.rid
        out = self.outcome(qid, path)
        tail = ANSWER_PHRASE.split() + [out.answer + "."] if out.answer is not None else []
        body_len = max(out.num_tokens - 1 - len(tail), 1)  # one token is the delimiter / EOS
        words = [f"<{path}>"] + [_FILLER[i % len(_FILLER)] for i in range(body_len - 1)] + tail
        if out.num_tokens > req.max_new_tokens:  # cut off mid-step, no answer reached
            text = " ".join(words[: req.max_new_tokens])
            return SimOutput(text, req.max_new_tokens, "length", None, out.reward)
        stop = None if out.answer is not None or not req.stop else req.stop[0]
        return SimOutput(" ".join(words), out.num_tokens, "stop", stop, out.reward)


class MixedWorkload:
    """Several workloads on one engine: searches of different programs (policies) sharing it, as on a server.

    Question ``i`` of :meth:`questions` belongs to part ``i % len(parts)`` and is that part's question
    ``i // len(parts)``; the parts' question ids are disjoint (part ``g`` numbers from ``g * QID_STRIDE``), so every
    request and reward call finds its part from the prompt's question id."""

    QID_STRIDE = 1_000_000

    def __init__(self, parts: List[Workload]):
        if not parts:
            raise ValueError("parts: a mixed workload needs at least one workload")
        self.parts = list(parts)

    question_id = staticmethod(Workload.question_id)

    def _part(self, qid: Optional[int]) -> Workload:
        return self.parts[min((qid or 0) // self.QID_STRIDE, len(self.parts) - 1)]

    def part_of(self, index: int) -> int:
        """The part that question ``index`` of :meth:`questions` belongs to."""
        return index % len(self.parts)

    def describe(self) -> Dict:
        return {"mixed": [p.describe() for p in self.parts]}

    def questions(self, n: int, start: int = 0) -> List[Tuple[str, str]]:
        out = []
        for i in range(start, start + n):
            g, k = self.part_of(i), i // len(self.parts)
            qid = g * self.QID_STRIDE + k
            out.append((self.parts[g].question(qid), self.parts[g].reference(qid)))
        return out

    def reward(self, qid: int, path: str) -> float:
        return self._part(qid).reward(qid, path)

    def generate(self, req: GenRequest) -> SimOutput:
        return self._part(self.question_id(req.prompt)).generate(req)


AnyWorkload = Union[Workload, MixedWorkload]


def workload_for(
    policies: Union[str, Sequence[str]], seed: Union[int, Sequence[int]] = 0, **overrides: Any
) -> AnyWorkload:
    """One policy's :meth:`Workload.for_policy` (``policies`` a name), or a :class:`MixedWorkload` with one such part
    per name (a sequence; ``seed`` one for all parts or one per part)."""
    if isinstance(policies, str):
        return Workload.for_policy(policies, seed=seed if isinstance(seed, int) else seed[0], **overrides)
    seeds = [seed] * len(policies) if isinstance(seed, int) else list(seed)
    if len(seeds) != len(policies):
        raise ValueError(f"seed: {len(policies)} policies need one seed or {len(policies)} seeds, got {len(seeds)}")
    return MixedWorkload([Workload.for_policy(p, seed=s, **overrides) for p, s in zip(policies, seeds)])
