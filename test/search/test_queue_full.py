"""SGLang's ``--max-queued-requests``: a search's own fan-out overflows a small queue. A primary refused with 503
"The request queue is full." is sent again after a bounded back-off (its node does not fail), a speculative one is
a miss, and the search returns the tree its baseline (speculation off) returns."""

from __future__ import annotations

from typing import Iterator, List, Optional

import fastapi
import httpx
import pytest
from server_modes import FANOUT_SEARCH, spex_args, start_server

from sglang_spex.serve import ServerProcess
from sglang_spex.tot import backpressure
from sglang_spex.tot.backpressure import QueueFull, QueueGate, refused_for_load
from sglang_spex.tot.engine import ROLE_PRIMARY, ROLE_SPEC, EnginePort, GenRequest, GenResult, node_rid
from sglang_spex.tot.http_port import HttpPort, WorkerBusy

from .helpers import BASELINE, post_search

BODY = FANOUT_SEARCH
FULL = fastapi.HTTPException(status_code=503, detail="The request queue is full.")


class _RefusingPort(EnginePort):
    """Refuses the first ``refusals`` requests as SGLang's full queue does, then answers."""

    def __init__(self, refusals: int, error: Optional[BaseException] = None):
        self.refusals, self.error, self.sent = refusals, error or FULL, 0

    async def generate(self, req: GenRequest) -> GenResult:
        self.sent += 1
        if self.sent <= self.refusals:
            raise self.error
        return GenResult(rid=req.rid, text="ok", output_ids=[1], finish_reason="stop")

    async def abort(self, rid_or_prefix: str) -> None:
        pass


@pytest.fixture
def fast_backoff(monkeypatch) -> None:
    monkeypatch.setattr(backpressure, "QUEUE_FULL_BACKOFF_S", (0.01, 0.01, 0.01))


async def test_primary_refused_for_load_is_sent_again(fast_backoff) -> None:
    port, gate, waits = _RefusingPort(2), QueueGate(), []
    res = await gate.generate_primary(port, GenRequest(prompt="p", rid="spex:s:r.0:"), waiting=waits.append)
    assert (res.text, port.sent, waits) == ("ok", 3, [True, False, True, False])
    assert not gate.spec_ok()  # the queue was at its cap just now: no speculation


async def test_primary_still_refused_fails_with_a_clear_error(fast_backoff) -> None:
    with pytest.raises(QueueFull, match="queue stayed full"):
        await QueueGate().generate_primary(_RefusingPort(99), GenRequest(prompt="p", rid="r"))


async def test_cancelled_while_backing_off_is_not_sent_again(fast_backoff) -> None:
    port = _RefusingPort(99)
    res = await QueueGate().generate_primary(port, GenRequest(prompt="p", rid="r"), cancelled=lambda: True)
    assert res.aborted and port.sent == 1


async def test_other_errors_are_not_retried() -> None:
    not_load = (
        ValueError("bad"),
        fastapi.HTTPException(status_code=503, detail="Request waiting timeout reached."),
        fastapi.HTTPException(status_code=503, detail="Using priority is disabled for this server. Please send a new"),
    )
    for error in not_load:
        port = _RefusingPort(1, error)
        with pytest.raises(type(error)):
            await QueueGate().generate_primary(port, GenRequest(prompt="p", rid="r"))
        assert port.sent == 1
    assert refused_for_load(FULL) and not refused_for_load(ValueError("The request queue is full."))
    for load in ("The request is aborted by a higher priority request.", "Retracted under decode memory pressure "
                 "without a KV backup. Retry later."):  # fmt: skip
        assert refused_for_load(fastapi.HTTPException(status_code=503, detail=load))


def test_speculation_gate() -> None:
    now: List[float] = [0.0]
    gate = QueueGate(clock=lambda: now[0])
    assert gate.spec_ok()
    gate.note_refused()
    assert not gate.spec_ok()
    now[0] = backpressure.SPEC_HOLD_S
    assert gate.spec_ok()
    gate.backing_off = 1
    assert not gate.spec_ok()
    assert QueueGate(capped=False, clock=lambda: now[0]).spec_ok()


async def test_http_speculative_request_refused_is_a_miss_not_retried(fast_backoff) -> None:
    sent: List[str] = []

    def full(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        return httpx.Response(503, json={"object": "error", "message": FULL.detail, "code": 503})

    port = HttpPort("http://server:1", client=httpx.AsyncClient(transport=httpx.MockTransport(full)))
    req = GenRequest(prompt="p", rid=node_rid("s1", "r.0", ROLE_SPEC), role=ROLE_SPEC, search_id="s1")
    with pytest.raises(WorkerBusy) as err:  # (SPEX's runner takes any error of a speculative request as a miss)
        await port.generate(req)
    assert sent == ["/generate"] and refused_for_load(err.value) and not port.lost
    # a primary HttpPort found refused is sent again by the gate (HttpPort has no retry loop of its own)
    gate = QueueGate()
    primary = GenRequest(prompt="p", rid=node_rid("s1", "r.1", ROLE_PRIMARY), role=ROLE_PRIMARY, search_id="s1")
    busy = _RefusingPort(1, err.value)
    assert (await gate.generate_primary(busy, primary)).text == "ok"
    assert busy.sent == 2 and not gate.spec_ok()
    await port.close()


@pytest.fixture(scope="module")
def capped_server(tiny_model) -> Iterator[ServerProcess]:
    srv = start_server([*spex_args(tiny_model), "--max-queued-requests", "2"])
    yield srv
    srv.stop()


def _tree(result: dict) -> list:
    return sorted((n["path"], n["status"], n["text"]) for n in result["nodes"])


@pytest.mark.server
def test_search_on_a_capped_queue_has_no_failures_and_the_baseline_tree(capped_server) -> None:
    searched = post_search(capped_server.url, BODY).json()
    assert searched["status"] == "done" and searched["failures"] == [], searched.get("failures")
    # the same search without speculation (its primaries alone overflow the queue too, and are sent again)
    baseline = post_search(capped_server.url, {**BODY, "spec": {**BODY["spec"], "speculation": BASELINE}}).json()
    assert baseline["status"] == "done" and baseline["failures"] == [], baseline.get("failures")
    assert _tree(searched) == _tree(baseline)


def test_profile_on_a_capped_queue_stops_at_the_cap(capped_server) -> None:
    """``POST /spex/profile`` on a server whose queue holds 2: the sweep measures no burst the queue would refuse
    (before, batch 4 was refused 503 and the measurement failed)."""
    small = {"short_tokens": 2, "long_tokens": 6, "ctx_prefix_words": 0, "prefill_words": 0, "repeats": 1}
    r = httpx.post(capped_server.url + "/spex/profile", json=small, timeout=120)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["batch_sizes"] == [1, 2] and d["meta"]["sweep_limit"] == 2
    r = httpx.post(capped_server.url + "/spex/profile", json={**small, "batch_sizes": [1, 4]}, timeout=30)
    assert r.status_code == 400 and "batch_sizes" in r.text  # past the cap: named, nothing measured
