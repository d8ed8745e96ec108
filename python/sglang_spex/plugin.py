"""The ``sglang.srt.plugins`` entry point: hands this process's config to :mod:`sglang_spex.srt.hooks`.

SGLang calls :func:`register` early in every process it starts (HTTP server, scheduler, detokenizer), then applies
the registered hooks. Which touch points a process gets (the report hook always, the HTTP routes in the HTTP
process, SPEX hooks only with ``--tot-speculation``) is decided by the feature table in ``srt/hooks.py``.
"""

from __future__ import annotations

import logging

from sglang_spex.config import load
from sglang_spex.srt import hooks

logger = logging.getLogger(__name__)


def register() -> None:
    """Register this process's features (SGLang's plugin entry point)."""
    cfg = load().spex
    plan = hooks.register_all(cfg)
    logger.info("sglang-spex plugin registered (speculation=%s, features=%s, disabled=%s)", cfg.enabled,
                plan.enabled, sorted(plan.disabled))  # fmt: skip
