"""``--respec-*`` launcher flags: parsed apart from SGLang's and ``--tot-*``; bad values fail fast, naming the flag."""

from __future__ import annotations

import json

import pytest

from sglang_spex import config
from sglang_spex.config import ENV_VAR, ConfigError, PluginConfig, RespecConfig, load
from sglang_spex.flags import parse_args

NGRAM = ["--speculative-algorithm", "NGRAM"]


def parse_respec_args(argv):
    cfg, rest = parse_args(argv)
    return cfg.respec, rest


def parse_learner_args(argv):
    cfg, rest = parse_args(argv)
    return cfg.learner, rest


@pytest.fixture
def clean_env(monkeypatch):
    """prepare() exports the config into os.environ: keep that inside the test (setenv first, so monkeypatch
    restores the variable's absence; a bare delenv of an unset variable records nothing to undo)."""
    monkeypatch.setenv(ENV_VAR, "")
    monkeypatch.delenv(ENV_VAR)
    yield monkeypatch
    config.reset()


def test_defaults_and_pass_through():
    cfg, rest = parse_respec_args(["--model-path", "m", "--tot-speculation"])
    assert cfg == RespecConfig() and rest == ["--model-path", "m"]
    both, rest = parse_args(["--respec-adaptive", "--tot-speculation", *NGRAM])
    assert both.spex.enabled and both.respec.enabled and both.respec.algorithm == "NGRAM" and rest == NGRAM


def test_all_flags(tmp_path):
    prof = tmp_path / "p.json"
    prof.write_text("{}")
    argv = ["--respec-adaptive", "--respec-profile", str(prof), "--respec-hysteresis", "2,16,3", *NGRAM]
    cfg, rest = parse_respec_args(argv + ["--respec-force=alternate:4"])
    assert (cfg.profile, cfg.hysteresis, cfg.force) == (str(prof), "2,16,3", "alternate:4") and rest == NGRAM
    assert RespecConfig(**json.loads(cfg.to_json())) == cfg == RespecConfig.from_json(cfg.to_json())


def test_from_env(clean_env):
    respec = RespecConfig(enabled=True, force="plain", algorithm="NGRAM")
    clean_env.setenv(ENV_VAR, PluginConfig(respec=respec).to_json())
    assert RespecConfig.from_env().force == "plain" and RespecConfig.from_env() is load().respec
    clean_env.delenv(ENV_VAR)
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


def test_launcher_adds_sglang_adaptive_flags_for_eagle(clean_env):
    from sglang_spex.launch_server import prepare

    eagle = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1"]
    for gpu in (False, True):
        args = prepare(["--model-path", "m", "--respec-adaptive", "--respec-force", "spec", *eagle], gpu=gpu)
        assert "--speculative-adaptive" in args
        assert "--disable-overlap-schedule" not in args  # overlap stays on (SGLang's default), CPU included
        path = args[args.index("--speculative-adaptive-config") + 1]
        assert json.loads(open(path).read()) == {"1": {"candidate_steps": [0, 2]}}  # off and the server's own
        assert args[args.index("--max-running-requests") + 1] == "256"  # not SGLang's speculative 48
        assert not any(a.startswith("--respec") for a in args)
        assert load().respec.server_key == "EAGLE3:s2t1n3" and load().stats_path
    given = prepare(["--model-path", "m", "--respec-adaptive", *eagle, "--max-running-requests", "8"], gpu=False)
    assert given.count("--max-running-requests") == 1 and given[given.index("--max-running-requests") + 1] == "8"
    ngram = prepare(["--model-path", "m", "--respec-adaptive", *NGRAM, "--speculative-num-draft-tokens", "4"], gpu=True)
    assert "--speculative-adaptive" not in ngram and "--disable-overlap-schedule" not in ngram
    assert load().respec == RespecConfig(enabled=True, algorithm="NGRAM", server_key="NGRAM:s4t1n4")


def test_learner_flags(tmp_path, clean_env):
    from sglang_spex.launch_server import prepare

    assert parse_learner_args(["--model-path", "m"]) == (None, ["--model-path", "m"])
    for name in ("d", "t"):  # the launcher checks the drafter and the target are model dirs
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    d, t = str(tmp_path / "d"), str(tmp_path / "t")
    eagle3 = ["--speculative-algorithm", "EAGLE3"]  # the learner publishes into the server's EAGLE drafter
    path = tmp_path / "learner.json"
    path.write_text(json.dumps({"drafter": d, "target": t, "learner": {"train_steps": 2, "mode": "sync"}}))
    argv = ["--respec-learner", str(path), "--respec-update-interval", "3", "--respec-kd", "unweighted", "-x"]
    spec, rest = parse_learner_args([*argv, *eagle3])
    lrn = spec.learner
    assert rest == ["-x", *eagle3] and (lrn.train_steps, lrn.mode, lrn.update_interval, lrn.variant) == (
        2,
        "sync",
        3,
        "unweighted",
    )
    assert lrn.lr == 1e-4  # the rest stay defaults
    spec_json = json.dumps({"drafter": d, "target": t})
    prepare(["--model-path", "m", "--respec-learner", spec_json, "--respec-learner-mode", "sync", *eagle3])
    assert (load().learner.drafter, load().learner.target, load().learner.learner.mode) == (d, t, "sync")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--respec-update-interval", "2"], "--respec-update-interval needs --respec-learner"),
        (["--respec-learner", "/nonexistent.json"], "--respec-learner"),
        (["--respec-learner", '{"drafter": "d"}'], "needs \\['target'\\]"),
        (["--respec-learner", '{"drafter": "d", "target": "t", "lr": 1}'], r"unknown field\(s\) \['lr'\]"),
        (["--respec-learner", '{"drafter": "d", "target": "t", "learner": {"mode": "x"}}'], "learner.mode"),
        (["--respec-learner", '{"drafter": "d", "target": "t"}', "--respec-kd", "distill"], "--respec-kd"),
        (["--respec-learner", '{"drafter": "d", "target": "t"}', "--respec-update-interval", "0"], ">= 1"),
    ],
)
def test_bad_learner_flags_name_themselves(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_learner_args(argv)


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"server_url": ""}, "server_url: '' is not an http"),
        ({"server_url": "notaurl"}, "server_url: 'notaurl'"),
        ({"replica_urls": ["http://r:1", "x"]}, r"replica_urls\[1\]: 'x'"),
        ({"probe": [[[1, 2], []]]}, r"probe\[0\]"),
        ({"probe": [[[1], [2]], [[-1], [2]]]}, r"probe\[1\]"),
    ],
)
def test_learner_urls_and_probe_are_checked_at_launch(tmp_path, clean_env, extra, needle):
    """They failed only at the learner's first publish or update, after the model loaded (review)."""
    from sglang_spex.launch_server import prepare

    for name in ("d", "t"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    spec = json.dumps({"drafter": str(tmp_path / "d"), "target": str(tmp_path / "t"), **extra})
    with pytest.raises(ConfigError, match=needle):
        prepare(["--model-path", "m", "--respec-learner", spec, "--speculative-algorithm", "EAGLE3"])
