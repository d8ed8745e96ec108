"""The profiler's point at a small batch covers several prompts (pure measurement logic; the HTTP calls are
replaced, the real-server path is test/respec/test_adaptive_profiler.py)."""

from __future__ import annotations

import pytest

from sglang_spex.respec import profiler


@pytest.fixture
def fake_server(monkeypatch):
    """A server whose acceptance depends on the prompt: prompt i accepts 1 + i tokens per verify step."""
    calls = []

    def generate(url, texts, n, temperature=0.0):
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


def test_a_point_with_few_verify_steps_takes_more_rounds(fake_server):
    """Prompt p3 accepts 4 tokens a step: 8 verify steps per round between 8 and 40 tokens, so reaching 32 steps
    takes 4 rounds (each a new prompt shift), and the tokens count every round."""
    prompts = [f"p{i}" for i in range(4)]
    p = profiler.measure_point("u", 1, 8, 40, ["p3"], repeats=1, min_sequences=1, min_steps=32)
    assert len(fake_server) == 2 * 4
    assert p.tokens_per_step == pytest.approx(4.0)
    fake_server.clear()
    profiler.measure_point("u", 1, 8, 40, ["p3"], repeats=1, min_sequences=1, min_steps=32, max_rounds=2)
    assert len(fake_server) == 2 * 2  # the cap holds
    fake_server.clear()
    profiler.measure_point("u", 4, 8, 40, prompts, repeats=1, min_sequences=4, min_steps=8)
    assert len(fake_server) == 2  # enough steps in one round: no more


class _Server:
    url = "u"

    def __init__(self, args):
        self.args = args

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_point_slower_than_a_bigger_batch_is_measured_once_more(monkeypatch):
    """Plain decode on a fake clock: B=4's first measurement is disturbed (3x slower per step than B=16), so it is
    measured again and the faster reading stays; B=1 and B=16 are measured once."""
    clock = [0.0]
    per_step = {1: 0.010, 4: 0.012, 16: 0.020}
    disturbed = {4: 4}  # B=4's first measurement (2 rounds of 8 sequences, a short and a long run each) is slow

    def generate(url, texts, n, temperature=0.0):
        b = len(texts)
        slow = 3.0 if disturbed.get(b, 0) > 0 else 1.0
        if b in disturbed:
            disturbed[b] -= 1
        clock[0] += n * per_step.get(b, 0.01) * slow
        return [{} for _ in texts]

    monkeypatch.setattr(profiler, "_generate", generate)
    monkeypatch.setattr(profiler, "flush", lambda url: None)
    monkeypatch.setattr(profiler, "time", type("T", (), {"perf_counter": lambda: clock[0], "strftime": lambda f: "t"}))
    prof = profiler.profile_configs(
        "m", [None], [1, 4, 16], n_short=8, n_long=40, repeats=1, server_factory=_Server, prompts=["a", "b"]
    )
    steps = {b: p.step_s for b, p in prof.points[profiler.PLAIN].items()}
    assert steps == pytest.approx(per_step)
    assert prof.meta["remeasured"][profiler.PLAIN] == [4]


def test_a_repeat_keeps_its_own_acceptance_and_sampled_runs_take_the_median():
    """The step count comes with the run its wall time came from (it came from the last run); at T > 0 the runs
    decode different tokens, and the fastest would be the one that happened to accept most (review)."""
    tries = [(3.0, ["slow"]), (1.0, ["lucky"]), (2.0, ["typical"])]
    assert profiler._representative(tries, 0.0) == (1.0, ["lucky"])
    assert profiler._representative(tries, 1.0) == (2.0, ["typical"])
    assert profiler._representative(tries[:2], 1.0) == (3.0, ["slow"])  # two runs: the upper median
