"""The suite's spare launchers (``test/warm_launchers.py``): a server start is handed to a spare only when their
environments match, the spare gets the server's argv, env and log, and a spare whose environment went stale is
replaced. A stand-in script plays the spare (the real one imports SGLang for ~13 s; every server test uses it)."""

from __future__ import annotations

import json

import pytest
import warm_launchers

from sglang_spex.serve import ServerProcess

STARTS_NO_SERVER = True  # ServerProcess objects are built, never started
FAKE_SPARE = "import json, sys\njob = json.loads(sys.stdin.readline())\nopen(job['log'], 'w').write(json.dumps(job))\n"


@pytest.fixture
def pool(tmp_path, monkeypatch):
    script = tmp_path / "spare.py"
    script.write_text(FAKE_SPARE)
    monkeypatch.setattr(warm_launchers, "SCRIPT", script)
    p = warm_launchers.WarmLaunchers(size=2)
    yield p
    p.close()


def test_a_matching_server_takes_the_oldest_spare_with_its_argv_env_and_log(pool, tmp_path):
    pool.refill()
    oldest = pool.spares[0][0]
    srv = ServerProcess(["--model-path", "m"], log_path=str(tmp_path / "server.log"))
    assert pool.take(srv) and srv.proc is oldest and pool.taken == 1
    assert srv.proc.wait(timeout=30) == 0
    job = json.loads((tmp_path / "server.log").read_text())
    assert job["argv"] == srv.args and job["env"] == srv.env and "--port" in job["argv"]
    assert len(pool.spares) == 1  # refill tops it up again
    pool.refill()
    assert len(pool.spares) == 2


def test_a_server_with_another_environment_starts_cold(pool, tmp_path):
    pool.refill()
    srv = ServerProcess(["--model-path", "m"], env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    assert not pool.take(srv) and srv.proc is None and len(pool.spares) == 2


def test_pytests_test_name_does_not_count_as_a_different_environment(pool, monkeypatch):
    pool.refill()
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")
    assert pool.take(ServerProcess(["--model-path", "m"]))


def test_a_spare_whose_environment_went_stale_is_replaced(pool, monkeypatch):
    pool.refill()
    stale = [p for p, _ in pool.spares]
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # e.g. a test leaking the launcher's CPU env
    assert not pool.take(ServerProcess(["--model-path", "m"]))
    pool.refill()
    assert all(p.poll() is not None for p in stale)
    assert [env["OMP_NUM_THREADS"] for _, env in pool.spares] == ["7", "7"]
    assert pool.take(ServerProcess(["--model-path", "m"]))


def test_a_dead_spare_is_not_handed_a_server(pool, tmp_path, monkeypatch):
    dead = tmp_path / "dead.py"
    dead.write_text("raise SystemExit(3)\n")
    monkeypatch.setattr(warm_launchers, "SCRIPT", dead)
    pool.refill()
    for p, _ in pool.spares:
        p.wait(timeout=30)
    assert not pool.take(ServerProcess(["--model-path", "m"]))
