"""Sync-mode ``POST /respec/rollouts`` and the shared threadpool: posts waiting for their updates do not each hold
one of AnyIO's worker threads (the updates run on the learner's one worker), so with the pool cut to 4 threads and
8 posts waiting on a blocked update, other ``run_in_threadpool`` routes (a policy push, any plain one) still answer;
each post answers after its own update, with the same fields as before."""

from __future__ import annotations

import asyncio
import threading

import anyio.to_thread
import httpx
import torch
from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from sglang_spex.respec import policy_wire, routes
from sglang_spex.respec.learner import LearnerConfig, OnlineLearner

POSTS = 8
THREADS = 4  # the pool's size for this test (AnyIO's default is 40): fewer than the posts
ANSWER_FIELDS = {"accepted", "buffer_size", "version", "update_due", "training"}


async def _until(condition, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not condition():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_posts_waiting_on_sync_updates_leave_the_threadpool_to_other_routes(
    tiny_drafter, tiny_features, tiny_seqs
):
    cfg = LearnerConfig(mode="sync", variant="unweighted", update_interval=1, train_steps=1, micro_batch=1)
    lrn = OnlineLearner(tiny_drafter, tiny_features.batch, cfg, publish=lambda v, t: None, policy_sync=len)
    entered, release = threading.Event(), threading.Event()

    def blocked_features(*args, **kw):  # the first update waits here until the test lets it go
        entered.set()
        release.wait(60)
        return tiny_features.batch(*args, **kw)

    lrn.features = blocked_features
    app = FastAPI()
    routes.install(app, lrn)

    @app.get("/ping")
    async def ping():
        return {"pong": await run_in_threadpool(lambda: threading.current_thread().name)}

    limiter = anyio.to_thread.current_default_thread_limiter()  # this event loop's pool, the app's too
    tokens, limiter.total_tokens = limiter.total_tokens, THREADS
    transport = httpx.ASGITransport(app=app)
    posts = []
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            for i in range(POSTS):
                p, r = tiny_seqs[i % len(tiny_seqs)]
                body = {"rollouts": [{"prompt_ids": list(p), "response_ids": list(r), "reward": 1.0}]}
                posts.append(asyncio.create_task(http.post("/respec/rollouts", json=body)))
            assert await _until(entered.is_set, 30), "the first update never started"
            await _until(lambda: lrn.buffer.total_added == POSTS, 5)  # every post validated and queued
            assert not any(t.done() for t in posts)  # sync: each waits for its update

            try:
                pong = await asyncio.wait_for(http.get("/ping"), 5)
                named = [("w", torch.ones(2))]
                push = http.post(
                    "/respec/policy",
                    content=policy_wire.encode(1, named),
                    headers={"content-type": policy_wire.CONTENT_TYPE},
                )
                pushed = await asyncio.wait_for(push, 5)
            except asyncio.TimeoutError:
                raise AssertionError(
                    f"{POSTS} rollout posts waiting on a sync update took the threadpool ({THREADS} threads): "
                    "a run_in_threadpool route did not answer in 5 s"
                ) from None
            assert pong.status_code == 200, pong.text
            assert pushed.status_code == 200 and pushed.json() == {"loaded": 1, "policy_version": 1}, pushed.text
            assert lrn.buffer.total_added == POSTS
            assert not any(t.done() for t in posts)  # the update still blocked: no post answered early

            release.set()
            answers = await asyncio.wait_for(asyncio.gather(*posts), 120)
    finally:
        release.set()
        limiter.total_tokens = tokens
        for t in posts:
            t.cancel()
    for a in answers:
        assert a.status_code == 200, a.text
        assert set(a.json()) == ANSWER_FIELDS and a.json()["update_due"] is True and a.json()["accepted"] == 1
    assert lrn.wait_idle(60) and lrn.attempts == POSTS  # one update per post, every one run
    assert lrn.version >= 1 and max(a.json()["version"] for a in answers) == lrn.version
