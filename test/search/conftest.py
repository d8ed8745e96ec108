"""A server with every hardening flag set small: API and admin keys, per-search limits, one search slot."""

from __future__ import annotations

from typing import Iterator

import pytest
from server_modes import TINY, start_server

from sglang_spex.serve import ServerProcess

USER_KEY, ADMIN_KEY = "user-key-7f3a", "admin-key-91c2"
USER = {"Authorization": f"Bearer {USER_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CONTEXT_LEN = 256
LIMITS = {
    "max_width": 4,
    "max_depth": 3,
    "max_iterations": 3,
    "max_nodes": 12,
    "max_search_tokens": 96,
    "max_step_tokens": 16,
}
HARDENED_FLAGS = [
    "--tot-speculation",
    "--tot-k-total",
    "8",
    "--api-key",
    USER_KEY,
    "--admin-api-key",
    ADMIN_KEY,
    "--context-length",
    str(CONTEXT_LEN),
    "--tot-max-concurrent-searches",
    "1",
    "--tot-max-queued-searches",
    "1",
    "--tot-max-body-bytes",
    "65536",
    *[a for k, v in LIMITS.items() for a in (f"--tot-{k.replace('_', '-')}", str(v))],
]


@pytest.fixture(scope="session")
def hardened_server(tiny_model) -> Iterator[ServerProcess]:
    srv = start_server([*TINY, tiny_model, *HARDENED_FLAGS], headers=USER)
    yield srv
    srv.stop()
