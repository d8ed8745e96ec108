"""KD from the served target's log-probs (issue #17): the rollout fields, SGLang's meta_info → rollout conversion,
the learner's served KD target (hand-computed loss, source choice, the copy/served gap) and an update moving the
drafter toward the served distribution. Tiny random Llama target, no server."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from sglang_spex.respec.buffer import ReplayBuffer, RolloutError, served_fields, validate_rollout
from sglang_spex.respec.drafter import Eagle3Drafter
from sglang_spex.respec.grpo import GRPOConfig, GRPOLoop, Sample, rollout_payloads
from sglang_spex.respec.learner import LearnerConfig, OnlineLearner
from sglang_spex.respec.target import TargetFeatures
from sglang_spex.respec.ttt import unroll

GOOD = {
    "prompt_ids": [1, 2, 3],
    "response_ids": [4, 5],
    "reward": 1.0,
    "target_top_logprobs": [[[4, -0.1]], [[5, -1.0]]],
}
DRAFT_IDS = list(range(100, 228, 2))  # the draft vocabulary: even target ids 100..226, draft id = (t - 100) / 2
PROMPT = [11, 12, 13]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture
def drafter(target) -> Eagle3Drafter:
    counts = torch.zeros(target.config.vocab_size)
    counts[DRAFT_IDS] = 1.0
    return Eagle3Drafter.for_target(target, len(DRAFT_IDS), counts)


@pytest.fixture
def features(target, drafter) -> TargetFeatures:
    return TargetFeatures(target, drafter.cfg.aux_layer_ids, drafter.t2d)


def _draft(t: int) -> int:
    return DRAFT_IDS.index(t)


# ---------------------------------------------------------------- buffer
@pytest.mark.parametrize(
    "top, field",
    [
        ("abc", "target_top_logprobs"),
        ([[[4, -0.1]]], "target_top_logprobs"),  # one row for two response tokens
        ([[[4, -0.1]], []], "target_top_logprobs[1]"),
        ([[[4, -0.1]], [[5]]], "target_top_logprobs[1][0]"),
        ([[[4, -0.1]], [[5.0, -0.1]]], "target_top_logprobs[1][0][0]"),
        ([[[4, -0.1]], [[400, -0.1]]], "target_top_logprobs[1][0][0]"),  # outside the 344-token vocabulary
        ([[[4, -0.1]], [[5, float("nan")]]], "target_top_logprobs[1][0][1]"),
        ([[[4, 0.5]], [[5, -0.1]]], "target_top_logprobs[0][0][1]"),  # log p > 0
        ([[[4, -1.0], [4, -2.0]], [[5, -0.1]]], "target_top_logprobs[0]"),  # repeated id
        ([[[4, -0.1], [6, -0.2]], [[5, -0.1]]], "target_top_logprobs[0]"),  # p sums to 1.72
    ],
)
def test_bad_top_logprobs_are_named(top, field):
    with pytest.raises(RolloutError) as e:
        validate_rollout({**GOOD, "target_top_logprobs": top}, vocab_size=344)
    assert e.value.field == field


def test_top_logprobs_stored_and_batch_atomic():
    buf = ReplayBuffer(vocab_size=344)
    with pytest.raises(RolloutError) as e:
        buf.add_batch([GOOD, {**GOOD, "target_top_logprobs": [[[4, -0.1]], [[-5, -0.1]]]}])
    assert e.value.field == "rollouts[1].target_top_logprobs[1][0][0]" and len(buf) == 0
    buf.add_batch([GOOD, {**GOOD, "target_logprobs": [-0.1, -1.0]}])
    first, second = buf.drain()
    top = first.target_top_logprobs
    assert top.ids.tolist() == [[4], [5]] and top.logp.ravel().tolist() == pytest.approx([-0.1, -1.0])
    assert first.target_logprobs is None
    assert second.target_logprobs.tolist() == pytest.approx([-0.1, -1.0])


def test_served_fields_from_sglang_meta_info():
    """SGLang 0.5.23 (tokenizer_manager.detokenize_*): ``[logprob, token_id, text | null]`` per output token, and
    per output token a list of those for the top-k (``null`` log-prob: -inf in JSON; ``null`` row: empty)."""
    meta = {
        "output_token_logprobs": [[-0.5, 4, None], [-1.0, 5, "x"]],
        "output_top_logprobs": [[[-0.5, 4, None], [-1.2, 9, None]], [[-1.0, 5, "x"], [None, 7, None]]],
    }
    fields = served_fields(meta, 2)
    assert fields == {"target_logprobs": [-0.5, -1.0], "target_top_logprobs": [[[4, -0.5], [9, -1.2]], [[5, -1.0]]]}
    top = validate_rollout({**GOOD, **fields}, vocab_size=344).target_top_logprobs
    assert top.ids.tolist() == [[4, 9], [5, -1]] and top.logp[0].tolist() == pytest.approx([-0.5, -1.2])
    assert served_fields(meta, 3) == {}  # not one entry per response token: left out
    assert served_fields({**meta, "output_top_logprobs": [meta["output_top_logprobs"][0], None]}, 2).keys() == {
        "target_logprobs"
    }
    assert served_fields({"output_token_logprobs": [[None, 4, None], [-1.0, 5, None]]}, 2) == {}
    # float32 log-probs as Python floats (17 digits) keep 7 significant digits; a rounding-positive one is 0
    f32 = {"output_token_logprobs": [[-3.1234567165374756, 4, None], [1.1920928955078125e-07, 5, None]]}
    assert served_fields(f32, 2)["target_logprobs"] == [-3.123457, 0.0]


def test_grpo_requests_top_logprobs_and_posts_them(tiny_model):
    from transformers import AutoTokenizer

    from sglang_spex.tot.tasks import ToyAdd

    seen = []

    class FakeClient:
        url = "http://fake"

        def generate(self, ids, params, concurrency=0, extra=None):
            seen.append(extra)
            meta = {"output_token_logprobs": [[-0.2, 7, None]], "output_top_logprobs": [[[-0.2, 7, None]]]}
            return [{"output_ids": [7], "meta_info": meta} for _ in ids]

    tok = AutoTokenizer.from_pretrained(tiny_model)
    loop = GRPOLoop(
        FakeClient(), None, tok, ToyAdd(2, 5), GRPOConfig(prompts_per_step=1, group_size=2, top_logprobs_num=3)
    )
    samples = loop.sample(loop._pool[:1], logprobs=True)
    loop.sample(loop._pool[:1])
    assert seen == [{"return_logprob": True, "top_logprobs_num": 3}, None]
    posted, _ = rollout_payloads(samples)
    assert posted["target_top_logprobs"] == [[[7, -0.2]]] and posted["target_logprobs"] == [-0.2]
    bare = rollout_payloads([Sample(samples[0].question, [1], [7], "", 0.0, {})])[0]
    assert set(bare) == {"prompt_ids", "response_ids", "reward"}


# ---------------------------------------------------------------- learner
# Hand-built served top-k for 2 rollouts × 2 response tokens (odd ids lie outside the draft vocabulary and are
# dropped before renormalising): the KD target p per trained position, written out.
TOP = [
    [[[102, math.log(0.5)], [104, math.log(0.3)], [101, math.log(0.1)]], [[110, math.log(0.6)], [226, math.log(0.2)]]],
    [[[100, math.log(0.9)]], [[131, math.log(0.7)], [120, math.log(0.1)], [122, math.log(0.1)]]],
]
P_HAND = [[{102: 0.625, 104: 0.375}, {110: 0.75, 226: 0.25}], [{100: 1.0}, {120: 0.5, 122: 0.5}]]
RESPONSES = [[102, 110], [100, 131]]


def _rollouts(top=TOP, rewards=(1.0, 0.5), **extra):
    out = []
    for b, (resp, w) in enumerate(zip(RESPONSES, rewards)):
        r = {"prompt_ids": PROMPT, "response_ids": resp, "reward": w}
        if top is not None and top[b] is not None:
            r["target_top_logprobs"] = top[b]
        out.append({**r, **{k: v[b] for k, v in extra.items()}})
    return out


def _sync_learner(drafter, features, **kw) -> OnlineLearner:
    cfg = {"mode": "sync", "train_steps": 1, "micro_batch": 2, "kd_steps": 1, "lr": 1e-3, **kw.pop("cfg", {})}
    return OnlineLearner(drafter, features.batch, LearnerConfig(**cfg), weight_mode="linear", **kw)


def _copy_log_p(target, prompt, response):
    """The copy's full-vocabulary log p of each response token (HF forward, written out)."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logp = torch.log_softmax(target(input_ids=ids).logits.float()[0], -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(response)]


