"""Launcher inputs that used to end in a traceback, a wrong message or a late failure are refused up front, naming
the flag (in process: no server starts)."""

from __future__ import annotations

import socket

import pytest

from sglang_spex import launch_server
from sglang_spex.config import ConfigError
from sglang_spex.serve import PORT_TAKEN


def _refusal(capsys, args) -> str:
    with pytest.raises(SystemExit) as e:
        launch_server.check_port_free(args)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("port", ["abc", "-1", "99999", "²", "1" * 40])
def test_a_bad_port_is_named(capsys, port):
    err = _refusal(capsys, ["--port", port])
    assert f"--port {port!r}: expected a port number in 0..65535" in err and PORT_TAKEN not in err


def test_an_unresolvable_host_is_not_reported_as_a_taken_port(capsys):
    err = _refusal(capsys, ["--host", "no-such-host.invalid", "--port", "30123"])
    assert "--host 'no-such-host.invalid': cannot resolve it" in err and PORT_TAKEN not in err


def test_a_taken_port_still_says_so(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert f"--port {port}: {PORT_TAKEN}" in _refusal(capsys, ["--host", "127.0.0.1", "--port", str(port)])


@pytest.mark.parametrize("flag", ["--dp-size", "--base-gpu-id"])
def test_unicode_digits_are_not_integers(flag):
    with pytest.raises(ConfigError, match=flag):
        launch_server.bind_group_ids([flag, "²"])


def test_a_huge_rank_count_is_refused_before_listing_the_ranks():
    # 10^10 ranks: listing each one's group would run for minutes and exhaust memory
    args = ["--device", "cpu", "--dp-size", "100000", "--tp-size", "100000"]
    with pytest.raises(ConfigError, match="10000000000 CPU rank"):  # (no example: more ranks than cores)
        launch_server.check_thread_binding(args, "0|1", [0, 1])


def test_a_respec_profile_that_is_not_one_is_refused_at_launch(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    for path in (tmp_path, bad):
        argv = ["--model-path", "x", "--speculative-algorithm", "NGRAM", "--respec-adaptive", "--respec-profile"]
        with pytest.raises(ConfigError, match="--respec-profile .*not a readable ReSpec profile"):
            launch_server.prepare([*argv, str(path)], gpu=False)


def test_a_zero_gpu_id_step_with_many_ranks_is_checked_without_listing_them():
    # --gpu-id-step 0: every replica binds the same group, so the binding is fine, and 10^8 ranks are not listed
    args = ["--device", "cpu", "--dp-size", "100000000", "--gpu-id-step", "0"]
    launch_server.check_thread_binding(args, "0|1", [0, 1])
    with pytest.raises(ConfigError, match="need 1 non-empty"):
        launch_server.check_thread_binding(args, " |1", [0, 1])
