"""sgl_kernel speculative CPU ops (torch, batched) against plain-Python per-request references."""

from __future__ import annotations

import random

import pytest
import torch

from sgl_kernel_ext import spec_ops


def _random_tree(rng: random.Random, n: int):
    """parents[i] < i (node 0 is the root); returns parents and the [n, n] self+ancestor mask."""
    parents = [-1] + [rng.randrange(0, i) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        a = i
        while a >= 0:
            mask[i, a] = True
            a = parents[a]
    return parents, mask


def test_assign_extend_cache_locs_and_req_to_token():
    table = torch.arange(5 * 40, dtype=torch.int32).view(5, 40)
    rpi = torch.tensor([3, 0, 4])
    start, end = torch.tensor([2, 10, 0]), torch.tensor([6, 11, 3])
    out = torch.full((8,), -1, dtype=torch.int64)
    spec_ops.assign_extend_cache_locs_cpu(rpi, table, start, end, out, 40)
    ref = torch.cat([table[r, s:e] for r, s, e in zip(rpi.tolist(), start.tolist(), end.tolist())]).long()
    assert torch.equal(out, ref)
    locs = torch.arange(100, 108)
    t2 = table.clone()
    spec_ops.assign_req_to_token_pool_cpu(rpi, t2, start, end, locs, 40)
    ref2, k = table.clone(), 0
    for r, s, e in zip(rpi.tolist(), start.tolist(), end.tolist()):
        ref2[r, s:e] = locs[k : k + e - s].int()
        k += e - s
    assert torch.equal(t2, ref2)


def test_reconstruct_indices_from_tree_mask():
    rng = random.Random(0)
    bs, n = 4, 6
    trees = [_random_tree(rng, n) for _ in range(bs)]
    mask = torch.stack([m for _, m in trees]).reshape(-1)
    seq = torch.tensor([5, 0, 17, 3])
    pos = torch.zeros(bs * n, dtype=torch.int64)
    ri, nt, ns = (torch.zeros(bs, n, dtype=torch.int64) for _ in range(3))
    spec_ops.reconstruct_indices_from_tree_mask(mask, seq, pos, ri, nt, ns, bs, n)
    for b, (parents, m) in enumerate(trees):
        for i in range(n):
            anc = [j for j in range(i) if m[i, j]]
            assert pos[b * n + i] == len(anc) + seq[b]
            assert ri[b, i] == b * n + i
            kids = [k for k in range(i + 1, n) if m[k, i]]
            assert nt[b, i] == (kids[0] if kids else -1)
            sibs = [k for k in range(i + 1, n) if parents[k] == parents[i]] if parents[i] >= 0 else []
            assert ns[b, i] == (sibs[0] if sibs else -1)


def _verify_ref(candidates, ri, nt, ns, target, num_spec):
    bs, n = candidates.shape
    predicts = torch.zeros(bs * n, dtype=torch.int64)
    acc = torch.full((bs, num_spec), -1, dtype=torch.int64)
    num = torch.zeros(bs, dtype=torch.int64)
    for b in range(bs):
        last = int(ri[b, 0])
        acc[b, 0] = last
        cur = 0
        for _ in range(1, num_spec):
            cur = int(nt[b, cur])
            while cur != -1:
                if int(candidates[b, cur]) == int(target[last]):
                    predicts[last] = target[last]
                    num[b] += 1
                    acc[b, num[b]] = ri[b, cur]
                    last = int(ri[b, cur])
                    break
                cur = int(ns[b, cur])
            if cur == -1:
                break
        predicts[last] = target[last]
    return predicts, acc, num


def test_verify_tree_greedy_matches_reference():
    rng = random.Random(1)
    bs, n, num_spec, vocab = 5, 7, 4, 3  # tiny vocab: many matches
    trees = [_random_tree(rng, n) for _ in range(bs)]
    mask = torch.stack([m for _, m in trees]).reshape(-1)
    ri, nt, ns = (torch.zeros(bs, n, dtype=torch.int64) for _ in range(3))
    spec_ops.reconstruct_indices_from_tree_mask(mask, torch.zeros(bs), torch.zeros(bs * n), ri, nt, ns, bs, n)
    g = torch.Generator().manual_seed(2)
    candidates = torch.randint(0, vocab, (bs, n), generator=g)
    target = torch.randint(0, vocab, (bs * n,), generator=g)
    predicts = torch.zeros(bs * n, dtype=torch.int64)
    acc = torch.full((bs, num_spec), -1, dtype=torch.int64)
    num = torch.zeros(bs, dtype=torch.int64)
    spec_ops.verify_tree_greedy_cpu(predicts, acc, num, candidates, ri, nt, ns, target.view(bs, n))
    rp, ra, rn = _verify_ref(candidates, ri, nt, ns, target, num_spec)
    assert torch.equal(num, rn) and torch.equal(acc, ra) and torch.equal(predicts, rp)
    assert int(num.sum()) > 0


def test_copy_all_layer_kv_cache():
    bufs = [torch.randn(20, 2, 4) for _ in range(3)] + [torch.randn(20, 8).bfloat16()]
    ref = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)
    tgt, src = torch.tensor([3, 7, 19]), torch.tensor([10, 11, 0])
    spec_ops.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, r in zip(bufs, ref):
        r[tgt] = r[src]
        assert torch.equal(b, r)


