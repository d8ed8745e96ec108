"""The speculative gate's census: one pass over the running batch, the chunked request and the waiting queue.

Run at every scheduling step by the gate (``scheduling.h_cap_prefill`` and ``h_cap_decode``). The decode path
needs only the counts (:func:`census` with ``full=False``): it keeps no per-request lists and no set of searches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Set

from sglang_spex.adapters import scheduler as sa


@dataclass
class Census:
    """A gate decision's inputs."""

    spec_running: int = 0  # live speculative requests of the running batch (+ a speculative chunked request)
    spec_sure: int = 0  # of them, the ones their search expects to use (no room below the knee taken)
    primary_decoding: int = 0  # live primary requests of the running batch
    primary_chunked: bool = False  # a primary is being prefilled in chunks (a prefill runs anyway)
    primary_waiting: int = 0  # primary requests in the waiting queue
    waiting_spec: List[Any] = field(default_factory=list)  # (full census only)
    waiting_primary: List[Any] = field(default_factory=list)  # (full census only)
    primary_searches: Set[Any] = field(default_factory=set)  # searches (or plain requests) with live primary
    # requests (full census only)

    @property
    def primary_live(self) -> int:
        return self.primary_decoding + int(self.primary_chunked) + self.primary_waiting


def census(scheduler: Any, batch: Any, full: bool = True) -> Census:
    """Count the live speculative and primary work; ``full`` also lists the waiting requests by role and collects
    the searches with live primary requests (the prefill gate's extra inputs)."""
    c = Census()
    reqs = sa.reqs_view(batch)
    searches = c.primary_searches if full else None
    c.spec_running, c.primary_decoding, c.spec_sure = sa.live_roles(reqs, searches=searches)
    chunked = sa.chunked_req(scheduler)
    if chunked is not None and all(chunked is not r for r in reqs):
        if sa.is_spec(chunked):
            c.spec_running += 1
            c.spec_sure += int(sa.is_sure(chunked))
        else:
            c.primary_chunked = True
            if full:
                c.primary_searches.add(sa.search_of(chunked))
    waiting = sa.waiting(scheduler)
    if not full:
        c.primary_waiting = len(waiting) - sa.count_spec(waiting)
        return c
    for r in waiting:
        if sa.is_spec(r):
            c.waiting_spec.append(r)
        else:
            c.waiting_primary.append(r)
            c.primary_searches.add(sa.search_of(r))
    c.primary_waiting = len(c.waiting_primary)
    return c
