"""One typed configuration for sglang-spex, parsed once by the launcher and shipped to every process.

The launcher parses the ``--tot-*`` flags, serialises :class:`SpexConfig` into the environment variable
``SGLANG_SPEX_CONFIG`` (JSON) and starts SGLang; SGLang's subprocesses inherit the environment, so the
plugin reads the same config in the HTTP server and in the scheduler process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

ENV_VAR = "SGLANG_SPEX_CONFIG"
COMPONENTS = ("t1", "t2", "t3")


class ConfigError(ValueError):
    """A ``--tot-*`` flag or a config field has a bad value; the message names it."""


@dataclass(frozen=True)
class SpexConfig:
    """ToT speculation settings (SPEX)."""

    enabled: bool = False  # --tot-speculation
    k_total: Optional[int] = None  # --tot-k-total; None = "auto" (roofline knee)
    min_share: int = 1  # --tot-min-share: smallest speculative share a live query gets
    components: Tuple[str, ...] = COMPONENTS  # --tot-components
    lookahead: int = 4  # --tot-lookahead: DFS UCB simulation depth (k)
    budget_temperature: float = 1.0  # --tot-budget-temperature (tau)
    early_stop: bool = False  # --tot-early-stop (T3 changes the search space: off by default)
    early_stop_alpha: float = 0.5  # --tot-early-stop-alpha
    early_stop_min_answers: int = 4  # --tot-early-stop-min-answers (t)
    max_concurrent_searches: int = 64  # --tot-max-concurrent-searches
    reward_timeout: float = 120.0  # --tot-reward-timeout (seconds)
    spec_priority: int = -1000  # priority given to speculative requests (below any primary)

    def validate(self) -> "SpexConfig":
        checks = [
            ("--tot-k-total", self.k_total is None or self.k_total >= 0, "must be >= 0 or 'auto'"),
            ("--tot-min-share", self.min_share >= 0, "must be >= 0"),
            ("--tot-lookahead", self.lookahead >= 1, "must be >= 1"),
            ("--tot-budget-temperature", self.budget_temperature > 0, "must be > 0"),
            ("--tot-early-stop-alpha", 0 <= self.early_stop_alpha <= 1, "must be in [0, 1]"),
            ("--tot-early-stop-min-answers", self.early_stop_min_answers >= 1, "must be >= 1"),
            ("--tot-max-concurrent-searches", self.max_concurrent_searches >= 1, "must be >= 1"),
            ("--tot-reward-timeout", self.reward_timeout > 0, "must be > 0"),
        ]
        for flag, ok, why in checks:
            if not ok:
                raise ConfigError(f"{flag} {why}")
        bad = [c for c in self.components if c not in COMPONENTS]
        if bad:
            raise ConfigError(f"--tot-components: unknown component(s) {bad}; choose from {list(COMPONENTS)}")
        return self

    def has(self, component: str) -> bool:
        return self.enabled and component in self.components

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "SpexConfig":
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ConfigError(f"unknown config field(s) {sorted(unknown)}")
        if "components" in data:
            data["components"] = tuple(data["components"])
        return cls(**data).validate()

    @classmethod
    def from_env(cls) -> "SpexConfig":
        text = os.environ.get(ENV_VAR)
        return cls.from_json(text) if text else cls()


def _k_total(text: str) -> Optional[int]:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}")


def _on_off(text: str) -> bool:
    value = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return value


def _components(text: str) -> Tuple[str, ...]:
    parts = tuple(p.strip().lower() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in COMPONENTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"expected a comma list of {','.join(COMPONENTS)}, got {text!r}")
    return parts


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # no usage wall: one line naming the flag
        raise ConfigError(message)


def add_tot_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``--tot-*`` flags to ``parser``."""
    d = SpexConfig()
    g = parser.add_argument_group("sglang-spex (ToT speculation)")
    g.add_argument("--tot-speculation", action="store_true", help="enable SPEX speculation")
    g.add_argument("--tot-k-total", type=_k_total, default=d.k_total, help="global speculative budget or 'auto'")
    g.add_argument("--tot-min-share", type=int, default=d.min_share)
    g.add_argument("--tot-components", type=_components, default=d.components, help="subset of t1,t2,t3")
    g.add_argument("--tot-lookahead", type=int, default=d.lookahead, help="DFS UCB simulation steps")
    g.add_argument("--tot-budget-temperature", type=float, default=d.budget_temperature)
    g.add_argument(
        "--tot-early-stop", type=_on_off, nargs="?", const=True, default=d.early_stop, help="T3 early stop: [on|off]"
    )
    g.add_argument("--tot-early-stop-alpha", type=float, default=d.early_stop_alpha)
    g.add_argument("--tot-early-stop-min-answers", type=int, default=d.early_stop_min_answers)
    g.add_argument("--tot-max-concurrent-searches", type=int, default=d.max_concurrent_searches)
    g.add_argument("--tot-reward-timeout", type=float, default=d.reward_timeout)


