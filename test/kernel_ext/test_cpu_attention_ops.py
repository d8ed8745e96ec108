"""The batched attention kernels of the ``spex_cpu`` backend against a per-request float32 reference."""

from __future__ import annotations

from typing import List, Optional

import pytest
import torch

from sgl_kernel_ext.attention.kernels import decode_layout, extend_layout, paged_attention

H, HKV, D, SLOTS = 6, 2, 16, 512


def _pool(seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(SLOTS, HKV, D, generator=g)
    v = torch.randn(SLOTS, HKV, D, generator=g)
    return k, v, g


def _ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Q, H, D], k/v [S, HKV, D], allowed [Q, S] -> [Q, H, D] in float32 (plain softmax)."""
    rep = H // HKV
    kk = k.repeat_interleave(rep, 1).permute(1, 2, 0)  # [H, D, S]
    vv = v.repeat_interleave(rep, 1).transpose(0, 1)  # [H, S, D]
    s = torch.einsum("qhd,hds->hqs", q, kk) * scale
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqs,hsd->qhd", s.softmax(-1), vv)


def _table(g, bs: int, width: int) -> torch.Tensor:
    return torch.stack([torch.randperm(SLOTS - 1, generator=g)[:width] + 1 for _ in range(bs)])


def test_decode_matches_reference():
    k, v, g = _pool(0)
    seq = torch.tensor([1, 7, 33, 120, 64])
    table = _table(g, 8, 130)
    rpi = torch.tensor([3, 0, 7, 5, 1])
    q = torch.randn(5, H, D, generator=g)
    out = paged_attention(q, k, v, decode_layout(table, rpi, seq), D**-0.5)
    for i in range(5):
        slots = table[rpi[i], : seq[i]]
        ref = _ref(q[i : i + 1], k[slots], v[slots], torch.ones(1, int(seq[i]), dtype=torch.bool), D**-0.5)
        torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)


def _extend_case(
    prefix: List[int], ext: List[int], tree: Optional[List[torch.Tensor]], seed: int, qlen_only: bool = False
):
    k, v, g = _pool(seed)
    bs = len(prefix)
    table = _table(g, bs + 2, max(p + e for p, e in zip(prefix, ext)) + 4)
    rpi = torch.randperm(bs + 2, generator=g)[:bs]
    # new tokens live at fresh slots given by out_cache_loc (the table holds them too, as SGLang does)
    loc = torch.cat([table[rpi[i], prefix[i] : prefix[i] + ext[i]] for i in range(bs)])
    q = torch.randn(sum(ext), H, D, generator=g)
    if tree is None:
        flat_mask = None
    else:
        flat_mask = torch.cat([(m[:, p:] if qlen_only else m).reshape(-1) for m, p in zip(tree, prefix)])
    layout = extend_layout(table, rpi, torch.tensor(prefix), torch.tensor(ext), loc, flat_mask)
    out = paged_attention(q, k, v, layout, D**-0.5)
    start = 0
    for i in range(bs):
        s = prefix[i] + ext[i]
        slots = table[rpi[i], :s]
        if tree is None:
            allowed = torch.arange(s)[None, :] <= prefix[i] + torch.arange(ext[i])[:, None]
        else:
            allowed = tree[i]
        ref = _ref(q[start : start + ext[i]], k[slots], v[slots], allowed, D**-0.5)
        torch.testing.assert_close(out[start : start + ext[i]], ref, atol=1e-5, rtol=1e-5)
        start += ext[i]


@pytest.mark.parametrize(
    "prefix,ext",
    [([0], [9]), ([0, 5, 40], [3, 1, 17]), ([12, 0, 3, 70], [1, 1, 1, 1]), ([30, 2], [25, 40])],
)
def test_extend_with_prefix_matches_reference(prefix, ext):
    _extend_case(prefix, ext, None, seed=len(prefix))


@pytest.mark.parametrize("qlen_only", [False, True])
def test_tree_mask_verify_matches_reference(qlen_only):
    g = torch.Generator().manual_seed(5)
    prefix, n = [4, 19, 11], 5
    tree = []
    for p in prefix:
        m = torch.zeros(n, p + n, dtype=torch.bool)
        m[:, :p] = True
        parent = [-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, n)]
        for j in range(n):  # each draft token sees itself and its ancestors
            a = j
            while a >= 0:
                m[j, p + a] = True
                a = parent[a]
        tree.append(m)
    _extend_case(prefix, [n] * 3, tree, seed=9, qlen_only=qlen_only)


def test_bf16_close_to_reference():
    k, v, g = _pool(3)
    k, v = k.bfloat16(), v.bfloat16()
    seq = torch.tensor([50, 3])
    table = _table(g, 2, 60)
    rpi = torch.tensor([1, 0])
    q = torch.randn(2, H, D, generator=g).bfloat16()
    out = paged_attention(q, k, v, decode_layout(table, rpi, seq), D**-0.5)
    assert out.dtype == torch.bfloat16
    for i in range(2):
        slots = table[rpi[i], : seq[i]]
        ref = _ref(
            q[i : i + 1].float(),
            k[slots].float(),
            v[slots].float(),
            torch.ones(1, int(seq[i]), dtype=torch.bool),
            D**-0.5,
        )
        torch.testing.assert_close(out[i : i + 1].float(), ref, atol=2e-2, rtol=2e-2)


def test_draft_decode_layouts_follow_each_branch():
    from sgl_kernel_ext.attention.draft import draft_decode_layouts

    k, v, g = _pool(4)
    topk, steps = 2, 4
    seq = torch.tensor([6, 2, 9])
    table = _table(g, 4, 20)
    rpi = torch.tensor([1, 3, 0])
    out = torch.randperm(SLOTS - 1, generator=g)[: 3 * topk * steps] + 1  # [B, topk, steps] flattened
    layouts = draft_decode_layouts(table, rpi, seq, out, topk, steps)
    assert len(layouts) == steps - 1
    slots3 = out.view(3, topk, steps)
    for i, layout in enumerate(layouts):
        q = torch.randn(3 * topk, H, D, generator=g)
        got = paged_attention(q, k, v, layout, D**-0.5)
        for b in range(3):
            for j in range(topk):
                kv = torch.cat([table[rpi[b], : seq[b]], slots3[b, j, : i + 1]])
                row = b * topk + j
                ref = _ref(q[row : row + 1], k[kv], v[kv], torch.ones(1, kv.numel(), dtype=torch.bool), D**-0.5)
                torch.testing.assert_close(got[row : row + 1], ref, atol=1e-5, rtol=1e-5)
