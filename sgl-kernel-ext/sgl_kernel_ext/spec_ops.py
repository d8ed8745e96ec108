"""Torch implementations of the ``sgl_kernel`` CPU ops SGLang's speculative paths call (NGRAM, EAGLE, STANDALONE).

Each mirrors the contract of the C++/CUDA op of the same name (in-place outputs where SGLang passes them),
vectorised over the batch; loops run only over tree depth / siblings, never over requests.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Dict

import torch


def _ranges(start: torch.Tensor, end: torch.Tensor):
    """(row, column) pairs of the concatenated ranges [start[b], end[b]) in request order."""
    start = start.to(torch.int64)
    lens = (end.to(torch.int64) - start).clamp(min=0)
    rows = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    first = torch.cumsum(lens, 0) - lens
    cols = torch.arange(int(lens.sum()), device=lens.device) - first[rows] + start[rows]
    return rows, cols


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """out_cache_loc = concat_b req_to_token[req_pool_indices[b], start[b]:end[b]]."""
    rows, cols = _ranges(start_offset, end_offset)
    vals = req_to_token[req_pool_indices.to(torch.int64)[rows], cols]
    out_cache_loc[: vals.numel()] = vals.to(out_cache_loc.dtype)


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """req_to_token[req_pool_indices[b], start[b]:end[b]] = the b-th run of out_cache_loc."""
    rows, cols = _ranges(start_offset, end_offset)
    req_to_token[req_pool_indices.to(torch.int64)[rows], cols] = out_cache_loc[: rows.numel()].to(req_to_token.dtype)


def reconstruct_indices_from_tree_mask(
    tree_mask, verified_seq_len, positions, retrieve_index, retrieve_next_token, retrieve_next_sibling, batch_size, n
):
    """NGRAM verify metadata from a per-request [n, n] ancestor mask (see SGLang's reconstruct_tree.py contract)."""
    bs = int(batch_size)
    dev = verified_seq_len.device
    m = tree_mask.reshape(-1)[: bs * n * n].view(bs, n, n).to(torch.bool)
    idx = torch.arange(n, device=dev)
    anc = m & (idx[None, None, :] < idx[None, :, None])  # anc[b, i, j]: j is a strict ancestor of i
    pos = anc.sum(-1) + verified_seq_len.to(torch.int64)[:, None]
    positions.view(-1)[: bs * n] = pos.reshape(-1).to(positions.dtype)
    ri = torch.arange(bs, device=dev)[:, None] * n + idx[None, :]
    retrieve_index.view(-1)[: bs * n] = ri.reshape(-1).to(retrieve_index.dtype)
    big = torch.full((), n, device=dev, dtype=torch.int64)
    parent = torch.where(anc, idx[None, None, :], -1).amax(-1)  # [b, i]
    # first child: min k > i with anc[b, k, i]
    desc = anc.transpose(1, 2)  # desc[b, i, k] = i is an ancestor of k
    child = torch.where(desc, idx[None, None, :], big).amin(-1)
    child = torch.where(child >= n, -1, child)
    later = idx[None, None, :] > idx[None, :, None]
    same = (parent[:, :, None] == parent[:, None, :]) & later
    sib = torch.where(same, idx[None, None, :], big).amin(-1)
    sib = torch.where((sib >= n) | (parent < 0), -1, sib)
    retrieve_next_token.view(-1)[: bs * n] = child.reshape(-1).to(retrieve_next_token.dtype)
    retrieve_next_sibling.view(-1)[: bs * n] = sib.reshape(-1).to(retrieve_next_sibling.dtype)


def verify_tree_greedy_cpu(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
):
    """Greedy tree verification: walk each request's draft tree, accepting the child equal to the target's token."""
    bs, n = candidates.shape
    num_spec = accept_index.shape[1]
    dev = candidates.device
    rows = torch.arange(bs, device=dev)
    ri = retrive_index.reshape(bs, n).to(torch.int64)
    nxt = retrive_next_token.reshape(bs, n).to(torch.int64)
    sib = retrive_next_sibling.reshape(bs, n).to(torch.int64)
    cand = candidates.to(torch.int64)
    tgt = target_predict.reshape(-1).to(torch.int64)
    last = ri[:, 0].clone()
    accept_index[:, 0] = last.to(accept_index.dtype)
    num = torch.zeros(bs, dtype=torch.int64, device=dev)
    cur = torch.zeros(bs, dtype=torch.int64, device=dev)
    alive = torch.ones(bs, dtype=torch.bool, device=dev)
    for _ in range(1, num_spec):
        cur = torch.where(alive, nxt[rows, cur.clamp(min=0)], cur)
        target = tgt[last]
        found = torch.zeros(bs, dtype=torch.bool, device=dev)
        for _ in range(n):  # sibling search, all requests at once
            searching = alive & ~found & (cur >= 0)
            if not bool(searching.any()):
                break
            safe = cur.clamp(min=0)
            hit = searching & (cand[rows, safe] == target)
            draft = ri[rows, safe]
            predicts.view(-1)[last[hit]] = target[hit].to(predicts.dtype)
            num = num + hit.to(torch.int64)
            accept_index[rows[hit], num[hit]] = draft[hit].to(accept_index.dtype)
            last = torch.where(hit, draft, last)
            found |= hit
            cur = torch.where(searching & ~hit, sib[rows, safe], cur)
        alive &= found
        if not bool(alive.any()):
            break
    accept_token_num.view(-1)[:bs] = num.to(accept_token_num.dtype)
    predicts.view(-1)[last] = tgt[last].to(predicts.dtype)


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Compact the cache slots of accepted draft tokens: out[k] = out_cache_loc[k-th index != -1]."""
    idx = accept_index.reshape(-1).to(torch.int64)
    src = idx[idx != -1]
    accept_out_cache_loc[: src.numel()] = out_cache_loc[src].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus[b] = the last accepted token of request b (``accept_lens`` includes the bonus token)."""
    bs = accept_lens.numel()
    pos = torch.arange(bs, device=accept_lens.device) * int(accept_stride) + accept_lens.to(torch.int64) - 1
    bonus_tokens[:bs] = accept_tokens.reshape(-1)[pos].to(bonus_tokens.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_cols
):
    """out_cache_loc[b] = req_to_token[req_pool_indices[b], seq_lens[b] : seq_lens[b] + topk * num_cols]."""
    width = int(topk) * int(num_cols)
    start = seq_lens.to(torch.int64)
    assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start, start + width, out_cache_loc, pool_len)


