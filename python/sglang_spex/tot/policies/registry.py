"""The policies by name, the named presets, and how a (name, knobs) pair becomes a validated policy object.

Named configurations as in the SPEX paper: REBASE/ETS with width 8 and 16, rSTAR/REST with 5 and 10 target
answers.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple, Type

from sglang_spex.tot.policies.base import Policy
from sglang_spex.tot.policies.ets import Ets
from sglang_spex.tot.policies.mcts import MCTSPolicy
from sglang_spex.tot.policies.rebase import Rebase
from sglang_spex.tot.policies.rest import Rest
from sglang_spex.tot.policies.rstar import RStar
from sglang_spex.tot.validation import check, check_numbers, from_dict

POLICIES: Dict[str, Type[Policy]] = {cls.name: cls for cls in (Rebase, Ets, RStar, Rest)}
BFS_POLICIES = tuple(n for n, cls in POLICIES.items() if issubclass(cls, Rebase))
DFS_POLICIES = tuple(n for n, cls in POLICIES.items() if issubclass(cls, MCTSPolicy))

PRESETS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "rebase-8": ("rebase", {"width": 8}),
    "rebase-16": ("rebase", {"width": 16}),
    "ets-8": ("ets", {"width": 8}),
    "ets-16": ("ets", {"width": 16}),
    "rstar-5": ("rstar", {"target_answers": 5, "num_rollouts": 15}),
    "rstar-10": ("rstar", {"target_answers": 10, "num_rollouts": 30}),
    "rest-5": ("rest", {"target_answers": 5}),
    "rest-10": ("rest", {"target_answers": 10}),
}


def base_name(name: str) -> str:
    """The policy a name stands for (a preset's base policy, else the name itself)."""
    return PRESETS[name][0] if name in PRESETS else name


def build_policy(name: str, knobs: Dict[str, Any]) -> Policy:
    """The policy ``name`` (a base name or a preset; ``knobs`` override the preset's) with validated params;
    raises :class:`~sglang_spex.tot.validation.SearchSpecError` naming a bad name or knob."""
    check(
        isinstance(name, str), "policy.name", f"must be a string (a policy or preset name), not {type(name).__name__}"
    )
    check(isinstance(knobs, dict), "policy", "the knobs must be an object")
    base = base_name(name)
    params = {**PRESETS[name][1], **knobs} if name in PRESETS else dict(knobs)
    check(base in POLICIES, "policy.name", f"unknown policy {name!r}; choose from {sorted(POLICIES) + sorted(PRESETS)}")
    cls = POLICIES[base]
    obj = from_dict(cls.params_type, params, "policy")
    check_numbers(obj, "policy")  # numeric knobs must be numbers before the policy checks ranges
    obj.validate()
    return cls(obj)
