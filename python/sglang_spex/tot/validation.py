"""Field validation shared by the search spec, the reward config and the policies' params.

A leaf module (it imports nothing of ours), so every config dataclass can raise :class:`SearchSpecError`
without importing the spec that holds it, and any other input check can raise a :class:`FieldError`.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import Any, Dict, Type, TypeVar

T = TypeVar("T")


class FieldError(ValueError):
    """An input field is invalid; ``field`` names it (dotted), ``reason`` says why."""

    def __init__(self, field_name: str, reason: str):
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason

    def to_dict(self) -> Dict[str, str]:
        return {"field": self.field, "reason": self.reason}


class SearchSpecError(FieldError):
    """A search spec field is invalid."""


# A search id, as the server (``srt/http_api.SearchBody.search_id``) and the client (``tot/context``) take one: no
# ``:``, which would break the rids built from it (``tot/engine.node_rid``), and ASCII only.
SEARCH_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


def check_search_id(search_id: Any) -> str:
    """``search_id`` if it matches ``SEARCH_ID_PATTERN``, else :class:`SearchSpecError` naming ``search_id``."""
    if not isinstance(search_id, str) or re.fullmatch(SEARCH_ID_PATTERN, search_id) is None:
        raise SearchSpecError("search_id", f"must be 1-64 letters, digits, '_' or '-' (got {search_id!r:.80})")
    return search_id


def is_http_url(value: Any) -> bool:
    """``value`` is a string that starts with ``http://`` or ``https://`` (any case)."""
    return isinstance(value, str) and value.lower().startswith(("http://", "https://"))


def check(ok: bool, name: str, reason: str) -> None:
    """Raise :class:`SearchSpecError` for field ``name`` unless ``ok``."""
    if not ok:
        raise SearchSpecError(name, reason)


# JSON nesting a body or a spec may have: far past any route's schema (a rollout is 3 deep), and far inside what
# everything that walks one recursively survives (``copy.deepcopy`` in ``SearchSpec.from_dict``, pydantic, the JSON
# encoder of an answer echoing it, the DSL's ``plain``) under Python's recursion limit of 1000.
MAX_JSON_DEPTH = 64
FLOAT_MAX = sys.float_info.max  # a number knob past it (or NaN, inf) breaks the float maths of a policy


def is_num(x: Any) -> bool:
    """An int or float, not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_finite(value: Any, name: str, minimum: float = -FLOAT_MAX, above: bool = False) -> None:
    """``value`` is a finite number (not NaN, not inf, no larger than a float) >= ``minimum`` (> with ``above``)."""
    low_ok = value > minimum if above else value >= minimum
    bound = f"{'>' if above else '>='} {minimum:g}" if minimum > -FLOAT_MAX else ""
    check(low_ok and value <= FLOAT_MAX, name, f"must be a finite number {bound}".strip())


def check_int(value: Any, name: str, minimum: int) -> None:
    """``value`` is an integer (not a bool) >= ``minimum``."""
    check(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        name,
        f"must be an integer >= {minimum}",
    )


def from_dict(cls: Type[T], data: Any, prefix: str) -> T:
    """Build dataclass ``cls`` from a JSON object, refusing unknown fields (named ``prefix.<field>``)."""
    check(isinstance(data, dict), prefix, "must be an object")
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(map(str, set(data) - names))  # (a Python caller's key may be no string)
    check(not unknown, f"{prefix}.{unknown[0]}" if unknown else prefix, "unknown field")
    return cls(**data)


def check_numbers(obj: Any, prefix: str) -> None:
    """Every field of dataclass ``obj`` whose default is a number holds a number."""
    for f in dataclasses.fields(obj):
        if is_num(f.default):
            check(is_num(getattr(obj, f.name)), f"{prefix}.{f.name}", "must be a number")
