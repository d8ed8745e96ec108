"""Self-disabling guard for hook logic: a hook must never raise into SGLang's scheduler."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict

logger = logging.getLogger(__name__)

_guards: Dict[str, "HookGuard"] = {}


class HookGuard:
    """Runs one hook's logic; on the first unexpected exception logs it and disables that hook for good."""

    def __init__(self, name: str):
        self.name = name
        self.enabled = True
        self.error: str = ""
        _guards[name] = self

    def run(self, fn: Callable[..., Any], *args: Any, default: Any = None, **kwargs: Any) -> Any:
        if not self.enabled:
            return default
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # never into SGLang
            self.enabled = False
            self.error = f"{type(e).__name__}: {e}"
            logger.exception("spex: hook %s failed and disabled itself; SGLang continues without it", self.name)
            return default


def guard_report() -> Dict[str, Any]:
    """Which hooks are live and why any is off (for ``/spex/stats``)."""
    return {name: {"enabled": g.enabled, "error": g.error} for name, g in sorted(_guards.items())}