def _base_step(drafter, features):
    """The untrained drafter's one-step unroll on the rollouts, with the copy's target and mask."""
    with torch.no_grad():
        (step,) = unroll(drafter, features.batch([(PROMPT, r) for r in RESPONSES]), 1)
    return step


def _copy_loss(step, w) -> float:
    kl = (step.target_logp.exp() * (step.target_logp - step.log_q)).sum(-1) * step.mask
    return float((torch.tensor(w)[:, None] * kl).sum() / step.mask.sum())


def test_served_kd_loss_hand_computed(drafter, features):
    """Rewards (1, 0.5) → w = (4/3, 2/3); 4 trained positions; p from the hand-built top-k above, q from the
    drafter: L = Σ_b w_b Σ_t Σ_v p_v (log p_v − log q_v) / 4."""
    step = _base_step(drafter, features)
    lrn = _sync_learner(drafter, features)
    lrn.submit(_rollouts())
    (record,) = lrn.history
    assert record.outcome == "published" and record.target_source == "served" and record.served_masked == 0
    assert int(step.mask.sum()) == 4
    w = [4 / 3, 2 / 3]
    served = 0.0
    for b in range(2):
        for i in range(2):
            log_q = step.log_q[b, len(PROMPT) - 2 + i]  # position t scores the distribution after x_{t+1}
            served += w[b] * sum(p * (math.log(p) - float(log_q[_draft(t)])) for t, p in P_HAND[b][i].items())
    served /= 4
    tol = 1e-2 * served
    assert abs(record.losses[0] - served) < tol
    assert abs(record.losses[0] - _copy_loss(step, w)) > 10 * tol  # the copy's target would give another loss


