"""ServerProcess starts again on a new port when another process took the one it picked (uvicorn would neither
serve nor exit), on a real tiny server."""

from __future__ import annotations

import socket

import httpx
import pytest

from sglang_spex import serve

pytestmark = pytest.mark.server  # starts a server itself


def test_a_taken_port_is_replaced(tiny_model, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = serve.free_port
    monkeypatch.setattr(serve, "free_port", lambda: ports.pop(0) if ports else real())
    try:
        with serve.ServerProcess(["--model-path", tiny_model], startup_timeout=300) as srv:
            assert srv.port != taken.getsockname()[1]
            assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
    finally:
        taken.close()
