"""Fixtures for the scheduler-hook tests (real SGLang CPU servers, tiny model), in both scheduler modes."""

from __future__ import annotations

from typing import Iterator

import pytest
from server_modes import MODES, start_server

from sglang_spex.serve import ServerProcess

SMALL_POOL_TOKENS = 1200  # room for about four 280-token requests: too small for the ranking workload


@pytest.fixture(scope="session", params=MODES)
def small_pool_server(request, tiny_model) -> Iterator[ServerProcess]:
    """--tot-speculation with a tiny KV pool (ranking and protection under eviction pressure), per mode. A fixed
    ``--tot-k-total``: with ``auto`` a fresh machine measures its roofline profile in the background, and that
    sweep's requests share the pool the tests measure."""
    args = ["--model-path", tiny_model, "--tot-speculation", "--tot-k-total", "8"]
    args += ["--max-total-tokens", str(SMALL_POOL_TOKENS)]
    srv = start_server(args, request.param)
    yield srv
    srv.stop()
