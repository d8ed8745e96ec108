"""The policy copy's features do not depend on how the sequences are cut into forward passes."""

from __future__ import annotations

import torch


def test_token_bounded_chunks_give_the_same_features(tiny_features, tiny_seqs):
    whole = tiny_features.batch(tiny_seqs)  # 6 sequences of 14 tokens: one forward
    single = tiny_features.batch(tiny_seqs, chunk_tokens=20)  # 20 tokens: one sequence per forward
    assert len(whole) == len(single) == len(tiny_seqs)
    for name in ("input_ids", "attention_mask", "loss_mask", "target_argmax"):
        assert torch.equal(getattr(whole, name), getattr(single, name)), name
    for name in ("aux_hidden", "target_logp", "token_logp"):
        a, b = getattr(whole, name).float(), getattr(single, name).float()
        assert torch.allclose(a, b, atol=2e-2, rtol=0), (name, (a - b).abs().max())
