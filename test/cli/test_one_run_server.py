"""A server started for one run (the CLI without ``--url``, the demo) measures its first roofline profile before any
search, on an idle engine, so the profile is cached for the next run (first-hour review 3)."""

from __future__ import annotations

import io
import json

import httpx
from server_modes import TINY

from sglang_spex.serve import start_for_one_run


def test_one_run_server_caches_its_first_profile(tiny_model, tmp_path):
    out = io.StringIO()
    srv = start_for_one_run(  # a fresh profile cache; --max-running-requests 8 bounds the sweep at batch 8
        [*TINY, tiny_model, "--max-running-requests", "8"], env={"SPEX_CACHE_DIR": str(tmp_path)}, out=out
    )
    try:
        saved = list((tmp_path / "profiles").glob("*.json"))
        assert len(saved) == 1, out.getvalue()  # measured before start_for_one_run returned, and cached
        stats = httpx.get(srv.url + "/spex/stats", timeout=30).json()["profile"]
        assert stats["measured_under_load"] is False and not stats["measuring"]
        assert stats["k_total"] == json.loads(saved[0].read_text())["k_total"]
    finally:
        srv.stop()
    assert "roofline profile ready" in out.getvalue()
