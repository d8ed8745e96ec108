"""Hooks V1 and V3: speculative verify samples from the request's distribution (V1: on CPU at all; V3: min-p).

SGLang 0.5.23's ``eagle_sample`` (used by NGRAM, EAGLE/EAGLE3 and STANDALONE verify) asks
``_verify_uses_greedy(is_all_greedy, is_cpu, ...)`` whether to commit the target's argmax; it answers yes
whenever ``is_cpu``, because on CPU ``sglang.kernels.ops`` resolves ``tree_speculative_sampling_target_only``,
``top_k_renorm_prob`` and ``top_p_renorm_prob`` to ``None``. At temperature > 0 that makes every verified
token greedy: speculation changes the output distribution.

V1 wraps ``_verify_uses_greedy``: for a CPU batch that is not all greedy it binds the CPU ops of
:mod:`sgl_kernel_ext.spec_sampling` to those ``None`` names of ``eagle_utils`` (never over a real kernel)
and answers as SGLang does on CUDA, so the batch takes SGLang's own sampling branch (temperature softmax,
top-k / top-p renormalisation, coins, tree rejection sampling). All-greedy batches, non-CPU platforms and
``--speculative-use-rejection-sampling`` (its draft-probability kernel is Triton-only) are passed through
unchanged. Registered with or without ``--tot-speculation``: it is a correctness fix.
Top-k with top-p, which that branch applies as two successive renormalisations, is the joint filter of the
non-speculative CPU sampler with our ops (``spec_sampling.KEPT_MASS``).

V3 (AROUND ``eagle_utils.eagle_sample``) adds min-p, which SGLang's sampling branch leaves out on every device: for
a batch with a min-p request, the call's tree sampling op sees the target probabilities after top-k / top-p with
each row's tokens below ``min_p * max`` zeroed and the rest renormalised -- the non-speculative sampler's rule
(min-p is a ratio to the row's most likely token, which top-k / top-p always keep, so it commutes with their
renormalisations). The op is rebound on ``eagle_utils`` for that call only. ``--speculative-use-rejection-sampling``
(its Triton chain sampler) is left as SGLang has it.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Dict, List, Tuple

import torch
from sglang.srt.plugins.hook_registry import HookType

try:
    from sgl_kernel_ext import spec_sampling
except ImportError:  # sgl-kernel-ext not installed: V1 stays inert
    spec_sampling = None

logger = logging.getLogger(__name__)

EAGLE_UTILS = "sglang.srt.speculative.eagle_utils"
SAMPLING_OP = "tree_speculative_sampling_target_only"
OP_NAMES = (SAMPLING_OP, "top_k_renorm_prob", "top_p_renorm_prob")


def cpu_ops() -> Dict[str, Callable[..., Any]]:
    """The CPU implementations for the names in :data:`OP_NAMES` (empty without sgl-kernel-ext)."""
    if spec_sampling is None:
        return {}
    return {name: getattr(spec_sampling, name) for name in OP_NAMES}


def bind_cpu_ops(module: Any) -> bool:
    """Fill the ``None`` op names of ``module`` with the CPU ops; True when all of them are callable."""
    for name, op in cpu_ops().items():
        if getattr(module, name, None) is None:
            setattr(module, name, op)
    return all(callable(getattr(module, name, None)) for name in OP_NAMES)


def v1_verify_uses_greedy(original: Callable[..., bool], *args: Any, **kwargs: Any) -> bool:
    """V1 (AROUND ``eagle_utils._verify_uses_greedy``): on CPU, sampling batches take the sampling branch."""
    if kwargs.get("is_cpu") and not kwargs.get("is_all_greedy") and not kwargs.get("use_rejection_sampling"):
        try:
            if bind_cpu_ops(importlib.import_module(EAGLE_UTILS)):
                kwargs = {**kwargs, "is_cpu": False}
        except Exception:  # never break the scheduler: fall back to SGLang's greedy verify
            logger.exception("spex: V1 could not bind the CPU sampling ops; verify stays greedy")
    return original(*args, **kwargs)


def apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """``probs`` (rows, ..., vocab) with tokens below ``min_p * max`` of their row zeroed, renormalised.

    ``min_ps`` has one value per leading row (0 keeps the row as it is); the rule is SGLang's non-speculative one
    (a token is dropped when its probability is strictly below the threshold).
    """
    shape = (-1,) + (1,) * (probs.dim() - 1)
    threshold = min_ps.to(probs.dtype).view(shape) * probs.amax(dim=-1, keepdim=True)
    kept = probs.masked_fill(probs < threshold, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _sampling_with_min_p(op: Callable[..., Any], min_ps: torch.Tensor) -> Callable[..., Any]:
    def sample(**kwargs: Any) -> Any:
        kwargs["target_probs"] = apply_min_p(kwargs["target_probs"], min_ps)
        return op(**kwargs)

    return sample


def v3_eagle_sample(original: Callable[..., Any], verify_input: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """V3 (AROUND ``eagle_utils.eagle_sample``): a batch with a min-p request samples its verify with min-p."""
    info = getattr(batch, "sampling_info", None)
    if not getattr(info, "need_min_p_sampling", False) or getattr(info, "is_all_greedy", True):
        return original(verify_input, batch, *args, **kwargs)
    module = importlib.import_module(EAGLE_UTILS)
    op = None
    try:
        if info.min_ps.device.type == "cpu":
            bind_cpu_ops(module)  # what V1 binds for this batch anyway
        op = getattr(module, SAMPLING_OP, None)
        if op is not None:
            setattr(module, SAMPLING_OP, _sampling_with_min_p(op, info.min_ps))
    except Exception:  # never break the scheduler: verify as SGLang does
        logger.exception("spex: V3 could not bind min-p into verify; min-p is not applied to this batch")
        op = None
    try:
        return original(verify_input, batch, *args, **kwargs)
    finally:
        if op is not None:
            setattr(module, SAMPLING_OP, op)


HOOKS: List[Tuple[str, str, Callable[..., Any], HookType]] = [
    ("V1", f"{EAGLE_UTILS}._verify_uses_greedy", v1_verify_uses_greedy, HookType.AROUND),
    ("V3", f"{EAGLE_UTILS}.eagle_sample", v3_eagle_sample, HookType.AROUND),
]
