"""The ReSpec drafter in a real CPU SGLang server (tiny Llama, float32, spex_cpu attention, EAGLE3 speculation).

Plain SGLang's greedy outputs come from the shared ``respec_reference`` (one plain server, stopped before this one);
EAGLE3 with ``--speculative-draft-model-path`` = a drafter saved by ``Eagle3Drafter.save_pretrained``. It must load
in SGLang's ``LlamaForCausalLMEagle3`` and greedy output with speculation must equal the reference, token for token.
Then ``HotSwapClient`` pushes a new drafter version while streamed requests are in flight: they finish with the
reference tokens and the server's weight version changes.
"""

from __future__ import annotations

import json
import threading
from typing import List

import pytest
import requests
import torch
from workloads import COMMON, LOAD, N_LOAD, WORKLOADS, generate

from sglang_spex.respec.drafter import Eagle3Drafter
from sglang_spex.respec.hotswap import WEIGHT_VERSION_PREFIX, HotSwapClient, HotSwapError
from sglang_spex.serve import ServerProcess

EAGLE = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
DRAFT_VOCAB = 128


def _drafter(target, seed: int) -> Eagle3Drafter:
    torch.manual_seed(seed)
    counts = torch.rand(target.config.vocab_size)  # some fixed reduced vocabulary
    model = Eagle3Drafter.for_target(target, DRAFT_VOCAB, token_counts=counts, seed=seed)
    if seed:  # a visibly different version: perturb every trainable weight
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.05)
    return model


def _weight_version(url: str) -> str:
    return requests.get(url + "/model_info", timeout=60).json()["weight_version"]


@pytest.fixture(scope="module")
def eagle3_server(tiny_model, tiny_target, respec_reference, tmp_path_factory):  # after the reference server stopped
    path = _drafter(tiny_target, seed=0).save_pretrained(tmp_path_factory.mktemp("respec-drafter"))
    spec = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(path), *EAGLE]
    with ServerProcess(["--model-path", tiny_model, *COMMON, *spec]) as srv:
        yield srv


@pytest.fixture(scope="module")
def eagle3_outputs(eagle3_server):
    meta: list = []
    out = {}
    for k, texts in WORKLOADS.items():
        res = generate(eagle3_server.url, texts)
        out[k] = [x["output_ids"] for x in res]
        meta.extend(x["meta_info"] for x in res)
    return out, meta


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_saved_drafter_greedy_equals_no_speculation(respec_reference, eagle3_outputs, workload):
    out, _ = eagle3_outputs
    assert out[workload] == respec_reference["workloads"][workload]


def test_saved_drafter_is_used_for_speculation(eagle3_outputs):
    _, meta = eagle3_outputs
    assert all(m["spec_verify_ct"] > 0 for m in meta)  # the EAGLE3 draft/verify path ran for every request


def _stream(url: str, text: str, out: dict, started: threading.Event) -> None:
    params = {"temperature": 0, "max_new_tokens": N_LOAD, "ignore_eos": True}
    payload = {"text": text, "sampling_params": params, "stream": True}
    with requests.post(url + "/generate", json=payload, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data:") :])
            out.update(chunk)
            if chunk.get("output_ids"):
                started.set()


def test_hot_swap_under_load(eagle3_server, eagle3_outputs, respec_reference, tiny_target):
    url = eagle3_server.url
    before = _weight_version(url)
    # build and serialise the new version before the load starts: only the push itself races the streams
    tensors = _drafter(tiny_target, seed=1).hot_swap_tensors(torch.float32)
    results: List[dict] = [{} for _ in LOAD]
    events = [threading.Event() for _ in LOAD]
    threads = [threading.Thread(target=_stream, args=(url, t, results[i], events[i])) for i, t in enumerate(LOAD)]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(120), "a streamed request produced no tokens"
    in_flight = sum(t.is_alive() for t in threads)
    HotSwapClient(url, tag_weight_version=True).push(7, tensors)
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert before != f"{WEIGHT_VERSION_PREFIX}7"
    assert _weight_version(url) == f"{WEIGHT_VERSION_PREFIX}7"
    # streamed output_ids are cumulative: the final chunk holds the whole greedy sequence
    assert [r["output_ids"] for r in results] == respec_reference["load"]
    assert in_flight > 0
    # the scheduler paused in place and resumed with the new drafter: a request saw both versions (SGLang's spans)
    spans = [[s["version"] for s in r["meta_info"]["weight_versions"]] for r in results]
    print("weight_versions:", spans)
    assert ["default", f"{WEIGHT_VERSION_PREFIX}7"] in spans
    # after the swap, new requests still decode greedily with the new drafter
    assert [x["output_ids"] for x in generate(url, WORKLOADS["b4_mixed"])] == respec_reference["workloads"]["b4_mixed"]


def test_a_drafter_push_the_model_cannot_load_fails_and_the_server_serves_on(
    eagle3_server, respec_reference, tiny_target
):
    """U1: a wrong-shaped tensor in a drafter update is a failed update (HotSwapError), not a dead scheduler."""
    url = eagle3_server.url
    before = _weight_version(url)
    name, tensor = _drafter(tiny_target, seed=2).hot_swap_tensors(torch.float32)[0]
    with pytest.raises(HotSwapError) as e:
        HotSwapClient(url, tag_weight_version=True).push(8, [(name, tensor[:1])])
    assert e.value.step == "update_weights_from_tensor" and "Failed to update parameters" in str(e.value)
    assert requests.get(url + "/health_generate", timeout=120).status_code == 200
    assert _weight_version(url) == before  # a failed update records no version
    # the drafter is back to a full, valid set: greedy output is the reference again
    HotSwapClient(url, tag_weight_version=True).push(9, _drafter(tiny_target, seed=0).hot_swap_tensors(torch.float32))
    assert [x["output_ids"] for x in generate(url, WORKLOADS["b4_mixed"])] == respec_reference["workloads"]["b4_mixed"]
