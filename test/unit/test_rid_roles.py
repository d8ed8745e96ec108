"""The rid carries a request's role, so a proxy that drops ``custom_params`` (sglang-router) keeps it."""

from types import SimpleNamespace

from sglang_spex.adapters.scheduler import classify, make_primary
from sglang_spex.tot.engine import ROLE_PRIMARY, ROLE_SPEC, node_rid, parse_rid, search_rid_prefix


def _req(rid: str, custom_params=None):
    return SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(custom_params=custom_params))


def test_rid_round_trip_and_prefixes():
    spec, primary = node_rid("s1", "r.0.2", ROLE_SPEC), node_rid("s1", "r.0.2")
    assert parse_rid(spec) == ("s1", "r.0.2", ROLE_SPEC) and parse_rid(primary) == ("s1", "r.0.2", ROLE_PRIMARY)
    node = f"{search_rid_prefix('s1')}r.0.2:"
    assert spec.startswith(node) and primary.startswith(node)  # one node's abort prefix names both roles
    assert not node_rid("s1", "r.0.20", ROLE_SPEC).startswith(node)
    for bad in ("spex:s1:r.0:x", "spex:s1:r.0", "other:s1:r.0:", "spex:s1:r.0::"):
        assert parse_rid(bad) is None, bad


def test_scheduler_reads_the_role_from_the_rid_without_custom_params():
    assert classify(_req(node_rid("s1", "r.1", ROLE_SPEC))) == (ROLE_SPEC, "s1", "r.1")
    assert classify(_req(node_rid("s1", "r.1"))) == (ROLE_PRIMARY, "s1", "r.1")
    assert classify(_req("plain-request-7")) == (ROLE_PRIMARY, None, "")
    # custom_params, where they arrive, win; a promoted speculative request is primary whatever its rid says
    assert classify(_req(node_rid("s1", "r.1", ROLE_SPEC), {"spex_role": "primary"}))[0] == ROLE_PRIMARY
    promoted = _req(node_rid("s2", "r.0", ROLE_SPEC))
    promoted.priority = -5
    make_primary(promoted, 0)
    assert classify(promoted)[0] == ROLE_PRIMARY and promoted.priority == 0


def test_a_speculative_request_carries_its_worth_to_the_scheduler():
    from sglang_spex.adapters.scheduler import worth_s
    from sglang_spex.tot.engine import GenRequest

    sent = GenRequest("p", node_rid("s1", "r.0", ROLE_SPEC), role=ROLE_SPEC, worth_s=1.5).sampling_params()
    assert worth_s(_req("x", sent["custom_params"])) == 1.5
    assert "spex_worth_s" not in GenRequest("p", "r").sampling_params()["custom_params"]  # unknown: not sent
    for bad in (None, {}, {"spex_worth_s": "lots"}, {"spex_worth_s": float("nan")}):
        assert worth_s(_req("x", bad)) is None  # a malformed worth is no worth: the bucket alone decides
