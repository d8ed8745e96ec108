"""The launcher's CPU core binding for servers with more than one rank (SGLANG_CPU_OMP_THREADS_BIND)."""

from __future__ import annotations

import pytest

from sglang_spex.config import ConfigError
from sglang_spex.launch_server import cpu_thread_binding


@pytest.mark.parametrize(
    "args, cores, want",
    [
        ([], [0, 1], None),
        (["--dp-size", "2"], [0, 1], "0|1"),
        (["--dp", "2", "--tp", "2"], range(8), "0-1|2-3|4-5|6-7"),
        (["--dp-size=3"], range(8), "0-2|3-5|6-7"),
        (["--dp-size", "2"], [2, 5, 3, 7], "2-3|5,7"),
    ],
)
def test_one_core_range_per_rank(args, cores, want):
    assert cpu_thread_binding(args, cores) == want


def test_more_ranks_than_cores_is_refused():
    with pytest.raises(ConfigError, match="3 ranks, but only 2 CPU cores"):
        cpu_thread_binding(["--dp-size", "3"], [0, 1])
    with pytest.raises(ConfigError, match="--dp-size"):
        cpu_thread_binding(["--dp-size", "two"], [0, 1])
