"""CPU ops for SGLang's speculative *sampling* verify (temperature > 0), in torch.

SGLang 0.5.23 resolves these names to ``None`` on CPU (``sglang.kernels.ops.speculative.verify_sampling``,
``sglang.kernels.ops.sampling.renorm``), so its verify commits the argmax there. These ops have the
signatures and semantics of the CUDA ones:

- :func:`tree_speculative_sampling_target_only` -- the CUDA kernel of the same name (SGLang's
  ``speculative/sampling.cuh``): walk each request's draft tree from the root; at an accepted node with
  coin ``u`` (``uniform_samples[b, node]``), try its children in sibling order, adding each child's target
  probability to a running sum, and accept the first child with positive probability and
  ``u < sum / threshold_acc`` (or probability ``>= threshold_single``); a rejected child's target
  probability is written into ``draft_probs`` at that node. After the walk, the token after the last
  accepted node is drawn by inverse CDF with ``uniform_samples_for_final_sampling[b]`` from
  ``relu(target - draft)`` at that node (from ``target`` alone when the walk reached the depth limit).
  With the default thresholds (1, 1) and zero draft probabilities (a deterministic draft: NGRAM, EAGLE
  target-only) each committed token is distributed exactly as the target distribution.
- :func:`top_k_renorm_prob` / :func:`top_p_renorm_prob` -- flashinfer's ``top_k_renorm_probs`` /
  ``top_p_renorm_probs``: zero the tokens outside the top-k / the top-p nucleus and renormalise. Ties
  keep the lower token id first (stable sort), so ``top_k = 1`` selects ``torch.argmax``'s token; the
  nucleus keeps a token when the mass strictly before it is ``<= top_p`` (SGLang's pytorch sampler rule).
  SGLang's verify calls them one after the other, top-p on the top-k-renormalised rows; its non-speculative
  CPU sampler filters both at once on the original mass. So the tensor :func:`top_k_renorm_prob` returns
  carries the mass each row kept (``KEPT_MASS``), and :func:`top_p_renorm_prob` given that tensor compares with
  ``top_p / kept``: the joint filter, exactly (a row's mass before a token, renormalised, is its original mass
  before it over ``kept``). Min-p, which SGLang's verify leaves out, is applied by the plugin's hook V3
  (``sglang_spex.srt.lossless_verify``) after these two ops.

Vectorised over the batch; loops run only over tree depth and siblings.
"""

from __future__ import annotations

from typing import Union

import torch


