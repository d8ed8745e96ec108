"""Hook V2: SGLang's overlap scheduler relays EAGLE draft state on CPU without Triton.

Under the overlap scheduler SGLang 0.5.23 hands the next step its draft inputs through ``FutureMap``, which gathers
the relay buffers (top-k probabilities and indices, bonus tokens, hidden states) by request row with a fused Triton
kernel (``overlap_utils.gather_spec_extras``). On CPU there is no Triton driver, so EAGLE-family speculative
decoding cannot run with overlap there. V2 wraps that gather: for CPU tensors it takes the same rows with
``index_select`` (what the kernel computes: ``buf[indices]`` per buffer); every other device goes to SGLang's
kernel unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch

Rows = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


def gather_rows_cpu(
    indices: torch.Tensor,
    topk_p_buf: torch.Tensor,
    topk_index_buf: torch.Tensor,
    output_tokens_buf: torch.Tensor,
    hidden_states_buf: Optional[torch.Tensor],
) -> Rows:
    """The rows ``indices`` of each relay buffer (``None`` hidden states stay ``None``)."""
    idx = indices.reshape(-1).to(torch.long)
    hidden = hidden_states_buf.index_select(0, idx) if hidden_states_buf is not None else None
    return (
        topk_p_buf.index_select(0, idx),
        topk_index_buf.index_select(0, idx),
        output_tokens_buf.index_select(0, idx),
        hidden,
    )


def v2_gather_spec_extras(original: Callable[..., Rows], *args: Any, **kwargs: Any) -> Rows:
    """V2 (AROUND ``overlap_utils.gather_spec_extras``): a plain row gather for CPU tensors."""
    indices = kwargs.get("indices", args[0] if args else None)
    if isinstance(indices, torch.Tensor) and indices.device.type == "cpu":
        names = ("indices", "topk_p_buf", "topk_index_buf", "output_tokens_buf", "hidden_states_buf")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        return gather_rows_cpu(**bound)
    return original(*args, **kwargs)
