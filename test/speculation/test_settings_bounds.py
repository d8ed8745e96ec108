"""A search's ``speculation`` lookaheads are bounded: ``bfs_lookahead: 10**15`` hung the server's event loop (BFS
planning looped up to it, once per finished node), and a ``max_lookahead`` below the ``lookahead`` is refused as
the launcher refuses it; each is an HTTP 400 naming the field (no server)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.bfs_early import planned_levels
from sglang_spex.speculation.settings import MAX_LOOKAHEAD, resolve
from sglang_spex.srt import search_service
from sglang_spex.srt.engine_port import TokenizerManagerPort
from sglang_spex.srt.http_state import attach
from sglang_spex.srt.search_service import LIMIT_FIELDS, SearchService
from sglang_spex.tot.limits import derive
from sglang_spex.tot.search_spec import SearchSpecError

BOUNDED = ("bfs_lookahead", "lookahead", "max_lookahead")


def refused(overrides: dict, server: SpexConfig = SpexConfig()) -> SearchSpecError:
    with pytest.raises(SearchSpecError) as e:
        resolve(server, overrides)
    return e.value


@pytest.mark.parametrize("field", BOUNDED)
@pytest.mark.parametrize("value", [10**15, MAX_LOOKAHEAD + 1])
def test_a_lookahead_past_the_bound_is_refused_naming_it(field, value):
    e = refused({field: value})
    assert e.field == f"speculation.{field}"
    assert str(MAX_LOOKAHEAD) in e.reason


def test_lookaheads_up_to_the_bound_are_taken():
    got = resolve(SpexConfig(), {f: MAX_LOOKAHEAD for f in BOUNDED})
    assert (got.bfs_lookahead, got.lookahead, got.max_lookahead) == (MAX_LOOKAHEAD,) * 3


@pytest.mark.parametrize(
    "server, overrides, lookahead",
    [
        (SpexConfig(), {"lookahead": 8, "max_lookahead": 6}, 8),
        (SpexConfig(), {"max_lookahead": 6, "lookahead": 8}, 8),
        (SpexConfig(), {"max_lookahead": 2}, 4),  # the server's lookahead (4)
        (SpexConfig(lookahead=6, max_lookahead=16), {"max_lookahead": 5}, 6),
    ],
)
def test_a_max_lookahead_below_the_lookahead_is_refused_naming_it(server, overrides, lookahead):
    e = refused(overrides, server)
    assert e.field == "speculation.max_lookahead"
    assert f"must be >= lookahead ({lookahead})" in e.reason


def test_the_lookahead_checks_match_the_launchers():
    assert resolve(SpexConfig(), {"lookahead": 3, "max_lookahead": 3}).max_lookahead == 3  # = k: a cap
    # as --tot-lookahead 20 is with the default --tot-max-lookahead (16): planned at k, never grown past it
    assert resolve(SpexConfig(), {"lookahead": 20}).lookahead == 20


def test_planned_levels_with_a_huge_lookahead_stop_at_the_bound():
    calls = []

    def prior(distance: int) -> float:  # every distance unmeasured: the 0.5 prior, above the floor
        calls.append(distance)
        if len(calls) > 10 * MAX_LOOKAHEAD:
            raise AssertionError("planning past any bound")  # old: looped to 10**15
        return 0.5

    t0 = time.monotonic()
    assert planned_levels(10**15, prior) == MAX_LOOKAHEAD
    assert time.monotonic() - t0 < 1.0 and len(calls) == MAX_LOOKAHEAD - 1
    assert planned_levels(10**15, prior, max_levels=3) == 3  # the search's depths left, where the caller knows them
    assert planned_levels(3, prior, max_levels=10) == 3
    assert planned_levels(3, prior, max_levels=0) == 1  # the undecided depth is always predicted


class _TokenizerManager:
    """A stand-in TokenizerManager: a search it is asked to run fails at once (none should get that far)."""

    def __init__(self) -> None:
        self.server_args = SimpleNamespace(dp_size=1)
        self.tokenizer = SimpleNamespace(encode=lambda text: list(range(len(text.split()))))
        self.rid_to_state: dict = {}

    async def generate_request(self, obj, request):
        raise RuntimeError("no engine here")
        yield {}

    def abort_request(self, rid: str) -> None:
        pass

    def auto_create_handle_loop(self) -> None:
        pass

    def _dispatch_to_scheduler(self, req) -> None:
        pass


@pytest.mark.parametrize(
    "speculation, field",
    [
        ({"bfs_lookahead": 10**15}, "speculation.bfs_lookahead"),
        ({"lookahead": 10**15}, "speculation.lookahead"),
        ({"lookahead": 8, "max_lookahead": 6}, "speculation.max_lookahead"),
    ],
)
def test_post_search_answers_400_naming_the_field(speculation, field):
    port = TokenizerManagerPort(_TokenizerManager(), spex_control=True)
    cfg = SpexConfig(enabled=True, k_total=8)
    svc = SearchService(lambda: port, cfg, lambda: None)
    svc._limits = derive(  # SearchService asks the engine for these once; the stand-in has no capacity to report
        {name: None for name in LIMIT_FIELDS}, context_len=4096, max_running_requests=8, kv_tokens=100_000
    )
    app = FastAPI()
    attach(app, SimpleNamespace(cfg=cfg, searches=svc))
    search_service.install(app)
    spec = {
        "policy": {"name": "rebase", "width": 2, "max_depth": 2},
        "reward": {"type": "verifier", "name": "arith"},
        "speculation": speculation,
    }
    with TestClient(app) as c:
        r = c.post("/tot/search", json={"spec": spec, "question": "What is 1 + 2?"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field
    assert svc.counts() == {"running": 0, "queued": 0} and not svc.searches
