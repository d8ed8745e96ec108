"""CPU speculative-sampling ops (``sgl_kernel_ext.spec_sampling``) against a plain per-request reference.

The reference transcribes SGLang's CUDA ``TreeSpeculativeSamplingTargetOnly`` one request at a time in
numpy float32 (accept/reject decisions must match exactly, coin for coin); the distribution tests check
that every committed token follows the target distribution (chi-square, alpha = 1e-3, fixed seeds).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy import stats

from sgl_kernel_ext import spec_ops, spec_sampling

ALPHA = 1e-3


def _tree_links(parents_per_req, n):
    """SGLang's retrive_* tensors for trees given as parent lists (parents[i] < i, node 0 = root)."""
    bs = len(parents_per_req)
    mask = torch.zeros(bs, n, n, dtype=torch.bool)
    for b, parents in enumerate(parents_per_req):
        for i in range(n):
            a = i
            while a >= 0:
                mask[b, i, a] = True
                a = parents[a]
    pos = torch.zeros(bs * n, dtype=torch.int64)
    ri, nt, ns = (torch.zeros(bs, n, dtype=torch.int64) for _ in range(3))
    spec_ops.reconstruct_indices_from_tree_mask(mask.reshape(-1), torch.zeros(bs), pos, ri, nt, ns, bs, n)
    return ri, nt, ns


