"""Fixtures and helpers for the scheduler-hook tests (real SGLang CPU servers, tiny model)."""

from __future__ import annotations

import pytest

from sglang_spex.serve import ServerProcess

SMALL_POOL_TOKENS = 1200  # room for about four 280-token requests: too small for the ranking workload


@pytest.fixture(scope="module")
def small_pool_server(tiny_model):
    """--tot-speculation with a tiny KV pool (ranking and protection under eviction pressure)."""
    srv = ServerProcess(["--model-path", tiny_model, "--tot-speculation", "--max-total-tokens", str(SMALL_POOL_TOKENS)])
    srv.start()
    yield srv
    srv.stop()
