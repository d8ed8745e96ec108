"""Hook V1: speculative verify on CPU samples (rejection sampling) instead of committing the argmax.

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
Limit inherited from SGLang's sampling branch: min-p is not applied in verify. Top-k with top-p, which that
branch applies as two successive renormalisations, is the joint filter of the non-speculative CPU sampler with our
ops (``spec_sampling.KEPT_MASS``).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Dict, List, Tuple

from sglang.srt.plugins.hook_registry import HookType

try:
    from sgl_kernel_ext import spec_sampling
except ImportError:  # sgl-kernel-ext not installed: V1 stays inert
    spec_sampling = None

logger = logging.getLogger(__name__)

EAGLE_UTILS = "sglang.srt.speculative.eagle_utils"
OP_NAMES = ("tree_speculative_sampling_target_only", "top_k_renorm_prob", "top_p_renorm_prob")


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


HOOKS: List[Tuple[str, str, Callable[..., Any], HookType]] = [
    ("V1", f"{EAGLE_UTILS}._verify_uses_greedy", v1_verify_uses_greedy, HookType.AROUND),
]
