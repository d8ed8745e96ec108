"""A client that disconnects before its whole request body came: ``read_body`` raises the plugin's ``BodyError``
(499, field ``body``) instead of Starlette's ``ClientDisconnect``, so a route ends quietly (no 500, no traceback),
with a size limit or without one (``limit=None``, admin-scoped weight uploads)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import List, Optional

import pytest
from fastapi import FastAPI
from starlette.requests import Request

from sglang_spex.config import LearnerConfig
from sglang_spex.respec import routes
from sglang_spex.srt.http_api import BodyError, ProtectBody, json_body, read_body, read_json

CLIENT_CLOSED = 499  # ``http_api.CLIENT_CLOSED``: nginx's "client closed request"


def _scope(path: str = "/", content_length: Optional[int] = 1000) -> dict:
    headers = [(b"content-type", b"application/json")]
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    return {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b"", "app": None}


def _receive():
    """One chunk that says more follows, then the client is gone."""
    messages = [{"type": "http.request", "body": b'{"rollouts": [', "more_body": True}, {"type": "http.disconnect"}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return receive


@pytest.mark.parametrize("limit", [1 << 20, None])
async def test_a_disconnect_mid_body_is_a_body_error(limit):
    request = Request(_scope(), _receive())
    with pytest.raises(BodyError) as e:
        await read_body(request, limit)
    assert e.value.status_code == CLIENT_CLOSED and e.value.field == "body"
    assert "disconnected" in e.value.reason


async def test_read_json_passes_the_disconnect_on_as_a_body_error():
    request = Request(_scope(), _receive())
    with pytest.raises(BodyError) as e:
        await read_json(request, limit=None)
    assert e.value.status_code == CLIENT_CLOSED


async def _call(app: FastAPI, path: str) -> List[dict]:
    sent: List[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {**_scope(path), "app": app, "root_path": "", "server": ("test", 80), "client": ("test", 1)}
    await app(scope, _receive(), send)  # an exception out of a route would raise here
    return sent


async def test_routes_answer_a_disconnected_client_quietly():
    """A ``json_body`` route and ``POST /respec/rollouts`` answer 499 (the client is gone: nobody reads it) and
    raise nothing; the learner is never reached."""
    app = FastAPI()

    @app.post("/protect")
    @json_body(ProtectBody)
    async def protect(request, body):  # pragma: no cover - the body never arrives
        raise AssertionError("the handler ran without a body")

    learner = SimpleNamespace(config=LearnerConfig(), submit=None)  # submit=None: calling it would raise
    routes.install(app, learner)
    for path in ("/protect", "/respec/rollouts"):
        sent = await _call(app, path)
        start = next(m for m in sent if m["type"] == "http.response.start")
        assert start["status"] == CLIENT_CLOSED, (path, sent)
