"""Hook U2: a request whose prompt or top-logprob count the model cannot serve is a 400, not a dead server.

SGLang 0.5.23's ``TokenizerManager._validate_one_request`` checks a prompt's length but not its token ids (it checks
``token_ids_logprob``'s), nor ``top_logprobs_num``, and it refuses empty ``input_ids`` but not a text that tokenizes
to nothing. Each of these reached the scheduler and raised there, and the whole server exited (SIGQUIT, process tree
killed), so one malformed request took every client down: ``POST /generate`` with ``input_ids: [99999999]`` or a
negative id (the embedding lookup's ``IndexError``), ``return_logprob`` with ``top_logprobs_num`` above the vocabulary
size (``torch.topk``), ``text: ""`` with a tokenizer that adds no BOS (an extend of zero tokens). U2 checks them
before SGLang's own validation, as SGLang checks ``token_ids_logprob``; the ``ValueError`` becomes SGLang's usual 400.
Prompts whose ids a multimodal processor produced (placeholder pad values) and session continuations are left to
SGLang.

Hook U3: a prompt text far past the context length is refused after tokenizing a bounded prefix of it. SGLang
tokenizes a text in full on the TokenizerManager's event loop and only then compares its length with the context,
so one 64 MB ``/generate`` text held every other client for 229 s (8 MB: 24 s) before its 400. U3 tokenizes
prefixes of 8 characters per context token, doubling up to 2 x the longest token's characters per context token;
more than ``context_len`` + :data:`BOUNDARY_TOKENS` tokens in a prefix is SGLang's own "longer than the model's
context length" 400. A text that stays short (a tokenizer that drops or merges most of it) goes to SGLang whole, as
does every text under ``--allow-auto-truncate`` (SGLang keeps its first tokens). Hook U4 applies the same check to
a chat's message text (``/v1/chat/completions``), which SGLang renders and tokenizes on its executor threads.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Awaitable, Callable, Optional, Sequence, Tuple

MULTIMODAL_FIELDS = ("image_data", "video_data", "audio_data")
FIRST_PREFIX_CHARS_PER_TOKEN = 8  # about twice an average token's characters: most long texts end at the first prefix
BOUNDARY_TOKENS = 16  # a prefix's last word may tokenize differently in the whole text


def check_token_ids(input_ids: Optional[Sequence[Any]], vocab_size: int) -> None:
    """Raise ``ValueError`` for an empty prompt, or naming the first token id not an integer in ``[0, vocab_size)``."""
    if input_ids is None:
        return  # input_embeds
    if len(input_ids) == 0:
        raise ValueError("The prompt is empty (it has no tokens): send at least one token.")
    if all(type(t) is int for t in input_ids) and 0 <= min(input_ids) and max(input_ids) < vocab_size:
        return  # the common case, without a Python step per token
    for i, token_id in enumerate(input_ids):
        try:
            if isinstance(token_id, bool):
                raise TypeError
            value = operator.index(token_id)  # ints, numpy and 0-d torch integers
        except TypeError:
            raise ValueError(f"input_ids[{i}] is {token_id!r}: token ids must be integers.") from None
        if not 0 <= value < vocab_size:
            raise ValueError(
                f"input_ids[{i}] is {value}, outside the vocabulary: valid token ids are [0, {vocab_size})."
            )


def check_top_logprobs(obj: Any, vocab_size: int) -> None:
    """Raise ``ValueError`` when a request asks for logprobs with ``top_logprobs_num`` outside ``[0, vocab_size]``."""
    n = getattr(obj, "top_logprobs_num", None)
    if getattr(obj, "return_logprob", False) and isinstance(n, int) and not 0 <= n <= vocab_size:
        raise ValueError(f"top_logprobs_num is {n}: it must lie in [0, {vocab_size}] (the vocabulary size).")


def u2_validate_one_request(original: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """U2 (AROUND ``TokenizerManager._validate_one_request(self, obj, input_ids)``): the prompt's token ids are
    checked, and ``top_logprobs_num``, then SGLang's own checks run."""
    manager = args[0] if args else kwargs.get("self")
    obj = args[1] if len(args) > 1 else kwargs.get("obj")
    input_ids = args[2] if len(args) > 2 else kwargs.get("input_ids")
    vocab_size = getattr(getattr(manager, "model_config", None), "vocab_size", None)
    left_to_sglang = getattr(obj, "session_params", None) is not None or any(
        getattr(obj, name, None) is not None for name in MULTIMODAL_FIELDS
    )
    if isinstance(vocab_size, int):
        if not left_to_sglang:
            check_token_ids(input_ids, vocab_size)
        check_top_logprobs(obj, vocab_size)
    return original(*args, **kwargs)


