"""Launcher checks from a review: a flag or spec the server would ignore, or fail on only after the model loaded,
exits with status 2 and one line naming it, before any model loads; the valid forms still parse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_spex import config
from sglang_spex.config import (
    ENV_VAR,
    FORCE_CPU_ENV_VAR,
    MAX_DRAFT_STEPS,
    MAX_SEED,
    MAX_TRAIN_STEPS,
    ConfigError,
    LearnerConfig,
    PluginConfig,
)
from sglang_spex.flags import MAX_HYSTERESIS_STEPS, parse_args
from sglang_spex.launch_server import THREAD_BIND_ENV, check_thread_binding, prepare

EAGLE3 = ["--speculative-algorithm", "EAGLE3"]
NGRAM = ["--speculative-algorithm", "NGRAM"]


def model_dir(path: Path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return str(path)


@pytest.fixture
def dirs(tmp_path):
    """(drafter, target): two local model dirs."""
    return model_dir(tmp_path / "drafter"), model_dir(tmp_path / "target")


def spec(dirs, **fields) -> str:
    drafter, target = dirs
    return json.dumps({"drafter": drafter, "target": target, **fields})


def learner(dirs, **learner_fields) -> str:
    return spec(dirs, learner=learner_fields)


def run_launcher(*args: str, env: dict = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang_spex.launch_server", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, FORCE_CPU_ENV_VAR: "1", **(env or {})},
    )


def assert_one_line_exit_2(p: subprocess.CompletedProcess, *needles: str) -> str:
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sglang_spex.launch_server: error: "), p.stderr
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


@pytest.fixture
def clean_env(monkeypatch):
    """prepare() exports the config and reads SGLANG_CPU_OMP_THREADS_BIND: keep both inside the test."""
    for name in (ENV_VAR, THREAD_BIND_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    yield monkeypatch
    config.reset()


# ---------------------------------------------------------------- 1. the learner spec: local dirs, seed in range
def test_a_learner_spec_the_server_could_not_load_exits_2_naming_the_field(tmp_path, dirs):
    drafter, _ = dirs
    bad_target = json.dumps({"drafter": drafter, "target": "/nonexistent/model"})
    p = run_launcher("--respec-learner", bad_target, *EAGLE3)
    assert_one_line_exit_2(p, "--respec-learner target '/nonexistent/model': no such directory")
    p = run_launcher("--respec-learner", learner(dirs, seed=2**70), *EAGLE3)
    assert_one_line_exit_2(p, "--respec-learner.learner.seed", "must be in [0, 9223372036854775807]")


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda d, t: {"drafter": d, "target": "/nonexistent/model"}, "target '/nonexistent/model': no such directory"),
        (lambda d, t: {"drafter": "/nonexistent/drafter", "target": t}, "drafter '/nonexistent/drafter': no such"),
        (lambda d, t: {"target": t}, "needs ['drafter']"),
        (lambda d, t: {"drafter": d, "target": t, "learner": {"seed": 2**70}}, "--respec-learner.learner.seed"),
        (lambda d, t: {"drafter": d, "target": t, "learner": {"seed": -1}}, "--respec-learner.learner.seed -1"),
    ],
)
def test_bad_learner_specs_name_the_field(dirs, make, needle):
    with pytest.raises(ConfigError) as e:
        parse_args(["--respec-learner", json.dumps(make(*dirs)), *EAGLE3])
    assert needle in str(e.value)


def test_a_dir_without_config_json_is_not_a_model_dir(tmp_path, dirs):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="--respec-learner drafter .*: no config.json in it"):
        parse_args(["--respec-learner", json.dumps({"drafter": str(empty), "target": dirs[1]}), *EAGLE3])


def test_valid_learner_specs_still_parse(dirs, tmp_path):
    cfg, _ = parse_args(["--respec-learner", learner(dirs, seed=MAX_SEED), *EAGLE3])
    assert (cfg.learner.drafter, cfg.learner.target, cfg.learner.learner.seed) == (*dirs, MAX_SEED)
    path = tmp_path / "spec.json"
    path.write_text(spec(dirs))
    assert parse_args(["--respec-learner", str(path), "--speculative-algorithm", "EAGLE"])[0].learner.target == dirs[1]


# ---------------------------------------------------------------- 2. the learner needs an EAGLE drafter to publish into
@pytest.mark.parametrize("alg, got", [([], "none"), (NGRAM, "NGRAM"), (["--speculative-algorithm", "STANDALONE"], "")])
def test_a_learner_without_an_eagle_server_exits_2(dirs, alg, got):
    with pytest.raises(ConfigError, match=f"--respec-learner needs --speculative-algorithm EAGLE or EAGLE3 .got {got}"):
        parse_args(["--respec-learner", spec(dirs), *alg])


def test_a_learner_without_an_eagle_server_fails_fast_in_the_launcher(dirs):
    p = run_launcher("--respec-learner", spec(dirs), *NGRAM)
    assert_one_line_exit_2(p, "--respec-learner needs --speculative-algorithm EAGLE or EAGLE3 (got NGRAM)")


def test_a_learner_publishing_elsewhere_needs_no_local_drafter(dirs):
    cfg, _ = parse_args(["--respec-learner", spec(dirs, server_url="http://127.0.0.1:30001"), *NGRAM])
    assert cfg.learner.server_url == "http://127.0.0.1:30001"
    for alg in ("EAGLE", "EAGLE3"):
        assert parse_args(["--respec-learner", spec(dirs), "--speculative-algorithm", alg])[0].learner is not None


# ---------------------------------------------------------------- 3. learner numbers that train nothing or diverge
BAD_LEARNER = [
    ("grad_clip", 0),
    ("grad_clip", -0.5),
    ("grad_clip", float("nan")),
    ("grad_clip", float("inf")),
    ("w_max", -1.0),
    ("w_max", 0),
    ("w_max", float("nan")),
    ("lr", float("inf")),
    ("lr", float("nan")),
    ("lr", 0),
    ("lr", -1e-4),
    ("train_steps", 10**9),
    ("train_steps", MAX_TRAIN_STEPS + 1),
    ("kd_steps", 10**9),
    ("kd_steps", MAX_DRAFT_STEPS + 1),
    ("probe_steps", 10**9),
    ("probe_steps", 0),
]


@pytest.mark.parametrize("field, value", BAD_LEARNER)
def test_unsafe_learner_numbers_name_the_field(dirs, field, value):
    with pytest.raises(ConfigError, match=rf"--respec-learner\.learner\.{field} "):
        parse_args(["--respec-learner", learner(dirs, **{field: value}), *EAGLE3])
    with pytest.raises(ConfigError, match=rf"^{field} "):
        LearnerConfig(**{field: value}).validate()
    env_json = json.dumps({"learner": json.loads(learner(dirs, **{field: value}))})
    with pytest.raises(ConfigError, match=rf"{ENV_VAR}\.learner\.learner\.{field} "):
        PluginConfig.from_json(env_json, where=ENV_VAR)


def test_unsafe_learner_numbers_fail_fast_in_the_launcher(dirs):
    p = run_launcher("--respec-learner", learner(dirs, grad_clip=-1), *EAGLE3)
    assert_one_line_exit_2(p, "--respec-learner.learner.grad_clip -1.0: must be a finite number > 0")
    p = run_launcher("--respec-learner", learner(dirs, train_steps=10**9), *EAGLE3)
    assert_one_line_exit_2(p, "--respec-learner.learner.train_steps 1000000000: must be in [1, 10000]")


def test_the_learner_limits_themselves_are_accepted(dirs):
    edges = dict(train_steps=MAX_TRAIN_STEPS, kd_steps=MAX_DRAFT_STEPS, probe_steps=MAX_DRAFT_STEPS, lr=1e30)
    edges.update(grad_clip=1e-3, w_max=0.5, seed=0)
    cfg, _ = parse_args(["--respec-learner", learner(dirs, **edges), *EAGLE3])
    assert cfg.learner.learner == LearnerConfig(**edges)
    assert LearnerConfig().validate() == LearnerConfig()


def test_a_directly_built_config_checks_the_nested_learner_too(dirs):
    from sglang_spex.config import LearnerSpec

    bad = PluginConfig(learner=LearnerSpec(*dirs, LearnerConfig(grad_clip=float("nan"))))
    with pytest.raises(ConfigError, match="grad_clip nan"):
        bad.validate()


# ---------------------------------------------------------------- 4. flags that would do nothing
ADAPTIVE_ONLY = [
    ["--respec-force", "spec"],
    ["--respec-hysteresis", "2,4"],
    ["--respec-drift", "0.1"],
    ["--respec-eagle-off", "warm"],
    ["--respec-profile", "auto"],
]
SPECULATION_ONLY = [
    ["--tot-lookahead", "3"],
    ["--tot-max-lookahead", "8"],
    ["--tot-bfs-lookahead", "2"],
    ["--tot-k-total", "4"],
    ["--tot-components", "t1"],
    ["--tot-early-stop"],
    ["--tot-budget-temperature", "0.5"],
    ["--tot-live-knee", "off"],
    ["--tot-mixed-prefill", "off"],
    ["--tot-auto-off", "off"],
]


@pytest.mark.parametrize("flag", ADAPTIVE_ONLY)
def test_respec_flags_without_respec_adaptive_exit_2(flag):
    with pytest.raises(ConfigError, match=f"^{flag[0]} needs --respec-adaptive"):
        parse_args([*flag, *EAGLE3])
    with pytest.raises(ConfigError, match=f"^{flag[0]} needs --respec-adaptive"):
        parse_args([*flag, "--respec-adaptive", "off", *EAGLE3])
    cfg, _ = parse_args([*flag, "--respec-adaptive", *EAGLE3])
    assert cfg.respec.enabled


@pytest.mark.parametrize("flag", SPECULATION_ONLY)
def test_speculation_flags_without_tot_speculation_exit_2(flag):
    with pytest.raises(ConfigError, match=f"^{flag[0]} needs --tot-speculation"):
        parse_args(flag)
    assert parse_args([*flag, "--tot-speculation"])[0].spex.enabled


@pytest.mark.parametrize("flag", ["--tot-reward-timeout", "--tot-budget-temperature", "--tot-budget-max-wait-s"])
@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1"])
def test_time_and_temperature_flags_must_be_finite_and_positive(flag, value):
    with pytest.raises(ConfigError, match=f"^{flag} [-a-z0-9.]+: must be a finite number > 0"):
        parse_args(["--tot-speculation", flag, value])


def test_flags_without_their_switch_fail_fast_in_the_launcher():
    assert_one_line_exit_2(run_launcher("--respec-force", "spec"), "--respec-force needs --respec-adaptive")
    assert_one_line_exit_2(run_launcher("--tot-lookahead", "3"), "--tot-lookahead needs --tot-speculation")


def test_defaults_never_trip_the_combination_checks():
    assert parse_args([])[0] == PluginConfig()
    cfg, _ = parse_args(["--tot-speculation", "--tot-lookahead", "20"])  # the default max (16) is below: fine
    assert (cfg.spex.lookahead, cfg.spex.max_lookahead) == (20, 16)
    assert parse_args(["--respec-adaptive", *NGRAM])[0].respec.hysteresis == "1,8,2"
    assert parse_args(["--tot-speculation", "--tot-max-lookahead", "4"])[0].spex.max_lookahead == 4  # = k: a cap


def test_max_lookahead_below_lookahead_exits_2():
    with pytest.raises(ConfigError, match=r"^--tot-max-lookahead 2: must be >= --tot-lookahead \(4\)"):
        parse_args(["--tot-speculation", "--tot-max-lookahead", "2"])
    with pytest.raises(ConfigError, match=r"^--tot-max-lookahead 5: must be >= --tot-lookahead \(6\)"):
        parse_args(["--tot-speculation", "--tot-lookahead", "6", "--tot-max-lookahead", "5"])
    assert parse_args(["--tot-speculation", "--tot-lookahead", "3", "--tot-max-lookahead", "3"])[0].spex.lookahead == 3


def test_eagle_off_needs_an_eagle_server():
    with pytest.raises(ConfigError, match="^--respec-eagle-off needs --speculative-algorithm EAGLE or EAGLE3"):
        parse_args(["--respec-adaptive", "--respec-eagle-off", "warm", *NGRAM])
    assert parse_args(["--respec-adaptive", "--respec-eagle-off", "warm", *EAGLE3])[0].respec.eagle_off == "warm"


@pytest.mark.parametrize(
    "value, needle",
    [
        ("256,8", "MARGIN 256 must be below 256"),
        ("1000,8,2", "MARGIN 1000"),
        (f"1,{MAX_HYSTERESIS_STEPS + 1}", "MIN_DWELL and CONFIRM must be at most"),
        (f"1,8,{MAX_HYSTERESIS_STEPS + 1}", "MIN_DWELL and CONFIRM must be at most"),
        ("1,8,0", "expected MARGIN,MIN_DWELL"),
    ],
)
def test_a_hysteresis_under_which_the_fsm_never_switches_exits_2(value, needle):
    with pytest.raises(ConfigError, match=f"^--respec-hysteresis '{value}'"):
        parse_args(["--respec-adaptive", "--respec-hysteresis", value, *NGRAM])
    with pytest.raises(ConfigError) as e:
        parse_args(["--respec-adaptive", "--respec-hysteresis", value, *NGRAM])
    assert needle in str(e.value)


@pytest.mark.parametrize("value", ["0,0", "0,0,1", "255,8", f"0,{MAX_HYSTERESIS_STEPS},{MAX_HYSTERESIS_STEPS}"])
def test_hysteresis_values_the_fsm_runs_with_still_parse(value):
    """``0,0`` is margin 0, no dwell, CONFIRM 2 (two votes in a row switch); ``0,0,1`` is no hysteresis at all."""
    from sglang_spex.respec.fsm import Hysteresis

    cfg, _ = parse_args(["--respec-adaptive", "--respec-hysteresis", value, *NGRAM])
    assert cfg.respec.hysteresis == value and Hysteresis.parse(value).confirm >= 1


# ---------------------------------------------------------------- 5. SGLANG_CPU_OMP_THREADS_BIND: a group for each rank
@pytest.mark.parametrize(
    "args, binding, needle",
    [
        (["--dp-size", "2"], "0-1", "has 1 group(s), but this server's 2 CPU rank(s)"),
        (["--dp-size", "2"], "0|", "need 2 non-empty"),
        (["--dp", "2", "--tp", "2"], "0-1|2-3", "4 CPU rank(s)"),
        (["--base-gpu-id", "2"], "0|1", "need 3 non-empty"),
    ],
)
def test_a_binding_that_does_not_match_the_ranks_is_refused(args, binding, needle):
    with pytest.raises(ConfigError) as e:
        check_thread_binding(args, binding, [0, 1, 2, 3])
    assert str(e.value).startswith(f"{THREAD_BIND_ENV}={binding!r}") and needle in str(e.value)


def test_the_message_gives_a_binding_that_works():
    with pytest.raises(ConfigError, match=r"\(e\.g\. 0\|1\)$"):
        check_thread_binding(["--dp-size", "2"], "0-1", [0, 1])
    with pytest.raises(ConfigError, match=r"\(e\.g\. 0-1\|2-3\|4-5\|6-7\)$"):
        check_thread_binding(["--dp", "2", "--tp", "2"], "0-7", range(8))


@pytest.mark.parametrize(
    "args, binding",
    [
        ([], "0-1"),
        (["--dp-size", "2"], "0|1"),
        (["--dp-size", "2"], "0|0"),  # the user may share a core between ranks
        (["--dp", "2", "--tp", "2"], "0|1|2|3"),
        (["--base-gpu-id", "1"], "0|1"),  # servers sharing one binding: this one takes group 1
        (["--base-gpu-id", "1"], "0|1|2"),
        (["--dp-size", "2"], "0|1|0"),  # more groups than ranks: one binding shared by servers of other sizes
        ([], "0|1"),
        (["--dp-size", "2", "--tp-size", "2", "--enable-dp-attention"], "0|1"),  # attention DP: 2 ranks, not 4
        (["--dp-size", "2", "--nnodes", "2"], "0"),  # multi-node: left to SGLang
    ],
)
def test_bindings_with_a_group_per_rank_pass(args, binding):
    check_thread_binding(args, binding, [0, 1])


def test_prepare_checks_the_users_binding_on_cpu_only(clean_env, tmp_path):
    model = model_dir(tmp_path / "model")
    clean_env.setenv(THREAD_BIND_ENV, "0-1")
    with pytest.raises(ConfigError, match=f"^{THREAD_BIND_ENV}='0-1' has 1 group"):
        prepare(["--model-path", model, "--dp-size", "2"], gpu=False)
    assert ENV_VAR not in os.environ  # refused before the config was exported
    with pytest.raises(ConfigError, match=THREAD_BIND_ENV):
        prepare(["--model-path", model, "--dp-size", "2", "--device", "cpu"], gpu=True)
    assert "--dp-size" in prepare(["--model-path", model, "--dp-size", "2"], gpu=True)  # a GPU server ignores it
    clean_env.setenv(THREAD_BIND_ENV, "0|1")
    args = prepare(["--model-path", model, "--dp-size", "2", "--device", "cpu"], gpu=True)
    assert os.environ[THREAD_BIND_ENV] == "0|1" and args.count("--device") == 1


def test_a_wrong_binding_fails_fast_in_the_launcher(tmp_path):
    model = model_dir(tmp_path / "model")
    p = run_launcher("--model-path", model, "--dp-size", "2", env={THREAD_BIND_ENV: "0-1"})
    line = assert_one_line_exit_2(p, f"{THREAD_BIND_ENV}='0-1' has 1 group(s)", "need 2 non-empty '|'-separated")
    assert "Load weight" not in p.stdout + p.stderr and "Traceback" not in line


def test_a_launch_removes_the_rings_of_servers_whose_launcher_is_gone(tmp_path):
    """SGLang ends its schedulers with a signal, so a ring's writer never unlinks it: the next launch does, for
    every launcher that no longer runs, and leaves live servers' rings and other files alone."""
    import os
    import subprocess
    import sys

    from sglang_spex.config import STATS_FILE_PREFIX
    from sglang_spex.launch_server import remove_stale_rings

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    names = {
        f"{STATS_FILE_PREFIX}{dead}": False,
        f"{STATS_FILE_PREFIX}{dead}.0": False,
        f"{STATS_FILE_PREFIX}{dead}.1": False,
        f"{STATS_FILE_PREFIX}{os.getpid()}": True,  # a live launcher's
        f"{STATS_FILE_PREFIX}{os.getpid()}.0": True,
        f"{STATS_FILE_PREFIX}notapid": True,
        f"{STATS_FILE_PREFIX}{dead}.x": True,
        "sem.mp-abc": True,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_stale_rings(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == sorted(n for n, keep in names.items() if not keep)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, keep in names.items() if keep)
