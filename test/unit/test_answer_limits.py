"""A client's reference or answer pattern cannot hold the server: math-verify runs in a child process that is
killed past its limit, and an answer pattern has a time budget over the whole search."""

from __future__ import annotations

import asyncio

import pytest

from sglang_spex.tot import answers
from sglang_spex.tot.answers import PatternBudget, PatternTooSlow, check_answer, extract_answer
from sglang_spex.tot.math_check import MathChecker

SLOW = r"(.*)(.*)(.*)(.*)(.*)(.*)(?(1)(?!))"  # backtracks through every split of the text: never matches


def test_a_comparison_past_the_limit_is_killed_and_the_next_one_runs():
    """``9^{9^{9}}`` is one big-integer power that runs for minutes inside math-verify; the child running it is
    killed and started again for the next comparison, which math-verify still decides."""
    checker = MathChecker(timeout_s=1.0)
    try:
        assert checker.equal("7", "9^{9^{9}}") is None and checker.killed == 1
        assert checker.equal(r"\frac{1}{2}", "0.5") is True
        assert checker.equal(r"\frac{1}{3}", "0.5") is False
        assert checker.killed == 1
    finally:
        checker._stop()


def test_a_comparison_waits_at_most_wait_s_behind_a_busy_child():
    """Comparisons queued behind slow ones give up after ``wait_s`` (not verified) instead of waiting for all of
    them: a client sending slow references cannot hold every other search's verdict."""
    import threading
    import time

    checker = MathChecker(timeout_s=1.0, wait_s=0.3)
    try:
        assert checker.equal("1", "1") is True  # the child is up
        slow = [threading.Thread(target=checker.equal, args=("7", "9^{9^{9}}")) for _ in range(3)]
        for t in slow:
            t.start()
        time.sleep(0.1)
        t0 = time.monotonic()
        assert checker.equal(r"\frac{1}{2}", "0.5") is None  # had it waited for the child, a fresh one says True
        assert time.monotonic() - t0 < 2.5 and checker.busy >= 1  # not behind all three slow ones (3 s)
        for t in slow:
            t.join()
        assert checker.killed == 1 and checker.busy == 3  # one slow comparison ran; the others gave up waiting
        assert checker.equal(r"\frac{1}{2}", "0.5") is True  # a fresh child for the next one
    finally:
        checker._stop()


def test_check_answer_falls_back_to_the_normalised_text_without_a_verdict(monkeypatch):
    monkeypatch.setattr(answers.CHECKER, "equal", lambda answer, reference: None)
    assert check_answer(" X + 1", "x+1") is True and check_answer("7", "9^{9^{9}}") is False
    assert check_answer("1,000", "1000.0") is True  # numbers never reach math-verify


def test_a_slow_pattern_uses_up_its_budget_then_fails_the_steps():
    text = "The answer is 42 " * 8
    assert extract_answer(text, SLOW, timeout_s=0.05) is None  # timed out: no answer
    budget = PatternBudget(budget_s=0.3)
    calls = 0
    with pytest.raises(PatternTooSlow, match="answer.pattern"):
        for calls in range(1, 100):
            budget.extract(text, SLOW)
    assert 2 <= calls <= 8  # each call is cut at PATTERN_TIMEOUT_S (0.25 s) or what is left
    assert PatternBudget(budget_s=0.0).extract(text, lambda t: "42") == "42"  # a callable is the client's own
    fast = PatternBudget(budget_s=0.3)
    assert [fast.extract(text, r"answer is (\d+)") for _ in range(200)] == ["42"] * 200


def test_the_result_is_judged_off_the_event_loop(monkeypatch):
    """``SearchContext.finish`` runs the judge in a thread: the loop keeps ticking while math-verify works."""
    from sglang_spex.tot import context as context_mod

    ticks, during = [], []

    def slow_judge(answer, reference, task):
        import time

        start = len(ticks)
        time.sleep(0.5)
        during.append(len(ticks) - start)  # the loop's ticks while the judge ran
        return True

    class Ctx:
        reference, spec = "x", type("S", (), {"task": None})()

        def result(self, status, error=None, judged=True):
            return type("R", (), {"answer": "x", "correct": None})()

    monkeypatch.setattr(context_mod, "judge", slow_judge)

    async def main():
        async def tick():
            for _ in range(20):
                ticks.append(1)
                await asyncio.sleep(0.01)

        res, _ = await asyncio.gather(context_mod.SearchContext.finish(Ctx(), "done"), tick())
        return res

    assert asyncio.run(main()).correct is True and during[0] >= 5
