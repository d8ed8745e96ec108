"""Search policies as objects: REBASE and ETS (BFS), rSTAR and REST-MCTS* (MCTS); see ``registry``."""

from sglang_spex.tot.policies.registry import BFS_POLICIES, DFS_POLICIES, POLICIES, PRESETS, base_name, build_policy

__all__ = ["BFS_POLICIES", "DFS_POLICIES", "POLICIES", "PRESETS", "base_name", "build_policy"]