def test_served_by_standin():
    import sgl_kernel
    from sgl_kernel.speculative import reconstruct_indices_from_tree_mask

    assert sgl_kernel.verify_tree_greedy_cpu is spec_ops.verify_tree_greedy_cpu
    assert reconstruct_indices_from_tree_mask is spec_ops.reconstruct_indices_from_tree_mask


def test_fill_accept_out_cache_loc_and_bonus_tokens():
    accept_index = torch.tensor([[0, 2, -1], [3, -1, -1], [6, 7, 8]])
    out_cache_loc = torch.arange(100, 109)
    got = torch.zeros(6, dtype=torch.int64)
    spec_ops.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, got)
    assert got.tolist() == [100, 102, 103, 106, 107, 108]
    tokens = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    bonus = torch.zeros(3, dtype=torch.int64)
    spec_ops.fill_bonus_tokens_cpu(tokens, torch.tensor([2, 1, 3]), bonus, 3)
    assert bonus.tolist() == [6, 8, 13]


def test_assign_draft_cache_locs_contiguous():
    table = torch.arange(4 * 30, dtype=torch.int32).view(4, 30)
    rpi, seq = torch.tensor([2, 0]), torch.tensor([5, 11])
    out = torch.zeros(2 * 2 * 3, dtype=torch.int64)
    spec_ops.assign_draft_cache_locs_contiguous_cpu(rpi, table, seq, out, 30, 2, 3)
    assert out.tolist() == table[2, 5:11].tolist() + table[0, 11:17].tolist()


def _build_tree_ref(parent_list, sel, seq, topk, depth, n, full):
    """Per-request transcription of SGLang's build_tree kernel (Python loops)."""
    bs = sel.shape[0]
    pre = torch.cumsum(seq, 0) - seq
    size = int((seq * n).sum()) + n * n * bs if full else n * n * bs
    mask = torch.ones(size, dtype=torch.bool)
    pos = torch.zeros(bs * n, dtype=torch.int64)
    ri, nt, ns = (torch.full((bs, n), -1, dtype=torch.int64) for _ in range(3))
    for b in range(bs):
        s = int(seq[b])
        pos[b * n] = s
        for i in range(n - 1, 0, -1):
            ri[b, i] = b * n + i
            ptb = int(sel[b, i - 1]) // topk
            pp, found = 0, ptb == 0
            if not found:
                ptok = int(parent_list[b, ptb])
                for q in range(n - 1):
                    if int(sel[b, q]) == ptok:
                        pp, found = q + 1, True
                        break
            if found:
                old = int(nt[b, pp])
                nt[b, pp] = i
                if old != -1:
                    ns[b, i] = old
        ri[b, 0] = b * n
        for x in range(n):
            start = (n * n * b + int(pre[b]) * n + (s + n) * x + s) if full else n * n * b + n * x
            mask[start] = True
            mask[start + 1 : start + n] = False
            position = 0
            if x > 0:
                cur = x - 1
                for _ in range(depth):
                    position += 1
                    mask[start + 1 + cur] = True
                    ptb = int(sel[b, cur]) // topk
                    if ptb == 0:
                        break
                    ptok = int(parent_list[b, ptb])
                    nxt = [q for q in range(n - 1) if int(sel[b, q]) == ptok]
                    if not nxt:
                        break
                    cur = nxt[0]
            pos[b * n + x] = position + s
    return mask, pos, ri, nt, ns


def _draft_tree(rng: random.Random, topk: int, depth: int, n: int):
    """A plausible EAGLE selection: parent_list entries and top-scored indices into the topk-expanded levels."""
    width = topk + (depth - 1) * topk * topk
    parent_list = torch.tensor([-1] + list(range(topk)) + [topk + k for k in range((depth - 2) * topk)])
    sel = sorted(rng.sample(range(width), n - 1))
    return parent_list, torch.tensor(sel)


@pytest.mark.parametrize("topk, depth, n", [(2, 3, 5), (1, 4, 5), (4, 4, 16), (8, 5, 48)])
@pytest.mark.parametrize("full", [False, True])
def test_build_tree_kernel_efficient_matches_reference(full, topk, depth, n):
    rng = random.Random(3 + n)
    bs = 3
    trees = [_draft_tree(rng, topk, depth, n) for _ in range(bs)]
    parent_list = torch.stack([p for p, _ in trees])
    sel = torch.stack([s for _, s in trees])
    seq = torch.tensor([4, 9, 1])
    rm, rp, rri, rnt, rns = _build_tree_ref(parent_list, sel, seq, topk, depth, n, full)
    mask = torch.ones_like(rm)
    pos = torch.zeros(bs * n, dtype=torch.int64)
    ri, nt, ns = (torch.full((bs, n), -1, dtype=torch.int64) for _ in range(3))
    spec_ops.build_tree_kernel_efficient_cpu(
        parent_list, sel, seq, mask, pos, ri, nt, ns, topk, depth, n, 0 if full else 1
    )
    assert torch.equal(pos, rp) and torch.equal(ri, rri) and torch.equal(nt, rnt) and torch.equal(ns, rns)
    assert torch.equal(mask, rm)
