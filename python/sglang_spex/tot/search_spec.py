"""The search specification: one validated, JSON-serialisable description of a search.

The DSL (``sglang_spex.lang``) builds it, ``POST /tot/search`` receives it as JSON, and both the
server-side and the client-side runner execute it. :meth:`SearchSpec.validate` raises
:class:`SearchSpecError` naming the offending field, so a bad spec is refused before anything starts.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import regex

from sglang_spex.tot.answers import MAX_PATTERN_CHARS
from sglang_spex.tot.policies.base import Policy
from sglang_spex.tot.policies.registry import build_policy
from sglang_spex.tot.rewards import RewardConfig, check_template
from sglang_spex.tot.tasks import get_task
from sglang_spex.tot.validation import SearchSpecError, check, check_finite, check_int, from_dict, is_num

INT64 = (-(2**63), 2**63 - 1)  # SGLang's range for a request's priority
SEED_BOUND = 2**128  # a search seed is hashed into each node's seed: any 64-bit (or 128-bit) seed serves
MAX_STOP_STRINGS = 32  # SGLang refuses a request with more stop strings
# SGLang decodes the last (longest stop string's length) output tokens of a request at every decode step to look
# for a stop string, on the scheduler's thread: a long one costs every client's step time.
MAX_STOP_CHARS = 256
PROMPT_FIELDS = ("question",)  # what the search formats step.prompt_template with


__all__ = [
    "DEFAULT_ANSWER_PATTERN",
    "AnswerConfig",
    "PolicyConfig",
    "RewardConfig",
    "SearchSpec",
    "SearchSpecError",
    "StepConfig",
]

DEFAULT_ANSWER_PATTERN = r"(?:[Tt]he (?:final )?answer is|\\boxed\{)[:\s]*\$?([^\n$]+)"
AGGREGATES = ("majority", "weighted", "best_of_n")
SCORE_AGGS = ("last", "min", "mean", "prod")


@dataclass
class StepConfig:
    """How one reasoning step is generated."""

    stop: List[str] = field(default_factory=lambda: ["\n\n"])
    max_tokens: int = 256  # per step
    temperature: float = 1.0
    top_p: float = 1.0
    max_total_tokens: int = 1024  # generated tokens along a path; a node past it is finished
    prompt_template: str = "{question}\n"

    def validate(self, p: str = "step") -> None:
        check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            f"{p}.stop",
            "must be a list of non-empty strings",
        )
        check(len(self.stop) <= MAX_STOP_STRINGS, f"{p}.stop", f"at most {MAX_STOP_STRINGS} strings (SGLang's limit)")
        for i, stop in enumerate(self.stop):
            check(len(stop) <= MAX_STOP_CHARS, f"{p}.stop[{i}]", f"at most {MAX_STOP_CHARS} characters")
        check_int(self.max_tokens, f"{p}.max_tokens", 1)
        check(is_num(self.temperature), f"{p}.temperature", "must be a number >= 0")
        check_finite(self.temperature, f"{p}.temperature", 0)  # SGLang refuses inf, node by node
        check(is_num(self.top_p) and 0 < self.top_p <= 1, f"{p}.top_p", "must be in (0, 1]")
        check_int(self.max_total_tokens, f"{p}.max_total_tokens", 1)
        check_template(self.prompt_template, PROMPT_FIELDS, f"{p}.prompt_template", required="question")


@dataclass
class AnswerConfig:
    """How answers are extracted from terminal steps and aggregated into the search's answer."""

    pattern: str = DEFAULT_ANSWER_PATTERN  # regex; group 1 (or the whole match) is the answer
    aggregate: str = "weighted"  # majority | weighted (reward-weighted majority) | best_of_n
    score: str = "last"  # how step rewards aggregate into a path score: last | min | mean | prod

    def validate(self, p: str = "answer") -> None:
        check(
            isinstance(self.pattern, str) and len(self.pattern) <= MAX_PATTERN_CHARS,
            f"{p}.pattern",
            f"must be a string of at most {MAX_PATTERN_CHARS} characters",
        )
        try:
            regex.compile(self.pattern)
        except (regex.error, TypeError, ValueError, RecursionError) as e:
            raise SearchSpecError(f"{p}.pattern", f"invalid regex: {e}")
        check(self.aggregate in AGGREGATES, f"{p}.aggregate", f"must be one of {list(AGGREGATES)}")
        check(self.score in SCORE_AGGS, f"{p}.score", f"must be one of {list(SCORE_AGGS)}")


