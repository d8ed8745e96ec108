"""``/spex/cancel`` and ``/spex/release`` bodies, and the scheduler's memory of cancelled searches (pure logic on a
stand-in scheduler: the late-arrival abort reads only the waiting queue and ``abort_request``)."""

from __future__ import annotations

import types

import pydantic
import pytest

from sglang_spex.srt import control, scheduling
from sglang_spex.srt.http_api import CancelBody, ReleaseBody


class _Req:
    def __init__(self, rid: str) -> None:
        self.rid = rid

    def finished(self) -> bool:
        return False


class _Scheduler:
    def __init__(self) -> None:
        self.waiting_queue: list = []
        self.aborted: list = []
        self.tree_cache = types.SimpleNamespace()

    def abort_request(self, req) -> None:
        self.aborted.append(req.rid)


def test_cancel_takes_one_of_search_id_and_rid_prefix():
    for bad in ({}, {"search_id": "a", "rid_prefix": "b"}):
        with pytest.raises(pydantic.ValidationError, match="one of"):
            CancelBody(**bad)
    assert CancelBody(search_id="a").rid_prefix == "" and CancelBody(rid_prefix="b").search_id == ""
    both = control.SpexControlReq(op="cancel", search_id="a", prefix="b")
    assert "one of" in control.validate(both)


def test_release_all_only_without_the_field():
    assert ReleaseBody().search_id == ""  # every search's protection
    with pytest.raises(pydantic.ValidationError, match="search_id"):
        ReleaseBody(search_id="")  # an unset variable on the client is not "all"
    with pytest.raises(pydantic.ValidationError, match="search_id"):
        ReleaseBody(search_id=None)
    with pytest.raises(pydantic.ValidationError, match="node_prefix needs search_id"):
        ReleaseBody(node_prefix="r.0")


def test_late_requests_of_a_cancelled_search_are_aborted_and_no_one_elses():
    s = _Scheduler()
    # the scheduler keys its memory on the search's own rid prefix, whatever prefix the command aborted
    control.apply(s, control.SpexControlReq(op="cancel", search_id="a", prefix="b"))
    assert list(scheduling.state_of(s).cancelled) == ["spex:a:"]
    s.waiting_queue = [_Req("b0000000000000000000000000000001"), _Req("spex:a:r.0:"), _Req("spex:ab:r.0:")]
    s.aborted.clear()
    scheduling._pre_step(s, None, None)
    assert s.aborted == ["spex:a:"]  # SGLang aborts by the search's prefix: not another client's uuid rid, not "ab"


def test_cancelled_searches_are_remembered_up_to_a_cap_newest_kept():
    s = _Scheduler()
    n = scheduling.MAX_CANCELLED + 10
    for i in range(n):
        scheduling.cancel(s, f"spex:s{i}:", f"s{i}")
    kept = scheduling.state_of(s).cancelled
    assert len(kept) == scheduling.MAX_CANCELLED
    assert "spex:s0:" not in kept and f"spex:s{n - 1}:" in kept
    scheduling.cancel(s, "spex:s10:", "s10")  # cancelled again: it becomes the newest
    assert list(kept)[-1] == "spex:s10:"
