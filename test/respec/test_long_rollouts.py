"""Long rollouts in the online learner: memory bounded by the config, not by what was posted.

- the drafter's training attention and the KD loss's vocabulary head run on blocks (recomputed in backward): the
  loss and its gradients equal the unblocked ones;
- a feature window holds the features the whole sequence gives at those positions (the copy sees the context);
- the learner trains a rollout longer than ``train_window`` on a window of that many tokens that holds response
  predictions, and the served top-k lines up with the window's positions. Tiny random Llama, no server.
"""

from __future__ import annotations

import pytest
import torch

from sglang_spex.config import ConfigError, LearnerConfig
from sglang_spex.respec import drafter as drafter_mod
from sglang_spex.respec import kd as kd_mod
from sglang_spex.respec.kd import kd_loss, reward_weighted_kd
from sglang_spex.respec.learner import OnlineLearner, UpdateRecord
from sglang_spex.respec.ttt import unroll

WEIGHTS = torch.tensor([1.5, 0.0, 0.5, 2.0])


def _loss_and_grads(drafter, batch):
    drafter.zero_grad(set_to_none=True)
    loss, _ = reward_weighted_kd(drafter.train(), batch, [], steps=3, weights=WEIGHTS[: len(batch)])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def test_blocked_attention_and_head_give_the_same_loss_and_gradients(tiny_drafter, tiny_batch, monkeypatch):
    batch = tiny_batch.select([0, 1, 2, 3])
    whole, whole_grads = _loss_and_grads(tiny_drafter, batch)
    # the unblocked value is kd_loss of each step's full log q (the formula the module documents)
    with torch.no_grad():
        ref = sum(
            0.8**i * kd_loss(s.target_logp, s.log_q, s.mask, WEIGHTS)
            for i, s in enumerate(unroll(tiny_drafter, batch, 3))
        )
    assert whole == pytest.approx(float(ref), rel=1e-5)
    heads = tiny_drafter.cfg.num_attention_heads
    monkeypatch.setattr(drafter_mod, "ATTN_BLOCK_SCORES", 4 * heads * 13 * 3)  # 3 query rows per block (13 rows)
    monkeypatch.setattr(kd_mod, "KD_BLOCK_LOGITS", 4 * 64 * 2)  # 2 positions per head block
    calls = {"attend": 0, "kl": 0}

    def counted(name, fn):
        def wrapped(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)

        return wrapped

    monkeypatch.setattr(drafter_mod, "_attend_rows", counted("attend", drafter_mod._attend_rows))
    monkeypatch.setattr(kd_mod, "_block_kl", counted("kl", kd_mod._block_kl))
    blocked, blocked_grads = _loss_and_grads(tiny_drafter, batch)
    # forward and backward's recompute: 5 row blocks x 3 steps x 2; head blocks of 2 over 13, 12, 11 positions
    assert calls == {"attend": 5 * 3 * 2, "kl": (7 + 6 + 6) * 2}
    assert blocked == pytest.approx(whole, rel=1e-5)
    assert whole_grads.keys() == blocked_grads.keys() and whole_grads
    for name, g in whole_grads.items():
        assert torch.allclose(blocked_grads[name], g, rtol=1e-4, atol=1e-6), name


def test_a_window_holds_the_whole_sequences_features(tiny_features, tiny_seqs):
    whole = tiny_features.batch(tiny_seqs[:3])
    windows = [(4, 11), None, (2, 14)]
    for chunk_tokens in (4096, 14):  # all rows in one forward; one row per forward (the copy's logits cut)
        cut = tiny_features.batch(tiny_seqs[:3], windows=windows, chunk_tokens=chunk_tokens)
        for row, span in enumerate(windows):
            a, e = span or (0, 14)
            part = cut.select([row])
            ref = whole.select([row]).span(a, e)
            assert part.input_ids.shape[1] >= e - a
            for name in ("input_ids", "loss_mask", "target_argmax"):
                assert torch.equal(getattr(part, name)[:, : e - a], getattr(ref, name)), (name, row)
            # the last kept position predicts a token past the window: its next-token log p is not known here
            for name in ("aux_hidden", "target_logp", "token_logp"):
                a_, b_ = getattr(part, name)[:, : e - a].float(), getattr(ref, name).float()
                if name == "token_logp":
                    a_, b_ = a_[:, :-1], b_[:, :-1]
                assert torch.allclose(a_, b_, atol=2e-2, rtol=0), (name, row, (a_ - b_).abs().max())
            assert not part.attention_mask[0, e - a :].any()  # padding past the window


def test_a_long_rollout_trains_on_a_window_of_response_predictions(tiny_drafter, tiny_features, tiny_seqs):
    seen = []

    def features(seqs, windows=None):
        seen.append(list(windows))
        return tiny_features.batch(seqs, windows=windows)

    cfg = LearnerConfig(mode="sync", train_steps=3, micro_batch=2, kd_steps=1, train_window=6)
    lrn = OnlineLearner(tiny_drafter, features, cfg, publish=lambda v, t: None)
    posted = [{"prompt_ids": p, "response_ids": r, "reward": 1.0} for p, r in tiny_seqs]  # 5 + 9 = 14 tokens
    lrn.submit(posted)
    (record,) = lrn.history
    assert record.outcome == "published"
    (windows,) = seen
    assert windows and all(w is not None and w[1] - w[0] == 6 for w in windows)
    assert all(4 <= w[0] <= 8 for w in windows)  # from the first response prediction (position 4) to the end
    assert record.tokens == 6 * len(windows)
    short = LearnerConfig(mode="sync", train_steps=1, micro_batch=2, kd_steps=1, train_window=14)
    seen.clear()
    OnlineLearner(tiny_drafter, features, short, publish=lambda v, t: None).submit(posted)
    assert seen == [[None, None]]  # within the window: whole rollouts


def test_the_served_top_k_lines_up_with_a_window(tiny_drafter, tiny_features, tiny_seqs):
    d2t = tiny_drafter.draft_to_target.tolist()
    prompt, response = list(tiny_seqs[0][0]), d2t[:9]  # response tokens inside the draft vocabulary
    top = [[[d2t[(i * 7) % 64], -0.1], [d2t[(i * 7 + 1) % 64], -3.0]] for i in range(len(response))]
    cfg = LearnerConfig(mode="sync", train_window=6)
    lrn = OnlineLearner(tiny_drafter, tiny_features.batch, cfg)
    lrn.buffer.add_batch([{"prompt_ids": prompt, "response_ids": response, "reward": 1.0, "target_top_logprobs": top}])
    (rollout,) = lrn.buffer.drain()
    window = (6, 12)
    feats = tiny_features.batch([(prompt, response)], windows=[window])
    record = UpdateRecord(1, 0, 0, "rolled_back", "", 1, 0, [], None, None, 0.0)
    batch = lrn._kd_batch([rollout], [window], feats, tiny_drafter, record)
    assert record.target_source == "served"
    trained = torch.nonzero(batch.loss_mask[0]).flatten().tolist()
    assert trained == list(range(6))  # positions 6..11 of the rollout predict response tokens 2..7
    for j in trained:
        i = window[0] + j - (len(prompt) - 1)  # the response token this position predicts
        assert int(batch.target_logp[0, j].float().argmax()) == (i * 7) % 64, j


def test_train_window_is_checked():
    with pytest.raises(ConfigError, match="train_window"):
        LearnerConfig(train_window=1).validate()
