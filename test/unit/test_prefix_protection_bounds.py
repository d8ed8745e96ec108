"""The scheduler's protection bookkeeping stays bounded whatever ids clients send (``/spex/protect``, rids)."""

from __future__ import annotations

from sglang_spex.srt.prefix_protection import MAX_TRACKED, PrefixProtection


def test_registered_searches_without_locks_are_bounded_oldest_first():
    p = PrefixProtection()
    for i in range(MAX_TRACKED + 500):
        p.start_search(f"s{i}")
    assert len(p.last_seen) == len(p.locks) == MAX_TRACKED
    assert "s0" not in p.last_seen and f"s{MAX_TRACKED + 499}" in p.last_seen  # the oldest went first
    assert next(iter(p.last_seen)) == "s500"
    p.start_search("s500")  # renewing the oldest moves it to the young end
    p.start_search("new")
    assert "s500" in p.last_seen and "s501" not in p.last_seen and "new" in p.last_seen


def test_ended_searches_are_bounded():
    p = PrefixProtection()
    for i in range(MAX_TRACKED + 100):
        p.end_search(None, f"e{i}")  # no locks held: no tree cache needed
    assert len(p.ended) == MAX_TRACKED and "e0" not in p.ended and f"e{MAX_TRACKED + 99}" in p.ended
