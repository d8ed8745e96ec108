"""The plugin's routes on the real server refuse bad bodies with one 400 shape and change nothing."""

from __future__ import annotations

import pytest
import requests

from sglang_spex.speculation.payoff import policy_key

from .helpers import QUESTION, post_search, spec

pytestmark = pytest.mark.server


def _scheduler(url: str) -> dict:
    r = requests.get(url + "/spex/stats", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["scheduler"]


def _refused(r: requests.Response, field: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["field"] == field and err["reason"], err


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("/spex/budget", {"k_total": "lots"}, "k_total"),
        ("/spex/budget", {"k": "lots"}, "k"),
        ("/spex/budget", {"k": -2}, "k"),
        ("/spex/knobs", {"protect_max_fraction": 2.0}, "protect_max_fraction"),
        ("/spex/knobs", {"immediate_cancel": "no", "protect_ttl_s": 1.0}, "immediate_cancel"),
        ("/spex/knobs", {"protect_ttl": 1.0}, "protect_ttl"),
        ("/spex/cancel", {}, "body"),
        ("/spex/cancel", {"search_id": "a", "rid_prefix": "b"}, "body"),  # one of them, not both
        ("/spex/release", {"search_id": ""}, "search_id"),  # not "every search's"
        ("/spex/protect", {"search_id": 7}, "search_id"),
        ("/spex/release", {"search_id": "s", "bogus": 1}, "bogus"),
        ("/spex/promote", {"rid": ""}, "rid"),
        ("/spex/profile", {"batch_sizes": [1, 0]}, "batch_sizes[1]"),
        ("/spex/profile", {"force": "yes"}, "force"),
        # bounded by the engine: each would otherwise queue work for hours before answering
        ("/spex/profile", {"batch_sizes": [1, 100000]}, "batch_sizes[1]"),
        ("/spex/profile", {"batch_sizes": [1] * 17}, "batch_sizes"),
        ("/spex/profile", {"ctx_batch": 100000}, "ctx_batch"),
        ("/spex/profile", {"repeats": 100000}, "repeats"),
        ("/spex/profile", {"long_tokens": 10**9}, "long_tokens"),
        ("/spex/profile", {"short_tokens": 30}, "long_tokens"),  # the default long_tokens is 20
        ("/spex/profile", {"prefill_words": 10**8}, "prefill_words"),
    ],
)
def test_bad_control_body_is_a_400_and_changes_nothing(spex_server, route, body, field):
    before = _scheduler(spex_server.url)
    _refused(requests.post(spex_server.url + route, json=body, timeout=30), field)
    after = _scheduler(spex_server.url)
    for key in ("budget", "immediate_cancel", "protection"):
        assert after.get(key) == before.get(key), key


def test_budget_round_trip(spex_server):
    url = spex_server.url
    before = _scheduler(url)["budget"]
    try:
        r = requests.post(url + "/spex/budget", json={"k": 5}, timeout=30)
        assert r.status_code == 200 and r.json()["ok"] is True and r.json()["scheduler"]["budget"] == 5
        r = requests.post(url + "/spex/budget", json={"k": None}, timeout=30)
        assert r.status_code == 200 and r.json()["scheduler"]["budget"] is None
    finally:
        requests.post(url + "/spex/budget", json={"k": before}, timeout=30)
    assert _scheduler(url)["budget"] == before


def test_bad_search_envelope_starts_nothing(spex_server):
    url = spex_server.url
    before = requests.get(url + "/tot/searches", timeout=30).json()["searches"]
    good = {"spec": spec({"name": "rebase", "width": 2, "max_depth": 1}), "question": QUESTION}
    for body, field in (
        ({**good, "k_total": 3}, "k_total"),
        ({**good, "stream": "yes"}, "stream"),
        ({**good, "reference": {"x": 1}}, "reference"),
        ({**good, "question": "  "}, "question"),
    ):
        _refused(post_search(url, body), field)
    assert requests.get(url + "/tot/searches", timeout=30).json()["searches"] == before


def test_unknown_search_is_a_404_in_the_same_shape(spex_server):
    for method in ("get", "delete"):
        r = getattr(requests, method)(spex_server.url + "/tot/search/no-such-search", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["field"] == "search_id"


def test_info_reads_the_app_state(spex_server):
    info = requests.get(spex_server.url + "/spex/info", timeout=30).json()
    assert info["speculation"] is True and info["plugin_loaded_in_scheduler"] is True
    assert info["config"]["k_total"] == 8


@pytest.mark.parametrize("since", ["abc", "1.5", "9" * 30])
def test_a_bad_history_since_is_a_400_in_the_plugins_shape(spex_server, since):
    _refused(
        requests.get(spex_server.url + "/spex/stats", params={"history_since": since}, timeout=30), "history_since"
    )


@pytest.mark.parametrize("wait", ["abc", "nan", "inf"])
def test_a_bad_tree_view_wait_is_a_400_in_the_plugins_shape(spex_server, wait):
    r = requests.get(spex_server.url + "/tot/ui/events/nobody", params={"wait": wait}, timeout=30)
    _refused(r, "wait")


def test_stats_report_the_profiler_state(spex_server):
    prof = requests.get(spex_server.url + "/spex/stats", timeout=30).json()["profile"]
    assert set(prof) == {"measuring", "reprofile_due", "reprofiles", "k_total", "measured_under_load", "last_error"}
    assert prof["measuring"] is False and prof["reprofile_due"] is False and prof["reprofiles"] == 0
    assert prof["last_error"] is None


def test_stats_report_what_speculation_saved_and_auto_offs_verdict(spex_server):
    body = spec(
        {"name": "rebase", "width": 3, "max_depth": 2},
        speculation={"enabled": True, "components": ["t1", "t2"], "early_stop": False},
    )
    res = post_search(spex_server.url, {"spec": body, "question": QUESTION}).json()
    assert res["status"] == "done"
    rows = requests.get(spex_server.url + "/spex/stats", timeout=30).json()["payoff"]
    key = policy_key("rebase", {"width": 3, "max_depth": 2})  # the pool of this policy with these knobs
    mine = [r for r in rows if r["policy"] == key and r["step_tokens"] == body["step"]["max_tokens"]]
    assert len(mine) == 1
    row = mine[0]
    assert set(row) >= {"rank", "searches", "steps_saved", "tokens_wasted", "pays", "off_draws", "gate_min_use"}
    issued = res["speculation"]["issued"]
    assert (row["searches"] > 0) == (issued > 0)  # a search that speculated reported when it ended
    assert row["pays"] in (True, False, None) and row["steps_saved"] >= 0 and row["tokens_wasted"] >= 0
