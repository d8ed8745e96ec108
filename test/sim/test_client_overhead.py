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
from sglang_spex.tot.search_spec import PolicyConfig, SearchSpec

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


def finish_times(cost: CostModel, n: int, **engine_kw):
    """Finish times of ``n`` requests (same question prompt) issued together; client CPU used; cached tokens."""
    wl = fixed_workload()

    async def main():
        port = SimPort(cost, wl, **engine_kw)
        loop = asyncio.get_running_loop()
        done, cached = [], []

        async def one(i: int):
            req = GenRequest(prompt=wl.question(0), rid=f"r{i}", node_path=f"r.{i}", max_new_tokens=64)
            res = await port.generate(req)
            done.append(loop.time())
            cached.append(res.cached_tokens)

        await asyncio.gather(*(one(i) for i in range(n)))
        await port.close()
        return sorted(done), port.metrics.client_cpu_time, cached

    return run_virtual(main)


def test_one_request_pays_latency_and_cpu():
    (plain,), _, _ = finish_times(UnitCost(), 1)
    (charged,), cpu, _ = finish_times(UnitCost(OVERHEAD), 1)
    assert plain == 4.0
    assert charged == 4.0 + 0.5 + 0.25 + 0.125
    assert cpu == 0.125


def test_client_cpu_is_one_thread():
    """Two requests run in one batch and finish together; the client digests the results one after the other."""
    times, cpu, _ = finish_times(UnitCost(ClientOverhead(response_s=0.25, cpu_s=0.125)), 2)
    assert times == [4.0 + 0.25 + 0.125, 4.0 + 0.25 + 0.25]
    assert cpu == 0.25


def test_request_path_is_serial_and_can_feed_the_cache():
    """request_s 0.5: #1 arrives at 0.5 and starts decoding; #2 arrives at 1.0, mid-step, joins at the step boundary
    1.5 and finishes one step after #1. With cache_on_prefill #2 finds #1's prompt in the prefix cache."""
    cost = UnitCost(ClientOverhead(request_s=0.5))
    times, _, cached = finish_times(cost, 2)
    assert times == [0.5 + 4.0, 1.5 + 4.0]
    assert cached == [0, 0]
    _, _, cached = finish_times(cost, 2, cache_on_prefill=True, cache_block=1)
    assert cached[0] == 0 and cached[1] == len(fixed_workload().question(0).split()) - 1


def test_bfs_search_pays_per_level_latency_and_per_request_cpu():
    """REBASE, one question: each tree level is one wave of requests that finish together, so the overhead adds
    response_s per level and cpu_s per request, nothing else."""
    spec = SearchSpec(policy=PolicyConfig("rebase-8", {"max_depth": 4}), seed=2)
    kw = dict(workload=fixed_workload(), questions=1, concurrency=1)
    base = simulate(spec, cost=UnitCost(), **kw)
    overhead = ClientOverhead(response_s=0.25, cpu_s=0.125)
    charged = simulate(spec, cost=UnitCost(overhead), **kw)
    (res,) = charged.results
    requests = res.num_requests
    levels = len({n["depth"] for n in res.nodes if n["depth"] > 0 and n["status"] != "pending"})
    assert levels >= 2 and requests > levels
    assert base.virtual_time == pytest.approx(levels * (STEP_TOKENS - 1))
    expected = base.virtual_time + levels * overhead.response_s + requests * overhead.cpu_s
    assert charged.virtual_time == pytest.approx(expected)
    tree = [[{k: v for k, v in n.items() if k != "rid"} for n in r.results[0].nodes] for r in (base, charged)]
    assert tree[0] == tree[1]  # the overhead changes time, not the search


def test_device_models_default_to_no_overhead():
    assert RooflineCost("A100-80G", "Llemma-7B").client.is_zero
    with pytest.raises(ValueError, match="cpu_s"):
        ClientOverhead(cpu_s=-1.0)