@functools.lru_cache(maxsize=8)
def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the tokenizer's longest vocabulary entry (byte-level BPE: one character per byte)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def prefix_lengths(text_len: int, context_len: int, longest: int) -> Sequence[int]:
    """Prefix lengths U3 tokenizes for a text of ``text_len`` characters, shortest first (none: the text is short
    enough to tokenize whole). The last reaches ``2 * longest * context_len`` characters, where even a text of only
    longest tokens holds twice the context."""
    cap = 2 * max(1, longest) * context_len
    size = FIRST_PREFIX_CHARS_PER_TOKEN * context_len
    out = []
    while size < min(cap, text_len):
        out.append(size)
        size *= 2
    if cap < text_len:
        out.append(cap)
    return out


def check_text_length(text: str, context_len: int, tokenizer: Any, boundaries: int = 1) -> None:
    """Raise SGLang's context-length ``ValueError`` when a prefix of ``text`` already holds more tokens than the
    context (see U3); tokenizes less than three times the longest prefix's characters in all. ``boundaries``: places where ``text`` was
    joined from parts the model sees apart (chat messages), each allowed :data:`BOUNDARY_TOKENS`."""
    for size in prefix_lengths(len(text), context_len, longest_token_chars(tokenizer)):
        n = len(tokenizer.encode(text[:size]))
        if n > context_len + BOUNDARY_TOKENS * boundaries:
            raise ValueError(
                f"The input ({n} tokens in its first {size} of {len(text)} characters) is "
                f"longer than the model's context length ({context_len} tokens)."
            )


def length_bound(manager: Any) -> Optional[Tuple[int, Any]]:
    """(context length, tokenizer) that U3/U4 check texts against, or None where they leave texts to SGLang: no
    tokenizer (``--skip-tokenizer-init``), or ``--allow-auto-truncate`` (SGLang keeps a long prompt's first tokens)."""
    tokenizer = getattr(manager, "tokenizer", None)
    context_len = getattr(manager, "context_len", None)
    if tokenizer is None or not isinstance(context_len, int) or getattr(manager, "allow_auto_truncate", False):
        return None
    return context_len, tokenizer


def u3_tokenize_texts(original: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Awaitable[Any]:
    """U3 (AROUND ``TokenizerManager._tokenize_texts(self, texts, is_cross_encoder=False)``): each prompt text is
    checked against the context with bounded tokenization, then SGLang tokenizes. Raises before SGLang's coroutine
    is made, which SGLang's ``await`` reports as it reports its own ``ValueError``."""
    manager = args[0] if args else kwargs.get("self")
    texts = args[1] if len(args) > 1 else kwargs.get("texts")
    bound = length_bound(manager)
    if bound is not None:
        for text in [texts] if isinstance(texts, str) else texts if isinstance(texts, list) else []:
            if isinstance(text, str):
                check_text_length(text, *bound)
    return original(*args, **kwargs)


def message_texts(messages: Any) -> Sequence[str]:
    """The text of each chat message: its ``content`` string, or the ``text`` of each of its parts."""
    out = []
    for m in messages or []:
        content = getattr(m, "content", None)
        parts = [content] if isinstance(content, str) else content if isinstance(content, list) else []
        out += [p if isinstance(p, str) else getattr(p, "text", None) for p in parts]
    return [t for t in out if isinstance(t, str)]


def u4_validate_chat(result: Optional[str], *args: Any, **kwargs: Any) -> Optional[str]:
    """U4 (AFTER ``OpenAIServingChat._validate_request(self, request)``): U3's check on the messages' text, joined,
    where SGLang found nothing wrong. SGLang renders and tokenizes a chat on its executor threads (a few per core),
    so six 8 MB chats kept every other chat waiting up to 16 s here while they tokenized in full."""
    if result:
        return result
    serving = args[0] if args else kwargs.get("self")
    request = args[1] if len(args) > 1 else kwargs.get("request")
    bound = length_bound(getattr(serving, "tokenizer_manager", None))
    if bound is None:
        return None
    texts = message_texts(getattr(request, "messages", None))
    try:
        check_text_length("\n".join(texts), *bound, boundaries=max(1, len(texts)))
    except ValueError as e:
        return str(e)
    return None
