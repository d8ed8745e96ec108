"""The search specification: one validated, JSON-serialisable description of a search.

The DSL (``sglang_spex.lang``) builds it, ``POST /tot/search`` receives it as JSON, and both the
server-side and the client-side runner execute it. :meth:`SearchSpec.validate` raises
:class:`SearchSpecError` naming the offending field, so a bad spec is refused before anything starts.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

DEFAULT_ANSWER_PATTERN = r"(?:[Tt]he (?:final )?answer is|\\boxed\{)[:\s]*\$?([^\n$]+)"
REWARD_TYPES = ("logprob", "prm", "verifier", "callback")
AGGREGATES = ("majority", "weighted", "best_of_n")
SCORE_AGGS = ("last", "min", "mean", "prod")


class SearchSpecError(ValueError):
    """A search spec field is invalid; ``field`` names it (dotted), ``reason`` says why."""

    def __init__(self, field_name: str, reason: str):
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason

    def to_dict(self) -> Dict[str, str]:
        return {"field": self.field, "reason": self.reason}


def _check(ok: bool, name: str, reason: str) -> None:
    if not ok:
        raise SearchSpecError(name, reason)


def _from_dict(cls, data: Any, prefix: str):
    _check(isinstance(data, dict), prefix, "must be an object")
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    _check(not unknown, f"{prefix}.{unknown[0]}" if unknown else prefix, "unknown field")
    return cls(**data)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


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
        _check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            f"{p}.stop",
            "must be a list of non-empty strings",
        )
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"{p}.max_tokens", "must be an integer >= 1")
        _check(_is_num(self.temperature) and self.temperature >= 0, f"{p}.temperature", "must be a number >= 0")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, f"{p}.top_p", "must be in (0, 1]")
        _check(
            isinstance(self.max_total_tokens, int) and self.max_total_tokens >= 1,
            f"{p}.max_total_tokens",
            "must be an integer >= 1",
        )
        _check(
            isinstance(self.prompt_template, str) and "{question}" in self.prompt_template,
            f"{p}.prompt_template",
            "must be a string containing {question}",
        )


@dataclass
class RewardConfig:
    """Which reward scores a node (see ``tot/rewards.py``)."""

    type: str = "logprob"  # logprob | prm | verifier | callback
    url: Optional[str] = None  # prm: the PRM's SGLang server; callback: the client's scoring URL
    name: Optional[str] = None  # verifier: a name registered on the server
    mode: str = "token"  # prm: "token" (P(good) vs P(bad) at the step tag) | "mean_logprob"
    good_token: str = "+"
    bad_token: str = "-"
    step_tag: str = "\n"
    prm_template: str = "{question}\n{steps}"

    def validate(self, p: str = "reward") -> None:
        _check(self.type in REWARD_TYPES, f"{p}.type", f"must be one of {list(REWARD_TYPES)}")
        if self.type in ("prm", "callback"):
            _check(
                isinstance(self.url, str) and self.url.startswith(("http://", "https://")),
                f"{p}.url",
                f"a {self.type} reward needs an http(s) URL",
            )
        if self.type == "prm":
            _check(self.mode in ("token", "mean_logprob"), f"{p}.mode", "must be 'token' or 'mean_logprob'")
        if self.type == "verifier":
            from sglang_spex.tot.rewards import VERIFIERS

            _check(
                self.name in VERIFIERS, f"{p}.name", f"unknown verifier {self.name!r}; registered: {sorted(VERIFIERS)}"
            )


@dataclass
class AnswerConfig:
    """How answers are extracted from terminal steps and aggregated into the search's answer."""

    pattern: str = DEFAULT_ANSWER_PATTERN  # regex; group 1 (or the whole match) is the answer
    aggregate: str = "weighted"  # majority | weighted (reward-weighted majority) | best_of_n
    score: str = "last"  # how step rewards aggregate into a path score: last | min | mean | prod

    def validate(self, p: str = "answer") -> None:
        try:
            re.compile(self.pattern)
        except (re.error, TypeError) as e:
            raise SearchSpecError(f"{p}.pattern", f"invalid regex: {e}")
        _check(self.aggregate in AGGREGATES, f"{p}.aggregate", f"must be one of {list(AGGREGATES)}")
        _check(self.score in SCORE_AGGS, f"{p}.score", f"must be one of {list(SCORE_AGGS)}")


@dataclass
class PolicyConfig:
    """The policy by name (``rebase``, ``ets``, ``rstar``, ``rest`` or a preset like ``rebase-16``) and its knobs."""

    name: str = "rebase"
    params: Dict[str, Any] = field(default_factory=dict)

    def resolved(self):
        """``(base policy name, params dataclass instance)``; raises SearchSpecError naming a bad knob."""
        from sglang_spex.tot.policies import POLICIES, PRESETS

        base, params = self.name, dict(self.params)
        if base in PRESETS:
            preset_base, preset_params = PRESETS[base]
            base, params = preset_base, {**preset_params, **params}
        _check(
            base in POLICIES,
            "policy.name",
            f"unknown policy {self.name!r}; choose from " f"{sorted(POLICIES) + sorted(PRESETS)}",
        )
        params_cls = POLICIES[base].Params
        obj = _from_dict(params_cls, params, "policy")
        for f in dataclasses.fields(obj):  # numeric knobs must be numbers before the policy checks ranges
            if _is_num(f.default):
                _check(_is_num(getattr(obj, f.name)), f"policy.{f.name}", "must be a number")
        obj.validate()
        return base, obj

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, **self.params}


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
        _check(isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed", "must be an integer")
        self.policy.resolved()
        self.step.validate()
        self.reward.validate()
        self.answer.validate()
        if self.task is not None:
            from sglang_spex.tot.tasks import get_task

            try:
                get_task(self.task)
            except KeyError as e:
                raise SearchSpecError("task", str(e.args[0]))
        _check(
            self.reward_timeout is None or (_is_num(self.reward_timeout) and self.reward_timeout > 0),
            "reward_timeout",
            "must be a number > 0",
        )
        _check(self.priority is None or isinstance(self.priority, int), "priority", "must be an integer")
        _check(self.speculation is None or isinstance(self.speculation, dict), "speculation", "must be an object")
        return self

    def to_dict(self) -> Dict[str, Any]:
        return {
            "policy": self.policy.to_dict(),
            "step": dataclasses.asdict(self.step),
            "reward": {k: v for k, v in dataclasses.asdict(self.reward).items() if v is not None},
            "answer": dataclasses.asdict(self.answer),
            "seed": self.seed,
            "task": self.task,
            "reward_timeout": self.reward_timeout,
            "priority": self.priority,
            "speculation": self.speculation,
        }

    @classmethod
    def from_dict(cls, data: Any) -> "SearchSpec":
        """Parse and validate a JSON spec; raises :class:`SearchSpecError` naming the bad field."""
        _check(isinstance(data, dict), "spec", "must be an object")
        data = dict(data)
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        _check(not unknown, unknown[0] if unknown else "spec", "unknown field")
        pol = data.pop("policy", {"name": "rebase"})
        if isinstance(pol, str):
            pol = {"name": pol}
        _check(isinstance(pol, dict) and isinstance(pol.get("name"), str), "policy.name", "must be a string")
        pol = dict(pol)
        spec = cls(
            policy=PolicyConfig(name=pol.pop("name"), params=pol),
            step=_from_dict(StepConfig, data.pop("step", {}), "step"),
            reward=_from_dict(RewardConfig, data.pop("reward", {}), "reward"),
            answer=_from_dict(AnswerConfig, data.pop("answer", {}), "answer"),
            **data,
        )
        return spec.validate()