def build_tree_kernel_efficient_cpu(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrieve_index,
    retrieve_next_token,
    retrieve_next_sibling,
    topk,
    depth,
    draft_token_num,
    tree_mask_mode,
):
    """EAGLE verify tree from the draft's top-k selection (contract of SGLang's build_tree_kernel_efficient).

    Draft node i > 0 is selected entry i-1; its parent is the root when ``selected_index // topk == 0``, else the
    selected entry equal to ``parent_list[b, selected_index // topk]``. Writes positions, retrieve_* links and
    each node's ancestor row of the tree mask (QLEN_ONLY = 1, or FULL_MASK = 0 with the prefix left as given).
    """
    n = int(draft_token_num)
    sel = selected_index.to(torch.int64)
    bs = sel.shape[0]
    dev = sel.device
    rows = torch.arange(bs, device=dev)
    seq = verified_seq_len.to(torch.int64)
    plist = parent_list.to(torch.int64).reshape(bs, -1)
    # parent of selected entry k: -1 = root, -2 = not found, else the selected entry index
    ptb = sel[:, : n - 1] // int(topk)
    ptok = plist.gather(1, ptb.clamp(max=max(plist.shape[1] - 1, 0))) if plist.shape[1] else torch.zeros_like(ptb)
    match = sel[:, None, : n - 1] == ptok[:, :, None]  # [b, k, cp]
    first = torch.where(match.any(-1), match.to(torch.int8).argmax(-1), -2)
    par = torch.where(ptb == 0, -1, first)  # [b, n-1]
    # retrieve links as the kernel inserts children (from the last node down): a parent's next_token is its first
    # child, a child's next_sibling the next child of the same parent (a node whose parent was not found: no link)
    ri = rows[:, None] * n + torch.arange(n, device=dev)[None, :]
    retrieve_index.view(bs, n).copy_(ri.to(retrieve_index.dtype))
    nt = retrieve_next_token.view(bs, n)
    ns = retrieve_next_sibling.view(bs, n)
    found = par != -2  # [b, n-1], node i = entry i - 1
    at = torch.where(par == -1, 0, par + 1)  # the parent's node
    node = torch.arange(1, n, device=dev)
    none = torch.full_like(at, n)
    same = (at[:, :, None] == at[:, None, :]) & found[:, :, None] & found[:, None, :]
    later = torch.where(same & (node[None, None, :] > node[None, :, None]), node[None, None, :], n).min(-1).values
    link = later < n
    ns[:, 1:][link] = later[link].to(ns.dtype)
    child = torch.where(found, node[None, :], none)
    first = torch.full((bs, n), n, dtype=torch.int64, device=dev).scatter_reduce_(
        1, torch.where(found, at, 0), child, reduce="amin"
    )
    has = first < n
    nt[has] = first[has].to(nt.dtype)
    # ancestor rows and depths: every node walks up its parents at once, one level per step
    m = torch.zeros(bs, n, n, dtype=torch.bool, device=dev)
    m[:, :, 0] = True
    depth_of = torch.zeros(bs, n, dtype=torch.int64, device=dev)
    cur = node[None, :].expand(bs, n - 1) - 1  # entry index of each node x = 1 .. n-1
    cont = torch.ones(bs, n - 1, dtype=torch.bool, device=dev)
    b_idx = rows[:, None].expand(bs, n - 1)
    x_idx = node[None, :].expand(bs, n - 1)
    for _ in range(int(depth)):
        if not bool(cont.any()):
            break
        depth_of[:, 1:] += cont.to(torch.int64)
        m[b_idx[cont], x_idx[cont], cur[cont] + 1] = True
        nxt = par.gather(1, cur.clamp(min=0))
        cont = cont & (nxt >= 0)
        cur = torch.where(cont, nxt, cur)
    positions.view(-1)[: bs * n] = (depth_of + seq[:, None]).reshape(-1).to(positions.dtype)
    x = torch.arange(n, device=dev)[None, :, None]
    c = torch.arange(n, device=dev)[None, None, :]
    if int(tree_mask_mode) == 0:  # FULL_MASK: rows are seq + n wide, after the previous requests' rows
        pre = torch.cumsum(seq, 0) - seq
        start = (rows * n * n + pre * n)[:, None, None] + (seq[:, None, None] + n) * x + seq[:, None, None]
    else:  # QLEN_ONLY
        start = (rows * n * n)[:, None, None] + n * x
    tree_mask.view(-1)[(start + c).reshape(-1)] = m.reshape(-1).to(tree_mask.dtype)


