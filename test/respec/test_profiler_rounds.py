"""The profiler's point at a small batch covers several prompts (pure measurement logic; the HTTP calls are
replaced, the real-server path is test/respec/test_adaptive_profiler.py)."""

from __future__ import annotations

import pytest

from sglang_spex.respec import profiler


@pytest.fixture
def fake_server(monkeypatch):
    """A server whose acceptance depends on the prompt: prompt i accepts 1 + i tokens per verify step."""
    calls = []

    def generate(url, texts, n):
        calls.append((tuple(texts), n))
        return [{"spec_verify_ct": -(-n // (1 + int(t[1:]))), "spec_accept_length": 1.0 + int(t[1:])} for t in texts]

    monkeypatch.setattr(profiler, "_generate", generate)
    monkeypatch.setattr(profiler, "flush", lambda url: None)
    return calls


def test_small_batches_are_measured_on_several_prompts(fake_server):
    prompts = [f"p{i}" for i in range(4)]
    p = profiler.measure_point("u", 1, 8, 40, prompts, repeats=1, min_sequences=4)
    assert {texts for texts, _ in fake_server} == {("p0",), ("p1",), ("p2",), ("p3",)}
    assert [n for _, n in fake_server] == [8, 40] * 4
    # steps per prompt: 32, 16, 11, 8 (ceil-differences) -> 4 * 32 tokens over their sum
    steps = sum(-(-40 // k) - (-(-8 // k)) for k in (1, 2, 3, 4))
    assert p.tokens_per_step == pytest.approx(4 * 32 / steps)
    assert p.accept_length == pytest.approx(2.5) and p.verify_ct == sum(-(-40 // k) for k in (1, 2, 3, 4))


def test_a_batch_at_least_min_sequences_is_one_round(fake_server):
    prompts = [f"p{i}" for i in range(4)]
    profiler.measure_point("u", 4, 8, 40, prompts, repeats=2, min_sequences=4)
    assert len(fake_server) == 4 and all(texts == ("p0", "p1", "p2", "p3") for texts, _ in fake_server)