def test_source_served_only_when_every_rollout_has_top_k(drafter, features):
    step = _base_step(drafter, features)
    lrn = _sync_learner(drafter, features)
    lrn.submit(_rollouts(top=[TOP[0], None]))  # mixed: the copy for the whole batch, the top-k rollout included
    assert lrn.history[0].losses[0] == pytest.approx(_copy_loss(step, [4 / 3, 2 / 3]), rel=1e-5)
    lrn.submit(_rollouts())
    assert [r.target_source for r in lrn.history] == ["copy", "served"]
    assert [u["target_source"] for u in lrn.state()["updates"]] == ["copy", "served"]
    forced = _sync_learner(copy.deepcopy(drafter), features, kd_target="copy")
    forced.submit(_rollouts())
    assert forced.history[-1].target_source == "copy" and forced.state()["kd_target"] == "copy"
    with pytest.raises(ValueError):
        _sync_learner(drafter, features, kd_target="served-only")


def test_logp_gap_measures_a_stale_copy(drafter, features, target):
    """Served log p = the copy's own + 0.3 → the recorded gap is 0.3; without served log-probs it is None."""
    served = [[x - 0.3 for x in _copy_log_p(target, PROMPT, r)] for r in RESPONSES]
    lrn = _sync_learner(drafter, features)
    lrn.submit(_rollouts(top=None, target_logprobs=served))
    lrn.submit(_rollouts(top=None))
    gap, none = lrn.history
    assert gap.target_source == "copy" and gap.target_logp_gap == pytest.approx(0.3, abs=1e-4)
    assert none.target_logp_gap is None and lrn.state()["updates"][0]["target_logp_gap"] == pytest.approx(0.3, abs=1e-4)


def test_submit_stall_and_update_seconds_recorded(drafter, features):
    lrn = _sync_learner(drafter, features)
    lrn.submit(_rollouts())
    state = lrn.state()
    seconds = state["last_update"]["seconds"]
    assert seconds > 0 and state["last_submit_seconds"] >= seconds  # sync: the caller waited for the update
    lrn.submit(_rollouts())
    assert state["total_submit_seconds"] < lrn.state()["total_submit_seconds"]


def test_served_update_moves_drafter_toward_served_distribution(drafter, features):
    """Served p puts 0.8 / 0.15 on two draft tokens per position (unrelated to the copy); after an update from it,
    KL(served p ‖ q) over the trained positions falls."""
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 344, (6,), generator=g).tolist() for _ in range(4)]
    picks = torch.randint(0, len(DRAFT_IDS), (4, 6), generator=g).tolist()
    top = [[[[DRAFT_IDS[a], math.log(0.8)], [DRAFT_IDS[(a + 7) % 64], math.log(0.15)]] for a in row] for row in picks]
    rollouts = [{"prompt_ids": PROMPT, "response_ids": r, "reward": 1.0, "target_top_logprobs": t}
                for r, t in zip(responses, top)]  # fmt: skip
    seqs = [(PROMPT, r) for r in responses]

    def served_kl(model) -> float:
        with torch.no_grad():
            (step,) = unroll(model, features.batch(seqs), 1)
        total = 0.0
        for b, rows in enumerate(top):
            for i, row in enumerate(rows):
                mass = sum(math.exp(lp) for _, lp in row)
                log_q = step.log_q[b, len(PROMPT) - 2 + i]
                total += sum(math.exp(lp) / mass * (lp - math.log(mass) - float(log_q[_draft(t)])) for t, lp in row)
        return total / (6 * len(top))

    before = served_kl(drafter)
    lrn = _sync_learner(drafter, features, cfg={"train_steps": 12, "micro_batch": 4, "lr": 5e-3})
    lrn.submit(rollouts)
    record = lrn.history[-1]
    assert record.outcome == "published" and record.target_source == "served"
    after = served_kl(lrn.current()[1])
    assert after < 0.5 * before, (before, after)
