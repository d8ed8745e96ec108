"""Search policies: each module has ``Params`` (knobs with the reference defaults) and ``async run(ctx)``.

Named configurations as in the SPEX paper: REBASE/ETS with width 8 and 16, rSTAR/REST with 5 and 10 target
answers.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Dict, Tuple

from sglang_spex.tot.policies import ets, rebase, rest, rstar

POLICIES: Dict[str, ModuleType] = {"rebase": rebase, "ets": ets, "rstar": rstar, "rest": rest}
BFS_POLICIES = ("rebase", "ets")
DFS_POLICIES = ("rstar", "rest")

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
