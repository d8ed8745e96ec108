"""The speculative prefill allowance: the measured price of a prefill step, and the bucket of primary step time."""

from collections import deque

import pytest

from sglang_spex.srt.prefill_allowance import BUCKET, FREE, WORTH, PrefillAllowance, PrefillPrice, fit_price

LINE = (0.10, 0.01)  # decode step t = 0.10 s + 0.01 s per row


def _step(decode_rows: int, tokens: int, f: float, p: float) -> float:
    return LINE[0] + LINE[1] * decode_rows + f + p * tokens


def test_price_splits_the_excess_over_the_decode_line_into_a_step_cost_and_a_token_cost():
    price = PrefillPrice()
    assert price.price(None) is None
    assert price.price(LINE) == pytest.approx((0.0, 0.01))  # a prompt token priced like a decode row until measured
    price.add(LINE, 4, 5, _step(4, 5, 0.2, 0.004))
    assert price.price(LINE) == pytest.approx((0.0, 0.01))  # one size cannot tell the step from its tokens
    price.add(LINE, 0, 100, _step(0, 100, 0.2, 0.004))
    price.add(LINE, 8, 20, _step(8, 20, 0.2, 0.004))
    price.add(None, 4, 100, 9.0)  # no line: nothing to subtract, not a sample
    assert price.price(LINE) == pytest.approx((0.2, 0.004))


def test_the_fit_keeps_both_costs_non_negative():
    assert fit_price(deque([(10, 0.5), (100, 0.1)])) == pytest.approx((0.3, 0.0))  # falling: all of it per step
    f, p = fit_price(deque([(10, 0.0), (20, 0.5)]))
    assert f == 0.0 and p == pytest.approx(0.02, rel=0.2)  # through the origin
    assert fit_price(deque([(10, 0.1)])) is None


def test_the_bucket_earns_a_share_of_primary_steps_up_to_one_step_and_pays_the_step_cost_once():
    allow = PrefillAllowance(share=0.1)
    for e in (5, 100):
        allow.price.add(LINE, 0, e, _step(0, e, 0.05, 0.001))  # f 50 ms, p 1 ms per token
    assert allow.open(LINE, primary_searches=0, primary_prefills=False) is None  # nobody shares the step
    for _ in range(6):
        allow.earn(0.2, cap_s=0.5)
    assert allow.credit_s == pytest.approx(0.12)
    step = allow.open(LINE, primary_searches=1, primary_prefills=False)
    assert step.pays(70) == BUCKET and step.pays(71) is None  # 50 ms to make it a prefill step + 1 ms per token
    allow.spend(step.take(30, BUCKET))  # 80 ms
    assert step.pays(40) == BUCKET and step.pays(41) is None  # the step is a prefill step now: tokens only
    assert allow.credit_s == pytest.approx(0.04)
    riding = allow.open(LINE, primary_searches=1, primary_prefills=True)  # a primary prefills anyway
    assert riding.pays(40) == BUCKET and riding.pays(41) is None
    for _ in range(100):
        allow.earn(0.2, cap_s=0.5)
    assert allow.credit_s == pytest.approx(0.5)  # one primary step at most: a single step stretches by <= that


def test_share_zero_admits_only_what_is_measured_free():
    unmeasured = PrefillAllowance(share=0.0)
    assert unmeasured.open(None, 1, False).pays(1) is None  # no price known: nothing is free
    assert unmeasured.open(LINE, 1, True).pays(1) is None
    free = PrefillAllowance(share=0.0)
    for e, rows in ((50, 8), (200, 8)):
        free.price.add(LINE, rows, e, _step(rows, 0, 0.0, 0.0))  # prompt tokens rode the step for free
    step = free.open(LINE, 1, False)
    assert step.pays(200) == FREE and step.take(200, FREE) == 0.0 and not step.new_step  # counted apart, spends nothing
    assert PrefillAllowance(share=0.1).open(None, 1, False) is None  # share > 0, price unknown: no limit yet


def test_a_request_worth_more_than_it_costs_every_waiting_search_is_admitted_without_the_bucket():
    allow = PrefillAllowance(share=0.0)
    for e in (5, 100):
        allow.price.add(LINE, 0, e, _step(0, e, 0.2, 0.001))  # f 200 ms, p 1 ms per token
    step = allow.open(LINE, primary_searches=2, primary_prefills=False)
    assert step.pays(10) is None and step.pays(10, worth_s=0.41) is None  # 2 searches x 210 ms = 0.42 s
    assert step.pays(10, worth_s=0.43) == WORTH
    assert step.take(10, WORTH) == 0.0 and step.spent_s == 0.0  # the bucket is not touched ...
    assert step.pays(10, worth_s=0.02) == WORTH  # ... but the step is a prefill step now: 10 ms x 2 searches
