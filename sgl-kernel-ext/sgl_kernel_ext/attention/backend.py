"""``spex_cpu``: SGLang attention backend that batches decode, extend and verify across requests in torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sgl_kernel_ext.attention.kernels import BatchLayout, decode_layout, extend_layout, paged_attention

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner


def _check_layer(layer: "RadixAttention") -> None:
    if layer.is_cross_attention:
        raise NotImplementedError("spex_cpu attention backend: cross attention is not supported")
    if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
        raise NotImplementedError("spex_cpu attention backend: sliding-window attention is not supported")
    if layer.logit_cap and layer.logit_cap > 0:
        raise NotImplementedError("spex_cpu attention backend: logit soft-capping is not supported")


class SpexCpuAttnBackend(AttentionBackend):
    """Batched CPU attention: the KV index table and mask are built once per forward, one SDPA per layer."""

    def __init__(self, model_runner: "ModelRunner"):
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.layout: Optional[BatchLayout] = None
        self._preset = False  # layout given by the multi-step draft backend for this draft round

    def preset_layout(self, layout: BatchLayout) -> None:
        """Use ``layout`` for the next forward (a draft step) instead of deriving it from the batch."""
        self.layout, self._preset = layout, True

    # ---- metadata -------------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        if self._preset:
            self._preset = False
            return
        mode = forward_batch.forward_mode
        req_to_token = self.req_to_token_pool.req_to_token
        if forward_batch.batch_size == 0 or mode.is_idle():
            self.layout = None
        elif mode.is_decode():
            self.layout = decode_layout(req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens)
        elif mode.is_target_verify():
            spec = forward_batch.spec_info
            n = spec.draft_token_num
            ext = torch.full_like(forward_batch.seq_lens, n)
            mask = getattr(spec, "custom_mask", None)
            if mask is not None and mask.numel() == 0:
                mask = None
            self.layout = extend_layout(
                req_to_token,
                forward_batch.req_pool_indices,
                forward_batch.seq_lens,
                ext,
                forward_batch.out_cache_loc,
                mask,
            )
        else:  # extend, mixed, draft extend
            ext = forward_batch.extend_seq_lens
            if ext is None:
                raise NotImplementedError(f"spex_cpu attention backend: forward mode {mode} without extend_seq_lens")
            prefix = forward_batch.extend_prefix_lens
            if prefix is None:
                prefix = forward_batch.seq_lens - ext
            self.layout = extend_layout(
                req_to_token, forward_batch.req_pool_indices, prefix, ext, forward_batch.out_cache_loc
            )

    # ---- forward --------------------------------------------------------------------------------------
    def _attend(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache: bool):
        _check_layer(layer)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = q.new_empty((q_.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        if q_.shape[0] == 0 or self.layout is None:
            return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)
        paged_attention(
            q_,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.layout,
            layer.scaling,
            out=o,
        )
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_extend(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache=True):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache=True):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def support_triton(self) -> bool:
        return False
