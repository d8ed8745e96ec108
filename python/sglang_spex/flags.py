"""The launcher's flags, generated from the fields of :mod:`sglang_spex.config`'s dataclasses.

Each field with a ``flag`` in its metadata becomes one argparse flag: its name (``--tot-`` / ``--respec-`` plus
the field name, or the name given), its type (from the annotation, or the field's ``parse`` function), its default
and its help. This mirrors SGLang's ``add_cli_args_from_dataclass`` (``sglang.srt.arg_groups.arg_utils``).
:func:`parse_args` splits a command line into a validated :class:`~sglang_spex.config.PluginConfig` and the
arguments meant for SGLang. ``python -m sglang_spex.flags`` prints the flag and env-var tables (markdown).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Dict, Iterator, List, Literal, Optional, Sequence, Tuple, get_args, get_origin, get_type_hints

from sglang_spex.config import (
    ENV_VARS,
    RESPEC_ALGORITHMS,
    RESPEC_EAGLE,
    SECTIONS,
    ConfigError,
    LearnerConfig,
    LearnerSpec,
    PluginConfig,
    RespecConfig,
    SpexConfig,
    flag_name,
    flag_value,
    on_off,
    strip_optional,
)

FLAG_PREFIXES = ("--tot-", "--respec-")
# Flags that do something only with another one on: given explicitly without it, they are refused.
NEEDS: Dict[type, Tuple[str, Tuple[str, ...]]] = {
    SpexConfig: (
        "enabled",
        (
            "k_total",
            "min_share",
            "components",
            "lookahead",
            "max_lookahead",
            "bfs_lookahead",
            "live_knee",
            "mixed_prefill",
            "spec_prefill_share",
            "sure_use",
            "payoff_gate",
            "auto_off",
            "budget_temperature",
            "budget_max_wait_s",
            "early_stop",
            "early_stop_alpha",
            "early_stop_min_answers",
        ),
    ),
    RespecConfig: ("enabled", ("profile", "hysteresis", "force", "drift", "eagle_off")),
}
MAX_HYSTERESIS_STEPS = 10_000  # MIN_DWELL / CONFIRM past this: the FSM never switches in practice
MODEL_CONFIG = "config.json"  # what from_pretrained reads first, ours (respec/checkpoint.py) and HF's


def is_decimal(value: str) -> bool:
    """ASCII digits only, at most 9 of them (``'²'.isdigit()`` is true and ``int('²')`` fails)."""
    return value.isascii() and value.isdigit() and len(value) <= 9


def count_flag(text: str) -> int:
    """An argparse type for a count: an integer >= 1 (:func:`is_decimal`; the demo's and the cluster launcher's)."""
    if not is_decimal(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return int(text)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # no usage wall: one line naming the flag
        raise ConfigError(message)


def flag_fields(cls: type) -> Iterator[Tuple[str, dataclasses.Field, Any]]:
    """(flag, field, type) of every field of ``cls`` that has a flag."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = flag_name(cls, f)
        if name:
            yield name, f, hints[f.name]


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _shown(f: dataclasses.Field) -> str:
    value = _default(f)
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return f.metadata["none"] if value is None else str(value)


def _argparse_kwargs(f: dataclasses.Field, tp: Any) -> Dict[str, Any]:
    parse = f.metadata.get("parse")
    inner, _ = strip_optional(tp)
    if inner is bool:
        return {"nargs": "?", "const": True, "type": parse or on_off, "metavar": "on|off"}
    if get_origin(inner) is Literal:
        return {"type": parse or str, "choices": get_args(inner)}
    if parse is None and inner not in (int, float, str):
        raise TypeError(f"{f.name}: a flag of type {tp!r} needs a parse function")
    return {"type": parse or inner, "metavar": f.name.upper()}


