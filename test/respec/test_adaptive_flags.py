"""``--respec-*`` launcher flags: parsed apart from SGLang's and ``--tot-*``; bad values fail fast, naming the flag."""

from __future__ import annotations

import json
import os

import pytest

from sglang_spex.config import RESPEC_ENV_VAR, ConfigError, RespecConfig, parse_respec_args, parse_tot_args

NGRAM = ["--speculative-algorithm", "NGRAM"]


def test_defaults_and_pass_through():
    cfg, rest = parse_respec_args(["--model-path", "m", "--tot-speculation"])
    assert cfg == RespecConfig() and rest == ["--model-path", "m", "--tot-speculation"]
    tot, rest = parse_tot_args(["--respec-adaptive", "--tot-speculation", *NGRAM])
    assert tot.enabled and rest[0] == "--respec-adaptive"  # --tot-* parsing ignores our flags
    cfg, rest = parse_respec_args(rest)
    assert cfg.enabled and rest == NGRAM


def test_all_flags(tmp_path):
    prof = tmp_path / "p.json"
    prof.write_text("{}")
    argv = ["--respec-adaptive", "--respec-profile", str(prof), "--respec-hysteresis", "2,16,3", *NGRAM]
    cfg, rest = parse_respec_args(argv + ["--respec-force=alternate:4"])
    assert (cfg.profile, cfg.hysteresis, cfg.force) == (str(prof), "2,16,3", "alternate:4") and rest == NGRAM
    assert RespecConfig(**json.loads(cfg.to_json())) == cfg


def test_from_env(monkeypatch):
    monkeypatch.setenv(RESPEC_ENV_VAR, RespecConfig(enabled=True, force="plain").to_json())
    assert RespecConfig.from_env().force == "plain"
    monkeypatch.delenv(RESPEC_ENV_VAR)
    assert not RespecConfig.from_env().enabled


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--respec-adaptiv"], "--respec-adaptiv"),
        (["--respec-hysteresis", "fast"], "--respec-hysteresis"),
        (["--respec-force", "sometimes"], "--respec-force"),
        (["--respec-profile", "/nonexistent/p.json"], "--respec-profile"),
        (["--respec-adaptive"], "--speculative-algorithm one of"),
        (["--respec-adaptive", "--speculative-algorithm", "STANDALONE"], "STANDALONE"),
        (["--respec-adaptive", "--speculative-algorithm", "EAGLE3", "--speculative-eagle-topk", "2"], "topk 1"),
        (
            ["--respec-adaptive", "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3"]
            + ["--speculative-num-draft-tokens", "6"],
            "= num-steps",
        ),
        (["--respec-drift", "-1"], "--respec-drift"),
    ],
)
def test_bad_flags_name_themselves(argv, needle):
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-")):
        parse_respec_args(argv)


def test_server_key_from_sglang_flags():
    cfg, _ = parse_respec_args(["--respec-adaptive", *NGRAM, "--speculative-num-draft-tokens", "8"])
    assert (cfg.algorithm, cfg.server_key, cfg.eagle) == ("NGRAM", "NGRAM:s8t1n8", False)
    eagle = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1"]
    cfg, _ = parse_respec_args(["--respec-adaptive", "--respec-drift", "0", *eagle])
    assert (cfg.algorithm, cfg.server_key, cfg.eagle, cfg.drift) == ("EAGLE3", "EAGLE3:s3t1n4", True, 0.0)


def test_launcher_adds_sglang_adaptive_flags_for_eagle(monkeypatch):
    from sglang_spex.config import ENV_VAR
    from sglang_spex.launch_server import prepare

    monkeypatch.setenv(ENV_VAR, "")
    monkeypatch.setenv(RESPEC_ENV_VAR, "")
    eagle = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1"]
    args = prepare(["--model-path", "m", "--respec-adaptive", "--respec-force", "spec", *eagle])
    assert "--speculative-adaptive" in args and "--disable-overlap-schedule" in args
    path = args[args.index("--speculative-adaptive-config") + 1]
    assert json.loads(open(path).read()) == {"1": {"candidate_steps": [0, 2]}}  # off and the server's own
    assert not any(a.startswith("--respec") for a in args)
    ngram = prepare(["--model-path", "m", "--respec-adaptive", *NGRAM, "--speculative-num-draft-tokens", "4"])
    assert "--speculative-adaptive" not in ngram and "--disable-overlap-schedule" in ngram


def test_learner_flags(tmp_path, monkeypatch):
    from sglang_spex.config import LEARNER_ENV_VAR, parse_learner_args
    from sglang_spex.launch_server import prepare

    assert parse_learner_args(["--model-path", "m"]) == (None, ["--model-path", "m"])
    path = tmp_path / "learner.json"
    path.write_text(json.dumps({"drafter": "d", "target": "t", "learner": {"train_steps": 2, "mode": "sync"}}))
    argv = ["--respec-learner", str(path), "--respec-update-interval", "3", "--respec-kd", "unweighted", "-x"]
    spec, rest = parse_learner_args(argv)
    assert rest == ["-x"] and spec["learner"] == {
        "train_steps": 2,
        "mode": "sync",
        "update_interval": 3,
        "variant": "unweighted",
    }
    monkeypatch.setenv(LEARNER_ENV_VAR, "")
    monkeypatch.setenv(RESPEC_ENV_VAR, "")
    prepare(
        ["--model-path", "m", "--respec-learner", '{"drafter": "d", "target": "t"}', "--respec-learner-mode", "sync"]
    )
    assert json.loads(os.environ[LEARNER_ENV_VAR]) == {"drafter": "d", "target": "t", "learner": {"mode": "sync"}}


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--respec-update-interval", "2"], "--respec-update-interval needs --respec-learner"),
        (["--respec-learner", "/nonexistent.json"], "--respec-learner"),
        (["--respec-learner", '{"drafter": "d"}'], "needs \\['target'\\]"),
        (["--respec-learner", '{"drafter": "d", "target": "t", "lr": 1}'], "unknown field"),
        (["--respec-learner", '{"drafter": "d", "target": "t"}', "--respec-kd", "distill"], "--respec-kd"),
        (["--respec-learner", '{"drafter": "d", "target": "t"}', "--respec-update-interval", "0"], ">= 1"),
    ],
)
def test_bad_learner_flags_name_themselves(argv, needle):
    from sglang_spex.config import parse_learner_args

    with pytest.raises(ConfigError, match=needle):
        parse_learner_args(argv)
