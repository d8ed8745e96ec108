"""The one typed config: generated flags, JSON round trip, unknown fields and bad types rejected at every level,
one env var parsed once per process."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from sglang_spex import config
from sglang_spex.config import (
    CACHE_ENV_VAR,
    ENV_VAR,
    ENV_VARS,
    SECTIONS,
    ConfigError,
    LearnerConfig,
    LearnerSpec,
    PluginConfig,
    RespecConfig,
    SpexConfig,
    cache_dir,
    export,
    load,
    stats_channel,
)
from sglang_spex.flags import NEEDS, add_flags, flag_fields, flag_of, flag_table, parse_args

# One non-default command-line value per generated flag, and the field value it must produce.
NON_DEFAULT = {
    "--tot-speculation": ([], True),
    "--tot-k-total": (["12"], 12),
    "--tot-min-share": (["3"], 3),
    "--tot-components": (["t1,t3"], ("t1", "t3")),
    "--tot-lookahead": (["6"], 6),
    "--tot-max-lookahead": (["9"], 9),
    "--tot-sure-use": (["0.75"], 0.75),
    "--tot-bfs-lookahead": (["2"], 2),
    "--tot-budget-temperature": (["0.5"], 0.5),
    "--tot-early-stop": (["on"], True),
    "--tot-early-stop-alpha": (["0.25"], 0.25),
    "--tot-early-stop-min-answers": (["7"], 7),
    "--tot-max-concurrent-searches": (["9"], 9),
    "--tot-reward-timeout": (["30"], 30.0),
    "--tot-live-knee": (["off"], False),
    "--tot-mixed-prefill": (["off"], False),
    "--tot-spec-prefill-share": (["0.25"], 0.25),
    "--tot-payoff-gate": (["on"], True),
    "--tot-auto-off": (["off"], False),
    "--tot-budget-max-wait-s": (["3.5"], 3.5),
    "--tot-max-queued-searches": (["5"], 5),
    "--tot-max-width": (["8"], 8),
    "--tot-max-depth": (["9"], 9),
    "--tot-max-iterations": (["10"], 10),
    "--tot-max-nodes": (["100"], 100),
    "--tot-max-search-tokens": (["5000"], 5000),
    "--tot-max-step-tokens": (["64"], 64),
    "--tot-max-body-bytes": (["4096"], 4096),
    "--tot-reward-hosts": (["loopback,10.0.0.0/8"], ("loopback", "10.0.0.0/8")),
    "--tot-profile-max-age": (["60"], 60.0),
    "--respec-adaptive": ([], True),
    "--respec-profile": (["auto"], "auto"),
    "--respec-hysteresis": (["2,4,3"], "2,4,3"),
    "--respec-force": (["alternate:3"], "alternate:3"),
    "--respec-drift": (["0.5"], 0.5),
    "--respec-eagle-off": (["warm"], "warm"),
    "--respec-kd": (["frozen"], "frozen"),
    "--respec-learner-mode": (["sync"], "sync"),
    "--respec-update-interval": (["5"], 5),
}
# A flag that acts only with another one on (flags.NEEDS) is compared against a baseline that has it on.
PREREQ = {flag_of(cls, name): [flag_of(cls, switch)] for cls, (switch, names) in NEEDS.items() for name in names}
EAGLE3 = ["--speculative-algorithm", "EAGLE3"]  # the learner publishes into the server's EAGLE drafter


def learner_json(tmp_path) -> str:
    """A learner spec whose drafter and target are model dirs (the launcher checks both)."""
    for name in ("d", "t"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    return json.dumps({"drafter": str(tmp_path / "d"), "target": str(tmp_path / "t")})


@pytest.fixture
def env(monkeypatch):
    # setenv first so monkeypatch restores the variable's absence after export() wrote os.environ directly
    monkeypatch.setenv(ENV_VAR, "")
    monkeypatch.delenv(ENV_VAR)
    config.reset()
    yield monkeypatch
    config.reset()


def _field_value(cfg: PluginConfig, owner: type, name: str):
    section = {
        SpexConfig: cfg.spex,
        RespecConfig: cfg.respec,
        LearnerConfig: cfg.learner.learner if cfg.learner else None,
        PluginConfig: cfg,
    }[owner]
    return getattr(section, name)


def _flagged_values(cfg: PluginConfig) -> dict:
    """Every flagged field's value, except the learner spec as a whole (given in every case below)."""
    fields = [(cls, f.name) for cls in SECTIONS for _, f, _ in flag_fields(cls)]
    return {k: _field_value(cfg, *k) for k in fields if k != (PluginConfig, "learner")}


def test_every_flag_comes_from_a_field_and_sets_exactly_that_field(tmp_path):
    generated = {name: (cls, f) for cls in SECTIONS for name, f, _ in flag_fields(cls)}
    assert set(generated) - {"--respec-learner"} == set(NON_DEFAULT)
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    cases = {**NON_DEFAULT, "--respec-profile": ([str(profile)], str(profile))}
    base = ["--respec-learner", learner_json(tmp_path), *EAGLE3]
    for flag, (values, expected) in cases.items():
        cls, f = generated[flag]
        default, _ = parse_args([*base, *PREREQ.get(flag, [])])
        cfg, rest = parse_args([*base, *PREREQ.get(flag, []), flag, *values])
        assert rest == EAGLE3
        changed = {k for k, v in _flagged_values(cfg).items() if _flagged_values(default)[k] != v}
        assert changed == {(cls, f.name)} and _field_value(cfg, cls, f.name) == expected, flag


