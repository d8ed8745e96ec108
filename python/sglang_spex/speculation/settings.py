"""Per-search SPEX settings: the server's ``--tot-*`` config with the search spec's ``speculation`` overrides."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from sglang_spex.config import COMPONENTS, ConfigError, SpexConfig
from sglang_spex.tot.search_spec import SearchSpecError

# Fields a search may override (server-wide limits such as k_total and max searches stay the server's).
OVERRIDABLE = (
    "enabled",
    "components",
    "lookahead",
    "max_lookahead",
    "bfs_lookahead",
    "payoff_gate",
    "auto_off",
    "sure_use",
    "early_stop",
    "early_stop_alpha",
    "early_stop_min_answers",
)

# The most a search may ask for in ``lookahead`` / ``max_lookahead`` (DFS rollouts planned ahead) and
# ``bfs_lookahead`` (BFS depths expanded early). The launcher bounds none of them, but a search is a client's
# request: planning is synchronous on the event loop, once per finished node, so an unbounded value (10**15) hung
# the server. 64 is the default --tot-max-depth (no search of a default server is deeper, so no BFS plan needs more
# depths) and 4x the default --tot-max-lookahead.
MAX_LOOKAHEAD = 64
_BOUNDED = ("lookahead", "max_lookahead", "bfs_lookahead")


def check_override_names(overrides: Dict[str, Any]) -> None:
    """Raise :class:`SearchSpecError` naming the first key of ``overrides`` a search may not override."""
    for key in overrides:
        if key not in OVERRIDABLE:
            raise SearchSpecError(f"speculation.{key}", f"unknown or not overridable; choose from {list(OVERRIDABLE)}")


def resolve(server: SpexConfig, overrides: Optional[Dict[str, Any]]) -> SpexConfig:
    """Merge ``overrides`` (``SearchSpec.speculation``) into ``server``; bad fields raise SearchSpecError naming
    them."""
    if not overrides:
        return server
    if not isinstance(overrides, dict):
        raise SearchSpecError("speculation", "must be an object")
    check_override_names(overrides)
    changes: Dict[str, Any] = {}
    for key, value in overrides.items():
        if key == "components":
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list) or any(v not in COMPONENTS for v in value):
                raise SearchSpecError("speculation.components", f"must be a subset of {list(COMPONENTS)}")
            value = tuple(value)
        elif key in ("enabled", "early_stop", "payoff_gate", "auto_off") and not isinstance(value, bool):
            raise SearchSpecError(f"speculation.{key}", "must be true or false")
        changes[key] = value
    for key, value in changes.items():  # one at a time, so the error names the field at fault
        try:
            dataclasses.replace(server, **{key: value}).validate()
        except (ConfigError, TypeError, OverflowError) as e:
            raise SearchSpecError(f"speculation.{key}", str(e))
        if key in _BOUNDED and value > MAX_LOOKAHEAD:
            raise SearchSpecError(f"speculation.{key}", f"{value!r}: must be <= {MAX_LOOKAHEAD}")
    merged = dataclasses.replace(server, **changes).validate()
    # as the launcher (--tot-max-lookahead must be >= --tot-lookahead when it is given): a max_lookahead the
    # search gives may not be below its lookahead
    if "max_lookahead" in changes and merged.max_lookahead < merged.lookahead:
        raise SearchSpecError(
            "speculation.max_lookahead",
            f"{merged.max_lookahead}: must be >= lookahead ({merged.lookahead})",
        )
    return merged


def check_without_speculation(overrides: Optional[Dict[str, Any]]) -> None:
    """On a server without ``--tot-speculation`` a search's ``speculation`` may only turn it off: anything else
    would do nothing there, so it raises SearchSpecError naming the field."""
    for key, value in (overrides or {}).items():
        if not (key == "enabled" and value is False):
            raise SearchSpecError(
                f"speculation.{key}", "this server runs without --tot-speculation (only enabled: false applies here)"
            )
