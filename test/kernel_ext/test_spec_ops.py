"""sgl_kernel speculative CPU ops (torch, batched) against plain-Python per-request references."""

from __future__ import annotations

import random

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
