"""EAGLE-style multi-step draft decode for ``spex_cpu``, and the hooks that let SGLang's draft workers build it.

SGLang's ``DraftBackendFactory`` picks draft backends from a fixed map inside its methods, so ``spex_cpu`` is
added with AROUND hooks on ``create_decode_backend`` / ``create_draft_extend_backend``; every other backend
name goes to SGLang's own code unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

import torch

from sgl_kernel_ext.attention import BACKEND_NAME
from sgl_kernel_ext.attention.kernels import BatchLayout

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

FACTORY = "sglang.srt.speculative.draft_utils.DraftBackendFactory"


def draft_decode_layouts(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    topk: int,
    num_steps: int,
) -> List[BatchLayout]:
    """Layouts of draft steps 0..num_steps-2: branch j of request b sees its prefix + its own slots 0..i.

    ``out_cache_loc`` is SGLang's multi-step draft buffer, ``[B, topk, num_steps]`` flattened; query rows are
    request-major (``b * topk + j``), as ``select_top_k_tokens`` lays them out.
    """
    bs = seq_lens.shape[0]
    seq = seq_lens.to(torch.int64).repeat_interleave(topk)  # [B*topk]
    slots = out_cache_loc.view(bs, topk, num_steps).reshape(bs * topk, num_steps).to(torch.int64)
    p_max = int(seq.max()) if bs else 0
    width = p_max + num_steps
    rows = req_to_token[req_pool_indices.to(torch.int64), :p_max].to(torch.int64).repeat_interleave(topk, 0)
    cols = torch.arange(width, device=seq.device)[None, :]
    draft_pos = (cols - seq[:, None]).clamp(0, num_steps - 1)
    base = torch.where(cols < seq[:, None], torch.nn.functional.pad(rows, (0, num_steps)), slots.gather(1, draft_pos))
    layouts = []
    for i in range(num_steps - 1):
        s_max = p_max + i + 1
        valid = cols[:, :s_max] < (seq + i + 1)[:, None]
        kv_idx = torch.where(valid, base[:, :s_max], 0)
        layouts.append(BatchLayout(kv_idx, valid[:, None, None, :], 1, None))
    return layouts


class SpexCpuMultiStepDraftBackend:
    """One :class:`SpexCpuAttnBackend` per draft step; metadata for all steps built once per draft round."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        from sgl_kernel_ext.attention.backend import SpexCpuAttnBackend

        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.attn_backends = [SpexCpuAttnBackend(model_runner) for _ in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        layouts = draft_decode_layouts(
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            forward_batch.out_cache_loc,
            self.topk,
            self.speculative_num_steps,
        )
        for backend, layout in zip(self.attn_backends, layouts):
            backend.preset_layout(layout)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        pass


def _uses_ours(factory, backend_name: str) -> bool:
    from sglang.srt.runtime_context import attention_backends

    prefill, decode = attention_backends()
    configured = decode if backend_name == "decode_attention_backend" else prefill
    return (factory.draft_attn_backend or configured) == BACKEND_NAME


def _stamp(backend):
    backend.prefill_attention_backend_str = BACKEND_NAME
    backend.decode_attention_backend_str = BACKEND_NAME
    return backend


def h_create_decode_backend(original, factory, *args, **kwargs):
    """AROUND DraftBackendFactory.create_decode_backend: our multi-step draft backend for ``spex_cpu``."""
    if factory.speculative_num_steps <= 1 or not _uses_ours(factory, "decode_attention_backend"):
        return original(factory, *args, **kwargs)
    backend = SpexCpuMultiStepDraftBackend(factory.draft_model_runner, factory.topk, factory.speculative_num_steps)
    for child in backend.attn_backends:
        _stamp(child)
    return _stamp(backend)


def h_create_draft_extend_backend(original, factory, *args, **kwargs):
    """AROUND DraftBackendFactory.create_draft_extend_backend: a plain ``spex_cpu`` backend for draft extend."""
    from sglang.srt.runtime_context import get_spec

    name = (
        "decode_attention_backend" if get_spec().speculative_attention_mode == "decode" else "prefill_attention_backend"
    )
    if not _uses_ours(factory, name):
        return original(factory, *args, **kwargs)
    from sgl_kernel_ext.attention.backend import SpexCpuAttnBackend

    return _stamp(SpexCpuAttnBackend(factory.draft_model_runner))


def register_draft_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{FACTORY}.create_decode_backend", h_create_decode_backend, HookType.AROUND)
    HookRegistry.register(f"{FACTORY}.create_draft_extend_backend", h_create_draft_extend_backend, HookType.AROUND)
