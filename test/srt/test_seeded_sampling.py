"""Hook H2c on SGLang's own sampler code: a seeded batch that SGLang cannot sample seeded runs unseeded, once.

SGLang 0.5.23's ``Sampler._sample_from_probs`` asserts ``sampling_seed is None`` on the flashinfer/intel_xpu
top-k/top-p path (the GPU default) and, on every backend, when min-p is needed. These tests run that real method
with the backend the sampler reads patched to ``flashinfer`` and its fused kernel (absent on CPU) replaced by a
torch argmax; the min-p case runs end to end on a server in ``test/foundation/test_server.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers import sampler as sgl_sampler

from sglang_spex.srt import seeded_sampling
from sglang_spex.srt.seeded_sampling import h2c_sample, unusable_seed_reason

VOCAB = 32


def batch(n=3, seeded=True, top_p=1.0, top_k=None, min_p=0.0, greedy=False):
    return SimpleNamespace(
        sampling_seed=torch.arange(n, dtype=torch.int64) + 7 if seeded else None,
        is_all_greedy=greedy,
        need_top_p_sampling=top_p < 1.0,
        need_top_k_sampling=top_k is not None,
        need_min_p_sampling=min_p > 0,
        top_ps=torch.full((n,), top_p),
        top_ks=torch.full((n,), top_k or VOCAB, dtype=torch.int32),
        min_ps=torch.full((n,), min_p),
        max_top_k=top_k or VOCAB,
        sampling_mask_batch_indices=None,
    )


@pytest.fixture
def flashinfer(monkeypatch):
    """SGLang's sampler and H2c both see the flashinfer backend; its fused top-k/top-p kernel is an argmax."""
    exec_cfg = SimpleNamespace(kernel=SimpleNamespace(sampling_backend="flashinfer"))
    monkeypatch.setattr(sgl_sampler, "get_exec", lambda: exec_cfg)
    monkeypatch.setattr(seeded_sampling, "sampling_backend", lambda: "flashinfer")
    # on CPU SGLang never binds the name (CUDA: flashinfer.sampling, lazily)
    monkeypatch.setattr(sgl_sampler, "top_k_top_p_sampling_from_probs", lambda p, *a, **k: p.argmax(-1), raising=False)


def sample_top_p(sampler, logits_output, info):
    """Stands for ``Sampler.forward``: SGLang's own branch for a batch that needs top-k/top-p."""
    probs = torch.softmax(logits_output, -1)
    return sgl_sampler.Sampler._sample_from_probs(sampler, probs, info, torch.arange(probs.shape[0]), False)[0]


def test_sglang_asserts_on_a_seeded_top_p_batch_under_flashinfer(flashinfer):
    with pytest.raises(AssertionError, match="[Ss]eed"):
        sample_top_p(None, torch.randn(3, VOCAB), batch(top_p=0.9))


def test_h2c_samples_that_step_unseeded_and_puts_the_seeds_back(flashinfer):
    info, logits = batch(top_p=0.9), torch.randn(3, VOCAB)
    seeds = info.sampling_seed
    seen = []

    def original(sampler, lo, inf):
        seen.append(inf.sampling_seed)
        return sample_top_p(sampler, lo, inf)

    out = h2c_sample(original, None, logits, info)
    assert torch.equal(out, logits.argmax(-1)) and seen == [None]
    assert info.sampling_seed is seeds


def test_h2c_counts_each_step_it_samples_unseeded_on_the_sampler(flashinfer):
    sampler = SimpleNamespace()
    h2c_sample(lambda *a: None, sampler, None, batch(n=3, min_p=0.1))
    h2c_sample(lambda *a: None, sampler, None, batch(n=2))  # seeds usable: not counted
    h2c_sample(lambda *a: None, sampler, None, batch(n=5, top_k=4))
    assert seeded_sampling.unseeded_counts(sampler) == {"steps": 2, "rows": 8}
    assert seeded_sampling.unseeded_counts(SimpleNamespace()) == {"steps": 0, "rows": 0}
    h2c_sample(lambda *a: None, None, None, batch(min_p=0.1))  # nothing to count on: the step still samples


def test_h2c_leaves_batches_sglang_can_sample_seeded_alone(flashinfer):
    """Seeds reach the sampler for a simple seeded batch, a greedy one and an unseeded one."""
    for info in (batch(), batch(greedy=True, top_p=0.9), batch(seeded=False, top_p=0.9)):
        seen = []
        h2c_sample(lambda s, lo, inf: seen.append(inf.sampling_seed), None, None, info)
        assert seen[0] is info.sampling_seed


def test_h2c_restores_the_seeds_when_sampling_raises(flashinfer):
    info = batch(min_p=0.1)
    seeds = info.sampling_seed

    def boom(*args):
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        h2c_sample(boom, None, None, info)
    assert info.sampling_seed is seeds


@pytest.mark.parametrize(
    "backend, kw, reason",
    [
        ("pytorch", {"top_p": 0.9, "top_k": 5}, None),
        ("pytorch", {"min_p": 0.1}, "min_p"),
        ("flashinfer", {"top_k": 5}, "top_k/top_p under the flashinfer sampling backend"),
        ("intel_xpu", {"top_p": 0.5}, "top_k/top_p under the intel_xpu sampling backend"),
        ("flashinfer", {}, None),
        ("ascend", {"min_p": 0.1, "top_p": 0.5}, None),
    ],
)
def test_which_seeded_batches_sglang_refuses(backend, kw, reason):
    assert unusable_seed_reason(batch(**kw), backend) == reason
    assert unusable_seed_reason(batch(seeded=False, **kw), backend) is None


@pytest.mark.parametrize("device, pinned", [("cpu", False), ("cuda", True), ("cuda:1", True)])
def test_h2_copies_the_seeds_as_sglang_copies_its_sampling_tensors(monkeypatch, device, pinned):
    """H2's seed tensor goes to a CUDA device from pinned memory without blocking, as SGLang's own sampling tensors
    do (``SamplingBatchInfo.from_schedule_batch``): a blocking copy would wait for the forward in flight. On CPU
    neither applies. (No CUDA here: the host tensor and its copy are recorded, not made.)"""
    made, copied = [], []

    class Host:
        def to(self, dev, non_blocking=False):
            copied.append((dev, non_blocking))
            return "on device"

    monkeypatch.setattr(seeded_sampling.torch, "tensor", lambda values, **kw: made.append((values, kw)) or Host())
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(sampling_seed=s)) for s in (5, 9)]
    result = SimpleNamespace(sampling_seed=None)
    seeded_sampling.h2_seeded_sampling(result, None, SimpleNamespace(reqs=reqs, device=device))
    assert made == [([5, 9], {"dtype": torch.int64, "pin_memory": pinned})]
    assert copied == [(device, pinned)] and result.sampling_seed == "on device"
