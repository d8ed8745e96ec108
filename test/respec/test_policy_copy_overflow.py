"""A policy push whose float64 values overflow the copy's dtype (1e300 is inf in float32) is refused before
anything is copied: it was accepted, and every later learner update then failed on a NaN loss."""

from __future__ import annotations

import copy

import pytest
import torch

from sglang_spex.respec.target import TargetFeatures


def test_a_push_that_overflows_the_copys_dtype_is_refused_and_changes_nothing(tiny_target, tiny_drafter):
    feats = TargetFeatures(copy.deepcopy(tiny_target), tiny_drafter.cfg.aux_layer_ids, tiny_drafter.t2d)
    state = feats.model.state_dict()
    (first, w0), (second, w1) = list(state.items())[:2]
    before = {k: v.clone() for k, v in state.items()}
    good = torch.zeros_like(w0, dtype=torch.float64)
    huge = torch.full_like(w1, 1e300, dtype=torch.float64)  # finite in float64, inf in the copy's dtype
    with pytest.raises(ValueError, match="non-finite"):
        feats.load_weights([(first, good), (second, huge)])
    assert all(torch.equal(state[k], v) for k, v in before.items())  # not even the good tensor was copied
    assert feats.load_weights([(first, good)]) == 1 and torch.equal(state[first], torch.zeros_like(w0))