def parse_tot_args(argv: Sequence[str]) -> Tuple[SpexConfig, List[str]]:
    """Split ``argv`` into our config and the arguments meant for SGLang.

    Raises :class:`ConfigError` naming the flag for an unknown ``--tot-*`` flag or a malformed value.
    """
    parser = _Parser(add_help=False, allow_abbrev=False)
    add_tot_args(parser)
    ns, rest = parser.parse_known_args(list(argv))
    unknown = [a.split("=")[0] for a in rest if a.startswith("--tot-")]
    if unknown:
        raise ConfigError(f"unknown flag {unknown[0]}")
    cfg = SpexConfig(
        enabled=ns.tot_speculation,
        k_total=ns.tot_k_total,
        min_share=ns.tot_min_share,
        components=tuple(ns.tot_components),
        lookahead=ns.tot_lookahead,
        budget_temperature=ns.tot_budget_temperature,
        early_stop=ns.tot_early_stop,
        early_stop_alpha=ns.tot_early_stop_alpha,
        early_stop_min_answers=ns.tot_early_stop_min_answers,
        max_concurrent_searches=ns.tot_max_concurrent_searches,
        reward_timeout=ns.tot_reward_timeout,
    ).validate()
    return cfg, rest


def replace(cfg: SpexConfig, **changes) -> SpexConfig:
    """A copy of ``cfg`` with ``changes`` applied and validated."""
    return dataclasses.replace(cfg, **changes).validate()


# ---------------------------------------------------------------- ReSpec adaptive server (issue 8)
RESPEC_ENV_VAR = "SGLANG_SPEX_RESPEC"
_HYST = re.compile(r"^\d+,\d+(,[1-9]\d*)?$")
_FORCE = re.compile(r"^(plain|spec|alternate:[1-9]\d*)$")


@dataclasses.dataclass
class RespecConfig:
    """``--respec-adaptive``, ``--respec-profile PATH|auto``, ``--respec-hysteresis MARGIN,DWELL[,CONFIRM]``,
    ``--respec-drift FRACTION`` (online re-profile threshold, 0 = off).

    ``force`` (``--respec-force``, tests and benchmarks): ``plain``, ``spec`` or ``alternate:K`` (switch every K
    decode steps) instead of the profile's plan. ``algorithm`` and ``server_key`` (the (s,t,n) key the server was
    started with, e.g. ``NGRAM:s4t1n4``) are filled in by the launcher from SGLang's own speculative flags.
    """

    enabled: bool = False
    profile: str = "auto"
    hysteresis: str = "1,8,2"
    force: Optional[str] = None
    max_batch: int = 256
    drift: float = 0.2
    algorithm: str = ""
    server_key: str = ""
    eagle_off: str = "plain"  # --respec-eagle-off: EAGLE "no speculation" as a true plain step (+ catch-up) or warm

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls) -> "RespecConfig":
        text = os.environ.get(RESPEC_ENV_VAR)
        return cls(**json.loads(text)) if text else cls()

    @property
    def eagle(self) -> bool:
        """EAGLE / EAGLE3: (s,t,n) switching through SGLang's AdaptiveController (see respec/eagle_policy.py)."""
        return self.algorithm in RESPEC_EAGLE


RESPEC_EAGLE = ("EAGLE", "EAGLE3")
RESPEC_ALGORITHMS = ("NGRAM", *RESPEC_EAGLE)


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


