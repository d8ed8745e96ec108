"""The drafter push to every DP rank (``/respec/drafter/update_weights_from_tensor``, touch point W6), as logic.

The route against a stand-in tokenizer manager (what it sends through SGLang's fan-out communicator, what it refuses
before any scheduler sees it), and ``HotSwapClient``'s choice of route by the server's ``dp_size``. The acceptance
test on a real ``--dp-size 2`` EAGLE3 server is ``test_replicas.py``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import List

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from sglang_spex.respec.drafter import NOT_HOT_SWAPPED, DrafterConfig, Eagle3Drafter
from sglang_spex.respec.hotswap import DP_DRAFTER_PATH, HotSwapClient, HotSwapError, serialize_named_tensors
from sglang_spex.srt import dp_drafter_update
from sglang_spex.srt.http_state import attach


class _Lock:
    def __init__(self, log: List[str]):
        self.log = log

    @property
    @contextlib.asynccontextmanager
    async def writer_lock(self):
        self.log.append("writer_lock")
        yield


def _app(rank_ok=(True, True), paused: bool = False, drafter: str = "", tp: int = 1):
    """The route on an app whose tokenizer manager records what reaches its communicator (one reply per rank)."""
    sent, log = [], []

    async def communicator(obj):
        sent.append(obj)
        return [SimpleNamespace(success=ok, message=f"rank{i} {'ok' if ok else 'failed'}") for i, ok in
                enumerate(rank_ok)]  # fmt: skip

    tm = SimpleNamespace(server_args=SimpleNamespace(tp_size=tp, speculative_draft_model_path=drafter), is_pause=paused, model_update_lock=_Lock(log),
                         is_pause_cond=asyncio.Condition(),  # (binds to the loop of its first use)
                         update_weights_from_tensor_communicator=communicator)  # fmt: skip
    app = FastAPI()
    attach(app, SimpleNamespace(tokenizer_manager=tm))
    assert dp_drafter_update.install(app)
    return app, sent, log


def _payload() -> List[str]:
    return serialize_named_tensors([("fc.weight", torch.ones(2, 2))])


def test_the_update_reaches_every_rank_as_a_draft_update_without_flush():
    app, sent, log = _app()
    payload = _payload()
    with TestClient(app) as c:
        r = c.post(dp_drafter_update.PATH, json={"serialized_named_tensors": payload})
    assert r.status_code == 200, r.text
    assert r.json()["success"] and [x["success"] for x in r.json()["ranks"]] == [True, True]
    (obj,) = sent
    assert obj.selector == "draft" and obj.flush_cache is False and obj.weight_version is None
    assert obj.serialized_named_tensors == [base64.b64decode(payload[0])]  # raw bytes, as SGLang's IPC wants
    assert log == ["writer_lock"]  # not paused: under the model-update writer lock, as SGLang's method


def test_paused_in_place_sends_at_once_and_a_failed_rank_is_a_400():
    app, sent, log = _app(rank_ok=(True, False), paused=True)
    with TestClient(app) as c:
        r = c.post(dp_drafter_update.PATH, json={"serialized_named_tensors": _payload()})
    assert r.status_code == 400 and not r.json()["success"]
    assert [x["success"] for x in r.json()["ranks"]] == [True, False] and "rank1 failed" in r.json()["message"]
    assert len(sent) == 1 and log == []


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize(
    "body, field",
    [
        ({"serialized_named_tensors": ["not base64!"]}, "serialized_named_tensors[0]"),
        ({"serialized_named_tensors": [base64.b64encode(pickle.dumps(_Evil())).decode()]},
         "serialized_named_tensors[0]"),  # fmt: skip
        ({"serialized_named_tensors": [base64.b64encode(pickle.dumps([1, 2])).decode()]},
         "serialized_named_tensors[0]"),  # fmt: skip
        ({"serialized_named_tensors": _payload() * 2}, "serialized_named_tensors"),  # 2 payloads, tp 1
        ({"serialized_named_tensors": []}, "serialized_named_tensors"),
        ({"serialized_named_tensors": _payload(), "selector": "target"}, "selector"),  # the drafter only
        ({"serialized_named_tensors": serialize_named_tensors([("fc.weight", torch.full((2, 2), float("nan")))])},
         "serialized_named_tensors[0]"),  # fmt: skip
        ({"serialized_named_tensors": serialize_named_tensors([("fc.weight", torch.ones(2, 2, dtype=torch.int64))])},
         "serialized_named_tensors[0]"),  # fmt: skip
    ],
    ids=["base64", "unsafe_pickle", "not_pairs", "tp_count", "empty", "selector", "nan", "int64"],
)
def test_a_bad_body_is_a_400_naming_the_field_and_reaches_no_scheduler(body, field):
    app, sent, _ = _app()
    with TestClient(app) as c:
        r = c.post(dp_drafter_update.PATH, json=body)
    assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text
    assert sent == []


def _replica(dp_size: int):
    app, calls = FastAPI(), []
    ok = {"success": True, "message": "Success"}

    @app.get("/get_server_info")
    async def info():
        return {"dp_size": dp_size}

    async def record(req: Request):
        calls.append((req.url.path, await req.json()))
        return {"status": "ok", **ok}

    for path in ("/pause_generation", "/continue_generation", "/begin_weight_update", "/end_weight_update",
                 "/update_weights_from_tensor", DP_DRAFTER_PATH, "/respec/drafter"):  # fmt: skip
        app.add_api_route(path, record, methods=["POST"])
    return app, calls


@pytest.mark.parametrize("dp_size", [1, 2])
def test_the_client_sends_a_dp_servers_drafter_update_to_the_plugin_route(dp_size):
    app, calls = _replica(dp_size)
    c = TestClient(app)
    HotSwapClient("http://testserver", post=c.post, get=c.get).push(3, [("fc.weight", torch.ones(1))])
    paths = [p for p, _ in calls]
    update = DP_DRAFTER_PATH if dp_size > 1 else "/update_weights_from_tensor"
    assert paths == ["/pause_generation", "/begin_weight_update", update, "/end_weight_update",
                     "/continue_generation", "/respec/drafter"]  # fmt: skip
    body = calls[2][1]
    if dp_size > 1:  # only the fields the plugin route takes; it is always a draft update without flush
        assert set(body) == {"serialized_named_tensors", "load_format"}
    else:
        assert body["selector"] == "draft" and body["flush_cache"] is False


@pytest.mark.parametrize("bad", [torch.tensor([1.0, float("inf")]), torch.ones(2, dtype=torch.bool)])
def test_the_client_refuses_weights_that_are_not_finite_floats_before_any_call(bad):
    app, calls = _replica(1)
    c = TestClient(app)
    with pytest.raises(HotSwapError, match="fc.weight") as e:
        HotSwapClient("http://testserver", post=c.post, get=c.get).push(3, [("fc.weight", bad)])
    assert e.value.step == "check" and calls == []  # not even paused


def test_a_push_larger_than_the_drafter_could_be_is_a_413_that_reaches_no_scheduler(tmp_path):
    """The body was read whatever its size (an open admin route without keys): now it is bounded by the drafter
    checkpoint's bytes; a push of the drafter's own size still goes through."""
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    assert dp_drafter_update.max_body_bytes(SimpleNamespace(tp_size=2, speculative_draft_model_path=str(tmp_path))) == (
        2 * 4 * 4096 + dp_drafter_update.PUSH_SLACK_BYTES
    )
    assert (
        dp_drafter_update.max_body_bytes(SimpleNamespace(tp_size=1, speculative_draft_model_path="org/hub-id")) is None
    )
    app, sent, _ = _app(drafter=str(tmp_path))
    limit = dp_drafter_update.max_body_bytes(SimpleNamespace(tp_size=1, speculative_draft_model_path=str(tmp_path)))
    with TestClient(app) as c:
        big = c.post(dp_drafter_update.PATH, json={"serialized_named_tensors": ["A" * (limit + 1)]})
        ok = c.post(dp_drafter_update.PATH, json={"serialized_named_tensors": _payload()})
    assert big.status_code == 413 and big.json()["error"]["field"] == "body", big.text
    assert ok.status_code == 200, ok.text
    assert len(sent) == 1  # only the push that fits reached the communicator


# -- every (name, tensor) against the drafter checkpoint the server started with ---------------------------------------

TINY = DrafterConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                     vocab_size=32, draft_vocab_size=16, target_hidden_size=8, aux_layer_ids=[0, 1, 2])  # fmt: skip


def _checkpoint(folder: Path, layout: str = "sglang") -> Eagle3Drafter:
    """A tiny EAGLE3 drafter saved as the learner saves one (``save_pretrained``: every tensor, int64 ``d2t`` and
    bool ``t2d`` included) in ``layout`` (``layers.0.*`` or SpecForge's ``midlayer.*``)."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter(TINY)
    drafter.save_pretrained(folder, dtype=torch.bfloat16, layout=layout)
    return drafter


@pytest.mark.parametrize("layout", ["sglang", "specforge"])
def test_the_learners_push_and_every_float_tensor_of_the_checkpoint_go_through(tmp_path, layout):
    """What the learner pushes (``hot_swap_tensors``: our names, ``layers.0.*``, in any float dtype) is checkpoint
    names as SGLang's EAGLE3 ``load_weights`` maps them, in either layout; so is every float tensor of the file under
    the name it has there (``midlayer.*`` for SpecForge's layout) but the embedding, which is the target's."""
    drafter = _checkpoint(tmp_path, layout)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert ("midlayer.self_attn.q_proj.weight" in saved) == (layout == "specforge")
    assert saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool
    pushes = [
        drafter.hot_swap_tensors(torch.float32),
        [(n, t.float()) for n, t in saved.items() if t.is_floating_point() and n != "embed_tokens.weight"],
    ]
    app, sent, _ = _app(drafter=str(tmp_path))
    with TestClient(app) as c:
        for named in pushes:
            r = c.post(dp_drafter_update.PATH, json={"serialized_named_tensors": serialize_named_tensors(named)})
            assert r.status_code == 200, r.text
    assert len(sent) == 2
    assert {n for n, _ in pushes[0]} == {n for n in drafter.state_dict() if n not in NOT_HOT_SWAPPED}


def _bad(name: str, tensor: torch.Tensor):
    return [("fc.weight", torch.ones(8, 24)), (name, tensor)]  # a good tensor first (fc: 3 x 8 target features -> 8)


@pytest.mark.parametrize(
    "named, tensor_name, why",
    [
        (_bad("layers.1.mlp.up_proj.weight", torch.ones(16, 8)), "layers.1.mlp.up_proj.weight", "not a tensor"),
        (_bad("norm.weight", torch.ones(9)), "norm.weight", "shape [9]"),  # a good fc.weight before it
        ([("d2t", torch.zeros(16))], "d2t", "I64"),  # float garbage over the int64 vocabulary map
        ([("t2d", torch.ones(32))], "t2d", "BOOL"),
    ],
    ids=["unknown_name", "wrong_shape_after_a_good_one", "float_d2t", "float_t2d"],
)
def test_a_push_that_is_not_the_checkpoints_is_a_400_naming_the_tensor_and_reaches_no_scheduler(
    tmp_path, named, tensor_name, why
):
    """Was: a wrong shape after a good tensor left every rank with half a drafter (400 "may be partially updated");
    an unknown name loaded nothing and a float ``d2t`` garbage, both answered 200."""
    _checkpoint(tmp_path)
    app, sent, _ = _app(drafter=str(tmp_path))
    with TestClient(app) as c:
        r = c.post(dp_drafter_update.PATH, json={"serialized_named_tensors": serialize_named_tensors(named)})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["field"] == "serialized_named_tensors[0]" and error["reason"].startswith(f"{tensor_name}: "), error
    assert why in error["reason"], error
    assert sent == []


def test_a_bad_second_tp_payload_refuses_the_whole_push(tmp_path):
    drafter = _checkpoint(tmp_path)
    good = serialize_named_tensors(drafter.hot_swap_tensors(torch.float32))[0]
    bad = serialize_named_tensors([("fc.weight", torch.ones(3, 3))])[0]
    app, sent, _ = _app(drafter=str(tmp_path), tp=2)
    with TestClient(app) as c:
        r = c.post(dp_drafter_update.PATH, json={"serialized_named_tensors": [good, bad]})
        ok = c.post(dp_drafter_update.PATH, json={"serialized_named_tensors": [good, good]})
    assert r.status_code == 400 and r.json()["error"]["field"] == "serialized_named_tensors[1]", r.text
    assert r.json()["error"]["reason"].startswith("fc.weight: shape [3, 3]"), r.text
    assert ok.status_code == 200, ok.text
    assert len(sent) == 1  # only the good push


@pytest.mark.parametrize("checkpoint", ["bin", "hub_id", "unreadable"])
def test_a_checkpoint_without_readable_safetensors_skips_the_name_check(tmp_path, checkpoint):
    """A ``.bin`` checkpoint, a hub id or headers that do not parse: no names/shapes to check against, the push goes
    to the schedulers as before (their own per-tensor checks apply)."""
    if checkpoint == "bin":
        torch.save({"fc.weight": torch.ones(8, 24)}, tmp_path / "pytorch_model.bin")
        drafter = str(tmp_path)
    elif checkpoint == "hub_id":
        drafter = "org/some-eagle3-drafter"
    else:
        (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
        drafter = str(tmp_path)
    assert dp_drafter_update.checkpoint_tensors(drafter) is None
    app, sent, _ = _app(drafter=drafter)
    with TestClient(app) as c:
        r = c.post(dp_drafter_update.PATH, json={"serialized_named_tensors": _payload()})  # fc.weight (2, 2)
    assert r.status_code == 200, r.text
    assert len(sent) == 1


def test_the_checkpoints_headers_are_read_once_per_version_of_its_files(tmp_path, monkeypatch):
    save_file(
        {"fc.weight": torch.ones(2, 2), "d2t": torch.zeros(2, dtype=torch.int64)}, str(tmp_path / "a.safetensors")
    )
    reads = []
    real = dp_drafter_update.safe_open

    def counting(*args, **kwargs):
        reads.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(dp_drafter_update, "safe_open", counting)
    dp_drafter_update._read_headers.cache_clear()
    first = dp_drafter_update.checkpoint_tensors(str(tmp_path))
    assert dict(first) == {"fc.weight": ((2, 2), "F32"), "d2t": ((2,), "I64")}
    assert dp_drafter_update.checkpoint_tensors(str(tmp_path)) is first and len(reads) == 1
    save_file({"fc.weight": torch.ones(3, 2)}, str(tmp_path / "a.safetensors"))  # a new file: read again
    assert dict(dp_drafter_update.checkpoint_tensors(str(tmp_path))) == {"fc.weight": ((3, 2), "F32")}
    assert len(reads) == 2


@pytest.mark.parametrize("head_from_target", [False, True])
def test_a_tensor_the_served_drafter_shares_with_the_target_is_refused(tmp_path, head_from_target):
    """SGLang's drafter holds the target's embedding tensor, and its lm_head too when the config's
    ``draft_vocab_size`` is null: a push of either would rewrite the policy. Was: accepted (200)."""
    drafter = _checkpoint(tmp_path)
    if head_from_target:
        config = json.loads((tmp_path / "config.json").read_text())
        config["draft_vocab_size"] = None
        (tmp_path / "config.json").write_text(json.dumps(config))
    state = drafter.checkpoint_tensors(torch.float32)
    app, sent, _ = _app(drafter=str(tmp_path))
    with TestClient(app) as c:
        embed = c.post(dp_drafter_update.PATH, json={"serialized_named_tensors": serialize_named_tensors(
            [("fc.weight", state["fc.weight"]), ("embed_tokens.weight", state["embed_tokens.weight"])])})  # fmt: skip
        head = c.post(dp_drafter_update.PATH, json={"serialized_named_tensors": serialize_named_tensors(
            [("lm_head.weight", state["lm_head.weight"])])})  # fmt: skip
    assert embed.status_code == 400, embed.text
    assert embed.json()["error"]["reason"] == f"embed_tokens.weight: {dp_drafter_update.SHARED_EMBEDDING}"
    if head_from_target:
        assert head.status_code == 400, head.text
        assert head.json()["error"]["reason"] == f"lm_head.weight: {dp_drafter_update.SHARED_HEAD}"
        assert sent == []
    else:
        assert head.status_code == 200, head.text  # a drafter with its own draft vocabulary owns its head
        assert len(sent) == 1
