"""The binary rollouts body (``rollout_wire``): the same rollouts as JSON, checked by the same rules, and cut
into posts that fit the learner's body limit."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load, save

from sglang_spex.respec import rollout_wire
from sglang_spex.respec.buffer import RolloutError, validate_batch

TOP = [[[4, -0.1], [6, -3.0]], [[5, -1.0]], [[9, -0.5], [5, -2.0]]]


def _rollout(n: int, **fields) -> dict:
    return {"prompt_ids": [1, 2], "response_ids": list(range(n)), "reward": 0.5, **fields}


def _same(got, want) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.prompt_ids.tolist() == b.prompt_ids.tolist() and a.response_ids.tolist() == b.response_ids.tolist()
        assert a.reward == b.reward
        for name in ("target_logprobs", "target_top_logprobs"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None)
        if a.target_logprobs is not None:
            assert a.target_logprobs.tolist() == b.target_logprobs.tolist()
        if a.target_top_logprobs is not None:
            assert a.target_top_logprobs.rows() == b.target_top_logprobs.rows()


def test_a_step_decodes_to_the_rollouts_json_gives():
    """Mixed fields across rollouts (some with served log-probs, some with top-k rows of different widths)."""
    step = [
        _rollout(3, target_top_logprobs=TOP, target_logprobs=[-0.1, -1.0, -0.5]),
        _rollout(2),
        _rollout(1, target_top_logprobs=[[[7, -0.2]]]),
        {**_rollout(3, target_logprobs=[-0.1, 0.00005, -2.0]), "reward": 2},
    ]
    rollouts, more = rollout_wire.decode(rollout_wire.encode(step, more=True), vocab_size=344)
    assert more is True
    _same(rollouts, validate_batch(step, vocab_size=344))
    assert rollouts[2].target_top_logprobs.ids.tolist() == [[7]]  # its own width, not the body's
    assert rollouts[3].target_logprobs.tolist()[1] == 0.0  # a rounding-positive log-prob is 0, as in JSON


def _arrays(step) -> dict:
    return load(rollout_wire.encode(step))


def _decode(arrays, **kw):
    return rollout_wire.decode(save(arrays), vocab_size=344, **kw)


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda a: a.pop("reward"), "reward"),
        (lambda a: a.update(extra=np.zeros(1, np.int32)), "extra"),
        (lambda a: a.update(reward=np.array([np.nan, 1.0])), "rollouts[0].reward"),
        (lambda a: a.update(reward=np.ones((2, 1))), "reward"),
        (lambda a: a["response_ids"].__setitem__(4, 400), "rollouts[1].response_ids[1]"),
        (lambda a: a["prompt_ids"].__setitem__(0, -3), "rollouts[0].prompt_ids[0]"),
        (lambda a: a.update(prompt_lens=np.array([2, 0], np.int32)), "rollouts[1].prompt_ids"),
        (lambda a: a.update(response_lens=np.array([3], np.int32)), "response_lens"),
        # lengths that wrap in int64 when summed (2**63 - 1 + 2): refused before any sum or cast
        (lambda a: a.update(prompt_lens=np.array([2, 2**63 - 1], np.int64)), "rollouts[1].prompt_ids"),
        (lambda a: a.update(response_lens=np.array([2**62, 2**62 + 5], np.int64)), "rollouts[0].response_ids"),
        (lambda a: a.update(prompt_lens=np.array([2**64 - 1, 2], np.uint64)), "rollouts[0].prompt_ids"),
        (lambda a: a["target_logprobs"].__setitem__(4, 0.5), "rollouts[1].target_logprobs[1]"),
        (lambda a: a.pop("has_target_logprobs"), "has_target_logprobs"),
        (lambda a: a["target_top_ids"].__setitem__((3, 1), 4), "rollouts[1].target_top_logprobs[0]"),  # repeat
        (lambda a: a["target_top_ids"].__setitem__((3, 0), -1), "rollouts[1].target_top_logprobs[0]"),  # empty
        (lambda a: a["target_top_ids"].__setitem__((1, 1), -7), "rollouts[0].target_top_logprobs[1]"),
        (lambda a: a["target_top_logprobs"].__setitem__((0, 1), -0.01), "rollouts[0].target_top_logprobs[0]"),
        (lambda a: a["target_top_logprobs"].__setitem__((2, 0), np.inf), "rollouts[0].target_top_logprobs[2]"),
        (lambda a: a.update(target_top_ids=a["target_top_ids"][:, :1]), "target_top_logprobs"),
    ],
)
def test_bad_tensors_are_named_and_nothing_is_decoded(change, field):
    step = [
        _rollout(3, target_top_logprobs=TOP, target_logprobs=[-0.1, -1.0, -0.5]),
        _rollout(2, target_top_logprobs=[[[4, -0.1]], [[5, -0.2]]], target_logprobs=[-0.1, -0.2]),
    ]
    arrays = _arrays(step)
    change(arrays)
    with pytest.raises(RolloutError) as e:
        _decode(arrays)
    assert e.value.field == field, str(e.value)


def test_padding_past_a_row_is_ignored_and_a_long_rollout_refused():
    arrays = _arrays([_rollout(3, target_top_logprobs=TOP)])
    arrays["target_top_logprobs"][1, 1] = np.nan  # a padded cell: no value to check
    (rollout,), more = _decode(arrays)
    assert rollout.target_top_logprobs.rows()[1] == ((5, -1.0),) and more is False
    with pytest.raises(RolloutError) as e:
        _decode(_arrays([_rollout(3)]), max_len=4)
    assert e.value.field == "rollouts[0].response_ids" and "5 tokens" in str(e.value)


def _raw(header: dict, data: bytes) -> bytes:
    """A safetensors file written by hand (for dtypes numpy cannot write)."""
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def test_not_a_safetensors_body_is_named():
    bf16 = _raw({"reward": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}, b"\x80\x3f")
    for body in (b"", b"{}", b'{"rollouts": []}', b"\xff" * 64, bf16):
        with pytest.raises(RolloutError) as e:
            rollout_wire.decode(body)
        assert e.value.field == "body"
    with pytest.raises(RolloutError) as e:
        rollout_wire.decode(save({"reward": np.ones(1)}, metadata={"more": "yes"}))
    assert e.value.field == "more"


def test_a_step_that_fits_is_one_part_and_a_big_one_several():
    step = [_rollout(10) for _ in range(5)]
    (one,) = rollout_wire.parts(step, 1 << 20)
    _same(rollout_wire.decode(one)[0], validate_batch(step))
    per = (len(rollout_wire.encode(step)) - len(rollout_wire.encode(step[:1]))) / 4  # one rollout's values
    two = rollout_wire.HEADER_BYTES + int(2.5 * per)
    assert [len(rollout_wire.decode(p)[0]) for p in rollout_wire.parts(step, two)] == [2, 2, 1]


def test_a_rollout_that_cannot_fit_alone_is_named():
    with pytest.raises(ValueError, match="rollout 1 is .* over the learner's limit 2500"):
        rollout_wire.parts([_rollout(2), _rollout(200)], 2500)


@settings(deadline=None, max_examples=50)
@given(
    st.lists(st.tuples(st.integers(1, 60), st.integers(0, 3)), min_size=1, max_size=30),
    st.integers(0, 4000),
)
def test_parts_keep_the_order_and_fit(shapes, extra):
    """Rollouts of any lengths and top-k widths (0: none): every part fits, the last alone has ``more`` false,
    and the parts decode to the step in order."""
    step = [
        _rollout(n, **({"target_top_logprobs": [[[t, -1.5 - t] for t in range(k)]] * n} if k else {}))
        for n, k in shapes
    ]
    limit = max(len(rollout_wire.encode([r])) for r in step) + rollout_wire.HEADER_BYTES + extra
    bodies = rollout_wire.parts(step, limit)
    decoded = [rollout_wire.decode(b) for b in bodies]
    assert all(len(b) <= limit for b in bodies)
    assert [more for _, more in decoded] == [True] * (len(bodies) - 1) + [False]
    _same([r for rs, _ in decoded for r in rs], validate_batch(step))
