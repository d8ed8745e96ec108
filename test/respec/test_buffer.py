"""Rollout validation: bad payloads raise naming the field, and a bad batch stores nothing."""

from __future__ import annotations

import math

import pytest

from sglang_spex.respec.buffer import ReplayBuffer, RolloutError, validate_rollout

GOOD = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "reward": 1.0, "target_logprobs": [-0.1, -2.0]}


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"extra": 1}, "extra"),
        ({"prompt_ids": []}, "prompt_ids"),
        ({"prompt_ids": "abc"}, "prompt_ids"),
        ({"response_ids": [1, 2.5]}, "response_ids[1]"),
        ({"response_ids": [1, True]}, "response_ids[1]"),
        ({"response_ids": [1, 400]}, "response_ids[1]"),
        ({"response_ids": [-1, 2]}, "response_ids[0]"),
        ({"reward": float("nan")}, "reward"),
        ({"reward": math.inf}, "reward"),
        ({"reward": "1"}, "reward"),
        ({"target_logprobs": [-0.1]}, "target_logprobs"),
        ({"target_logprobs": [-0.1, float("nan")]}, "target_logprobs[1]"),
        ({"target_logprobs": [-0.1, 0.5]}, "target_logprobs[1]"),
    ],
)
def test_bad_fields_are_named(patch, field):
    with pytest.raises(RolloutError) as e:
        validate_rollout({**GOOD, **patch}, vocab_size=344)
    assert e.value.field == field


def test_missing_field():
    with pytest.raises(RolloutError) as e:
        validate_rollout({"prompt_ids": [1], "response_ids": [2]})
    assert e.value.field == "reward"


def test_batch_is_atomic_and_capacity():
    buf = ReplayBuffer(capacity=3, vocab_size=344)
    assert buf.add_batch([GOOD, {**GOOD, "target_logprobs": None}]) == 2
    with pytest.raises(RolloutError) as e:
        buf.add_batch([GOOD, {**GOOD, "reward": float("nan")}])
    assert e.value.field == "rollouts[1].reward"
    assert len(buf) == 2 and buf.total_added == 2
    buf.add_batch([GOOD, GOOD])
    assert len(buf) == 3 and buf.dropped == 1
    assert len(buf.drain()) == 3 and len(buf) == 0
    with pytest.raises(RolloutError):
        buf.add_batch([])


def test_a_rollout_longer_than_max_len_is_refused_and_named():
    """``max_len`` bounds prompt + response together (the learner's: the model's context), not each alone."""
    buf = ReplayBuffer(vocab_size=344, max_len=8)
    fits = {"prompt_ids": [1] * 4, "response_ids": [2] * 4, "reward": 1.0}
    assert buf.add_batch([fits]) == 1  # exactly 8: stored
    with pytest.raises(RolloutError) as e:
        buf.add_batch([fits, {**fits, "response_ids": [2] * 5}])
    assert e.value.field == "rollouts[1].response_ids" and "9 tokens" in str(e.value)
    assert len(buf) == 1


def test_the_buffer_holds_at_most_max_entries_values_oldest_dropped_first():
    """Memory grows with the values stored (ids, log-probs, top-k pairs), not only the rollout count: past
    ``max_entries`` the oldest rollouts go, whatever ``capacity`` allows; the newest is always kept."""
    top = {**GOOD, "target_top_logprobs": [[[4, -0.1], [6, -3.0]], [[5, -1.0]]]}  # 5 ids + 2 log-probs + 2x2 cells
    assert validate_rollout(GOOD).entries == 7 and validate_rollout(top, vocab_size=344).entries == 11
    buf = ReplayBuffer(capacity=100, vocab_size=344, max_entries=23)
    buf.add_batch([GOOD, GOOD, GOOD])  # 21 values
    assert len(buf) == 3 and buf.entries == 21 and buf.dropped == 0
    buf.add_batch([top])  # 32, then 25, are over 23: the two oldest go
    assert len(buf) == 2 and buf.entries == 18 and buf.dropped == 2
    assert [r.target_top_logprobs is not None for r in buf.snapshot()] == [False, True]
    small = ReplayBuffer(capacity=100, vocab_size=344, max_entries=5)
    small.add_batch([GOOD, top])  # each alone is over the bound: the newest stays
    assert len(small) == 1 and small.snapshot()[0].target_top_logprobs is not None
    assert len(buf.drain()) == 2 and buf.entries == 0


def test_a_log_prob_past_float32_is_stored_as_the_floor():
    """-1e39 is finite in JSON but -inf in float32 (a NaN once renormalised): stored as LOGP_FLOOR (p = 0 too)."""
    from sglang_spex.respec.buffer import LOGP_FLOOR

    r = validate_rollout({**GOOD, "target_logprobs": [-1e39, -0.5]}, vocab_size=344)
    assert r.target_logprobs.tolist() == [LOGP_FLOOR, -0.5]
