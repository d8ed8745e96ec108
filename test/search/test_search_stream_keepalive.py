"""``POST /tot/search`` with ``"stream": true`` sends an SSE comment while a search has nothing to report, so a
proxy's idle timeout does not cut the stream (a cut stream cancels the search); the events are unchanged."""

import asyncio
from types import SimpleNamespace

from sglang_spex.srt import search_service
from sglang_spex.srt.search_service import KEEPALIVE, StreamQueue, _stream


def test_a_quiet_search_stream_sends_keep_alives_and_then_its_events(monkeypatch):
    monkeypatch.setattr(search_service, "KEEPALIVE_S", 0.05)
    queue = StreamQueue()
    handle = SimpleNamespace(id="s1", subscribers=[queue], finished=False)
    cancelled = []

    async def cancel(search_id, reason):
        cancelled.append((search_id, reason))

    async def main():
        frames = []
        gen = _stream(SimpleNamespace(cancel=cancel), handle, queue)
        frames.append(await gen.__anext__())  # started
        frames.append(await gen.__anext__())  # nothing for 0.05 s: a comment
        queue.put_nowait({"event": "frontier", "depth": 1})
        frames.append(await gen.__anext__())
        handle.finished = True
        queue.put_nowait({"event": "result", "result": {"status": "done"}})
        frames += [f async for f in gen]
        return frames

    frames = asyncio.run(main())
    assert frames[0].startswith("event: started")
    assert frames[1] == KEEPALIVE and frames[1].startswith(":")  # an SSE comment: clients skip it
    assert frames[2].startswith("event: frontier") and frames[3].startswith("event: result")
    assert len(frames) == 4 and cancelled == []  # no event lost, nothing cancelled