def _random_case(seed: int, bs: int, n: int, vocab: int, depth: int, peaked: float = 3.0):
    """Random trees with distinct sibling tokens, drafts often equal to likely target tokens."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, n, vocab, generator=g) * peaked
    target = torch.softmax(logits, -1)
    parents_per_req, cand = [], torch.zeros(bs, n, dtype=torch.int64)
    for b in range(bs):
        parents = [-1] + [rng.randrange(0, i) for i in range(1, n)]
        parents_per_req.append(parents)
        cand[b, 0] = rng.randrange(vocab)
        for i in range(1, n):
            taken = {int(cand[b, j]) for j in range(1, i) if parents[j] == parents[i]}
            likely = torch.argsort(target[b, parents[i]], descending=True).tolist()
            pool = [t for t in (likely[:4] if rng.random() < 0.7 else range(vocab)) if t not in taken]
            pool = pool or [t for t in range(vocab) if t not in taken]
            cand[b, i] = rng.choice(pool)
    ri, nt, ns = _tree_links(parents_per_req, n)
    coins = torch.rand(bs, n, generator=g)
    final = torch.rand(bs, generator=g)
    return dict(
        cand=cand, ri=ri, nt=nt, ns=ns, coins=coins, final=final, target=target, depth=depth, parents=parents_per_req
    )


def _run_op(case, draft=None, threshold_single=1.0, threshold_acc=1.0):
    bs, n = case["cand"].shape
    predicts = torch.full((bs * n,), -7, dtype=torch.int32)
    accept_index = torch.full((bs, case["depth"]), -1, dtype=torch.int32)
    accept_num = torch.empty(bs, dtype=torch.int32)
    draft = torch.zeros_like(case["target"]) if draft is None else draft
    spec_sampling.tree_speculative_sampling_target_only(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_num,
        candidates=case["cand"],
        retrive_index=case["ri"],
        retrive_next_token=case["nt"],
        retrive_next_sibling=case["ns"],
        uniform_samples=case["coins"],
        uniform_samples_for_final_sampling=case["final"],
        target_probs=case["target"],
        draft_probs=draft,
        threshold_single=threshold_single,
        threshold_acc=threshold_acc,
        deterministic=True,
    )
    return predicts, accept_index, accept_num, draft


def _reference(case, draft=None, threshold_single=1.0, threshold_acc=1.0):
    """Plain transcription of the CUDA kernel, one request at a time (numpy float32 scalars)."""
    cand, ri, nt, ns = (case[k].numpy() for k in ("cand", "ri", "nt", "ns"))
    coins, final = case["coins"].numpy(), case["final"].numpy()
    target = case["target"].numpy()
    draft = np.zeros_like(target) if draft is None else draft.numpy().copy()
    bs, n = cand.shape
    depth, vocab = case["depth"], target.shape[-1]
    predicts = np.full(bs * n, -7, dtype=np.int64)
    accept_index = np.full((bs, depth), -1, dtype=np.int64)
    accept_num = np.zeros(bs, dtype=np.int64)
    t_single, t_acc = np.float32(threshold_single), np.float32(max(threshold_acc, 1e-9))
    for b in range(bs):
        node, last, num, cur = 0, int(ri[b, 0]), 0, 0
        accept_index[b, 0] = last
        prob_acc, coin = np.float32(0.0), coins[b, 0]
        for _ in range(1, depth):
            cur = int(nt[b, cur])
            while cur != -1:
                tok = int(cand[b, cur])
                p = target[b, node, tok]
                prob_acc = np.float32(prob_acc + p)
                if p > 0 and (coin < np.float32(prob_acc / t_acc) or p >= t_single):
                    prob_acc, node, coin = np.float32(0.0), cur, coins[b, cur]
                    predicts[last] = tok
                    num += 1
                    accept_index[b, num] = ri[b, cur]
                    last = int(ri[b, cur])
                    break
                draft[b, node, tok] = p
                cur = int(ns[b, cur])
            if cur == -1:
                break
        accept_num[b] = num
        q = target[b, node].astype(np.float64)
        resid = q if num == depth - 1 else np.maximum(q - draft[b, node], 0.0)
        u, acc, sampled, last_valid = final[b] * resid.sum(), 0.0, vocab, -1
        for i in range(vocab):
            if resid[i] > 0:
                last_valid = i
                acc += resid[i]
                if acc > u:
                    sampled = i
                    break
        predicts[last] = sampled if sampled < vocab else (last_valid if last_valid >= 0 else vocab - 1)
    return predicts, accept_index, accept_num, draft


@pytest.mark.parametrize(
    "seed,bs,n,vocab,depth", [(0, 16, 6, 11, 4), (1, 9, 8, 50, 8), (2, 5, 1, 7, 1), (3, 12, 5, 30, 3)]
)
def test_tree_sampling_matches_reference(seed, bs, n, vocab, depth):
    case = _random_case(seed, bs, n, vocab, depth)
    got = _run_op(case)
    ref = _reference(case)
    assert got[2].tolist() == ref[2].tolist()  # accepted counts
    assert got[1].tolist() == ref[1].tolist()  # accepted tree paths
    assert got[0].tolist() == ref[0].tolist()  # committed tokens, including the resampled one
    assert torch.equal(got[3], torch.from_numpy(ref[3]))  # rejected children recorded in draft_probs
    if depth == 1:  # no draft: only the resampled token
        assert got[2].tolist() == [0] * bs
    else:  # both acceptance and rejection happened
        assert int(got[2].sum()) > 0 and int((got[2] < depth - 1).sum()) > 0


@pytest.mark.parametrize("threshold_single,threshold_acc", [(0.3, 1.0), (1.0, 0.5), (0.2, 0.1)])
def test_tree_sampling_thresholds_match_reference(threshold_single, threshold_acc):
    case = _random_case(4, 16, 6, 11, 4)
    got = _run_op(case, threshold_single=threshold_single, threshold_acc=threshold_acc)
    ref = _reference(case, threshold_single=threshold_single, threshold_acc=threshold_acc)
    for a, b in zip(got[:3], ref[:3]):
        assert a.tolist() == b.tolist()


def test_tree_sampling_subtracts_given_draft_probs():
    case = _random_case(5, 10, 6, 9, 4)
    draft = torch.rand(case["target"].shape, generator=torch.Generator().manual_seed(5)) * 0.05
    got = _run_op(case, draft=draft.clone())
    ref = _reference(case, draft=draft.clone())
    for a, b in zip(got[:3], ref[:3]):
        assert a.tolist() == b.tolist()


def test_tree_sampling_with_draft_probs_matches_at_the_depth_limit_too():
    """Given draft probabilities, a request that accepts every level draws its bonus token from the target alone
    (nothing drafted below the depth limit): op = reference on cases that reach it."""
    depth, at_limit = 3, 0
    for seed in range(40):
        case = _random_case(100 + seed, 16, 4, 6, depth, peaked=6.0)
        draft = torch.rand(case["target"].shape, generator=torch.Generator().manual_seed(seed)) * 0.5
        got = _run_op(case, draft=draft.clone())
        ref = _reference(case, draft=draft.clone())
        for a, b in zip(got[:3], ref[:3]):
            assert a.tolist() == b.tolist(), seed
        at_limit += int((got[2] == depth - 1).sum())
    assert at_limit > 0  # the cases reach the depth limit


def test_one_hot_target_equals_greedy_verify():
    """top_k = 1 (greedy rows in a sampling batch): the sampling verify commits exactly what greedy verify does."""
    case = _random_case(6, 16, 7, 13, 5)
    argmax = case["target"].argmax(-1)
    case["target"] = torch.nn.functional.one_hot(argmax, 13).to(torch.float32)
    bs, n = case["cand"].shape
    coin = torch.rand(bs, n, generator=torch.Generator().manual_seed(6))
    for b, parents in enumerate(case["parents"]):
        for i in range(1, n):
            if coin[b, i] < 0.5:  # half the drafts are the target's argmax at their parent
                case["cand"][b, i] = argmax[b, parents[i]]
    got = _run_op(case)
    predicts = torch.full((bs * n,), -7, dtype=torch.int32)
    accept_index = torch.full((bs, 5), -1, dtype=torch.int32)
    accept_num = torch.empty(bs, dtype=torch.int32)
    spec_ops.verify_tree_greedy_cpu(
        predicts, accept_index, accept_num, case["cand"], case["ri"], case["nt"], case["ns"], argmax.reshape(bs, n)
    )
    assert got[2].tolist() == accept_num.tolist()
    assert got[1].tolist() == accept_index.tolist()
    rows = accept_index[accept_index >= 0].long()
    assert got[0][rows].tolist() == predicts[rows].tolist()


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit, cells with expected count < 5 pooled into one; 0 when any sample fell on a token of
    probability 0 (pooling would hide it: a truncated target's zeros are the cells that matter)."""
    if counts[probs <= 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def _one_tree_many_times(reps: int, seed: int):
    """One fixed tree (root with 3 children, the first with 2) copied into ``reps`` rows with fresh coins."""
    vocab, n, depth = 8, 6, 3
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(n, vocab, generator=g) * 1.5, -1)
    parents = [-1, 0, 0, 0, 1, 1]
    tokens = torch.tensor([5, 2, 6, 0, 3, 7])
    ri, nt, ns = _tree_links([parents], n)
    case = dict(
        cand=tokens.repeat(reps, 1),
        ri=ri + n * torch.arange(reps)[:, None],  # global node index b * n + i
        nt=nt.repeat(reps, 1),
        ns=ns.repeat(reps, 1),
        coins=torch.rand(reps, n, generator=g),
        final=torch.rand(reps, generator=g),
        target=target.repeat(reps, 1, 1).contiguous(),
        depth=depth,
    )
    return case, target, tokens


