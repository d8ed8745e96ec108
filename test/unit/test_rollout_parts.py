"""How the GRPO client cuts one RL step's rollouts into posts that fit the learner's body limit."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_spex.respec.grpo import rollout_parts


def _body(part, more):
    return len(json.dumps({"rollouts": part, "more": more}, separators=(",", ":")).encode())


def _rollout(n: int) -> dict:
    return {"prompt_ids": [1, 2], "response_ids": list(range(n)), "reward": 0.5}


def test_a_step_that_fits_is_one_part_and_a_big_one_several():
    step = [_rollout(10) for _ in range(5)]
    assert rollout_parts(step, 1 << 20) == [step]
    parts = rollout_parts(step, _body(step[:2], False))  # room for exactly two
    assert [len(p) for p in parts] == [2, 2, 1]


def test_a_rollout_that_cannot_fit_alone_is_named():
    with pytest.raises(ValueError, match="rollout 1 is .* over the learner's limit 200"):
        rollout_parts([_rollout(2), _rollout(200)], 200)


@given(st.lists(st.integers(1, 60), min_size=1, max_size=30), st.integers(0, 400))
def test_parts_keep_the_order_and_fit(lengths, extra):
    step = [_rollout(n) for n in lengths]
    limit = max(_body([r], False) for r in step) + extra
    parts = rollout_parts(step, limit)
    assert [r for p in parts for r in p] == step and all(parts)
    assert all(_body(p, i < len(parts) - 1) <= limit for i, p in enumerate(parts))
