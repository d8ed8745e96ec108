"""How the policy copy's feature batches are cut: by rows and by padded tokens."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sglang_spex.respec.target import _chunks


def test_rows_and_tokens_cut_the_groups():
    assert _chunks([10] * 5, rows=2, tokens=100) == [(0, 2), (2, 4), (4, 5)]
    assert _chunks([10, 10, 60, 10], rows=8, tokens=100) == [(0, 2), (2, 3), (3, 4)]  # 3 x 60 > 100
    assert _chunks([500, 3], rows=8, tokens=100) == [(0, 1), (1, 2)]  # longer than the budget: alone
    assert _chunks([], rows=8, tokens=100) == []


@given(st.lists(st.integers(1, 300), max_size=40), st.integers(1, 9), st.integers(1, 1000))
def test_groups_cover_in_order_and_fit(lengths, rows, tokens):
    groups = _chunks(lengths, rows, tokens)
    assert [i for s, e in groups for i in range(s, e)] == list(range(len(lengths)))
    for s, e in groups:
        assert 1 <= e - s <= rows
        assert e - s == 1 or (e - s) * max(lengths[s:e]) <= tokens
