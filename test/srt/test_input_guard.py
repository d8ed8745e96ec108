"""U2: a request whose prompt or top-logprob count the model cannot serve is a 400 and the server stays up."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from sglang_spex.srt.input_guard import check_token_ids, check_top_logprobs, u2_validate_one_request

VOCAB = 344  # the tiny Llama's


@pytest.mark.parametrize(
    "ids, field",
    [
        ([1, VOCAB], "input_ids[1] is 344"),
        ([-1], "input_ids[0] is -1"),
        ([2, 1.5], "input_ids[1] is 1.5"),
        ([True], "input_ids[0] is True"),
        ([], "empty"),
    ],
)
def test_bad_prompt_ids_name_the_offender(ids, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        check_token_ids(ids, VOCAB)


def test_valid_prompt_ids_pass():
    check_token_ids([0, 5, VOCAB - 1], VOCAB)
    check_token_ids(np.array([0, VOCAB - 1]), VOCAB)  # numpy integers, as sglang.Engine may pass
    check_token_ids(None, VOCAB)  # input_embeds


def test_top_logprobs_checked_only_when_logprobs_are_asked():
    check_top_logprobs(SimpleNamespace(return_logprob=True, top_logprobs_num=VOCAB), VOCAB)
    check_top_logprobs(SimpleNamespace(return_logprob=False, top_logprobs_num=VOCAB + 1), VOCAB)
    for n in (VOCAB + 1, -1):
        with pytest.raises(ValueError, match="top_logprobs_num"):
            check_top_logprobs(SimpleNamespace(return_logprob=True, top_logprobs_num=n), VOCAB)


def test_hook_leaves_multimodal_prompts_to_sglang_and_runs_sglang_after():
    calls = []
    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB))
    obj = SimpleNamespace(image_data=["img"], return_logprob=False)
    u2_validate_one_request(lambda *a: calls.append(a), manager, obj, [VOCAB + 10**6])  # pad values: SGLang's
    assert calls == [(manager, obj, [VOCAB + 10**6])]
    with pytest.raises(ValueError):
        u2_validate_one_request(lambda *a: calls.append(a), manager, SimpleNamespace(), [VOCAB])
    assert len(calls) == 1


BAD = [
    ("/generate", {"input_ids": [1, 2, 99_999_999], "sampling_params": {"max_new_tokens": 2}}, "input_ids[2]"),
    ("/generate", {"input_ids": [[1, 2], [-3]], "sampling_params": {"max_new_tokens": 2}}, "input_ids[0] is -3"),
    ("/generate", {"text": "", "sampling_params": {"max_new_tokens": 2}}, "empty"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 100_000}, "top_logprobs_num"),
    ("/v1/completions", {"model": "m", "prompt": [5, 999_999], "max_tokens": 2}, "input_ids[1]"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2, "logprobs": 100_000}, "top_logprobs_num"),
]


@pytest.mark.parametrize("server", ["spex_server", "plain_server"])
def test_malformed_requests_answer_400_and_the_server_serves_on(request, server):
    """Each of these killed the scheduler (and the server) before U2; every launch has it, plain or SPEX."""
    srv = request.getfixturevalue(server)
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        for route, body, message in BAD:
            r = client.post(route, json=body)
            assert r.status_code == 400, (route, body, r.text)
            assert message in r.text, r.text
        ok = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3
        assert client.get("/health_generate").status_code == 200
