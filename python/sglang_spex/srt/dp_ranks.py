"""This scheduler process's place under ``--dp-size N``: its rank, the rank count, and a rank's share of the server's
speculative budget. A leaf: SGLang's ``get_parallel()`` is read lazily (it is set only in processes the DP
controller spawned)."""

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


def process_dp_size() -> int:
    """How many DP ranks this scheduler process's server runs (SGLang's ``get_parallel().dp_size``), 1 without DP."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return max(1, int(get_parallel().dp_size or 1))
    except Exception:  # not written in this process (no DP controller spawned it)
        return 1


def per_rank(k_total: Optional[int], dp_size: int) -> Optional[int]:
    """A rank's share of the server's speculative budget: ``ceil(k_total / dp_size)`` (the knee and ``k_total`` are
    measured for the whole server, whose batches the DP controller splits over its ranks)."""
    return None if k_total is None else max(1, -(-int(k_total) // max(1, dp_size)))