def test_committed_tokens_follow_the_target_distribution():
    reps = 40000
    case, target, tokens = _one_tree_many_times(reps, seed=7)
    predicts, accept_index, accept_num, _ = _run_op(case)
    pred = predicts.view(reps, -1).long()
    first = pred[:, 0]  # the token after the root: an accepted child or the resampled one
    counts = np.bincount(first.numpy(), minlength=8)
    assert _chi2_pvalue(counts, target[0].numpy()) > ALPHA
    # given that child 1 (token 2) was accepted, the next token follows the target at node 1
    took1 = first == int(tokens[1])
    second = pred[took1, 1]
    assert _chi2_pvalue(np.bincount(second.numpy(), minlength=8), target[1].numpy()) > ALPHA
    # acceptance happens at the rate the target gives the drafted children
    assert abs(float((accept_num > 0).float().mean()) - float(target[0, tokens[1:4]].sum())) < 0.01


def test_argmax_commit_fails_the_distribution_check():
    """Test of the test: committing argmax (SGLang's CPU behaviour) is rejected by the same check."""
    case, target, _ = _one_tree_many_times(2000, seed=7)
    rows = case["target"].shape[0]
    greedy = torch.full((rows,), int(target[0].argmax()))
    counts = np.bincount(greedy.numpy(), minlength=8)
    assert _chi2_pvalue(counts, target[0].numpy()) < ALPHA


