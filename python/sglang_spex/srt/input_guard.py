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
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

MULTIMODAL_FIELDS = ("image_data", "video_data", "audio_data")


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
