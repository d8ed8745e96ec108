"""The prepared GPU check's wiring: the shell script parses and the python driver answers ``--help``; the timed
stages' logic (profiler wait, flush retry, warm-up and alternating pairs) against fakes (fast; the
dry run itself starts servers and is run by hand: ``bash scripts/gpu_check.sh --dry-run``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_shell_script_parses():
    r = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_driver_help_lists_the_dry_run():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "--dry-run" in r.stdout and "--budget-s" in r.stdout


# --- the timed stages' logic, against fakes (no server) -------------------------------------------------------


def _gpu_check():
    """scripts/gpu_check.py as a module (loaded once; registered first: its dataclasses look their module up)."""
    import importlib.util

    if "gpu_check" not in sys.modules:
        if str(ROOT / "scripts") not in sys.path:  # its helpers (gpu_check_server.py) sit beside it
            sys.path.insert(0, str(ROOT / "scripts"))
        spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
        sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["gpu_check"])
    return sys.modules["gpu_check"]


class _Resp:
    def __init__(self, status_code=200, payload=None):
        self.status_code, self._payload = status_code, payload or {}

    def json(self):
        return self._payload

    def raise_for_status(self):
        if self.status_code != 200:
            raise RuntimeError(f"HTTP {self.status_code}")


def test_settle_profiler_waits_for_the_startup_profile_then_replaces_one_measured_under_load(monkeypatch):
    """Right after start-up there is no profile and no sweep yet (``measuring`` false): the check asks for one
    (unforced: a sweep in progress is waited for), and a profile measured under load is measured again, forced."""
    gc = _gpu_check()
    state = {"measuring": False, "reprofile_due": False, "reprofiles": 0, "k_total": None, "measured_under_load": None}
    posts = []

    def post(url, json=None, timeout=None):
        assert url.endswith("/spex/profile")
        posts.append(json["force"])
        under_load = len(posts) == 1  # the first sweep shared the engine with something
        state.update(k_total=512 if under_load else 93, measured_under_load=under_load, reprofile_due=under_load)
        return _Resp()

    monkeypatch.setattr(gc.httpx, "post", post)
    monkeypatch.setattr(gc.httpx, "get", lambda url, timeout=None: _Resp(payload={"profile": dict(state)}))
    prof = gc._settle_profiler("http://x", 60)
    assert posts == [False, True]
    assert prof["settled"] and prof["k_total"] == 93
    assert "settled" in gc._profile_note(prof, 0) and "quiet" in gc._profile_note(prof, 0)


def test_settle_profiler_reports_a_sweep_that_outlasts_its_bound(monkeypatch):
    gc = _gpu_check()
    state = {"measuring": True, "reprofile_due": False, "reprofiles": 0, "k_total": None, "measured_under_load": None}

    def post(url, json=None, timeout=None):
        raise gc.httpx.ReadTimeout("still sweeping")

    monkeypatch.setattr(gc.httpx, "post", post)
    monkeypatch.setattr(gc.httpx, "get", lambda url, timeout=None: _Resp(payload={"profile": dict(state)}))
    prof = gc._settle_profiler("http://x", 5)
    assert not prof["settled"]
    assert "NOT settled" in gc._profile_note(prof, 0)
    assert gc._profiler_ran({"measuring": False, "reprofiles": 0}, {"measuring": False, "reprofiles": 1})
    assert not gc._profiler_ran({"reprofiles": 1, "k_total": 93}, {"reprofiles": 1, "k_total": 93})


def test_flush_cache_retries_while_refused(monkeypatch):
    gc = _gpu_check()
    codes = iter([400, 400, 200])
    monkeypatch.setattr(gc.httpx, "post", lambda url, timeout=None: _Resp(next(codes)))
    monkeypatch.setattr(gc.time, "sleep", lambda s: None)
    assert gc._flush_cache("http://x") >= 0
    monkeypatch.setattr(gc.httpx, "post", lambda url, timeout=None: _Resp(400))
    with pytest.raises(RuntimeError, match="refused"):
        gc._flush_cache("http://x", wait_s=0)


def test_search_stage_warms_both_modes_and_alternates_pairs(monkeypatch, tmp_path):
    """One untimed search per mode, then ``search_pairs`` pairs in alternating order, each on a flushed cache after
    the profiler settled; the detail reports the median (min-max) of the per-pair ratios."""
    gc = _gpu_check()
    check = gc.GpuCheck(dry=True, budget_s=60, out=tmp_path)
    check.state["template"] = "{question}\n"
    calls = []
    monkeypatch.setattr(check, "need_server", lambda tag: "http://x")
    monkeypatch.setattr(gc, "_settle_profiler", lambda url, wait_s: {"settled": True, "wait_s": 3.0, "k_total": 93})
    monkeypatch.setattr(gc, "_profile_status", lambda url: {"measuring": False, "reprofiles": 0, "k_total": 93})
    monkeypatch.setattr(gc, "_flush_cache", lambda url: calls.append("flush") or 0.0)

    async def post_all(url, bodies, timeout):
        spec = bodies[0]["spec"]
        mode = "spex" if spec["speculation"]["enabled"] else "baseline"
        calls.append(f"{mode}:{'warm' if len(bodies) == 1 else len(bodies)}")
        return [{"status": "done", "nodes": [{"path": "0", "text": b["question"]}]} for b in bodies]

    monkeypatch.setattr(gc, "_post_all", post_all)
    out = check.stage_search()
    n = check.sizes.questions
    runs = [c for c in calls if c != "flush"]
    assert runs[:2] == ["baseline:warm", "spex:warm"]
    assert runs[2:] == [f"{m}:{n}" for m in ("baseline", "spex", "spex", "baseline", "baseline", "spex")]
    assert calls.count("flush") == len(runs)  # every run, warm-ups included, starts on a flushed cache
    assert len(out["ratios"]) == check.sizes.search_pairs == 3
    assert not out["_fail"], out["_detail"]
    assert "3 alternating pairs" in out["_detail"] and "per pair" in out["_detail"]
    assert f"same tree {3 * n}/{3 * n}" in out["_detail"] and "profiler settled in 3 s" in out["_detail"]
