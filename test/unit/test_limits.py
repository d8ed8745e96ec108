"""Per-search limits (tot/limits.py): worst-case bounds, the allowlist, derivation from the engine, client side."""

from __future__ import annotations

import asyncio

import pytest

from sglang_spex.tot.limits import SearchLimits, derive, host_allowed, node_bound
from sglang_spex.tot.search import run_search
from sglang_spex.tot.search_spec import SearchSpec, SearchSpecError


def _params(policy: dict):
    return SearchSpec.from_dict({"policy": policy}).policy.build().params


@pytest.mark.parametrize(
    "policy, nodes",
    [
        ({"name": "rebase", "width": 16, "max_depth": 25}, 400),
        ({"name": "ets", "width": 8, "max_depth": 4}, 32),
        ({"name": "rstar", "num_rollouts": 30, "max_depth": 5, "branch": 3}, 450),
        ({"name": "rest", "iterations": 100, "branch": 3, "roll_forward_steps": 2, "roll_branch": 1}, 500),
    ],
)
def test_node_bound(policy, nodes):
    assert node_bound(_params(policy)) == nodes


def test_spec_over_a_limit_names_field_and_flag():
    limits = SearchLimits(max_width=8)
    spec = SearchSpec.from_dict({"policy": {"name": "rebase", "width": 9}})
    with pytest.raises(SearchSpecError) as e:
        limits.check_spec(spec)
    assert e.value.field == "policy.width" and "8" in e.value.reason and "--tot-max-width" in e.value.reason
    limits.check_spec(SearchSpec.from_dict({"policy": {"name": "rebase", "width": 8, "max_depth": 4}}))


def test_huge_width_is_refused_before_anything_is_built():
    spec = SearchSpec.from_dict({"policy": {"name": "rebase", "width": 10**18}})
    with pytest.raises(SearchSpecError) as e:
        SearchLimits().check_spec(spec)
    assert e.value.field == "policy.width"


def test_prompt_and_step_must_fit_the_context():
    limits = SearchLimits(context_len=100)
    spec = SearchSpec.from_dict({"step": {"max_tokens": 10}})
    limits.check_spec(spec, prompt_tokens=90)
    with pytest.raises(SearchSpecError) as e:
        limits.check_spec(spec, prompt_tokens=91)
    assert e.value.field == "question" and "100" in e.value.reason


@pytest.mark.parametrize(
    "host, allowed, ok",
    [
        ("127.0.0.1", ("loopback",), True),
        ("127.9.9.9", ("loopback",), True),
        ("::1", ("loopback",), True),
        ("localhost", ("loopback",), True),
        ("LOCALHOST.", ("loopback",), True),
        ("10.0.0.5", ("loopback",), False),
        ("evil.example", ("loopback",), False),
        ("localhost.evil.example", ("loopback",), False),
        ("10.0.0.5", ("10.0.0.0/8",), True),
        ("11.0.0.5", ("10.0.0.0/8",), False),
        ("prm.internal", ("prm.internal",), True),
        ("x.prm.internal", ("prm.internal",), False),
        ("anything", ("*",), True),
        ("0:0:0:0:0:0:0:1", ("::1",), True),  # one IPv6 address, two spellings
        ("fd00::0:5", ("FD00::5",), True),
        ("fd00::6", ("fd00::5",), False),
    ],
)
def test_host_allowed(host, allowed, ok):
    assert host_allowed(host, allowed) is ok


def test_reward_url_checked_without_connecting():
    limits = SearchLimits()
    spec = SearchSpec.from_dict({"reward": {"type": "callback", "url": "http://169.254.169.254/latest"}})
    with pytest.raises(SearchSpecError) as e:
        limits.check_spec(spec)
    assert e.value.field == "reward.url" and "169.254.169.254" in e.value.reason
    limits.check_spec(SearchSpec.from_dict({"reward": {"type": "callback", "url": "http://127.0.0.1:9/s"}}))


def test_derive_takes_auto_limits_from_the_engine():
    configured = {"max_width": None, "max_step_tokens": None, "max_search_tokens": None, "max_depth": 7}
    lim = derive(configured, context_len=2048, max_running_requests=48, kv_tokens=1000)
    assert (lim.max_width, lim.max_step_tokens, lim.max_search_tokens, lim.max_depth) == (48, 2048, 16000, 7)
    assert lim.context_len == 2048
    # a configured step limit above the context is capped by it
    assert (
        derive({"max_step_tokens": 10**6}, context_len=512, max_running_requests=None, kv_tokens=None).max_step_tokens
        == 512
    )


def test_client_side_runner_checks_the_same_limits():
    spec = SearchSpec.from_dict({"policy": {"name": "rebase", "width": 300}})
    with pytest.raises(SearchSpecError) as e:  # the port is never touched
        asyncio.run(run_search(spec, "q", port=None))
    assert e.value.field == "policy.width"


def test_prompt_template_with_other_fields_is_refused():
    with pytest.raises(SearchSpecError) as e:
        SearchSpec.from_dict({"step": {"prompt_template": "{question} {secret}"}})
    assert e.value.field == "step.prompt_template"
