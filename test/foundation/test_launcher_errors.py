"""Bad flags and paths fail fast (before any model loads) with a message naming the problem."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from sglang_spex.config import ConfigError, PluginConfig, SpexConfig, flag_value
from sglang_spex.flags import parse_args
from sglang_spex.launch_server import CPU_DEFAULTS, build_sglang_args
from sglang_spex.serve import PORT_TAKEN


def spex_args(argv):
    cfg, rest = parse_args(argv)
    return cfg.spex, rest


def run_launcher(*args):
    t = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "sglang_spex.launch_server", *args], capture_output=True, text=True, timeout=120
    )
    return p, time.monotonic() - t


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--tot-speculaton"], "--tot-speculaton"),
        (["--tot-k-total", "many"], "--tot-k-total"),
        (["--tot-components", "t1,t9"], "--tot-components"),
        (["--tot-early-stop-alpha", "3"], "--tot-early-stop-alpha"),
        (["--model-path", "/nonexistent/model", "--tot-speculation"], "/nonexistent/model"),
        # a typo in one of SGLang's flags: its error line and the closest flags, not its whole usage text
        (["--max-runing-requests", "8"], "(did you mean --max-running-requests"),
    ],
)
def test_bad_input_fails_fast_with_named_flag(args, needle):
    p, took = run_launcher(*args)
    assert p.returncode == 2
    assert needle in p.stderr
    assert "Traceback" not in p.stderr and "usage:" not in p.stderr
    assert took < 60


def test_a_taken_port_fails_fast_with_its_number(tiny_model):
    """The launcher checks SGLang's HTTP port before any model loads (uvicorn would hit it after, then hang)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p, took = run_launcher("--model-path", tiny_model, "--host", "127.0.0.1", "--port", str(port))
    assert p.returncode == 2
    assert f"--port {port}: {PORT_TAKEN}" in p.stderr
    assert "Traceback" not in p.stderr and "Load weight" not in p.stderr + p.stdout
    assert took < 60


def test_parse_splits_ours_from_sglang():
    cfg, rest = spex_args(["--tot-speculation", "--tot-k-total", "auto", "--tp", "1", "--tot-lookahead=3"])
    assert cfg.enabled and cfg.k_total is None and cfg.lookahead == 3
    assert rest == ["--tp", "1"]
    assert not cfg.early_stop
    on = ["--tot-speculation"]
    assert spex_args([*on, "--tot-early-stop"])[0].early_stop
    assert spex_args([*on, "--tot-early-stop", "on"])[0].early_stop
    assert not spex_args([*on, "--tot-early-stop", "off"])[0].early_stop
    with pytest.raises(ConfigError, match="--tot-early-stop"):
        spex_args([*on, "--tot-early-stop", "maybe"])
    assert SpexConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['bogus'\]"):
        SpexConfig.from_json('{"bogus": 1}')


def test_cpu_defaults_respect_user_flags(tiny_model):
    cfg, rest = parse_args(["--model-path", tiny_model, "--attention-backend", "triton", "--tot-speculation"])
    args = build_sglang_args(cfg, rest, gpu=False)
    assert args.count("--attention-backend") == 1 and "triton" in args
    for flag in ("--device", "--sleep-on-idle", "--radix-eviction-policy"):
        assert flag in args
    plain = build_sglang_args(PluginConfig(), ["--model-path", tiny_model], gpu=True)
    assert not any(f in plain for f in CPU_DEFAULTS) and "--radix-eviction-policy" not in plain


