"""U2: a request whose prompt or top-logprob count the model cannot serve is a 400 and the server stays up."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from sglang_spex.srt.input_guard import (
    check_text_length,
    check_token_ids,
    check_top_logprobs,
    message_texts,
    prefix_lengths,
    u2_validate_one_request,
    u3_tokenize_texts,
    u4_validate_chat,
)

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


class CountingTokenizer:
    """One token per ``chars_per_token`` characters; records the text lengths it was asked to encode."""

    def __init__(self, chars_per_token: int, longest: int = 8):
        self.chars_per_token, self.longest, self.seen = chars_per_token, longest, []

    def get_vocab(self):
        return {"x" * self.longest: 0, "y": 1}

    def encode(self, text):
        self.seen.append(len(text))
        return [0] * (len(text) // self.chars_per_token)


def test_prefixes_double_from_eight_characters_per_token_up_to_twice_the_longest_token():
    assert prefix_lengths(10**9, 100, 10) == [800, 1600, 2000]  # cap: 2 x 10 characters x 100 tokens
    assert prefix_lengths(1000, 100, 10) == [800]  # then the whole text, by SGLang
    assert prefix_lengths(800, 100, 10) == []  # short enough to tokenize whole
    assert prefix_lengths(10**9, 100, 2) == [400]  # the cap comes first


def test_a_long_text_is_refused_after_its_first_prefix(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    with pytest.raises(ValueError, match=r"in its first 16384 of 2400000 characters\) is longer than the model's"):
        check_text_length("alpha beta7 " * 200_000, 2048, tokenizer)
    check_text_length("alpha beta7 " * 1000, 2048, tokenizer)  # 12,000 characters: SGLang's to tokenize


def test_a_text_that_tokenizes_short_goes_to_sglang_whole_after_bounded_prefixes():
    tok = CountingTokenizer(chars_per_token=100)  # every prefix stays under the context
    check_text_length("z" * 10**7, 100, tok)
    assert tok.seen == [800, 1600]  # the cap (2 x 8 x 100) ends the prefixes: under 3 x the cap in all
    dense = CountingTokenizer(chars_per_token=1)
    with pytest.raises(ValueError, match=r"\(800 tokens in its first 800 of"):
        check_text_length("z" * 10**7, 100, dense)
    assert dense.seen == [800]


def test_u3_checks_each_text_unless_sglang_truncates():
    tok = CountingTokenizer(chars_per_token=1)
    manager = SimpleNamespace(tokenizer=tok, context_len=100, allow_auto_truncate=False)
    assert u3_tokenize_texts(lambda *a: "tokenized", manager, ["short", "z" * 100]) == "tokenized"
    for texts in ("z" * 10**6, ["ok", "z" * 10**6]):
        with pytest.raises(ValueError, match="longer than the model's context length"):
            u3_tokenize_texts(lambda *a: "tokenized", manager, texts)
    manager.allow_auto_truncate = True  # SGLang keeps the first tokens: the whole text is its to tokenize
    assert u3_tokenize_texts(lambda *a: "tokenized", manager, "z" * 10**6) == "tokenized"


def test_u4_checks_a_chats_joined_message_text_where_sglang_found_nothing_wrong():
    parts = [SimpleNamespace(type="text", text="b" * 500), SimpleNamespace(type="image_url", image_url="u")]
    messages = [SimpleNamespace(content="a" * 500), SimpleNamespace(content=parts), SimpleNamespace(content=None)]
    assert message_texts(messages) == ["a" * 500, "b" * 500]
    manager = SimpleNamespace(tokenizer=CountingTokenizer(1), context_len=100, allow_auto_truncate=False)
    serving = SimpleNamespace(tokenizer_manager=manager)
    error = u4_validate_chat(None, serving, SimpleNamespace(messages=messages))
    assert "(800 tokens in its first 800 of 1001 characters)" in error  # two messages: 2 x 16 boundary tokens
    assert u4_validate_chat("Messages cannot be empty.", serving, SimpleNamespace(messages=messages)).startswith("M")
    assert u4_validate_chat(None, serving, SimpleNamespace(messages=messages[:1])) is None  # 500 characters
    manager.context_len = 400  # 1,001 characters, under 8 per context token: SGLang tokenizes it whole
    assert u4_validate_chat(None, serving, SimpleNamespace(messages=messages)) is None


LONG_TEXT = "alpha beta7 " * 200_000  # 2.4 MB: SGLang alone tokenized all of it on the event loop (~7 s here)
BAD = [
    ("/generate", {"input_ids": [1, 2, 99_999_999], "sampling_params": {"max_new_tokens": 2}}, "input_ids[2]"),
    ("/generate", {"input_ids": [[1, 2], [-3]], "sampling_params": {"max_new_tokens": 2}}, "input_ids[0] is -3"),
    ("/generate", {"text": "", "sampling_params": {"max_new_tokens": 2}}, "empty"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 100_000}, "top_logprobs_num"),
    ("/v1/completions", {"model": "m", "prompt": [5, 999_999], "max_tokens": 2}, "input_ids[1]"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2, "logprobs": 100_000}, "top_logprobs_num"),
    ("/generate", {"text": LONG_TEXT, "sampling_params": {"max_new_tokens": 2}}, "of 2400000 characters) is longer"),
    ("/v1/completions", {"model": "m", "prompt": LONG_TEXT, "max_tokens": 2}, "of 2400000 characters) is longer"),
    (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 2},
        "of 2400000 characters) is longer",
    ),
]


@pytest.mark.parametrize("server", ["spex_server", "plain_server"])
def test_malformed_requests_answer_400_and_the_server_serves_on(request, server):
    """Each of these killed the scheduler (and the server) before U2, or held every client while SGLang tokenized it
    (U3); every launch has both, plain or SPEX."""
    srv = request.getfixturevalue(server)
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        for route, body, message in BAD:
            r = client.post(route, json=body)
            assert r.status_code == 400, (route, body, r.text)
            assert message in r.text, r.text
        ok = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3
        assert client.get("/health_generate").status_code == 200
