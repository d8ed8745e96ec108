"""Hook U1: a tensor weight update the model cannot load fails the update instead of the scheduler.

SGLang 0.5.23's ``WeightUpdater.update_weights_from_tensor`` calls the model's ``load_weights`` without a guard, so
a tensor whose shape the loader asserts on (or any other loader error) raises in the scheduler's event loop and the
server exits (SIGQUIT, process tree killed) — for the target and, through ``selector`` draft, for the drafter a
learner publishes. Its ``update_weights_from_disk`` already turns the same failure into ``(False, message)``. U1
does that for tensors: the scheduler answers ``success: false`` with the loader's reason, SGLang logs it, and the
weights may be partially updated (a publisher pushes a full set again; the drafter only proposes tokens the target
verifies).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Tuple

logger = logging.getLogger(__name__)


def u1_update_weights_from_tensor(original: Callable[..., Tuple[bool, str]], *args: Any, **kwargs: Any) -> Any:
    """U1 (AROUND ``WeightUpdater.update_weights_from_tensor``): SGLang's result, or ``(False, reason)`` when
    loading the tensors raised."""
    try:
        return original(*args, **kwargs)
    except Exception as e:  # a name, shape or dtype the model's load_weights refuses
        message = (
            f"Failed to update parameters from tensors: {type(e).__name__}: {e}. "
            "The weights may be partially updated: push a full set again."
        )
        logger.error("spex: %s", message)
        return False, message
