"""The simulator charges per-request client overhead (latency + serial client CPU) in virtual time."""

from __future__ import annotations

import asyncio
from typing import Optional

import numpy as np
import pytest

from sglang_spex.sim.client import ClientOverhead
from sglang_spex.sim.clock import run_virtual
from sglang_spex.sim.cost import CostModel, RooflineCost
from sglang_spex.sim.engine import SimPort
from sglang_spex.sim.run import simulate
from sglang_spex.sim.workload import Workload, WorkloadParams
from sglang_spex.tot.engine import GenRequest
from sglang_spex.tot.spec import PolicyConfig, SearchSpec

STEP_TOKENS = 5  # every node: 5 tokens = 1 from the prefill pass + 4 decode steps
OVERHEAD = ClientOverhead(request_s=0.5, response_s=0.25, cpu_s=0.125)  # binary fractions: exact sums


class UnitCost(CostModel):
    """1 s per decode step at any batch, free prefill: easy to add up by hand."""

    name = "unit"

    def __init__(self, client: ClientOverhead = ClientOverhead()):
        self.client = client

    def decode_time(self, batch, ctx_total):
        t = np.ones_like(np.asarray(ctx_total, dtype=float))
        return float(t) if np.ndim(t) == 0 else t

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0, attn_pairs: Optional[float] = None) -> float:
        return 0.0


def fixed_workload() -> Workload:
    return Workload(WorkloadParams(lengths="dfs", dfs_min_tokens=STEP_TOKENS, dfs_max_tokens=STEP_TOKENS), seed=1)


def finish_times(cost: CostModel, n: int):
    wl = fixed_workload()

    async def main():
        port = SimPort(cost, wl)
        loop = asyncio.get_running_loop()
        done = []

        async def one(i: int):
            await port.generate(GenRequest(prompt=wl.question(0), rid=f"r{i}", node_path=f"r.{i}", max_new_tokens=64))
            done.append(loop.time())

        await asyncio.gather(*(one(i) for i in range(n)))
        await port.close()
        return sorted(done), port.metrics.client_cpu_time

    return run_virtual(main)


def test_one_request_pays_latency_and_cpu():
    (plain,), _ = finish_times(UnitCost(), 1)
    (charged,), cpu = finish_times(UnitCost(OVERHEAD), 1)
    assert plain == 4.0
    assert charged == 4.0 + 0.5 + 0.25 + 0.125
    assert cpu == 0.125


def test_client_cpu_is_one_thread():
    """Two requests run in one batch and finish together; the client digests the results one after the other."""
    times, cpu = finish_times(UnitCost(OVERHEAD), 2)
    assert times == [4.0 + 0.75 + 0.125, 4.0 + 0.75 + 0.25]
    assert cpu == 0.25


def test_bfs_search_pays_per_level_latency_and_per_request_cpu():
    """REBASE, one question: each tree level is one wave of requests that finish together, so the overhead adds
    (request_s + response_s) per level and cpu_s per request, nothing else."""
    spec = SearchSpec(policy=PolicyConfig("rebase-8", {"max_depth": 4}), seed=2)
    kw = dict(workload=fixed_workload(), questions=1, concurrency=1)
    base = simulate(spec, cost=UnitCost(), **kw)
    charged = simulate(spec, cost=UnitCost(OVERHEAD), **kw)
    (res,) = charged.results
    requests = res.num_requests
    levels = len({n["depth"] for n in res.nodes if n["depth"] > 0 and n["status"] != "pending"})
    assert levels >= 2 and requests > levels
    assert base.virtual_time == pytest.approx(levels * (STEP_TOKENS - 1))
    expected = base.virtual_time + levels * (OVERHEAD.request_s + OVERHEAD.response_s) + requests * OVERHEAD.cpu_s
    assert charged.virtual_time == pytest.approx(expected)
    tree = [[{k: v for k, v in n.items() if k != "rid"} for n in r.results[0].nodes] for r in (base, charged)]
    assert tree[0] == tree[1]  # the overhead changes time, not the search


def test_device_models_default_to_no_overhead():
    assert RooflineCost("A100-80G", "Llemma-7B").client.is_zero
    with pytest.raises(ValueError, match="cpu_s"):
        ClientOverhead(cpu_s=-1.0)