def _pytorch_sampler_filter(probs, top_ks, top_ps):
    """The filter of SGLang's ``top_k_top_p_min_p_sampling_from_probs_torch`` (one of top-k / top-p), renormalised."""
    values, order = probs.sort(dim=-1, descending=True, stable=True)
    total = torch.cumsum(values, -1)
    values[torch.arange(probs.shape[-1])[None, :] >= top_ks[:, None]] = 0.0
    values[(total - values) > top_ps[:, None]] = 0.0
    out = torch.zeros_like(probs).scatter_(-1, order, values)
    return out / out.sum(-1, keepdim=True)


def test_top_k_renorm_matches_sampler_filter():
    probs = torch.softmax(torch.randn(6, 40, generator=torch.Generator().manual_seed(8)), -1)
    ks = torch.tensor([1, 2, 5, 40, 1 << 30, 3])
    got = spec_sampling.top_k_renorm_prob(probs, ks)
    ref = _pytorch_sampler_filter(probs.clone(), ks, torch.ones(6))
    assert torch.allclose(got, ref, atol=1e-7)
    assert torch.allclose(got.sum(-1), torch.ones(6))
    assert (got > 0).sum(-1).tolist() == [1, 2, 5, 40, 40, 3]


def test_the_fit_test_sees_samples_outside_the_support():
    probs = np.array([0.5, 0.5, 0.0, 0.0])
    assert _chi2_pvalue(np.array([500, 500, 0, 0]), probs) > 0.5
    assert _chi2_pvalue(np.array([350, 350, 300, 0]), probs) == 0.0  # was p = 1.0: the zero cell was dropped


def test_top_k_one_keeps_argmax_on_ties():
    probs = torch.tensor([[0.1, 0.4, 0.4, 0.1], [0.25, 0.25, 0.25, 0.25]])
    got = spec_sampling.top_k_renorm_prob(probs, 1)
    assert got.argmax(-1).tolist() == probs.argmax(-1).tolist() == [1, 0]
    assert got.max(-1).values.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_renorm_without_a_sort_keeps_what_the_stable_sort_keeps(dtype):
    """Ties included (values drawn from a few levels, so many tokens share the k-th value): the kept set is the
    stable sort's (the lowest ids among the tied), for per-row k from 1 to past the vocabulary, and one int k."""
    g = torch.Generator().manual_seed(11)
    probs = torch.randint(1, 6, (64, 97), generator=g).to(dtype)
    probs = probs / probs.sum(-1, keepdim=True)
    ks = torch.randint(1, 120, (64,), generator=g)
    ks[:4] = torch.tensor([1, 97, 1 << 30, 2])
    for top_k in (ks, 7):
        got = spec_sampling.top_k_renorm_prob(probs, top_k)
        per_row = torch.as_tensor(top_k).expand(64) if isinstance(top_k, int) else top_k
        ref = _pytorch_sampler_filter(probs.clone(), per_row, torch.full((64,), 2.0, dtype=dtype))  # no top-p
        assert torch.equal(got > 0, ref > 0)
        assert torch.allclose(got.float(), ref.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-7)


