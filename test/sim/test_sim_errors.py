"""The simulator refuses bad configurations with a ValueError naming the field, and an error inside the simulated
engine reaches its callers at once (not as a SimulationDeadlock after the wall-clock wait)."""

from __future__ import annotations

import asyncio
import math

import pytest

from sglang_spex.sim.client import ClientOverhead
from sglang_spex.sim.clock import run_virtual
from sglang_spex.sim.cost import RooflineCost
from sglang_spex.sim.engine import PrefixCache, SimPort
from sglang_spex.sim.run import SimReward, simulate
from sglang_spex.sim.workload import Workload, WorkloadParams
from sglang_spex.tot.engine import GenRequest
from sglang_spex.tot.search_spec import PolicyConfig, SearchSpec
from sglang_spex.tot.tree import Node

WL = Workload(WorkloadParams(lengths="dfs"), seed=0)


def _req(i: int, priority=None) -> GenRequest:
    return GenRequest(
        prompt=WL.question(i), rid=f"r{i}", node_path=f"r.{i}", max_new_tokens=256, priority=priority, stop=["\n\n"]
    )


class _Broken(RooflineCost):
    """A cost model with a bug in one of its two step times."""

    def __init__(self, where: str):
        super().__init__("A100-80G", "Llemma-7B")
        self.where = where

    def decode_time(self, batch, ctx_total):
        if self.where == "decode":
            raise ZeroDivisionError("bug inside the cost model")
        return super().decode_time(batch, ctx_total)

    def prefill_time(self, new_tokens, cached_tokens=0, attn_pairs=None):
        if self.where == "prefill":
            raise ZeroDivisionError("bug inside the cost model")
        return super().prefill_time(new_tokens, cached_tokens, attn_pairs)


@pytest.mark.parametrize("where", ["decode", "prefill"])
def test_an_error_in_the_engine_loop_reaches_every_waiting_caller(monkeypatch, where):
    monkeypatch.setattr("sglang_spex.sim.clock.DEADLOCK_WALL_S", 0.5)  # the old behaviour: a deadlock, quickly

    async def main():
        port = SimPort(_Broken(where), WL)
        out = await asyncio.gather(*(port.generate(_req(i)) for i in range(3)), return_exceptions=True)
        with pytest.raises(RuntimeError, match="engine loop failed earlier") as later:
            await port.generate(_req(9))
        await port.close()  # the error already reached its callers: closing does not raise it again
        return out, later.value

    out, later = run_virtual(main)
    assert [type(e) for e in out] == [ZeroDivisionError] * 3
    assert isinstance(later.__cause__, ZeroDivisionError)


@pytest.mark.parametrize(
    "kw", [{"request_s": math.inf}, {"response_s": math.inf}, {"cpu_s": math.nan}, {"cpu_s": "1"}, {"cpu_s": -1.0}]
)
def test_client_overhead_refuses_non_finite_and_non_numbers(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"ClientOverhead.{name} must be a finite number >= 0"):
        ClientOverhead(**kw)


def test_client_overhead_accepts_finite_numbers():
    assert ClientOverhead(request_s=1, response_s=0.5, cpu_s=0.0).to_dict() == {
        "request_s": 1,
        "response_s": 0.5,
        "cpu_s": 0.0,
    }


@pytest.mark.parametrize("delay", [math.inf, math.nan])
def test_virtual_loop_refuses_a_timer_at_a_non_finite_time(delay):
    async def main():
        await asyncio.sleep(delay)

    with pytest.raises(ValueError, match="non-finite time"):
        run_virtual(main)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"cache_block": 0}, "SimPort.cache_block"),
        ({"cache_block": -1}, "SimPort.cache_block"),
        ({"max_running": 0}, "SimPort.max_running"),
        ({"spec_knee": 0}, "SimPort.spec_knee"),
        ({"kv_capacity": -5}, "SimPort.kv_capacity"),
        ({"prefill_chunk": 0}, "SimPort.prefill_chunk"),
        ({"cache_capacity": -1}, "SimPort.cache_capacity"),
        ({"max_running": 2.5}, "SimPort.max_running"),
    ],
)
def test_simport_refuses_bad_settings(kw, field):
    with pytest.raises(ValueError, match=f"{field} must be an int >= "):
        SimPort(RooflineCost("A100-80G", "Llemma-7B"), WL, **kw)


def test_simport_and_prefix_cache_accept_their_edge_values():
    SimPort(RooflineCost("A100-80G", "Llemma-7B"), WL, max_running=1, spec_knee=1, kv_capacity=1, cache_capacity=0)
    with pytest.raises(ValueError, match="PrefixCache.block must be an int >= 1"):
        PrefixCache(0)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"lengths": "bogus"}, "WorkloadParams.lengths must be 'dfs' or 'bfs'"),
        ({"dfs_min_tokens": 100, "dfs_max_tokens": 50}, "WorkloadParams.dfs_min_tokens .100. must be <= dfs_max"),
        ({"bfs_median_tokens": 0.0}, "WorkloadParams.bfs_median_tokens must be > 0"),
        ({"distractors": 0}, "WorkloadParams.distractors must be >= 1"),
        ({"dfs_min_tokens": 0, "dfs_max_tokens": 0}, "WorkloadParams.dfs_min_tokens must be >= 1"),
        ({"min_tokens": 0}, "WorkloadParams.min_tokens must be >= 1"),
        ({"reward_noise": math.nan}, "WorkloadParams.reward_noise must be a finite number"),
    ],
)
def test_workload_params_refuse_bad_values(kw, message):
    with pytest.raises(ValueError, match=message):
        WorkloadParams(**kw)


@pytest.mark.parametrize("device, model", [("A6000", "Llemma-34B"), ("A6000", "Qwen3-30B-A3B")])
def test_a_model_that_does_not_fit_is_refused(device, model):
    cost = RooflineCost(device, model)
    with pytest.raises(ValueError, match=f"model {model} .* does not fit in {device}"):
        cost.max_kv_tokens()
    spec = SearchSpec(policy=PolicyConfig("rebase-8"), seed=0)
    with pytest.raises(ValueError, match="does not fit"):
        simulate(spec, cost=(device, model), questions=1)


def test_a_model_that_fits_gets_its_kv_room():
    assert RooflineCost("H100", "Llemma-34B").max_kv_tokens() == 23396  # (72 GB - 67.4 GB) / 196608 B


def test_questions_not_from_the_workload_are_refused():
    spec = SearchSpec(policy=PolicyConfig("rebase-8"), seed=0)
    wl = Workload.for_policy("rebase-8")
    custom = wl.questions(1) + [("What is 2 + 3?", "5")]
    with pytest.raises(ValueError, match=r"questions\[1\]: the simulator only knows its workload's questions"):
        simulate(spec, cost=("A100-80G", "Llemma-7B"), questions=custom, workload=wl)


def test_sim_reward_refuses_a_question_it_does_not_know():
    reward = SimReward(WL)
    node = Node(path="r.0")
    assert run_virtual(lambda: reward.score(node, WL.question(3))) == WL.reward(3, "r.0")
    with pytest.raises(ValueError, match="not one of the workload's questions"):
        run_virtual(lambda: reward.score(node, "What is 2 + 3?"))
