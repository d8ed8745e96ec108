"""The DSL runs the same program server-side and client-side with the same result format."""

from __future__ import annotations

import pytest

import sglang_spex.lang as tot
from sglang_spex.tot.search import SearchResult

from .helpers import QUESTION, check_well_formed

pytestmark = pytest.mark.server


@tot.search
def solve(s):
    s.policy(tot.rebase(width=3, max_depth=2))
    s.step(stop=["\n\n"], max_tokens=6, temperature=1.0, seed=11)
    s.reward(tot.verifier("arith"))
    s.answer(r"The answer is (\d+)", aggregate="majority")
    s.speculation(enabled=False)  # passed through untouched (SPEX reads it): the baseline core is tested here


def test_program_server_and_client_side_agree(spex_server):
    server = solve.run(QUESTION, tot.Endpoint(spex_server.url), reference="19")
    client = solve.run(QUESTION, tot.Endpoint(spex_server.url, server_side=False), reference="19")
    assert isinstance(server, SearchResult) and isinstance(client, SearchResult)
    assert set(server.to_dict()) == set(client.to_dict())
    for r in (server, client):
        check_well_formed(r.to_dict(), "rebase")
    assert [(n["path"], n["text"]) for n in server.nodes] == [(n["path"], n["text"]) for n in client.nodes]


def test_program_batch_and_invalid_spec(spex_server):
    res = solve.run_batch(["What is 1 + 2?", "What is 3 + 4?"], tot.Endpoint(spex_server.url), concurrency=2)
    assert [r.question for r in res] == ["What is 1 + 2?", "What is 3 + 4?"]
    bad = tot.Program.from_json(solve.to_json())
    bad._spec.policy = tot.rebase(width=0)
    with pytest.raises(tot.SearchSpecError) as e:
        bad.run(QUESTION, tot.Endpoint(spex_server.url))
    assert e.value.field == "policy.width"
