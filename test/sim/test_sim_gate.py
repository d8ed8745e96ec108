"""The simulator's model of the scheduler's speculative gate (``spec_knee``) and of mixed chunked prefill."""

from __future__ import annotations

import asyncio
from typing import List, Tuple

from sglang_spex.sim.clock import run_virtual
from sglang_spex.sim.cost import RooflineCost
from sglang_spex.sim.engine import SimPort
from sglang_spex.sim.workload import Workload, WorkloadParams
from sglang_spex.tot.engine import GenRequest

SPEC = -1000  # SpexConfig.spec_priority


class Traced(SimPort):
    """Records every prefill pass (speculative / primary admitted, primaries running) and the running speculative
    requests against the gate's room at every decode step."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.prefills: List[Tuple[int, int, int]] = []
        self.decodes: List[Tuple[int, int]] = []

    async def _prefill(self, batch):
        spec = sum(1 for r in batch if self._is_spec(r))
        self.prefills.append((spec, len(batch) - spec, sum(1 for r in self.running if not self._is_spec(r))))
        await super()._prefill(batch)

    def _trim_spec(self):
        super()._trim_spec()
        self.decodes.append((sum(1 for r in self.running if self._is_spec(r)), self._spec_room()))


def _req(i: int, priority=None, max_new: int = 256) -> GenRequest:
    q = Workload().question(i % 2)
    return GenRequest(prompt=q, rid=f"spex:s:r.{i}:", max_new_tokens=max_new, node_path=f"r.{i}", priority=priority)


def _run(reqs_at, **kw):
    wl = Workload(WorkloadParams(lengths="dfs"), seed=0)

    async def main():
        port = Traced(RooflineCost("A100-80G", "Llemma-7B"), wl, **kw)

        async def at(t, req):
            await asyncio.sleep(t)
            return await port.generate(req), asyncio.get_running_loop().time()

        out = await asyncio.gather(*(at(t, r) for t, r in reqs_at))
        await port.close()
        return out, port

    return run_virtual(main)


def _primaries_then_spec(n_primary: int, n_spec: int):
    return [(0.0, _req(i)) for i in range(n_primary)] + [(0.05, _req(10 + i, SPEC)) for i in range(n_spec)]


def test_without_mixing_speculative_prefill_never_replaces_a_primary_decode_step():
    out, port = _run(_primaries_then_spec(2, 3), spec_knee=8)
    assert any(s > 0 for s, _, _ in port.prefills)  # speculation ran at all
    assert not [p for p in port.prefills if p[0] > 0 and p[1] == 0 and p[2] > 0]  # ... never instead of a decode
    ends = [t for _, t in out]
    assert min(ends[2:]) >= max(ends[:2])  # here: only once the primaries were done


def test_mixed_prefill_admits_speculation_while_primaries_decode_and_keeps_their_tokens():
    plain, _ = _run(_primaries_then_spec(2, 0))
    out, port = _run(_primaries_then_spec(2, 3), spec_knee=8, mixed_chunk=True)
    assert [p for p in port.prefills if p[0] > 0 and p[1] == 0 and p[2] > 0]  # spec prefilled beside their decode
    assert [r.text for r, _ in out[:2]] == [r.text for r, _ in plain]  # same outputs for the primaries
    assert min(t for _, t in out[2:]) < max(t for _, t in out[:2])  # speculation finished while they ran


def test_speculation_stays_in_the_room_below_the_knee_and_is_off_at_it():
    # 4 primaries at knee 6: room 2; then 3 more primaries: room 0, the running speculation is retracted
    reqs = _primaries_then_spec(4, 4) + [(0.5, _req(20 + i)) for i in range(3)]
    out, port = _run(reqs, spec_knee=6, mixed_chunk=True)
    assert all(spec <= room for spec, room in port.decodes)
    assert any(room == 0 for _, room in port.decodes) and port.metrics.preempted > 0
    assert all(r.finish_reason != "abort" for r, _ in out)  # and every request still finishes


def test_a_promoted_request_is_admitted_at_the_next_step():
    """Two primaries decode at knee 2, so a speculative request waits; promoted at 0.1 s, it is prefilled within a
    step or two (the engine wakes), not when a primary finishes."""
    wl = Workload(WorkloadParams(lengths="dfs"), seed=0)
    cost = RooflineCost("A100-80G", "Llemma-7B")
    prefilled = {}

    class Timed(SimPort):
        async def _prefill(self, batch):
            for r in batch:
                prefilled.setdefault(r.req.rid, asyncio.get_running_loop().time())
            await super()._prefill(batch)

    async def main():
        port = Timed(cost, wl, spec_knee=2)

        async def at(t, req):
            await asyncio.sleep(t)
            return await port.generate(req)

        primaries = [asyncio.ensure_future(at(0.0, _req(i))) for i in range(2)]
        spec = asyncio.ensure_future(at(0.05, _req(9, SPEC)))
        await asyncio.sleep(0.1)
        await port.promote("spex:s:r.9:")
        done = await asyncio.gather(*primaries, spec)
        await port.close()
        return [r.latency for r in done[:2]]

    primary_latencies = run_virtual(main)
    step = cost.decode_time(2, 2 * 200)  # a decode step of the two primaries (contexts well under 200 tokens)
    assert 0.1 <= prefilled["spex:s:r.9:"] <= 0.1 + 2 * step
    assert prefilled["spex:s:r.9:"] < min(primary_latencies)  # before either primary finished
