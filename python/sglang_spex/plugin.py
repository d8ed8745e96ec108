"""The ``sglang.srt.plugins`` entry point. Decides which hooks to register; nothing else.

SGLang calls :func:`register` early in every process it starts (HTTP server, scheduler, detokenizer).
Without ``--tot-speculation`` only the read-only report hook is registered, so ``/spex/info`` can prove
that the plugin is inert; the server otherwise behaves as plain SGLang.
"""

from __future__ import annotations

import logging
import sys

from sglang_spex.config import SpexConfig

logger = logging.getLogger(__name__)

HTTP_SERVER_MODULE = "sglang.srt.entrypoints.http_server"


def register() -> None:
    from sglang_spex.srt import hooks

    cfg = SpexConfig.from_env()
    hooks.register_all(cfg)
    if HTTP_SERVER_MODULE in sys.modules:  # the process that serves HTTP
        from sglang_spex.srt import routes

        routes.install(sys.modules[HTTP_SERVER_MODULE].app, cfg)
    logger.info("sglang-spex plugin registered (speculation=%s)", cfg.enabled)