def add_flags(parser: argparse.ArgumentParser, classes: Sequence[type] = SECTIONS) -> None:
    """Add one flag per flagged field of ``classes`` (values land under ``"<Class>.<field>"``; absent flags are
    left out of the namespace)."""
    for cls in classes:
        group = parser.add_argument_group(cls._flag_group)
        for name, f, tp in flag_fields(cls):
            group.add_argument(
                name,
                dest=f"{cls.__name__}.{f.name}",
                default=argparse.SUPPRESS,
                help=f"{f.metadata['help']} (default: {_shown(f)})",
                **_argparse_kwargs(f, tp),
            )


def flag_of(cls: type, name: str) -> str:
    """The flag of field ``name`` of ``cls``."""
    return next(flag for flag, f, _ in flag_fields(cls) if f.name == name)


def flag_table() -> List[Tuple[str, str, str]]:
    """(flag, default, help) of every generated flag, for docs."""
    return [(name, _shown(f), f.metadata["help"]) for cls in SECTIONS for name, f, _ in flag_fields(cls)]


def _parse(argv: Sequence[str]) -> Tuple[Dict[str, Dict[str, Any]], List[str]]:
    """The flags given in ``argv`` (per class name) and the remaining arguments."""
    parser = _Parser(add_help=False, allow_abbrev=False)
    add_flags(parser)
    ns, rest = parser.parse_known_args(list(argv))
    for arg in rest:
        if arg.startswith(FLAG_PREFIXES):
            raise ConfigError(f"unknown flag {arg.split('=', 1)[0]}")
    given: Dict[str, Dict[str, Any]] = {cls.__name__: {} for cls in SECTIONS}
    for dest, value in vars(ns).items():
        owner, name = dest.split(".", 1)
        given[owner][name] = value
    return given, rest


def _server_key(alg: str, rest: Sequence[str]) -> str:
    """The (s,t,n) key of SGLang's speculative flags in ``rest`` ('' when a count is left to SGLang's default)."""

    def flag(name: str) -> Optional[int]:
        v = flag_value(rest, name)
        try:
            return None if v is None else int(v)
        except ValueError:
            raise ConfigError(f"{name} {v!r}: expected an integer") from None

    n = flag("--speculative-num-draft-tokens")
    if alg == "NGRAM":
        t = flag("--speculative-ngram-max-bfs-breadth") or 1
        return f"NGRAM:s{max(1, n // t)}t{t}n{n}" if n else ""
    s, t = flag("--speculative-num-steps"), flag("--speculative-eagle-topk")
    if t not in (None, 1):
        raise ConfigError(f"--respec-adaptive with {alg} needs --speculative-eagle-topk 1 (got {t})")
    if s is not None and n is not None and n != s + 1:
        raise ConfigError(f"--respec-adaptive with {alg} needs --speculative-num-draft-tokens = num-steps + 1")
    return f"{alg}:s{s}t1n{s + 1}" if s is not None else ""


def _respec(given: Dict[str, Any], rest: Sequence[str]) -> RespecConfig:
    cfg = RespecConfig(**given)
    if not cfg.enabled:
        return cfg
    alg = (flag_value(rest, "--speculative-algorithm") or "").upper()
    key = _server_key(alg, rest) if alg in RESPEC_ALGORITHMS else ""
    return dataclasses.replace(cfg, algorithm=alg, server_key=key)


def _learner(spec: Optional[dict], overrides: Dict[str, Any]) -> Optional[LearnerSpec]:
    if spec is None:
        if overrides:
            raise ConfigError(f"{flag_of(LearnerConfig, next(iter(overrides)))} needs --respec-learner")
        return None
    parsed = LearnerSpec.from_dict(spec, where="--respec-learner")
    if not overrides:
        return parsed
    return dataclasses.replace(parsed, learner=dataclasses.replace(parsed.learner, **overrides).validate())


def check_learner_dirs(spec: LearnerSpec) -> None:
    """``drafter`` and ``target`` are local model dirs: the server loads them (``respec.routes.build_learner``) only
    after it started, where a failure leaves it serving without the learner's routes. Nothing comes from a hub."""
    for name in ("drafter", "target"):
        path = Path(getattr(spec, name))
        if not path.is_dir():
            raise ConfigError(f"--respec-learner {name} {str(path)!r}: no such directory (a local model dir)")
        if not (path / MODEL_CONFIG).is_file():
            raise ConfigError(f"--respec-learner {name} {str(path)!r}: no {MODEL_CONFIG} in it (not a model dir)")