def test_top_k_then_top_p_as_verify_calls_them_is_the_samplers_joint_filter():
    """SGLang's verify runs top-p on the top-k-renormalised rows; the non-speculative sampler filters both on the
    original mass. [.4, .3, .2, .1] with k=2, p=0.5: joint keeps two tokens (.57/.43), two renormalisations kept
    one (1.0) -- a total variation of ~0.09 per token at k=40, p=0.9 on random rows."""
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    chained = spec_sampling.top_p_renorm_prob(spec_sampling.top_k_renorm_prob(probs, 2), 0.5)
    assert torch.allclose(chained, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))
    g = torch.Generator().manual_seed(12)
    probs = torch.softmax(torch.randn(300, 500, generator=g) * 2.5, -1)
    ks = torch.randint(1, 60, (300,), generator=g)
    ks[:3] = 1 << 30
    ps = torch.rand(300, generator=g) * 0.95 + 0.05
    got = spec_sampling.top_p_renorm_prob(spec_sampling.top_k_renorm_prob(probs, ks), ps)
    ref = _pytorch_sampler_filter(probs.clone(), ks, ps)
    assert torch.equal(got > 0, ref > 0)
    assert torch.allclose(got, ref, atol=1e-6)


def test_a_top_k_result_changed_in_place_carries_no_kept_mass():
    out = spec_sampling.top_k_renorm_prob(torch.tensor([[0.4, 0.3, 0.2, 0.1]]), 2)
    out.copy_(torch.tensor([[0.5, 0.3, 0.2, 0.0]]))  # reused as a buffer: its old mass no longer applies
    assert torch.allclose(spec_sampling.top_p_renorm_prob(out, 0.45), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_top_p_renorm_matches_sampler_filter():
    probs = torch.softmax(torch.randn(5, 40, generator=torch.Generator().manual_seed(9)) * 2, -1)
    ps = torch.tensor([0.05, 0.5, 0.9, 0.99, 1.0])
    got = spec_sampling.top_p_renorm_prob(probs, ps)
    ref = _pytorch_sampler_filter(probs.clone(), torch.full((5,), 1 << 30), ps)
    assert torch.allclose(got, ref, atol=1e-7)
    kept = (got > 0).sum(-1)
    assert kept[0] == 1 and kept[-1] == 40 and bool((kept[1:] >= kept[:-1]).all())


@pytest.mark.parametrize("nucleus_k", [4, spec_sampling.NUCLEUS_K])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_renorm_without_a_sort_keeps_what_the_stable_sort_keeps(monkeypatch, nucleus_k, dtype):
    """Rows whose nucleus ends inside the first topk, rows that need it doubled (flat rows), ties drawn from a few
    levels (a tie group across the nucleus edge keeps its lowest ids), top_p 0 and >= 1, and after top-k: the kept
    set and values are the full stable sort's."""
    monkeypatch.setattr(spec_sampling, "NUCLEUS_K", nucleus_k)
    g = torch.Generator().manual_seed(13)
    rows, vocab = 96, 1500
    scale = torch.tensor([0.0, 0.5, 2.0, 6.0]).repeat(rows // 4)[:, None]  # flat ... peaked
    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * scale, -1)
    levels = torch.randint(1, 6, (rows // 4, vocab), generator=g).float()
    probs[: rows // 4] = levels / levels.sum(-1, keepdim=True)  # ties everywhere
    probs = probs.to(dtype)
    ps = (torch.rand(rows, generator=g) * 0.98 + 0.01).to(dtype)
    ps[:4] = torch.tensor([0.0, 1.0, 2.0, 0.999])
    ks = torch.randint(1, 2 * vocab, (rows,), generator=g)
    for top_k in (None, ks):
        filtered = probs if top_k is None else spec_sampling.top_k_renorm_prob(probs, top_k)
        got = spec_sampling.top_p_renorm_prob(filtered, ps)
        monkeypatch.setattr(spec_sampling, "NUCLEUS_K", vocab)  # the full stable sort of every row
        assert torch.equal(got, spec_sampling.top_p_renorm_prob(filtered, ps))
        monkeypatch.setattr(spec_sampling, "NUCLEUS_K", nucleus_k)
        if dtype == torch.float32:  # (in bf16, top_p / kept is rounded: the sort's result too)
            ref = _pytorch_sampler_filter(probs.clone(), torch.full((rows,), 1 << 30) if top_k is None else ks, ps)
            assert torch.equal(got > 0, ref > 0)
            assert torch.allclose(got, ref, atol=1e-6)
