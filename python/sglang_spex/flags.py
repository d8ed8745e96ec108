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
from typing import Any, Dict, Iterator, List, Literal, Optional, Sequence, Tuple, get_args, get_origin, get_type_hints

from sglang_spex.config import (
    ENV_VARS,
    RESPEC_ALGORITHMS,
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
            flags = {f.name: name for name, f, _ in flag_fields(LearnerConfig)}
            raise ConfigError(f"{flags[next(iter(overrides))]} needs --respec-learner")
        return None
    parsed = LearnerSpec.from_dict(spec, where="--respec-learner")
    if not overrides:
        return parsed
    return dataclasses.replace(parsed, learner=dataclasses.replace(parsed.learner, **overrides).validate())


def _build(given: Dict[str, Dict[str, Any]], rest: Sequence[str]) -> PluginConfig:
    top = dict(given["PluginConfig"])
    learner = _learner(top.pop("learner", None), given["LearnerConfig"])
    return PluginConfig(
        spex=SpexConfig(**given["SpexConfig"]),
        respec=_respec(given["RespecConfig"], rest),
        learner=learner,
        **top,
    ).validate()


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