def _check_hysteresis(cfg: RespecConfig) -> None:
    """Refuse a --respec-hysteresis under which the FSM never switches (respec/fsm.py): a band wider than every
    batch size planned, or a dwell / confirmation no server runs long enough to see."""
    margin, *steps = (int(x) for x in cfg.hysteresis.split(","))
    if margin >= cfg.max_batch:
        raise ConfigError(
            f"--respec-hysteresis {cfg.hysteresis!r}: MARGIN {margin} must be below {cfg.max_batch}, the largest batch "
            "planned (a band that wide never lets the FSM switch)"
        )
    if max(steps) > MAX_HYSTERESIS_STEPS:
        raise ConfigError(
            f"--respec-hysteresis {cfg.hysteresis!r}: MIN_DWELL and CONFIRM must be at most {MAX_HYSTERESIS_STEPS} "
            "decode steps (the FSM would never switch)"
        )


def _check_combinations(cfg: PluginConfig, given: Dict[str, Dict[str, Any]], rest: Sequence[str]) -> None:
    """Checks that span flags, on the flags given explicitly (a default never fails them)."""
    for cls, section in ((SpexConfig, cfg.spex), (RespecConfig, cfg.respec)):
        switch, fields = NEEDS[cls]
        unused = [name for name in fields if name in given[cls.__name__] and not getattr(section, switch)]
        if unused:
            raise ConfigError(f"{flag_of(cls, unused[0])} needs {flag_of(cls, switch)} (without it, it does nothing)")
    spex, respec = given["SpexConfig"], given["RespecConfig"]
    if "max_lookahead" in spex and cfg.spex.max_lookahead < cfg.spex.lookahead:
        raise ConfigError(
            f"--tot-max-lookahead {cfg.spex.max_lookahead}: must be >= --tot-lookahead ({cfg.spex.lookahead})"
        )
    if "hysteresis" in respec:
        _check_hysteresis(cfg.respec)
    if "eagle_off" in respec and not cfg.respec.eagle:
        raise ConfigError(
            f"--respec-eagle-off needs --speculative-algorithm EAGLE or EAGLE3 (got {cfg.respec.algorithm})"
        )
    if cfg.learner is not None:
        check_learner_dirs(cfg.learner)
        alg = (flag_value(rest, "--speculative-algorithm") or "").upper()
        if cfg.learner.server_url is None and alg not in RESPEC_EAGLE:
            raise ConfigError(
                f"--respec-learner needs --speculative-algorithm EAGLE or EAGLE3 (got {alg or 'none'}): it publishes "
                "its drafter into this server (or give the spec a server_url)"
            )


def _build(given: Dict[str, Dict[str, Any]], rest: Sequence[str]) -> PluginConfig:
    top = dict(given["PluginConfig"])
    learner = _learner(top.pop("learner", None), given["LearnerConfig"])
    cfg = PluginConfig(
        spex=SpexConfig(**given["SpexConfig"]),
        respec=_respec(given["RespecConfig"], rest),
        learner=learner,
        **top,
    ).validate()
    _check_combinations(cfg, given, rest)
    return cfg


def parse_args(argv: Sequence[str]) -> Tuple[PluginConfig, List[str]]:
    """Split ``argv`` into our validated config and the arguments meant for SGLang.

    :class:`ConfigError` names an unknown ``--tot-*`` / ``--respec-*`` flag or a bad value.
    """
    given, rest = _parse(argv)
    return _build(given, rest), rest


def _markdown() -> str:
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    rows += [f"| `{name}` | {default} | {help} |" for name, default, help in flag_table()]
    rows += ["", "| environment variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.default} | {v.meaning} |" for v in ENV_VARS]
    return "\n".join(rows)


if __name__ == "__main__":
    print(_markdown())
