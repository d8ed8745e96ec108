"""The DSL names the field of a bad input before anything is sent (no server: a request would fail to connect)."""

from __future__ import annotations

import httpx
import pytest

import sglang_spex.lang as tot
from sglang_spex.tot.search_spec import SearchSpecError

NOWHERE = "http://127.0.0.1:9"  # nothing listens: a search that were sent would fail with a connection error


def _program() -> tot.Program:
    return tot.Program().policy(tot.rebase(width=1, max_depth=1)).step(max_tokens=4).reward(tot.verifier("arith"))


def _field(fn) -> str:
    with pytest.raises(SearchSpecError) as e:
        fn()
    return e.value.field


def test_step_stop_and_unknown_step_fields_are_named():
    assert _field(lambda: _program().step(stop=5)) == "step.stop"
    assert _field(lambda: _program().step(stop={"a": 1})) == "step.stop"  # not silently its keys
    assert _field(lambda: _program().step(foo=1)) == "step.foo"
    assert _program().step(stop=("\n", "."), top_p=0.9).spec().step.stop == ["\n", "."]


def test_endpoint_fields_are_checked_when_made():
    assert _field(lambda: tot.Endpoint(5)) == "url"
    assert _field(lambda: tot.Endpoint("ftp://x")) == "url"
    for bad in (float("nan"), -1, 0, float("inf"), True):
        assert _field(lambda: tot.Endpoint(NOWHERE, timeout=bad)) == "timeout"
    assert _field(lambda: tot.Endpoint(NOWHERE, server_side="yes")) == "server_side"
    assert _field(lambda: tot.Endpoint(NOWHERE, api_key=7)) == "api_key"
    for ok in (None, 5, httpx.Timeout(5.0)):  # as before
        assert tot.Endpoint("HTTP://server:1", timeout=ok).timeout is ok


def test_backend_and_on_result_are_checked_before_any_search_runs():
    p = _program()
    assert _field(lambda: p.run_batch(["1 + 1?"], None)) == "backend"
    assert _field(lambda: p.run_batch(["1 + 1?"], NOWHERE, on_result="print")) == "on_result"


def test_spec_checks_speculation_overrides_seed_and_empty_answer_fields():
    assert _field(lambda: _program().speculation(bogus=1).spec()) == "speculation.bogus"
    assert _field(lambda: _program().step(seed=10**5000).spec()) == "seed"
    assert _field(lambda: _program().answer(aggregate="").spec()) == "answer.aggregate"  # not the old value kept
    assert _program().step(seed=2**64 - 1).spec().seed == 2**64 - 1  # e.g. random.getrandbits(64)
    assert _program().speculation(max_lookahead=2).spec().speculation == {"max_lookahead": 2}  # the server judges


def test_a_value_json_cannot_hold_is_named():
    import decimal

    import numpy as np

    for bad in (decimal.Decimal("0.5"), np.array([3, 4]), float("nan")):
        assert _field(lambda: _program().speculation(sure_use=bad).spec()) == "speculation.sure_use"


def test_a_key_that_is_no_string_is_named_not_a_python_error():
    assert _field(lambda: tot.Program.from_json({1: 2, "a": 3})) == "1"
    spec = _program().spec().to_dict()
    assert _field(lambda: tot.Program.from_json({**spec, "step": {**spec["step"], 7: 1, "x": 2}})) == "step.7"


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def test_a_value_nested_past_what_a_server_takes_is_named_not_a_recursion_error():
    """Nesting past ``MAX_JSON_DEPTH`` (the server's 400) is named where it is given; 5,000 levels were a
    ``RecursionError`` from copying the value."""
    from sglang_spex.tot.validation import MAX_JSON_DEPTH

    assert _field(lambda: tot.rebase(width=1, extra=_nested(5000))) == "policy"
    assert _field(lambda: _program().step(top_p=_nested(MAX_JSON_DEPTH + 1))) == "step"
    assert _field(lambda: _program().speculation(bfs_lookahead=_nested(5000))) == "speculation"
    assert tot.rebase(width=1, extra=_nested(MAX_JSON_DEPTH - 2)).params["extra"] == _nested(MAX_JSON_DEPTH - 2)


def test_a_callback_reward_url_in_any_case_is_taken_like_an_endpoint_url():
    """One URL rule (``validation.is_http_url``) for rewards and endpoints: ``HTTP://`` is a URL both ways."""
    tot.callback("HTTP://127.0.0.1:9/score").validate()
    assert _field(lambda: tot.callback("ftp://127.0.0.1/score").validate()) == "reward.url"
