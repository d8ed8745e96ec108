"""A speculative request that ends without a result (refused for load, failed) is counted as ``failed``: not a
hit, cancel, never-used node or miss of the prediction, and the search's tree stays the baseline's (pure logic)."""

from __future__ import annotations

import asyncio
from typing import List

import fastapi
import pytest
from speculation.test_spex_fake import POLICIES, JitterPort, make_spec, signature
from unit.fake_port import FakePort

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.accounting import DistanceRates, SpecAccounting
from sglang_spex.speculation.dfs_lookahead import DuePredictions
from sglang_spex.speculation.runner import context_factory
from sglang_spex.tot import backpressure
from sglang_spex.tot.engine import ROLE_SPEC, parse_rid
from sglang_spex.tot.search import run_search

FULL = fastapi.HTTPException(status_code=503, detail="The request queue is full.")


class SpecRefusingPort(JitterPort):
    """Fails every other speculative request with ``error`` (the first one included); primaries are served."""

    def __init__(self, error: BaseException):
        super().__init__()
        self.error = error
        self.spec_paths: List[str] = []

    async def generate(self, req):
        if req.role == ROLE_SPEC:
            self.spec_paths.append(parse_rid(req.rid)[1])
            if len(self.spec_paths) % 2 == 1:
                await asyncio.sleep(0.001)
                raise self.error
        return await super().generate(req)


def _run(policy: str, port: FakePort):
    cfg = SpexConfig(enabled=True, k_total=6, components=("t1", "t2"))
    return asyncio.run(
        run_search(make_spec(POLICIES[policy]), "What is 2 + 3?", port, context_factory=context_factory(cfg))
    )


@pytest.mark.parametrize("policy", ["rebase", "rstar"])
def test_a_failed_speculative_request_is_counted_apart_and_its_path_not_resent(policy):
    base = asyncio.run(run_search(make_spec(POLICIES[policy]), "What is 2 + 3?", JitterPort()))
    port = SpecRefusingPort(ValueError("engine error"))
    res = _run(policy, port)
    acc = res.speculation
    assert signature(res) == signature(base)
    assert acc["failed"] >= 1
    assert acc["hits"] + acc["cancelled"] + acc["never_used"] + acc["failed"] == acc["issued"]
    assert len(port.spec_paths) == len(set(port.spec_paths))  # a failed path is not speculated again
    assert sum(acc["missed_distance"].values()) <= acc["cancelled"] + acc["never_used"]  # failures: no misses


def test_a_speculative_request_refused_for_load_frees_its_path(monkeypatch):
    monkeypatch.setattr(backpressure, "SPEC_HOLD_S", 0.0)  # the gate's hold after a refusal: none here
    base = asyncio.run(run_search(make_spec(POLICIES["rstar"]), "What is 2 + 3?", JitterPort()))
    port = SpecRefusingPort(FULL)
    res = _run("rstar", port)
    acc = res.speculation
    assert signature(res) == signature(base)
    assert acc["failed"] >= 1
    assert acc["hits"] + acc["cancelled"] + acc["never_used"] + acc["failed"] == acc["issued"]
    # a refusal says nothing about the node: its path may be speculated again once the queue has room
    assert len(port.spec_paths) > len(set(port.spec_paths))


def test_a_failed_prediction_is_neither_hit_nor_miss_and_leaves_the_hit_rate_alone():
    rates = DistanceRates()
    dues = DuePredictions(lambda: rates)
    dues.issued("r.0.1", rollout=2, distance=1)
    dues.issued("r.0.2", rollout=2, distance=1)
    dues.dropped("r.0.1")  # its request was refused: not judged when the search ends without it
    dues.ended()
    assert rates.resolved(1) == rates_after_one_miss().resolved(1)
    acc = SpecAccounting(issued=4, hits=2, failed=2)
    assert acc.hit_rate == 1.0  # the two that ran were both used


def rates_after_one_miss() -> DistanceRates:
    rates = DistanceRates()
    rates.record_miss(1)
    return rates
