"""Data parallelism: the DP rank of this scheduler process, and one rank's knee from a knee measured on the whole
server. A leaf: SGLang's ``get_parallel()`` is read lazily (it is set only in processes the DP controller spawned)."""

from __future__ import annotations

from typing import Optional


def process_dp_rank() -> Optional[int]:
    """The DP rank this scheduler process serves (SGLang's ``get_parallel().dp_rank``), None without DP."""
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        return None if par.dp_size <= 1 or par.dp_rank is None else int(par.dp_rank)
    except Exception:  # not written in this process (no DP controller spawned it)
        return None


def per_rank(knee: Optional[int], dp_size: int) -> Optional[int]:
    """One rank's knee from a knee measured on the whole server (the roofline profile's batches are split over the
    ranks by the DP controller): ``ceil(knee / dp_size)``; 0 stays 0."""
    return None if knee is None else -(-int(knee) // max(1, dp_size))
