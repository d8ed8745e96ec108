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
from sglang_spex.tot.search_spec import SearchSpec, SearchSpecError

__all__ = [
    "Endpoint",
    "Program",
    "SearchSpec",
    "SearchSpecError",
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