def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """Rejection-sample each request's draft tree against ``target_probs``; writes the first three and ``draft_probs``.

    Shapes (as SGLang passes them): ``candidates``/``retrive_*``/``uniform_samples`` ``[bs, n]``,
    ``accept_index`` ``[bs, depth]`` (pre-filled with -1), ``accept_token_num`` ``[bs]``, ``predicts``
    ``[bs * n]``, ``target_probs``/``draft_probs`` ``[bs, n, vocab]`` float32. ``deterministic`` is accepted
    for signature compatibility; this op is always deterministic given its coins.
    """
    if not 0.0 <= threshold_single <= 1.0 or not 0.0 <= threshold_acc <= 1.0:
        raise ValueError(f"thresholds must lie in [0, 1], got single={threshold_single}, acc={threshold_acc}")
    bs, n = candidates.shape
    if bs == 0:
        return
    num_spec = accept_index.shape[1]
    vocab = target_probs.shape[-1]
    dev = candidates.device
    rows = torch.arange(bs, device=dev)
    ri = retrive_index.reshape(bs, n).to(torch.int64)
    nxt = retrive_next_token.reshape(bs, n).to(torch.int64)
    sib = retrive_next_sibling.reshape(bs, n).to(torch.int64)
    cand = candidates.reshape(bs, n).to(torch.int64)
    coins = uniform_samples.reshape(bs, n)
    q = target_probs.view(bs, n, vocab)
    dq = draft_probs.view(bs, n, vocab)  # a view: rejected children are recorded in the caller's tensor
    acc_scale = max(float(threshold_acc), 1e-9)
    single = torch.tensor(float(threshold_single), dtype=q.dtype, device=dev)

    node = torch.zeros(bs, dtype=torch.int64, device=dev)  # local index of the last accepted node
    last = ri[:, 0].clone()  # its global (retrive_index) index: where its successor token is written
    accept_index[:, 0] = last.to(accept_index.dtype)
    num = torch.zeros(bs, dtype=torch.int64, device=dev)
    cur = torch.zeros(bs, dtype=torch.int64, device=dev)
    alive = torch.ones(bs, dtype=torch.bool, device=dev)
    pred = predicts.view(-1)
    for _ in range(1, num_spec):
        cur = torch.where(alive, nxt[rows, cur.clamp(min=0)], cur)
        coin = coins[rows, node]
        prob_acc = torch.zeros(bs, dtype=q.dtype, device=dev)
        found = torch.zeros(bs, dtype=torch.bool, device=dev)
        for _ in range(n):  # sibling scan, all requests at once
            searching = alive & ~found & (cur >= 0)
            if not bool(searching.any()):
                break
            safe = cur.clamp(min=0)
            tok = cand[rows, safe]
            p = q[rows, node, tok]
            prob_acc = torch.where(searching, prob_acc + p, prob_acc)
            hit = searching & (p > 0) & ((coin < prob_acc / acc_scale) | (p >= single))
            miss = searching & ~hit
            dq[rows[miss], node[miss], tok[miss]] = p[miss]
            draft = ri[rows, safe]
            pred[last[hit]] = tok[hit].to(pred.dtype)
            num = num + hit.to(torch.int64)
            accept_index[rows[hit], num[hit]] = draft[hit].to(accept_index.dtype)
            last = torch.where(hit, draft, last)
            node = torch.where(hit, safe, node)
            found |= hit
            cur = torch.where(miss, sib[rows, safe], cur)
        alive &= found
        if not bool(alive.any()):
            break
    accept_token_num.view(-1)[:bs] = num.to(accept_token_num.dtype)

    # the token after the last accepted node: inverse CDF of relu(target - draft) there
    residual = q[rows, node]
    at_depth_limit = num == num_spec - 1  # no draft mass is subtracted for the bonus token
    residual = torch.where(at_depth_limit[:, None], residual, (residual - dq[rows, node]).clamp(min=0))
    u = uniform_samples_for_final_sampling.reshape(-1)[:bs].to(residual.dtype) * residual.sum(-1)
    cdf = torch.cumsum(residual, dim=-1)
    sampled = torch.searchsorted(cdf, u[:, None].contiguous(), right=True).squeeze(-1)  # first cdf > u
    positive = residual > 0
    last_valid = torch.where(
        positive.any(-1), vocab - 1 - positive.flip(-1).to(torch.int8).argmax(-1), torch.full_like(sampled, vocab - 1)
    )
    sampled = torch.where(sampled >= vocab, last_valid, sampled)
    pred[last] = sampled.to(pred.dtype)


def _largest(probs: torch.Tensor, k: int):
    """Each row's ``k`` largest values and their ids, in :func:`_sorted_desc`'s order (ties: lower id first)."""
    if k >= probs.shape[-1]:
        return _sorted_desc(probs)
    values, order = torch.topk(probs, k, dim=-1)
    order, by_id = order.sort(dim=-1)
    values, by_value = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, order.gather(-1, by_value)


NUCLEUS_K = 256  # top_p_renorm_prob's first topk width, times NUCLEUS_GROWTH for rows whose nucleus is wider
NUCLEUS_GROWTH = 16  # (topk of 128 x 49k rows: 32 ms at k=256, 133 ms at 4096; their full sort 700 ms)


def _sorted_desc(probs: torch.Tensor):
    return torch.sort(probs, dim=-1, descending=True, stable=True)


# attribute of top_k_renorm_prob's result: (each row's kept mass [rows, 1], the tensor's version then); a view or a
# copy of the result does not carry it (two successive renormalisations, SGLang's own rule, then apply)
KEPT_MASS = "_sgl_kernel_ext_kept_mass"


def _renorm(kept: torch.Tensor) -> torch.Tensor:
    return kept / kept.sum(dim=-1, keepdim=True)


def _with_kept_mass(kept: torch.Tensor) -> torch.Tensor:
    """``kept`` renormalised, carrying each row's kept mass for a top-p renorm that follows (module doc)."""
    mass = kept.sum(dim=-1, keepdim=True)
    out = kept / mass
    setattr(out, KEPT_MASS, (mass, out._version))  # the version: a buffer changed in place since carries no mass
    return out


