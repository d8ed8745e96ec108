"""Batched paged attention in plain torch: one SDPA call per layer for the whole batch.

Requests are padded to the longest query and the longest KV length of the batch; a boolean mask
(``[B, Q, S]``) says which KV slot each query row may see. KV is gathered from SGLang's token pool
through an index table ``kv_idx[B, S]`` built once per forward pass and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.functional import scaled_dot_product_attention


@dataclass
class BatchLayout:
    """Per-forward layout shared by every layer.

    kv_idx: [B, S] token-pool slots (padding points at slot 0, masked out).
    mask: [B, 1, Q, S] bool, True = may attend.
    q_rows: [N] flat query token -> row of the padded ``[B * Q]`` query (None when Q == 1 and rows are 1:1).
    """

    kv_idx: torch.Tensor
    mask: torch.Tensor
    q_len: int
    q_rows: Optional[torch.Tensor]

    @property
    def bias(self) -> torch.Tensor:
        """The mask as an additive float32 ``[B, 1, 1, Q, S]`` bias (0 / -inf), built once per forward."""
        cached = self.__dict__.get("_bias")
        if cached is None:
            m = self.mask  # [B, 1, Q, S]
            cached = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill_(~m, float("-inf"))
            cached = cached.unsqueeze(2)
            self.__dict__["_bias"] = cached
        return cached


def _arange(n: int, device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=device)


def decode_layout(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> BatchLayout:
    """One query per request, attending to its first ``seq_lens[i]`` tokens (the new one included)."""
    seq_lens = seq_lens.to(torch.int64)
    s_max = max(int(seq_lens.max()), 1)
    valid = _arange(s_max, seq_lens.device)[None, :] < seq_lens[:, None]
    kv_idx = req_to_token[req_pool_indices.to(torch.int64), :s_max].to(torch.int64)
    kv_idx = torch.where(valid, kv_idx, 0)
    return BatchLayout(kv_idx, valid[:, None, None, :], 1, None)


def extend_layout(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    tree_mask: Optional[torch.Tensor] = None,
) -> BatchLayout:
    """Requests extending a cached prefix by ``extend_lens[i]`` new tokens (flat in ``out_cache_loc``).

    KV of the prefix comes from ``req_to_token``, KV of the new tokens from ``out_cache_loc``. Without
    ``tree_mask`` the new tokens are causal; with it (speculative verify) ``tree_mask`` is SGLang's
    flattened per-request boolean mask, concatenated over requests: ``[E_i, P_i + E_i]`` (FULL_MASK) or
    ``[E_i, E_i]`` over the new tokens only, the prefix fully visible (QLEN_ONLY, what SGLang builds on CPU).
    """
    dev = prefix_lens.device
    prefix = prefix_lens.to(torch.int64)
    ext = extend_lens.to(torch.int64)
    seq = prefix + ext
    bs = prefix.shape[0]
    q_max = max(int(ext.max()), 1)
    s_max = max(int(seq.max()), 1)
    cols = _arange(s_max, dev)[None, :]
    # KV slots: prefix from the request's row, new tokens from out_cache_loc (flat, request-major).
    ext_start = torch.cumsum(ext, 0) - ext
    rows = req_to_token[req_pool_indices.to(torch.int64), :s_max].to(torch.int64)
    new_pos = (ext_start[:, None] + cols - prefix[:, None]).clamp(0, max(out_cache_loc.numel() - 1, 0))
    is_new = (cols >= prefix[:, None]) & (cols < seq[:, None])
    kv_idx = torch.where(is_new, out_cache_loc.to(torch.int64)[new_pos], rows)
    kv_idx = torch.where(cols < seq[:, None], kv_idx, 0)
    # Mask [B, Q, S].
    r = _arange(q_max, dev)[None, :, None]
    c = cols[:, None, :]
    p3, s3, e3 = prefix[:, None, None], seq[:, None, None], ext[:, None, None]
    if tree_mask is None:
        mask = c <= p3 + r
    else:
        tree = tree_mask.reshape(-1).to(torch.bool)
        qlen_only = tree.numel() != int((ext * seq).sum())
        if not qlen_only:  # FULL_MASK: rows are P_i + E_i wide
            row_len, col, width = ext * seq, c, s3
        elif tree.numel() == int((ext * ext).sum()):  # QLEN_ONLY (SGLang's CPU layout): rows are E_i wide
            row_len, col, width = ext * ext, (c - p3).clamp(min=0), e3
        else:
            raise ValueError(f"tree mask of {tree.numel()} elements fits neither full nor qlen-only layout")
        start = (torch.cumsum(row_len, 0) - row_len)[:, None, None]
        flat = (start + r * width + col).clamp(0, max(tree.numel() - 1, 0))
        mask = tree[flat] & (c < s3)
        if qlen_only:
            mask = mask | (c < p3)
    mask = mask & (c < s3)
    real_row = r < e3
    mask = torch.where(real_row, mask, c == 0)  # padded rows see slot 0 only (no NaN; discarded)
    q_rows = (_arange(bs, dev)[:, None] * q_max + _arange(q_max, dev)[None, :])[
        (_arange(q_max, dev)[None, :] < ext[:, None])
    ]
    return BatchLayout(kv_idx, mask[:, None], q_max, q_rows)


# Up to this many query rows per request the explicit float32 math beats torch's CPU SDPA (which is slow for
# many short queries: ~10x at decode with batch 16); above it (prefill) SDPA's flash kernel wins.
SMALL_Q = 16


def _gather_f32(cache: torch.Tensor, flat_idx: torch.Tensor, bs: int, s_max: int) -> torch.Tensor:
    """cache[flat_idx] as float32 ``[B, Hkv, S, D]``: a contiguous row gather, then one cast-and-permute copy."""
    rows = cache.index_select(0, flat_idx).view(bs, s_max, cache.shape[1], cache.shape[2])
    out = torch.empty((bs, cache.shape[1], s_max, cache.shape[2]), dtype=torch.float32, device=cache.device)
    return out.copy_(rows.transpose(1, 2))


def _small_q_attention(
    qp: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: BatchLayout, scale: float
) -> torch.Tensor:
    """qp [B, Q, H, D] -> [B, Q, H, Dv]; float32 scores and softmax, batched over (request, kv head)."""
    bs, q_len, h, d = qp.shape
    hkv = k_cache.shape[1]
    g = h // hkv
    s_max = layout.kv_idx.shape[1]
    flat_idx = layout.kv_idx.reshape(-1)
    k = _gather_f32(k_cache, flat_idx, bs, s_max)
    v = _gather_f32(v_cache, flat_idx, bs, s_max)
    qf = torch.empty((bs, hkv, g, q_len, d), dtype=torch.float32, device=qp.device)
    qf.copy_(qp.view(bs, q_len, hkv, g, d).permute(0, 2, 3, 1, 4))
    s = torch.matmul(qf.view(bs, hkv, g * q_len, d), k.transpose(-1, -2))  # [B, Hkv, G*Q, S]
    s.view(bs, hkv, g, q_len, s_max).mul_(scale).add_(layout.bias)
    # As torch's CPU flash kernel does for reduced types: exp in float32, probabilities rounded to the
    # input dtype for the PV product, normalised by the float32 sum afterwards.
    e = torch.exp(s - s.amax(dim=-1, keepdim=True))
    denom = e.sum(dim=-1, keepdim=True)
    if qp.dtype != torch.float32:
        e = e.to(qp.dtype).float()
    o = torch.matmul(e, v).div_(denom)  # [B, Hkv, G*Q, Dv]
    out = torch.empty((bs, q_len, h, v.shape[-1]), dtype=qp.dtype, device=qp.device)
    out.view(bs, q_len, hkv, g, -1).copy_(o.view(bs, hkv, g, q_len, -1).permute(0, 3, 1, 2, 4))
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: BatchLayout,
    scale: Optional[float],
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q: [N, H, D] flat query tokens; k/v_cache: [slots, Hkv, D(v)]. Returns [N, H, Dv]."""
    bs, s_max = layout.kv_idx.shape
    n, h, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    scale = d**-0.5 if scale is None else scale
    if layout.q_rows is None:
        qp = q.view(bs, 1, h, d)
    else:
        qp = q.new_zeros(bs * layout.q_len, h, d)
        qp[layout.q_rows] = q
        qp = qp.view(bs, layout.q_len, h, d)
    if layout.q_len <= SMALL_Q:
        o = _small_q_attention(qp, k_cache, v_cache, layout, scale)
    else:
        flat_idx = layout.kv_idx.reshape(-1)
        k = k_cache.index_select(0, flat_idx).view(bs, s_max, hkv, d)
        v = v_cache.index_select(0, flat_idx).view(bs, s_max, hkv, dv)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        o = scaled_dot_product_attention(
            qp.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=layout.mask,
            scale=scale,
            enable_gqa=h != hkv,
        ).transpose(1, 2)
    o = o.reshape(bs * layout.q_len, h, dv)
    if layout.q_rows is not None:
        o = o[layout.q_rows]
    if out is None:
        return o
    out.copy_(o)
    return out