def flag_value(args: Sequence[str], flag: str) -> Optional[str]:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def parse_respec_args(argv: Sequence[str]) -> Tuple[RespecConfig, List[str]]:
    """Split ``--respec-*`` flags off ``argv``; :class:`ConfigError` names a bad flag or value."""
    parser = _Parser(add_help=False, allow_abbrev=False)
    g = parser.add_argument_group("sglang-spex (ReSpec adaptive server)")
    g.add_argument("--respec-adaptive", action="store_true", help="switch speculation on/off by active batch")
    g.add_argument("--respec-profile", default="auto", help="profile JSON (scripts/respec_profile.py) or 'auto'")
    g.add_argument("--respec-hysteresis", default="1,8,2", help="MARGIN,MIN_DWELL[,CONFIRM]")
    g.add_argument("--respec-drift", type=float, default=0.2, help="re-profile online past this drift (0: off)")
    g.add_argument("--respec-force", default=None, help="plain | spec | alternate:K (testing)")
    g.add_argument(
        "--respec-eagle-off",
        default="plain",
        choices=("plain", "warm"),
        help="EAGLE off-state: plain (no drafter work, KV catch-up on resume) or warm (SGLang's steps=0)",
    )
    ns, rest = parser.parse_known_args(list(argv))
    unknown = [a.split("=")[0] for a in rest if a.startswith("--respec-")]
    if unknown:
        raise ConfigError(f"unknown flag {unknown[0]}")
    if not _HYST.match(ns.respec_hysteresis):
        raise ConfigError(f"--respec-hysteresis {ns.respec_hysteresis!r}: expected MARGIN,MIN_DWELL[,CONFIRM]")
    if ns.respec_force is not None and not _FORCE.match(ns.respec_force):
        raise ConfigError(f"--respec-force {ns.respec_force!r}: expected plain, spec or alternate:K")
    if ns.respec_profile != "auto" and not os.path.exists(ns.respec_profile):
        raise ConfigError(f"--respec-profile {ns.respec_profile}: no such file")
    if not 0.0 <= ns.respec_drift < 10.0:
        raise ConfigError(f"--respec-drift {ns.respec_drift}: expected a fraction >= 0 (0 turns it off)")
    alg, key = "", ""
    if ns.respec_adaptive:
        alg = (flag_value(rest, "--speculative-algorithm") or "").upper()
        if alg not in RESPEC_ALGORITHMS:
            raise ConfigError(f"--respec-adaptive needs --speculative-algorithm one of {RESPEC_ALGORITHMS} (got {alg})")
        key = _server_key(alg, rest)
    cfg = RespecConfig(
        ns.respec_adaptive,
        ns.respec_profile,
        ns.respec_hysteresis,
        ns.respec_force,
        256,
        ns.respec_drift,
        alg,
        key,
        ns.respec_eagle_off,
    )
    return cfg, rest


# ---------------------------------------------------------------- ReSpec online learner (issue 9)
LEARNER_ENV_VAR = "SPEX_RESPEC"  # the learner's spec (JSON), read by respec/routes.py in the HTTP process
LEARNER_FIELDS = ("drafter", "target", "learner", "probe", "server_url")


def parse_learner_args(argv: Sequence[str]) -> Tuple[Optional[dict], List[str]]:
    """``--respec-learner SPEC`` (a JSON object or the path of one: ``drafter``, ``target``, optional ``learner``,
    ``probe``, ``server_url``) plus ``--respec-update-interval N``, ``--respec-kd frozen|unweighted|reward`` and
    ``--respec-learner-mode sync|async`` overriding its ``learner`` fields. Returns (spec or None, the rest)."""
    parser = _Parser(add_help=False, allow_abbrev=False)
    g = parser.add_argument_group("sglang-spex (ReSpec online learner)")
    g.add_argument("--respec-learner", default=None, help="learner spec: JSON object or path (enables /respec/*)")
    g.add_argument("--respec-update-interval", type=int, default=None, help="update the drafter every N batches")
    g.add_argument("--respec-kd", default=None, choices=("frozen", "unweighted", "reward"), help="KD variant")
    g.add_argument("--respec-learner-mode", default=None, choices=("sync", "async"), help="update mode")
    ns, rest = parser.parse_known_args(list(argv))
    overrides = {
        k: v
        for k, v in (
            ("update_interval", ns.respec_update_interval),
            ("variant", ns.respec_kd),
            ("mode", ns.respec_learner_mode),
        )
        if v is not None
    }
    if ns.respec_learner is None:
        if overrides:
            raise ConfigError(f"--respec-{next(iter(overrides)).replace('_', '-')} needs --respec-learner")
        return None, rest
    text = ns.respec_learner.strip()
    try:
        spec = json.loads(text if text.startswith("{") else open(text).read())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--respec-learner {text[:80]!r}: not a JSON object or a readable JSON file ({e})") from None
    if not isinstance(spec, dict):
        raise ConfigError("--respec-learner: expected a JSON object")
    unknown = sorted(set(spec) - set(LEARNER_FIELDS))
    missing = [k for k in ("drafter", "target") if k not in spec]
    if unknown or missing:
        raise ConfigError(
            f"--respec-learner: unknown field(s) {unknown}" if unknown else f"--respec-learner: needs {missing}"
        )
    if ns.respec_update_interval is not None and ns.respec_update_interval < 1:
        raise ConfigError(f"--respec-update-interval {ns.respec_update_interval}: expected >= 1")
    spec["learner"] = {**spec.get("learner", {}), **overrides}
    return spec, rest
