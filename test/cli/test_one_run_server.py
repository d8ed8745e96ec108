"""A server started for one run (the CLI without ``--url``, the demo) measures its first roofline profile before any
search, on an idle engine, so the profile is cached for the next run (first-hour review 3)."""

from __future__ import annotations

import io

import httpx
from server_modes import TINY

from sglang_spex.serve import start_for_one_run


def test_one_run_server_caches_its_first_profile(tiny_model, tmp_path):
    out = io.StringIO()
    srv = start_for_one_run(  # a fresh profile cache; --max-running-requests 8 bounds the sweep at batch 8
        [*TINY, tiny_model, "--max-running-requests", "8"], env={"SPEX_CACHE_DIR": str(tmp_path)}, out=out
    )
    try:
        prof = httpx.get(srv.url + "/spex/profile", timeout=30).json()
        stats = httpx.get(srv.url + "/spex/stats", timeout=30).json()["profile"]
    finally:
        srv.stop()
    load = prof["meta"]["load"]
    assert load["others_in_flight"] == 0 and "requests in flight" not in load["why"], load  # an idle engine
    assert not stats["measuring"] and stats["k_total"] == prof["k_total"] is not None
    saved = list((tmp_path / "profiles").glob("*.json"))
    # cached, unless the tiny model's few-ms steps read as a disturbed curve (``max_dip``), which no wait can help
    assert len(saved) == (0 if load["why"] else 1), (load, out.getvalue())
    assert "roofline profile ready" in out.getvalue()
