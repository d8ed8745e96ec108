"""A client's reference or a model's answer never reaches a reasoning_gym scorer that evaluates it as code, and a
scorer that does run cannot hold the server: it runs in math_check's killable child under its time limit.

Every test shares the process's one child (``math_check.CHECKER``); the one that gets it killed runs last."""

from __future__ import annotations

import time

import pytest

from sglang_spex.tot import math_check, tasks
from sglang_spex.tot.result import judge
from sglang_spex.tot.tasks import get_task, rg_scorer_is_safe

HANG_S = 30.0  # a hang check, not a speed bound: the old in-process scorer ran for minutes


def payload(path) -> str:
    return f"__import__('pathlib').Path({str(path)!r}).write_text('pwned')"


def test_the_verdict_per_dataset():
    assert not rg_scorer_is_safe("polynomial_multiplication")  # sympy parse_expr
    assert not rg_scorer_is_safe("number_sorting") and not rg_scorer_is_safe("string_insertion")  # eval
    assert not rg_scorer_is_safe("composite")  # forwards to other datasets' scorers
    assert rg_scorer_is_safe("chain_sum")  # overrides: reasoning_gym.utils.compute_decimal_reward (Decimal)
    assert rg_scorer_is_safe("basic_arithmetic")  # the base class's string comparison
    assert tasks._SCORER_SAFE["polynomial_multiplication"] is False and tasks._SCORER_SAFE["chain_sum"] is True


def test_a_scorer_whose_source_cannot_be_read_is_unsafe(monkeypatch):
    def no_source(obj):
        raise OSError("no source")

    monkeypatch.setattr(tasks.inspect, "getsource", no_source)
    assert tasks._rg_scorer_is_safe("chain_sum") is False
    assert tasks._rg_scorer_is_safe("basic_arithmetic") is True  # the base comparison needs no source


@pytest.mark.parametrize("dataset, answer", [("polynomial_multiplication", "x"), ("number_sorting", "[1, 2]")])
def test_a_client_reference_is_never_evaluated(tmp_path, dataset, answer):
    """The reviewer's live exploit: ``POST /tot/search`` with this task and reference ran the reference as code."""
    target = tmp_path / "pwned"
    assert judge(answer, payload(target), f"rg:{dataset}") is False
    assert not target.exists()


def test_a_model_answer_is_never_evaluated(tmp_path):
    """string_insertion's scorer evals the answer: a model (or a client steering it) cannot run code through it."""
    task = get_task("rg:string_insertion")
    q = task.questions(1)[0]
    target = tmp_path / "pwned"
    assert task.check_answer(payload(target), q) is False
    assert judge(payload(target), "x", "rg:string_insertion") is False
    assert not target.exists()
    assert task.check_answer(q.reference, q) is True  # the default comparison still knows the right answer


def test_a_safe_dataset_is_judged_by_its_own_scorer():
    task = get_task("rg:chain_sum")
    qs = task.questions(3, "dev")
    for q in qs:
        assert task.check_answer(q.reference, q) is True
        assert task.check_answer(str(int(q.reference) + 1), q) is False
        assert task.check_answer("nonsense", q) is False
    q = qs[0]
    assert task.check_answer(f"+0{q.reference}.00", q) is True  # the scorer's own tolerance (Decimal), not math-verify
    assert judge(q.reference, q.reference, "rg:chain_sum") is True  # a client's reference: no metadata
    assert judge(str(int(q.reference) + 1), q.reference, "rg:chain_sum") is False


@pytest.mark.parametrize("dataset", ["polynomial_multiplication", "chain_sum"])
def test_a_huge_power_as_reference_does_not_hold_the_judge(dataset):
    """``9**9**8`` froze the whole server ~70 s (sympy's big-integer power in the judge thread, holding the GIL)."""
    t0 = time.monotonic()
    assert judge("x", "9**9**8", f"rg:{dataset}") is False
    assert time.monotonic() - t0 < HANG_S


def test_a_safe_scorer_past_the_limit_is_killed_and_counts_as_not_correct():
    """prime_factorization's own scorer multiplies the reference's factors: thousands of 4,000-digit ones run for
    tens of seconds. It runs in the child, which is killed at the limit; the answer is not correct."""
    assert rg_scorer_is_safe("prime_factorization")
    reference = " × ".join(["9" * 4000] * 1000)
    killed = math_check.CHECKER.killed
    t0 = time.monotonic()
    assert judge("2", reference, "rg:prime_factorization") is False
    assert time.monotonic() - t0 < HANG_S and math_check.CHECKER.killed == killed + 1
    assert judge("2 × 3", "3 × 2", "rg:prime_factorization") is True  # a fresh child for the next one
