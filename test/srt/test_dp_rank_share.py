"""Under ``--dp-size N`` ``k_total`` is each rank's (``SpecBudget``: "the knee of one rank"; the scheduler caps per
rank). ``--tot-k-total auto`` measures the knee on the whole server, whose batches the DP controller splits over the
ranks: each rank takes ``ceil(knee / N)``, on the HTTP side and in its scheduler alike. (Session 34 first divided only
the scheduler side; a review caught the HTTP side still handing each rank the whole knee.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from sglang_spex.config import SpexConfig
from sglang_spex.srt import control, spex_wiring
from sglang_spex.srt.dp_ranks import per_rank


@pytest.mark.parametrize(
    "knee, dp_size, share", [(8, 1, 8), (8, 2, 4), (5, 2, 3), (1, 4, 1), (0, 2, 0), (None, 2, None)]
)
def test_a_ranks_share_of_a_server_knee(knee, dp_size, share):
    assert per_rank(knee, dp_size) == share


@pytest.mark.parametrize("dp_size, k", [(1, 5), (2, 3)])
def test_the_measured_knee_reaches_each_rank_as_its_share_on_both_sides(monkeypatch, dp_size, k):
    sent = []

    async def send(tm, req):
        sent.append((req.op, req.value))

    monkeypatch.setattr(control, "send", send)
    wiring = spex_wiring.SpexWiring(SpexConfig(enabled=True, k_total=None), lambda: None)
    wiring._tm = SimpleNamespace(server_args=SimpleNamespace(dp_size=dp_size))
    asyncio.run(wiring._set_k_total(SimpleNamespace(k_total=5)))
    assert wiring.budget.k_total == k  # the HTTP-side T2 budget: one rank's knee
    assert sent == [("budget", float(k))] and wiring.scheduler_cap == k


@pytest.mark.parametrize("dp_size, seen", [(1, 3), (2, 6)])
def test_a_ranks_decode_step_reaches_the_drift_monitor_on_the_servers_scale(monkeypatch, dp_size, seen):
    """The profile's batch is the whole server's: a rank decoding 3 rows under --dp-size 2 is its curve at 6 (was
    compared with its curve at 3: a drift that never goes away, and re-profiles)."""
    observed = []
    manager = SimpleNamespace(observe=lambda batch, step_s: observed.append((batch, step_s)))
    wiring = spex_wiring.SpexWiring(SpexConfig(enabled=True, k_total=None), lambda: manager)
    wiring._tm = SimpleNamespace(server_args=SimpleNamespace(dp_size=dp_size))
    row = {"mode": spex_wiring.DECODE_MODE, "step_s": 0.1, "time": 1.0, "batch_size": 3, "primary_live": 2}
    monkeypatch.setattr(wiring, "_reader", lambda rank: SimpleNamespace(latest=lambda: row))
    assert wiring.engine_primary(0) == 2
    assert observed == [(seen, 0.1)]
