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


def test_aux_states_are_the_aux_layers_inputs_without_every_layers_states(tiny_target, tiny_features, monkeypatch):
    """The copy keeps only the aux layers' inputs (pre-hooks), equal to HF's ``hidden_states[i]``; it never asks
    for every layer's states."""
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    attn = torch.ones(2, 12, dtype=torch.bool)
    attn[1, 9:] = False
    with torch.no_grad():
        out = tiny_target(input_ids=ids, attention_mask=attn.long(), output_hidden_states=True)
    ref = torch.cat([out.hidden_states[i] for i in tiny_features.aux_layer_ids], -1).to(tiny_features.feature_dtype)
    asked = []
    forward = tiny_target.forward
    monkeypatch.setattr(
        tiny_target, "forward", lambda *a, **kw: asked.append(kw["output_hidden_states"]) or forward(*a, **kw)
    )
    assert torch.equal(tiny_features.forward(ids, attn)[0], ref)
    assert torch.equal(tiny_features.forward(ids[:1], attn[:1], start=3)[0], ref[:1, 3:])
    assert asked == [False, False]
    layers = tiny_target.get_decoder().layers
    assert not any(layer._forward_pre_hooks for layer in layers)  # removed after each forward
