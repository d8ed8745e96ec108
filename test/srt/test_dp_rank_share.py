"""Under ``--dp-size N`` the server's speculative budget is split over the ranks: each rank's scheduler caps its
speculative requests (and takes its knee) at ``ceil(k_total / N)``, for a static ``--tot-k-total`` and for the knee
``auto`` measures. The roofline profile measures the whole server (the DP controller splits its batches over the
ranks), so the whole knee per rank admitted up to N times the knee in all."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from sglang_spex.config import SpexConfig
from sglang_spex.srt import control, spex_wiring
from sglang_spex.srt.dp_ranks import per_rank
from sglang_spex.srt.scheduling import SpexSchedulerState


@pytest.mark.parametrize("k_total, dp_size, share", [(8, 1, 8), (8, 2, 4), (5, 2, 3), (1, 4, 1), (None, 2, None)])
def test_a_ranks_share(k_total, dp_size, share):
    assert per_rank(k_total, dp_size) == share
    state = SpexSchedulerState.from_config(SpexConfig(enabled=True, k_total=k_total), dp_size=dp_size)
    assert state.budget == share and state.knee == share


@pytest.mark.parametrize("dp_size, cap", [(1, 5), (2, 3)])
def test_the_measured_knee_reaches_each_rank_as_its_share(monkeypatch, dp_size, cap):
    sent = []

    async def send(tm, req):
        sent.append((req.op, req.value))

    monkeypatch.setattr(control, "send", send)
    wiring = spex_wiring.SpexWiring(SpexConfig(enabled=True, k_total=None), lambda: None)
    wiring._tm = SimpleNamespace(server_args=SimpleNamespace(dp_size=dp_size))
    asyncio.run(wiring._set_k_total(SimpleNamespace(k_total=5)))
    assert wiring.budget.k_total == 5  # the HTTP-side T2 budget stays the server's
    assert sent == [("budget", float(cap))] and wiring.scheduler_cap == cap
