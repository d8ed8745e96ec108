"""The plugin's state in the SGLang HTTP server process, kept where SGLang keeps its own: ``app.state``.

One :class:`SpexHttpState` per app (``app.state.spex``), made by ``srt.routes.install``; route handlers
reach it through ``request.app.state``. It holds the engine port (one per process), the search service (and
through it the SPEX budget) and the roofline profile manager. SGLang creates its TokenizerManager after the
plugin installs the routes, so the port and the profile manager are made on first use.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request

from sglang_spex.config import SpexConfig
from sglang_spex.profile.manager import ProfileManager
from sglang_spex.profile.measure import profile_key, server_args_dict
from sglang_spex.srt.engine_port import TokenizerManagerPort
from sglang_spex.srt.http_api import STATE_ATTR
from sglang_spex.srt.search_service import SearchService


class SpexHttpState:
    """Everything the plugin's routes share in one HTTP server process."""

    def __init__(self, cfg: SpexConfig, global_state: Callable[[], Any]):
        self.cfg = cfg
        self._global_state = global_state  # SGLang's http_server.get_global_state
        self._port: Optional[TokenizerManagerPort] = None
        self._profile: Optional[ProfileManager] = None
        self.searches = SearchService(lambda: self.port, cfg, lambda: self.profile)
        self.profile_thread: Optional[threading.Thread] = None  # --tot-k-total auto: background profiling

    @property
    def tokenizer_manager(self) -> Any:
        state = self._global_state()
        if state is None:
            raise RuntimeError("SGLang HTTP server state is not initialised yet")
        return state.tokenizer_manager

    @property
    def port(self) -> TokenizerManagerPort:
        if self._port is None:
            self._port = TokenizerManagerPort(self.tokenizer_manager, spex_control=self.cfg.enabled)
        return self._port

    @property
    def profile(self) -> ProfileManager:
        """The server's roofline :class:`ProfileManager` (loads a cached profile when it is made); a due re-profile
        also waits for the server-side searches to end (``in_use``: running or queued, in every mode)."""
        if self._profile is None:
            key = profile_key(server_args_dict(self.tokenizer_manager.server_args))
            self._profile = ProfileManager(self.port, key)
            self._profile.in_use = lambda: any(self.searches.counts().values())
        return self._profile


def http_state(request: Request) -> SpexHttpState:
    """The state of the app serving ``request``."""
    return getattr(request.app.state, STATE_ATTR)


def installed(app: FastAPI) -> bool:
    """Whether ``app`` already has the plugin's state (and so its routes)."""
    return getattr(app.state, STATE_ATTR, None) is not None


def attach(app: FastAPI, state: SpexHttpState) -> None:
    """Store ``state`` on ``app`` (``app.state.spex``)."""
    setattr(app.state, STATE_ATTR, state)