def test_overlap_schedule_stays_sglangs_default(tiny_model):
    """Overlap on everywhere (SGLang's default): the launcher never adds --disable-overlap-schedule, keeps the user's,
    and takes the old --enable-overlap-schedule as a no-op that contradicts --disable-overlap-schedule."""
    model = ["--model-path", tiny_model]
    for gpu in (False, True):
        cfg, rest = parse_args([*model, "--tot-speculation", "--respec-adaptive", "--speculative-algorithm", "NGRAM"])
        args = build_sglang_args(cfg, rest, gpu=gpu)
        assert "--disable-overlap-schedule" not in args and "--radix-eviction-policy" in args
        cfg, rest = parse_args([*model, "--disable-overlap-schedule"])
        assert build_sglang_args(cfg, rest, gpu=gpu).count("--disable-overlap-schedule") == 1
    cfg, rest = parse_args([*model, "--enable-overlap-schedule", "--tot-speculation"])
    args = build_sglang_args(cfg, rest, gpu=False)
    assert "--disable-overlap-schedule" not in args and "--enable-overlap-schedule" not in args
    assert "--device" in args  # the other CPU defaults still apply
    cfg, rest = parse_args([*model, "--enable-overlap-schedule"])
    with pytest.raises(ConfigError, match="contradict"):
        build_sglang_args(cfg, [*rest, "--disable-overlap-schedule", "--enable-overlap-schedule"], gpu=False)


def test_mixed_prefill_is_on_under_tot_speculation_unless_off_or_speculative(tiny_model):
    """--tot-mixed-prefill (default on) adds SGLang's --enable-mixed-chunk once, on CPU and GPU, but not with
    --tot-mixed-prefill off, without --tot-speculation, or with a speculative algorithm (SGLang refuses the mix)."""
    model = ["--model-path", tiny_model]

    def args_for(*flags):
        cfg, rest = parse_args([*model, *flags])
        return build_sglang_args(cfg, rest, gpu=False)

    for gpu in (False, True):
        cfg, rest = parse_args([*model, "--tot-speculation"])
        assert build_sglang_args(cfg, rest, gpu=gpu).count("--enable-mixed-chunk") == 1
    assert args_for("--tot-speculation", "--enable-mixed-chunk").count("--enable-mixed-chunk") == 1
    assert "--enable-mixed-chunk" not in args_for("--tot-speculation", "--tot-mixed-prefill", "off")
    assert "--enable-mixed-chunk" not in args_for()
    assert "--enable-mixed-chunk" not in args_for("--tot-speculation", "--speculative-algorithm", "NGRAM")


def test_tot_speculation_samples_with_torch_unless_told(tiny_model):
    """Seeded ToT nodes need a sampler that takes seeds for top-k/top-p: pytorch under --tot-speculation on a GPU
    too (SGLang's GPU default, flashinfer, takes none); a backend the user names is kept; no default without it."""
    model = ["--model-path", tiny_model]
    cfg, rest = parse_args([*model, "--tot-speculation"])
    assert flag_value(build_sglang_args(cfg, rest, gpu=True), "--sampling-backend") == "pytorch"
    cfg, rest = parse_args([*model, "--tot-speculation", "--sampling-backend", "flashinfer"])
    args = build_sglang_args(cfg, rest, gpu=True)
    assert flag_value(args, "--sampling-backend") == "flashinfer" and args.count("--sampling-backend") == 1
    cfg, rest = parse_args(model)
    assert "--sampling-backend" not in build_sglang_args(cfg, rest, gpu=True)


@pytest.mark.parametrize("policy, ok", [("lpm", False), ("dfs-weight", False), ("lof", True), ("fcfs", True)])
def test_a_schedule_policy_without_priority_scheduling_is_refused_before_start(tiny_model, policy, ok):
    """--tot-speculation needs SGLang's priority scheduling, which SGLang asserts only with fcfs/lof: seconds into
    start-up, as a traceback (review); the launcher names the conflict first. Without --tot-speculation, any policy."""
    cfg, rest = parse_args(["--tot-speculation", "--model-path", tiny_model, "--schedule-policy", policy])
    if ok:
        assert "--enable-priority-scheduling" in build_sglang_args(cfg, rest, gpu=False)
    else:
        with pytest.raises(ConfigError, match=f"--schedule-policy {policy}: .*fcfs or lof"):
            build_sglang_args(cfg, rest, gpu=False)
    cfg, rest = parse_args(["--model-path", tiny_model, "--schedule-policy", policy])
    assert build_sglang_args(cfg, rest, gpu=False).count("--schedule-policy") == 1
