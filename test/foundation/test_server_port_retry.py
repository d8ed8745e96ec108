"""ServerProcess starts again on a new port when another process took the one it picked (uvicorn would neither
serve nor exit), on a real tiny server: the session's ``plain_server`` is started that way (``test/conftest.py``)."""

from __future__ import annotations

import httpx


def test_a_taken_port_is_replaced(plain_server):
    assert plain_server.port != plain_server.taken_port
    assert httpx.get(plain_server.url + "/health", timeout=30).status_code == 200