def test_help_shows_each_default_and_the_table_lists_every_flag():
    parser = argparse.ArgumentParser(add_help=False)
    add_flags(parser)
    text = parser.format_help()
    assert "--tot-k-total" in text and "(default: auto)" in text and "(default: t1,t2,t3)" in text
    rows = {name: default for name, default, _ in flag_table()}
    assert rows["--tot-lookahead"] == str(SpexConfig().lookahead) and rows["--respec-eagle-off"] == "plain"
    assert set(rows) == set(NON_DEFAULT) | {"--respec-learner"}


def test_round_trip_of_the_whole_config(tmp_path):
    cfg, _ = parse_args(
        ["--tot-speculation", "--tot-components", "t2", "--respec-adaptive", "--speculative-algorithm", "EAGLE3"]
        + ["--speculative-num-steps", "3", "--respec-learner", learner_json(tmp_path), "--respec-kd", "unweighted"]
    )
    cfg = dataclasses.replace(cfg, stats_path="/dev/shm/x")
    again = PluginConfig.from_json(cfg.to_json())
    assert again == cfg and again.respec.server_key == "EAGLE3:s3t1n4" and again.spex.components == ("t2",)
    dirs = str(tmp_path / "d"), str(tmp_path / "t")
    assert again.learner == LearnerSpec(*dirs, LearnerConfig(variant="unweighted"))


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"bogus": 1}, r"unknown field\(s\) \['bogus'\]"),
        ({"spex": {"lookahed": 4}}, r"spex: unknown field\(s\) \['lookahed'\]"),
        ({"respec": {"adaptive": True}}, r"respec: unknown field\(s\) \['adaptive'\]"),
        ({"learner": {"drafter": "d", "target": "t", "lr": 1}}, r"learner: unknown field\(s\) \['lr'\]"),
        ({"learner": {"drafter": "d", "target": "t", "learner": {"steps": 1}}}, r"learner.learner: unknown"),
        ({"learner": {"drafter": "d"}}, r"learner: needs \['target'\]"),
        ({"spex": {"lookahead": "4"}}, "spex.lookahead '4': expected int"),
        ({"spex": {"lookahead": True}}, "spex.lookahead True: expected int"),
        ({"spex": {"components": "t1"}}, "spex.components"),
        ({"spex": {"components": ["t1", "t9"]}}, "--tot-components"),
        ({"respec": {"eagle_off": "cold"}}, r"respec.eagle_off 'cold': choose from \['plain', 'warm'\]"),
        ({"respec": {"drift": -1}}, "--respec-drift"),
        ({"respec": {"enabled": True}}, "--respec-adaptive needs --speculative-algorithm"),
        ({"learner": {"drafter": "d", "target": "t", "probe": [[[1], "x"]]}}, r"learner.probe\[0\]\[1\]"),
        ({"learner": {"drafter": "", "target": "t"}}, "must not be empty"),
        ({"profile_max_age_s": 0}, "--tot-profile-max-age"),
        ([], "expected a JSON object"),
    ],
)
def test_bad_json_names_the_field(data, needle):
    with pytest.raises(ConfigError, match=needle):
        PluginConfig.from_json(json.dumps(data), where=ENV_VAR)


def test_sections_validate_direct_construction():
    with pytest.raises(ConfigError, match="--tot-lookahead 0: must be >= 1"):
        SpexConfig(lookahead=0).validate()
    with pytest.raises(ConfigError, match="--tot-lookahead 'x': expected int"):
        SpexConfig(lookahead="x").validate()
    with pytest.raises(ConfigError, match="--respec-hysteresis"):
        RespecConfig(hysteresis="fast").validate()
    assert config.replace(SpexConfig(), lookahead=2).lookahead == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        SpexConfig().lookahead = 3  # type: ignore[misc]


def test_load_parses_once_and_follows_the_variable(env):
    assert load() == PluginConfig() and load() is load()
    cfg = PluginConfig(spex=SpexConfig(enabled=True, lookahead=2))
    export(cfg)
    first = load()
    assert first == cfg and load() is first  # cached: the same object, no re-parse
    assert SpexConfig.from_env() is first.spex and RespecConfig.from_env() is first.respec
    env.setenv(ENV_VAR, PluginConfig().to_json())
    assert load() == PluginConfig()
    env.setenv(ENV_VAR, '{"spex": {"bogus": 1}}')
    with pytest.raises(ConfigError, match=r"SGLANG_SPEX_CONFIG.spex: unknown field\(s\) \['bogus'\]"):
        load()
    env.setenv(ENV_VAR, "{not json")
    with pytest.raises(ConfigError, match="SGLANG_SPEX_CONFIG: not JSON"):
        load()


def test_export_refuses_an_invalid_config(env):
    export(PluginConfig())
    before = load()
    with pytest.raises(ConfigError, match="--tot-early-stop-alpha"):
        export(PluginConfig(spex=SpexConfig(early_stop_alpha=2.0)))
    assert load() is before


def test_stats_channel_is_the_launchers_or_fixed_once(env):
    export(PluginConfig(stats_path="/dev/shm/from-launcher"))
    assert stats_channel() == "/dev/shm/from-launcher"
    env.delenv(ENV_VAR)
    path = stats_channel()  # no launcher: picked now and written back for the processes started later
    assert path and load().stats_path == path and json.loads(config.os.environ[ENV_VAR])["stats_path"] == path
    assert stats_channel() == path


def test_cache_dir_and_env_registry(env, tmp_path):
    env.setenv(CACHE_ENV_VAR, str(tmp_path))
    assert cache_dir("models") == tmp_path / "models"
    env.delenv(CACHE_ENV_VAR)
    assert cache_dir("profiles").parts[-2:] == ("sglang-spex", "profiles")
    names = [v.name for v in ENV_VARS]
    assert len(names) == len(set(names)) <= 4 and ENV_VAR in names and CACHE_ENV_VAR in names
