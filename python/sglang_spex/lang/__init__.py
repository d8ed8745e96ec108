"""The tree-search frontend DSL (see :mod:`sglang_spex.lang.program`)."""

from sglang_spex.lang.program import (
    Endpoint,
    Program,
    callback,
    ets,
    logprob,
    policy,
    prm,
    rebase,
    rest,
    rstar,
    search,
    verifier,
)
from sglang_spex.tot.spec import SearchSpec, SpecError

__all__ = [
    "Endpoint",
    "Program",
    "SearchSpec",
    "SpecError",
    "callback",
    "ets",
    "logprob",
    "policy",
    "prm",
    "rebase",
    "rest",
    "rstar",
    "search",
    "verifier",
]