def _raw_rows(ptr: int, stride: int, rows: int) -> torch.Tensor:
    """A [rows, stride] uint8 view of memory SGLang owns (a KV buffer addressed by its data pointer)."""
    buf = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(rows, stride)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every buffer (all layers' K and V): row tgt_loc[i] = row src_loc[i] (byte rows of ``strides[j]``)."""
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        view = _raw_rows(int(ptr), int(stride), rows)
        view[tgt] = view[src]


IMPLEMENTED: Dict[str, Callable[..., Any]] = {
    "sgl_kernel.assign_extend_cache_locs_cpu": assign_extend_cache_locs_cpu,
    "sgl_kernel.assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "sgl_kernel.speculative.reconstruct_indices_from_tree_mask": reconstruct_indices_from_tree_mask,
    "sgl_kernel.verify_tree_greedy_cpu": verify_tree_greedy_cpu,
    "sgl_kernel.copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
    "sgl_kernel.fill_accept_out_cache_loc_cpu": fill_accept_out_cache_loc_cpu,
    "sgl_kernel.fill_bonus_tokens_cpu": fill_bonus_tokens_cpu,
    "sgl_kernel.assign_draft_cache_locs_contiguous_cpu": assign_draft_cache_locs_contiguous_cpu,
    "sgl_kernel.build_tree_kernel_efficient_cpu": build_tree_kernel_efficient_cpu,
}
