"""A weight push that finds another writer's session open hands generation back while it waits, and a push into a
server someone else paused leaves that pause alone (``HotSwapClient.push``, steps 0, 1 and 4 of ``hotswap.py``).

The sequence logic runs against an in-process stand-in of SGLang's routes; the acceptance test runs on the tiny
plain server: while a learner's push waits out an open session, a new request is served to the end.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import List

import httpx
import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from fastapi.testclient import TestClient
from safetensors import safe_open

from sglang_spex.respec.hotswap import HotSwapClient


def _stand_in(refusals: int, paused: bool = False):
    """SGLang's pause/session routes; ``begin`` is refused ``refusals`` times (another writer's session)."""
    app, log = FastAPI(), []
    app.state.paused, app.state.refusals = paused, refusals
    ok = {"success": True, "message": "Success"}

    @app.get("/ready")
    async def ready():
        return Response(status_code=503 if app.state.paused else 200)

    @app.post("/pause_generation")
    async def pause():
        app.state.paused = True
        log.append("pause")
        return {"status": "ok"}

    @app.post("/continue_generation")
    async def resume():
        app.state.paused = False
        log.append("continue")
        return {"status": "ok"}

    @app.post("/begin_weight_update")
    async def begin():
        if app.state.refusals > 0:
            app.state.refusals -= 1
            log.append(f"begin refused ({'paused' if app.state.paused else 'running'})")
            return JSONResponse({"success": False, "message": "a weight-update session is already open"}, 400)
        log.append("begin")
        return ok

    @app.post("/update_weights_from_tensor")
    async def update():
        log.append("update")
        return ok

    @app.post("/end_weight_update")
    async def end():
        log.append("end")
        return ok

    return app, log


def _client(app: FastAPI, **kw) -> HotSwapClient:
    c = TestClient(app)
    return HotSwapClient("http://testserver", post=c.post, get=c.get, selector="target", retry_sleep=0.0, **kw)


def test_a_refused_begin_releases_the_pause_before_waiting():
    app, log = _stand_in(refusals=3)
    _client(app, begin_retries=5).push(1, [("w", torch.ones(2))])
    assert log == ["pause", "begin refused (paused)", "continue"] * 3 + ["pause", "begin", "update", "end", "continue"]
    assert app.state.paused is False


def test_the_last_refusal_raises_and_leaves_generation_running():
    app, log = _stand_in(refusals=10)
    try:
        _client(app, begin_retries=2).push(1, [("w", torch.ones(2))])
        raise AssertionError("the push should fail")
    except Exception as e:
        assert "begin_weight_update" in str(e)
    assert log == ["pause", "begin refused (paused)", "continue"] * 3
    assert app.state.paused is False


def test_someone_elses_pause_is_neither_taken_again_nor_released():
    app, log = _stand_in(refusals=1, paused=True)
    _client(app, begin_retries=2).push(1, [("w", torch.ones(2))])
    assert log == ["begin refused (paused)", "begin", "update", "end"]
    assert app.state.paused is True


def _norm_weight(model_dir: str) -> List:
    """``model.norm.weight`` as the tiny model has it on disk (pushing it back changes nothing others see)."""
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            if "model.norm.weight" in f.keys():
                return [("model.norm.weight", f.get_tensor("model.norm.weight"))]
    raise AssertionError(f"no model.norm.weight in {model_dir}")


def test_generation_runs_while_a_push_waits_for_another_writers_session(plain_server, tiny_model):
    url = plain_server.url
    named = _norm_weight(tiny_model)
    other = httpx.post(url + "/begin_weight_update", json={"selector": "target"}, timeout=60)  # the RL trainer's
    assert other.status_code == 200 and other.json()["success"], other.text
    pusher = HotSwapClient(url, selector="target", begin_retries=400, retry_sleep=0.05, tag_weight_version=False)
    errors: List[BaseException] = []

    def push():
        try:
            pusher.push(1, named)
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=push, daemon=True)
    done = threading.Event()
    try:
        t.start()
        time.sleep(1.0)  # the push is retrying its begin by now
        assert t.is_alive(), errors

        def generate():
            body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}}
            r = httpx.post(url + "/generate", json=body, timeout=60)
            if r.status_code == 200:
                done.set()

        threading.Thread(target=generate, daemon=True).start()
        served = done.wait(timeout=10.0)
        still_waiting = t.is_alive()
    finally:
        httpx.post(url + "/end_weight_update", json={}, timeout=60)  # the other writer closes its session
        t.join(timeout=30)
        httpx.post(url + "/continue_generation", json={}, timeout=60)  # never leave the shared server paused
    assert served, "a request sent while the push waited was not served within 10 s (generation was paused)"
    assert still_waiting  # it was served while the push still waited, not after
    assert not t.is_alive() and not errors, errors
    assert pusher.pushed_versions == [1]
    assert httpx.get(url + "/ready", timeout=10).status_code == 200
