"""Hooks H2, H2b, H2c: per-request ``sampling_seed`` under ``--tot-speculation``, without a sampler SGLang refuses.

H2 gives a batch SGLang's ``sampling_seed`` tensor when any of its requests carries a seed (SGLang 0.5.23 reads
seeds only under ``--enable-deterministic-inference``), so a ToT node's sample is a function of (seed, position),
independent of its batch. H2b keeps seeded and unseeded batches mergeable.

SGLang's sampler asserts that a seeded batch never reaches a path that cannot use the seed (``layers/sampler.py``):
min-p on every backend but Ascend, and top-k / top-p on the ``flashinfer`` and ``intel_xpu`` backends (the GPU
default). Because H2 seeds a whole batch, one such request batched beside a seeded ToT node would kill the
scheduler. H2c (AROUND ``Sampler.forward``) lifts the seeds for exactly those steps and puts them back afterwards:
that step samples as SGLang does without seeds, every other step stays seeded. It counts them on the sampler
(``UNSEEDED_ATTR``: steps and rows; ``/spex/stats`` → ``scheduler.unseeded_sampling``), since a ToT node sampled in
such a step is no longer a function of its seed. The launcher makes ``pytorch`` the
sampling backend under ``--tot-speculation`` so that seeded top-k / top-p ToT steps keep their seeds on a GPU too.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Dict, Optional

import torch

logger = logging.getLogger(__name__)

# Sampling backends whose top-k / top-p path takes no seed (SGLang 0.5.23, Sampler._sample_from_probs).
UNSEEDED_TOP_K_P = ("flashinfer", "intel_xpu")
UNSEEDED_ATTR = "_spex_unseeded"  # on SGLang's Sampler: {"steps", "rows"} that H2c sampled without their seeds
_warned = set()


def _random_seeds(n: int, device: Any) -> torch.Tensor:
    return torch.randint(0, 2**62, (n,), dtype=torch.int64, device=device)


def seeds_on_device(values: list, device: Any) -> torch.Tensor:
    """The seeds as an int64 tensor on ``device``, copied as SGLang copies its sampling tensors: from pinned host
    memory without blocking on a CUDA device (a blocking copy on the scheduler's stream waits for the forward in
    flight and takes away the overlap scheduler's overlap)."""
    cuda = torch.device(device).type == "cuda"
    return torch.tensor(values, dtype=torch.int64, pin_memory=cuda).to(device, non_blocking=cuda)


def h2_seeded_sampling(result, cls, batch, *args, **kwargs):
    """H2 (AFTER ``SamplingBatchInfo.from_schedule_batch``): a seeded batch when any request has a seed; rows
    without one get a fresh random seed."""
    try:
        if result.sampling_seed is not None:
            return result
        seeds = [r.sampling_params.sampling_seed for r in batch.reqs]
        if all(s is None for s in seeds):
            return result
        fill = _random_seeds(len(seeds), "cpu").tolist()
        values = [s if s is not None else f for s, f in zip(seeds, fill)]
        result.sampling_seed = seeds_on_device(values, batch.device)
    except Exception:
        logger.exception("spex: H2 seeded sampling failed; falling back to unseeded sampling")
    return result


def h2_merge_seeds(self, other, *args, **kwargs):
    """H2b (BEFORE ``SamplingBatchInfo.merge_batch``): give the unseeded side random seeds so lengths match."""
    try:
        a, b = self.sampling_seed, other.sampling_seed
        if (a is None) != (b is None):
            side = self if a is None else other
            side.sampling_seed = _random_seeds(len(side), side.temperatures.device)
    except Exception:
        logger.exception("spex: H2b seed merge failed")
    return None


def unusable_seed_reason(sampling_info: Any, backend: Optional[str]) -> Optional[str]:
    """Why SGLang's sampler would assert on this seeded batch (None when the seeds can be used)."""
    if sampling_info.sampling_seed is None or sampling_info.is_all_greedy or backend == "ascend":
        return None
    if sampling_info.need_min_p_sampling:
        return "min_p"
    if backend in UNSEEDED_TOP_K_P and (sampling_info.need_top_p_sampling or sampling_info.need_top_k_sampling):
        return f"top_k/top_p under the {backend} sampling backend"
    return None


@functools.lru_cache(maxsize=1)
def sampling_backend() -> Optional[str]:
    """The process's sampling backend as SGLang's sampler reads it (touch point P21; fixed for a process's life)."""
    from sglang.srt.runtime_context import get_exec

    return get_exec().kernel.sampling_backend


def count_unseeded(sampler: Any, seeds: Any) -> None:
    """Count one step whose seeded rows (``seeds``, one per row) ``sampler`` samples without their seeds (never
    raises: a count must not stop a sampling step)."""
    try:
        counts = getattr(sampler, UNSEEDED_ATTR, None)
        if counts is None:
            counts = {"steps": 0, "rows": 0}
            setattr(sampler, UNSEEDED_ATTR, counts)
        counts["steps"] += 1
        counts["rows"] += len(seeds)
    except Exception:  # e.g. an object that takes no attributes: nothing to count on
        logger.debug("spex: H2c could not count an unseeded step on %r", type(sampler).__name__)


def unseeded_counts(sampler: Any) -> Dict[str, int]:
    """Steps and rows ``sampler`` sampled without their seeds (H2c); zeros when none."""
    return dict(getattr(sampler, UNSEEDED_ATTR, None) or {"steps": 0, "rows": 0})


def h2c_sample(original: Callable[..., Any], sampler, logits_output, sampling_info, *args, **kwargs):
    """H2c (AROUND ``Sampler.forward``): a step whose seeded batch SGLang cannot sample seeded runs unseeded."""
    if sampling_info.sampling_seed is None:  # the common step: nothing to inspect
        return original(sampler, logits_output, sampling_info, *args, **kwargs)
    reason = None
    try:
        reason = unusable_seed_reason(sampling_info, sampling_backend())
    except Exception:
        logger.exception("spex: H2c could not inspect the batch; sampling as SGLang does")
    if reason is None:
        return original(sampler, logits_output, sampling_info, *args, **kwargs)
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("spex: a batch with %s cannot be sampled with seeds; such steps sample unseeded", reason)
    seeds = sampling_info.sampling_seed
    count_unseeded(sampler, seeds)
    sampling_info.sampling_seed = None
    try:
        return original(sampler, logits_output, sampling_info, *args, **kwargs)
    finally:
        sampling_info.sampling_seed = seeds