def top_k_renorm_prob(probs: torch.Tensor, top_k: Union[torch.Tensor, int]) -> torch.Tensor:
    """Keep each row's ``top_k`` largest probabilities (``top_k`` per row or one int), zero the rest, renormalise.

    Without a sort of the vocabulary: ``torch.topk`` up to the batch's largest k + 1 gives each row's k-th value,
    and a row keeps what is at least that. Where the (k+1)-th value ties with the k-th (rare in a softmax), the row
    keeps, of the tied tokens, the lowest ids up to k (a stable sort's choice, so top_k = 1 is ``argmax``'s token).
    A greedy request (top_k = 1) in a sampling batch makes SGLang run this over every row: a full sort took 140 ms
    for 32 rows of a 49k vocabulary."""
    vocab = probs.shape[-1]
    k = torch.as_tensor(top_k, device=probs.device).to(torch.int64).reshape(-1, 1).clamp(1, vocab)
    k = k.expand(probs.shape[0], 1)
    rows = (k[:, 0] < vocab).nonzero().squeeze(-1)  # rows that drop anything (SGLang's "all" is 1 << 30)
    if rows.numel() == 0:
        return _with_kept_mass(probs)
    every = rows.numel() == probs.shape[0]
    sub, ks = (probs, k) if every else (probs[rows], k[rows])
    top = torch.topk(sub, min(int(ks.max()) + 1, vocab), dim=-1).values
    kth = top.gather(-1, ks - 1)  # each row's k-th largest value (k < vocab: the (k+1)-th exists)
    threshold = kth if every else torch.full_like(probs[:, :1], float("-inf")).index_copy_(0, rows, kth)
    out = torch.where(probs >= threshold, probs, 0.0)
    ties = (top.gather(-1, ks) == kth).nonzero().squeeze(-1)  # the k-th value continues past position k
    if ties.numel():
        at = rows[ties]
        row, kt = probs[at], ks[ties]
        above, tied = row > kth[ties], row == kth[ties]
        room = kt - above.sum(-1, keepdim=True)  # how many of the tied tokens the row still keeps
        keep = above | (tied & (torch.cumsum(tied.to(torch.int32), dim=-1) <= room))
        out[at] = torch.where(keep, row, 0.0)
    return _with_kept_mass(out)


def top_p_renorm_prob(probs: torch.Tensor, top_p: Union[torch.Tensor, float]) -> torch.Tensor:
    """Keep the top-p nucleus of each row (mass before a kept token ``<= top_p``), zero the rest, renormalise;
    on :func:`top_k_renorm_prob`'s result, the nucleus of the original mass (``top_p / kept``, module doc).

    Without a sort of the vocabulary: rows with ``top_p >= 1`` keep everything, and the others take
    ``torch.topk`` of ``NUCLEUS_K`` tokens; a row whose nucleus reaches past them takes ``NUCLEUS_GROWTH`` times
    more, or its full sort when its k-th value says the nucleus is wider still (a full sort of every row: 128
    rows of a 49k vocabulary took ~700 ms; ~40-260 ms now for nuclei of up to a few hundred tokens)."""
    p = torch.as_tensor(top_p, device=probs.device).to(probs.dtype).reshape(-1, 1).expand(probs.shape[0], 1)
    kept, version = getattr(probs, KEPT_MASS, (None, None))
    if kept is not None and version == probs._version and kept.shape[0] == probs.shape[0]:
        p = p / kept.to(p.dtype)
    out = probs.clone()
    vocab = probs.shape[-1]
    stages = [((p[:, 0] < 1).nonzero().squeeze(-1), NUCLEUS_K)]  # (rows that may drop a token, topk width)
    while stages:
        pending, k = stages.pop()
        if pending.numel() == 0:
            continue
        k = min(k, vocab)
        values, order = _largest(probs[pending], k)
        before = torch.cumsum(values, dim=-1) - values
        smallest_kept = values.gather(-1, (before <= p[pending]).sum(-1, keepdim=True).clamp(min=1) - 1)[:, 0]
        # the nucleus ends before the k-th token, and no token tied with its smallest lies past the k-th
        done = ((before[:, -1] > p[pending, 0]) & (smallest_kept > values[:, -1])) | (k == vocab)
        rows = pending[done]
        kept_values = values[done].masked_fill(before[done] > p[rows], 0.0)
        out[rows] = torch.zeros_like(out[rows]).scatter_(-1, order[done], kept_values)
        rest, wider = pending[~done], NUCLEUS_GROWTH * k
        # tokens a row still needs, at least (no later token is above its k-th): past the wider topk, sort it all
        need = (p[rest, 0] - before[~done, -1]) / values[~done, -1].clamp(min=torch.finfo(values.dtype).tiny)
        sort_all = k + need > wider
        stages += [(rest[sort_all], vocab), (rest[~sort_all], wider)]
    return _renorm(out)
