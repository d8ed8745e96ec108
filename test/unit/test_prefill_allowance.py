"""The speculative prefill allowance: the measured price of a prompt token, and the bucket of primary step time."""

import pytest

from sglang_spex.srt.prefill_allowance import MIN_TOKENS, PrefillAllowance, PrefillPrice

LINE = (0.10, 0.01)  # decode step t = 0.10 s + 0.01 s per row


def test_price_is_the_step_time_over_the_decode_line_per_prompt_token():
    price = PrefillPrice()
    assert price.per_token(None) is None
    assert price.per_token(LINE) == pytest.approx(0.01)  # a decode row's cost until a step is measured
    price.add(LINE, decode_rows=4, tokens=50, step_s=0.14 + 50 * 0.004)  # 4 rows: 0.14 s; 50 tokens: 0.2 s
    price.add(LINE, decode_rows=0, tokens=20, step_s=0.10 + 20 * 0.006)  # a prefill-only step
    price.add(LINE, decode_rows=4, tokens=MIN_TOKENS - 1, step_s=1.0)  # too few tokens to say anything
    price.add(None, decode_rows=4, tokens=100, step_s=1.0)  # no line: nothing to subtract
    assert price.per_token(LINE) == pytest.approx(0.005)  # median of 0.004 and 0.006


def test_allowance_earns_a_share_of_primary_steps_up_to_one_step_and_spends_at_the_price():
    allow = PrefillAllowance(share=0.1)
    allow.price.add(LINE, 0, 10, 0.10 + 10 * 0.002)  # 2 ms per prompt token
    assert allow.tokens(LINE, primary_live=False) is None  # nothing shares the step: no limit
    assert allow.tokens(LINE, primary_live=True) == 0
    for _ in range(3):
        allow.earn(0.2, cap_s=0.5)
    assert allow.credit_s == pytest.approx(0.06)
    assert allow.tokens(LINE, primary_live=True) == 30
    allow.spend(20, LINE)
    assert allow.tokens(LINE, primary_live=True) == 10
    for _ in range(100):
        allow.earn(0.2, cap_s=0.5)
    assert allow.credit_s == pytest.approx(0.5)  # one primary step at most: a single step stretches by <= that


def test_share_zero_allows_nothing_beside_primaries_and_a_free_token_allows_everything():
    assert PrefillAllowance(share=0.0).tokens(LINE, primary_live=True) == 0
    free = PrefillAllowance(share=0.1)
    free.price.add(LINE, 8, 200, 0.18)  # the step took what its 8 rows take: prompt tokens rode it for free
    assert free.tokens(LINE, primary_live=True) is None
