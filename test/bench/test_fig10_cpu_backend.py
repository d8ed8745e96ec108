"""bench_fig10 --real (its modes taken explicitly from bench_tot's, results written after every run) and
bench_cpu_backend's flush retry, against a stubbed runner / HTTP (no server)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

SIM = ["--policies", "rstar-5", "--batch-sizes", "1", "--min-questions", "1"]
REAL = ["--real", "--url", "http://127.0.0.1:9", "--real-policies", "rstar-5", "--real-concurrency", "1,4"]


def _fake_run_mode(calls, fail_at=None):
    async def run_mode(url, spec, questions, concurrency, mode, k_total):
        calls.append(mode)
        if fail_at is not None and len(calls) == fail_at:
            raise RuntimeError("server went away")
        return {"q_per_min": 10.0 + len(calls), "answers": [], "speculation": None}

    return run_mode


def test_fig10_real_runs_the_plotted_modes_and_writes_every_row(tmp_path, monkeypatch):
    import bench_fig10
    import bench_tot

    calls = []
    monkeypatch.setattr(bench_tot, "run_mode", _fake_run_mode(calls))
    out, png = tmp_path / "fig10.json", tmp_path / "fig10.png"
    monkeypatch.setattr(sys, "argv", ["bench_fig10", *SIM, *REAL, "--out", str(out), "--plot", str(png)])
    bench_fig10.main()
    real = json.loads(out.read_text())["real_rows"]
    assert [r["mode"] for r in real] == ["baseline", "spex_sched", "spex_t3"] * 2  # 2 concurrencies
    assert all(r["speedup"] for r in real)
    assert (tmp_path / "fig10_real.png").stat().st_size > 0
    assert calls[1:4] == [bench_tot.MODES[m] for m in bench_fig10.REAL_MODES]  # after the one warm-up


def test_fig10_real_keeps_the_rows_measured_before_a_failure(tmp_path, monkeypatch):
    import bench_fig10
    import bench_tot

    monkeypatch.setattr(bench_tot, "run_mode", _fake_run_mode([], fail_at=5))  # warm-up + 3 runs, then it fails
    out, png = tmp_path / "fig10.json", tmp_path / "fig10.png"
    monkeypatch.setattr(sys, "argv", ["bench_fig10", *SIM, *REAL, "--out", str(out), "--plot", str(png)])
    with pytest.raises(RuntimeError, match="went away"):
        bench_fig10.main()
    data = json.loads(out.read_text())
    assert data["rows"] and len(data["real_rows"]) == 3  # the simulator rows and the real rows so far


def test_fig10_real_stops_with_a_message_when_bench_tot_lacks_a_mode(tmp_path, monkeypatch):
    import bench_fig10
    import bench_tot

    monkeypatch.setattr(bench_tot, "MODES", {k: v for k, v in bench_tot.MODES.items() if k != "spex_t1t2t3"})
    monkeypatch.setattr(sys, "argv", ["bench_fig10", *SIM, *REAL, "--out", str(tmp_path / "o.json")])
    with pytest.raises(SystemExit, match="spex_t1t2t3"):
        bench_fig10.main()
    assert not (tmp_path / "o.json").exists()  # stopped before the simulator grid


def test_cpu_backend_search_flush_retries_while_refused(monkeypatch):
    """SGLang refuses /flush_cache while an earlier search's requests linger: the search waits (bench_tot's bounded
    retry) instead of failing on the first refusal."""
    import bench_cpu_backend

    codes = iter([400, 400, 200])

    class R:
        def __init__(self, code):
            self.status_code = code

    monkeypatch.setattr(httpx, "post", lambda url, timeout=None: R(next(codes)))  # (respec.profiler.flush's)
    monkeypatch.setattr(time, "sleep", lambda s: None)

    async def searches(url, bodies):
        return [{"status": "done", "tokens_generated": 5} for _ in bodies]

    monkeypatch.setattr(bench_cpu_backend, "_searches", searches)
    q = type("Q", (), {"text": "1+1", "reference": "2"})()
    res = bench_cpu_backend.search_rate("http://x", {}, [q, q])
    assert res["tokens"] == 10 and res["flush_wait_s"] != "unflushed"
    assert next(codes, None) is None  # the flush was asked until it was accepted