@dataclass
class PolicyConfig:
    """The policy by name (``rebase``, ``ets``, ``rstar``, ``rest`` or a preset like ``rebase-16``) and its knobs."""

    name: str = "rebase"
    params: Dict[str, Any] = field(default_factory=dict)

    def build(self) -> Policy:
        """The validated policy object; raises SearchSpecError naming a bad knob."""
        return build_policy(self.name, self.params)

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, **copy.deepcopy(self.params)}


@dataclass
class SearchSpec:
    """Everything a search needs besides the question."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    step: StepConfig = field(default_factory=StepConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    answer: AnswerConfig = field(default_factory=AnswerConfig)
    seed: int = 0
    task: Optional[str] = None  # a task set name whose checker judges answers (default: math-verify)
    reward_timeout: Optional[float] = None  # seconds; None = the server's --tot-reward-timeout (client: 120)
    priority: Optional[int] = None  # SGLang request priority of the search's (primary) requests
    speculation: Optional[Dict[str, Any]] = None  # per-search SPEX overrides, passed through untouched

    def validate(self) -> "SearchSpec":
        check(
            isinstance(self.seed, int) and not isinstance(self.seed, bool) and abs(self.seed) < SEED_BOUND,
            "seed",
            "must be an integer of at most 128 bits",
        )
        self.policy.build()
        self.step.validate()
        self.reward.validate()
        self.answer.validate()
        if self.task is not None:
            check(isinstance(self.task, str), "task", "must be a string or null")
            try:
                get_task(self.task)
            except KeyError as e:
                raise SearchSpecError("task", str(e.args[0]))
        if self.reward_timeout is not None:
            check(is_num(self.reward_timeout), "reward_timeout", "must be a finite number > 0")
            check_finite(self.reward_timeout, "reward_timeout", 0, above=True)
        check(
            self.priority is None
            or (
                isinstance(self.priority, int)
                and not isinstance(self.priority, bool)
                and INT64[0] <= self.priority <= INT64[1]
            ),
            "priority",
            f"must be an integer in {INT64[0]}..{INT64[1]} (SGLang's request priority is a signed 64-bit integer)",
        )
        check(self.speculation is None or isinstance(self.speculation, dict), "speculation", "must be an object")
        return self

    def to_dict(self) -> Dict[str, Any]:
        """The JSON spec; it shares nothing with this spec."""
        return {
            "policy": self.policy.to_dict(),
            "step": dataclasses.asdict(self.step),
            "reward": {k: v for k, v in dataclasses.asdict(self.reward).items() if v is not None},
            "answer": dataclasses.asdict(self.answer),
            "seed": self.seed,
            "task": self.task,
            "reward_timeout": self.reward_timeout,
            "priority": self.priority,
            "speculation": copy.deepcopy(self.speculation),
        }

    @classmethod
    def from_dict(cls, data: Any) -> "SearchSpec":
        """Parse and validate a JSON spec (it shares nothing with ``data``); raises :class:`SearchSpecError` naming
        the bad field."""
        check(isinstance(data, dict), "spec", "must be an object")
        try:
            data = copy.deepcopy(data)
        except RecursionError:  # (the server's bodies are nested far less deeply: validation.MAX_JSON_DEPTH)
            raise SearchSpecError("spec", "nested too deeply") from None
        unknown = sorted(map(str, set(data) - {f.name for f in dataclasses.fields(cls)}))  # (a key may be no str)
        check(not unknown, unknown[0] if unknown else "spec", "unknown field")
        pol = data.pop("policy", {"name": "rebase"})
        if isinstance(pol, str):
            pol = {"name": pol}
        check(isinstance(pol, dict) and isinstance(pol.get("name"), str), "policy.name", "must be a string")
        spec = cls(
            policy=PolicyConfig(name=pol.pop("name"), params=pol),
            step=from_dict(StepConfig, data.pop("step", {}), "step"),
            reward=from_dict(RewardConfig, data.pop("reward", {}), "reward"),
            answer=from_dict(AnswerConfig, data.pop("answer", {}), "answer"),
            **data,
        )
        return spec.validate()
