"""Weight payloads (``/respec/policy``'s JSON form, ``/respec/drafter/update_weights_from_tensor``) are walked
without building anything before they are unpickled: SGLang's safe unpickler lets a 64-byte payload call
``bytearray(10**10)`` or ``list(itertools.repeat(...))``, and a stride-0 view claims a size its storage does not hold
(the reviewer's four payloads took the server from 1.0 to 6.8 GB). Each is now refused (a 400 on both routes)."""

from __future__ import annotations

import base64
import itertools
import pickle
import resource

import pytest
import torch

from sglang_spex.respec.hotswap import deserialize_named_tensors, serialize_named_tensors


class _Call:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payload(obj) -> str:
    return base64.b64encode(pickle.dumps([("w", obj)], protocol=pickle.HIGHEST_PROTOCOL)).decode()


def _rss_mb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


@pytest.mark.parametrize(
    "bomb, named",
    [
        (_Call(bytearray, 8 * 10**9), "builtins.bytearray"),
        (_Call(list, _Call(itertools.repeat, 0, 10**9)), "builtins.list"),
    ],
)
def test_a_payload_naming_anything_but_tensors_is_refused_before_it_allocates(bomb, named):
    before = _rss_mb()
    with pytest.raises(pickle.UnpicklingError, match=named):
        deserialize_named_tensors(_payload(bomb))
    assert _rss_mb() - before < 500  # the old path allocated the whole object first (8 GB here)


def test_a_strided_view_larger_than_its_storage_is_refused():
    view = torch.zeros(1).as_strided((100_000, 100_000), (0, 0))  # 10^10 elements over one float
    with pytest.raises(ValueError, match="not a dense tensor"):
        deserialize_named_tensors(_payload(view))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_a_real_payload_still_round_trips(dtype):
    named = [("fc.weight", torch.randn(4, 4).to(dtype)), ("norm.weight", torch.ones(3, dtype=dtype))]
    out = deserialize_named_tensors(serialize_named_tensors(named)[0])
    assert [n for n, _ in out] == ["fc.weight", "norm.weight"]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(named, out))


def test_truncated_or_not_base64_is_refused():
    good = serialize_named_tensors([("w", torch.ones(2))])[0]
    with pytest.raises(pickle.UnpicklingError):
        deserialize_named_tensors(base64.b64encode(base64.b64decode(good)[:40]).decode())
    with pytest.raises(ValueError, match="base64"):
        deserialize_named_tensors("not base64 at all!")
