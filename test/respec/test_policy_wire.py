"""``POST /respec/policy``'s binary body (``policy_wire.py``): the same weights as SGLang's JSON payload reach the
learner's policy copy, and a bad body is a 400 naming the field with the copy unchanged."""

from __future__ import annotations

import pytest
import torch

from sglang_spex.respec import policy_wire
from sglang_spex.respec.hotswap import serialize_named_tensors
from sglang_spex.srt.http_api import BodyError

BINARY = {"content-type": policy_wire.CONTENT_TYPE}


def moved(model: torch.nn.Module, delta: float):
    return [(n, p.detach() + delta) for n, p in model.named_parameters()]


def weights(model: torch.nn.Module):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_round_trip_keeps_names_dtypes_and_values_and_copies_shared_storage():
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    named = [("a", base), ("tied", base), ("b", torch.ones(4, dtype=torch.bfloat16)), ("view", base[1])]
    version, got = policy_wire.decode(policy_wire.encode(7, named))
    assert version == 7 and sorted(n for n, _ in got) == sorted(n for n, _ in named)
    got = dict(got)
    for name, t in named:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)


@pytest.mark.parametrize("version", [-1, 2**63])
def test_encode_refuses_a_version_out_of_range(version):
    with pytest.raises(ValueError, match="version"):
        policy_wire.encode(version, [("a", torch.ones(1))])


def test_binary_body_loads_the_same_weights_as_the_json_payload(served, tiny_target):
    (client, model, _), named = served, moved(tiny_target, 0.25)
    r = client.post("/respec/policy", content=policy_wire.encode(3, named), headers=BINARY)
    assert r.status_code == 200 and r.json() == {"loaded": len(named), "policy_version": 3}
    after_binary = weights(model)
    assert all(torch.equal(after_binary[n], t) for n, t in named)
    client.post(
        "/respec/policy",
        json={"version": 4, "serialized_named_tensors": serialize_named_tensors(moved(tiny_target, 0))},
    )
    r = client.post("/respec/policy", json={"version": 5, "serialized_named_tensors": serialize_named_tensors(named)})
    assert r.status_code == 200 and r.json()["policy_version"] == 5
    assert all(torch.equal(after_binary[n], p) for n, p in model.named_parameters())
    assert client.get("/respec/state").json()["policy_version"] == 5


def _body_with_version(text: str) -> bytes:
    from safetensors.torch import save

    return save({"x": torch.ones(1)}, metadata={"version": text})


@pytest.mark.parametrize(
    "body, field",
    [
        (b"", "body"),
        (b"not safetensors at all", "body"),
        (b"\xff" * 8 + b"{}", "body"),
        (_body_with_version("-1"), "version"),
        (_body_with_version("1.5"), "version"),
        (_body_with_version("9" * 5000), "version"),
        (_body_with_version(str(2**63)), "version"),
        (_body_with_version("٣"), "version"),  # a digit, not an ASCII one
    ],
    ids=["empty", "text", "bad-header", "negative", "float", "5000-digits", "2**63", "arabic-digit"],
)
def test_a_bad_body_is_400_naming_the_field_and_the_copy_is_unchanged(served, body, field):
    client, model, _ = served
    before = weights(model)
    r = client.post("/respec/policy", content=body, headers=BINARY)
    assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("bad", ["unknown name", "shape", "nan"])
def test_tensors_that_do_not_fit_the_copy_are_400_and_change_nothing(served, tiny_target, bad):
    client, model, _ = served
    before = weights(model)
    named = moved(tiny_target, 1.0)
    name, t = named[-1]
    named[-1] = {"unknown name": ("nope", t), "shape": (name, t[:1]), "nan": (name, t * float("nan"))}[bad]
    r = client.post("/respec/policy", content=policy_wire.encode(1, named), headers=BINARY)
    assert r.status_code == 400 and r.json()["error"]["field"] == "body", r.text
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert client.get("/respec/state").json()["policy_version"] is None


def test_decode_errors_are_body_errors():
    with pytest.raises(BodyError) as e:
        policy_wire.decode(policy_wire.encode(1, [("a", torch.ones(1))])[:-2])  # truncated
    assert e.value.field == "body"
