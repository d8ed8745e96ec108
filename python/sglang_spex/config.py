"""One typed configuration for sglang-spex, validated in one place and shipped to every process in one env var.

:class:`PluginConfig` holds the SPEX settings (:class:`SpexConfig`), the ReSpec adaptive server
(:class:`RespecConfig`), the online learner (:class:`LearnerSpec`, with its :class:`LearnerConfig`) and the
process-level fields (batch-stats channel, profile staleness). The launcher builds it from its flags, which
:func:`sglang_spex.flags.add_flags` generates from the dataclass fields (name, type, default and help from each
field's metadata; the mechanism mirrors SGLang's ``sglang.srt.arg_groups.arg_utils.add_cli_args_from_dataclass``,
written here because importing that module imports all of SGLang and torch, ~8 s, and this module is imported by
the simulator and by every fast-failing launcher call). :meth:`PluginConfig.validate` holds every cross-field
check; unknown fields are rejected with a :class:`ConfigError` naming them wherever a config is read from JSON.

The launcher writes the config as JSON to ``SGLANG_SPEX_CONFIG`` (:func:`export`); SGLang's subprocesses inherit
the environment and read it with :func:`load`, which parses it once per process and caches it (keyed by the
variable's text, so a test that changes the variable gets the new value; :func:`reset` clears the cache).
:data:`ENV_VARS` names the package's own environment variables (SGLang's and the system's aside).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    Any,
    Callable,
    Dict,
    Literal,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

from sglang_spex.tot.limits import parse_reward_hosts, valid_host_entry

# ---------------------------------------------------------------- environment variables (the package's own)
ENV_VAR = "SGLANG_SPEX_CONFIG"
CACHE_ENV_VAR = "SPEX_CACHE_DIR"
FORCE_CPU_ENV_VAR = "SPEX_FORCE_CPU"


class EnvVar(NamedTuple):
    name: str
    default: str
    meaning: str


ENV_VARS: Tuple[EnvVar, ...] = (
    EnvVar(ENV_VAR, "unset (all defaults)", "the PluginConfig as JSON; written by the launcher, read by load()"),
    EnvVar(CACHE_ENV_VAR, "~/.cache/sglang-spex", "root of the model and profile caches (cache_dir())"),
    EnvVar(FORCE_CPU_ENV_VAR, "unset", "1: the launcher treats the machine as having no GPU (CPU defaults)"),
)


def cache_dir(kind: str) -> Path:
    """``$SPEX_CACHE_DIR/<kind>`` (default root ``~/.cache/sglang-spex``), e.g. ``models`` or ``profiles``."""
    root = os.environ.get(CACHE_ENV_VAR) or str(Path.home() / ".cache" / "sglang-spex")
    return Path(root).expanduser() / kind


class ConfigError(ValueError):
    """A flag or a config field has a bad value; the message names it."""


# ---------------------------------------------------------------- field metadata and typed conversion
COMPONENTS = ("t1", "t2", "t3")
RESPEC_EAGLE = ("EAGLE", "EAGLE3")
RESPEC_ALGORITHMS = ("NGRAM", *RESPEC_EAGLE)
_HYST = re.compile(r"^\d+,\d+(,[1-9]\d*)?$")
_FORCE = re.compile(r"^(plain|spec|alternate:[1-9]\d*)$")
_AUTO = ""  # flag name derived from the section's prefix and the field name
Check = Tuple[Callable[[Any], bool], str]
_POSITIVE: Check = (lambda v: v >= 1, "must be >= 1")
_NON_NEGATIVE: Check = (lambda v: v >= 0, "must be >= 0")
_FINITE_POSITIVE: Check = (lambda v: math.isfinite(v) and v > 0, "must be a finite number > 0")


def _opt(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    flag: Optional[str] = _AUTO,
    parse: Optional[Callable[[str], Any]] = None,
    check: Optional[Check] = None,
    none: str = "none",
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with its flag (``None``: no flag), help text, argparse type, a (predicate, reason) check
    and the word a ``None`` value is shown as in help."""
    meta = {"help": help, "flag": flag, "parse": parse, "check": check, "none": none}
    return field(default=default, default_factory=default_factory, metadata=meta)


def strip_optional(tp: Any) -> Tuple[Any, bool]:
    if get_origin(tp) is Union:
        rest = [a for a in get_args(tp) if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return tp, False


def _typed(tp: Any, value: Any, label: str) -> Any:
    """``value`` (decoded JSON or a field value) as type ``tp``; :class:`ConfigError` naming ``label`` otherwise."""
    inner, optional = strip_optional(tp)
    if value is None and optional:
        return None
    origin = get_origin(inner)
    if dataclasses.is_dataclass(inner):
        if isinstance(value, inner):
            return value
        if isinstance(value, dict):
            return inner.from_dict(value, where=label)
    elif origin is Literal:
        if value in get_args(inner):
            return value
        raise ConfigError(f"{label} {value!r}: choose from {list(get_args(inner))}")
    elif origin is tuple:
        args = get_args(inner)
        if isinstance(value, (list, tuple)) and len(args) == 2 and args[1] is Ellipsis:
            return tuple(_typed(args[0], v, f"{label}[{i}]") for i, v in enumerate(value))
        if isinstance(value, (list, tuple)) and len(args) == len(value):
            return tuple(_typed(a, v, f"{label}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    elif inner in (bool, int, float, str):
        accepts = (int, float) if inner is float else inner
        if isinstance(value, bool) == (inner is bool) and isinstance(value, accepts):
            return float(value) if inner is float else value
    else:
        raise TypeError(f"{label}: unsupported config type {tp!r}")
    raise ConfigError(f"{label} {value!r}: expected {_type_name(tp)}")


def _type_name(tp: Any) -> str:
    inner, optional = strip_optional(tp)
    name = getattr(inner, "__name__", None) or str(inner).replace("typing.", "")
    return f"{name} or null" if optional else name


class _Section:
    """Shared behaviour of the config dataclasses: field checks, JSON round trip, unknown fields rejected."""

    _flag_prefix = ""  # flags of fields with a derived name: prefix + field name with dashes
    _flag_group = "sglang-spex"

    def _label(self, f: dataclasses.Field, where: str) -> str:
        return flag_name(type(self), f) or (f"{where}.{f.name}" if where else f.name)

    def validate(self, where: str = "") -> Any:
        """Check each field's type and its declared constraint (a field without a flag named ``where.field``)."""
        hints = get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value, label = getattr(self, f.name), self._label(f, where)
            _typed(hints[f.name], value, label)
            check = f.metadata.get("check")
            if check is not None and not check[0](value):
                raise ConfigError(f"{label} {value!r}: {check[1]}")
        return self

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any, where: str = "") -> Any:
        """Typed and validated; unknown or missing fields raise :class:`ConfigError` naming them."""
        where = where or cls.__name__
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {unknown}; known: {sorted(fields)}")
        required = [n for n, f in fields.items() if f.default is f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if n not in data]
        if missing:
            raise ConfigError(f"{where}: needs {missing}")
        hints = get_type_hints(cls)
        values = {k: _typed(hints[k], v, f"{where}.{k}") for k, v in data.items()}
        return cls(**values).validate(where)

    @classmethod
    def from_json(cls, text: str, where: str = "") -> Any:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{where or cls.__name__}: not JSON ({e})") from None
        return cls.from_dict(data, where)


# ---------------------------------------------------------------- argparse value parsers
def _int_or_auto(text: str) -> Optional[int]:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}")


def _hosts(text: str) -> Tuple[str, ...]:
    try:
        return parse_reward_hosts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def on_off(text: str) -> bool:
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


def _json_object(text: str) -> dict:
    """A JSON object given inline or as the path of a JSON file."""
    text = text.strip()
    try:
        data = json.loads(text if text.startswith("{") else Path(text).read_text())
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text[:80]!r}: not a JSON object or a readable JSON file ({e})")
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"{text[:80]!r}: expected a JSON object")
    return data


DEFAULT_MAX_BODY_BYTES = 1 << 20


# ---------------------------------------------------------------- the sections
@dataclass(frozen=True)
class SpexConfig(_Section):
    """ToT speculation settings (SPEX)."""

    _flag_prefix = "--tot-"
    _flag_group = "sglang-spex: ToT speculation (SPEX)"

    enabled: bool = _opt(
        False, flag="--tot-speculation", help="enable SPEX (speculative requests, hooks H2-H13); else baseline searches"
    )
    k_total: Optional[int] = _opt(
        None,
        parse=_int_or_auto,
        none="auto",
        check=(lambda v: v is None or v >= 0, "must be >= 0 or 'auto'"),
        help="global speculative budget, or auto (the roofline knee)",
    )
    min_share: int = _opt(1, check=_NON_NEGATIVE, help="smallest speculative share of a query")
    components: Tuple[str, ...] = _opt(
        COMPONENTS,
        parse=_components,
        check=(lambda v: all(c in COMPONENTS for c in v), f"each must be one of {list(COMPONENTS)}"),
        help="which SPEX techniques run (comma list of t1,t2,t3)",
    )
    lookahead: int = _opt(4, check=_POSITIVE, help="DFS: UCB simulation steps (k)")
    max_lookahead: int = _opt(
        16,
        check=_POSITIVE,
        help="DFS: rollouts planned ahead at most (not below --tot-lookahead); past --tot-lookahead a distance is "
        "planned while its measured hit rate holds",
    )
    bfs_lookahead: int = _opt(
        3, check=_POSITIVE, help="BFS: depths expanded early ahead of the undecided one (1: the next depth only)"
    )
    live_knee: bool = _opt(
        True,
        parse=on_off,
        help="scheduler: also keep speculation below the knee of live decode step times, once at least 4 batch sizes "
        "over at least 2x pin it down (on/off)",
    )
    mixed_prefill: bool = _opt(
        True,
        parse=on_off,
        help="launcher: turn on SGLang's --enable-mixed-chunk (without a speculative algorithm), so speculative "
        "prefill runs in the primaries' decode step instead of waiting for a free step (on/off)",
    )
    spec_prefill_share: float = _opt(
        0.02,
        check=(lambda v: 0 <= v <= 1, "must be in [0, 1]"),
        help="scheduler: share of the primaries' step time speculative prefill beside them may take, at its "
        "measured price (0: only what is measured free)",
    )
    sure_use: float = _opt(
        0.9,
        check=(lambda v: v >= 0, "must be >= 0"),
        help="scheduler: a speculative request whose measured expected use is at least this may run above the "
        "knee, within the budget (a hit is work the search does anyway; above 1: never)",
    )
    payoff_gate: bool = _opt(
        False,
        parse=on_off,
        help="issue a speculative node only while its expected use pays for it on the live decode-step curve "
        "(measured steps saved per hit vs tokens wasted per miss; on/off)",
    )
    auto_off: bool = _opt(
        True,
        parse=on_off,
        help="stop a policy's speculation on an engine where, measured, the steps it saved did not pay for the tokens "
        "it wasted on the live decode-step curve; one search in 4 still speculates to measure again (on/off)",
    )
    budget_temperature: float = _opt(1.0, check=_FINITE_POSITIVE, help="T2 softmax temperature")
    budget_max_wait_s: float = _opt(
        2.0,
        check=_FINITE_POSITIVE,
        help="T2 starvation bound: seconds a query with work may go unserved",
    )
    early_stop: bool = _opt(False, help="T3 early termination, on or off (changes the search space)")
    early_stop_alpha: float = _opt(0.5, check=(lambda v: 0 <= v <= 1, "must be in [0, 1]"), help="T3 margin scale")
    early_stop_min_answers: int = _opt(4, check=_POSITIVE, help="T3: answers needed before stopping")
    max_concurrent_searches: int = _opt(64, check=_POSITIVE, help="server-side searches a server runs at once")
    reward_timeout: float = _opt(120.0, check=_FINITE_POSITIVE, help="seconds a reward may take")
    max_queued_searches: int = _opt(64, check=_NON_NEGATIVE, help="searches waiting for a slot; more get HTTP 429")
    # Per-search capacity limits (tot/limits.py); a spec over one gets HTTP 400 naming the field.
    max_width: Optional[int] = _opt(
        None,
        parse=_int_or_auto,
        none="auto",
        check=(lambda v: v is None or v >= 1, "must be >= 1 or 'auto'"),
        help="largest BFS width / MCTS branching of a search, or auto (the engine's running-request slots)",
    )
    max_depth: int = _opt(64, check=_POSITIVE, help="largest policy.max_depth")
    max_iterations: int = _opt(1024, check=_POSITIVE, help="largest MCTS rollouts/iterations/target answers")
    max_nodes: int = _opt(4096, check=_POSITIVE, help="most nodes a search's policy may generate (worst case)")
    max_search_tokens: Optional[int] = _opt(
        None,
        parse=_int_or_auto,
        none="auto",
        check=(lambda v: v is None or v >= 1, "must be >= 1 or 'auto'"),
        help="most tokens a search may generate (worst case nodes x step.max_tokens), or auto (16 KV pools)",
    )
    max_step_tokens: Optional[int] = _opt(
        None,
        parse=_int_or_auto,
        none="auto",
        check=(lambda v: v is None or v >= 1, "must be >= 1 or 'auto'"),
        help="largest step.max_tokens, or auto (the model's context length; never above it)",
    )
    max_body_bytes: int = _opt(
        DEFAULT_MAX_BODY_BYTES,
        check=(lambda v: v >= 1024, "must be >= 1024"),
        help="largest request body of the plugin's routes",
    )
    reward_hosts: Tuple[str, ...] = _opt(
        ("loopback",),
        parse=_hosts,
        check=(lambda v: bool(v) and all(map(valid_host_entry, v)), "must be host names, IPs, CIDRs, loopback or *"),
        help="hosts callback/PRM rewards may call: names, IPs, CIDRs, loopback or * (comma list)",
    )
    spec_priority: int = _opt(-1000, flag=None, help="priority of speculative requests (below any primary)")

    def has(self, component: str) -> bool:
        return self.enabled and component in self.components

    @classmethod
    def from_env(cls) -> "SpexConfig":
        """Accessor: ``load().spex`` (kept for existing callers)."""
        return load().spex


@dataclass(frozen=True)
class RespecConfig(_Section):
    """The ReSpec adaptive server (``--respec-*``).

    ``force`` (tests and benchmarks): ``plain``, ``spec`` or ``alternate:K`` (switch every K decode steps) instead
    of the profile's plan. ``algorithm`` and ``server_key`` (the (s,t,n) key the server was started with, e.g.
    ``NGRAM:s4t1n4``) are filled in by the launcher from SGLang's own speculative flags.
    """

    _flag_prefix = "--respec-"
    _flag_group = "sglang-spex: ReSpec adaptive server"

    enabled: bool = _opt(False, flag="--respec-adaptive", help="switch speculation on/off by active batch size")
    profile: str = _opt(
        "auto",
        check=(lambda v: v == "auto" or os.path.exists(v), "no such file"),
        help="profile JSON (scripts/respec_profile.py) or auto (the cached profile of the model)",
    )
    hysteresis: str = _opt(
        "1,8,2",
        check=(lambda v: bool(_HYST.match(v)), "expected MARGIN,MIN_DWELL[,CONFIRM]"),
        help="FSM hysteresis: MARGIN,MIN_DWELL[,CONFIRM]",
    )
    force: Optional[str] = _opt(
        None,
        check=(lambda v: v is None or bool(_FORCE.match(v)), "expected plain, spec or alternate:K"),
        help="plain, spec or alternate:K instead of the plan (testing)",
    )
    max_batch: int = _opt(256, flag=None, check=_POSITIVE, help="largest batch planned")
    drift: float = _opt(
        0.2,
        check=(lambda v: 0.0 <= v < 10.0, "expected a fraction >= 0 (0 turns it off)"),
        help="re-profile online when live steps drift past this fraction (0: off)",
    )
    algorithm: str = _opt("", flag=None, help="SGLang's --speculative-algorithm (set by the launcher)")
    server_key: str = _opt("", flag=None, help="the (s,t,n) key of SGLang's speculative flags (set by the launcher)")
    eagle_off: Literal["plain", "warm"] = _opt(
        "plain",
        help="EAGLE off-state: plain (a DECODE step of the target, no drafter work, KV catch-up on resume) or warm "
        "(SGLang's steps=0)",
    )

    @property
    def eagle(self) -> bool:
        """EAGLE / EAGLE3: (s,t,n) switching through SGLang's AdaptiveController (see respec/eagle_policy.py)."""
        return self.algorithm in RESPEC_EAGLE

    @classmethod
    def from_env(cls) -> "RespecConfig":
        """Accessor: ``load().respec`` (kept for existing callers)."""
        return load().respec


MAX_TRAIN_STEPS = 10_000  # optimizer steps of one update
MAX_DRAFT_STEPS = 64  # draft steps unrolled in the KD loss or the probe (far past any served num-steps)
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed


def _in(lo: Any, hi: Any) -> Check:
    return (lambda v: lo <= v <= hi, f"must be in [{lo}, {hi}]")


@dataclass(frozen=True)
class LearnerConfig(_Section):
    """Training settings of the ReSpec online learner (the ``learner`` object of a learner spec)."""

    _flag_group = "sglang-spex: ReSpec online learner"

    variant: Literal["frozen", "unweighted", "reward"] = _opt(
        "reward", flag="--respec-kd", help="KD variant: frozen, unweighted or reward"
    )
    mode: Literal["sync", "async"] = _opt("async", flag="--respec-learner-mode", help="learner updates: sync or async")
    update_interval: int = _opt(
        1, flag="--respec-update-interval", check=_POSITIVE, help="update the drafter every N posted batches"
    )
    train_steps: int = _opt(4, flag=None, check=_in(1, MAX_TRAIN_STEPS), help="optimizer steps per update")
    micro_batch: int = _opt(4, flag=None, check=_POSITIVE, help="rollouts per optimizer step")
    lr: float = _opt(1e-4, flag=None, check=_FINITE_POSITIVE, help="learning rate")
    grad_clip: float = _opt(0.5, flag=None, check=_FINITE_POSITIVE, help="gradient norm clip")
    kd_steps: int = _opt(3, flag=None, check=_in(1, MAX_DRAFT_STEPS), help="draft steps unrolled in the KD loss")
    train_window: int = _opt(
        2048, flag=None, check=(lambda v: v >= 2, "must be >= 2"), help="rollout tokens per update (longer: a window)"
    )
    weight_mode: Literal["linear", "zscore", "max", "none"] = _opt(
        "linear",
        flag=None,
        help="reward weights (reward variant): linear = the paper's w(r) = r normalised and clipped; zscore, max, none",
    )
    w_max: float = _opt(2.0, flag=None, check=_FINITE_POSITIVE, help="largest reward weight")
    kd_target: Literal["auto", "copy"] = _opt(
        "auto", flag=None, help="KD target: auto (the served top-k when every rollout has it, else the copy) or copy"
    )
    probe_steps: int = _opt(5, flag=None, check=_in(1, MAX_DRAFT_STEPS), help="draft steps in the acceptance probe")
    collapse_ratio: float = _opt(
        0.5, flag=None, check=(lambda v: 0 <= v <= 1, "must be in [0, 1]"), help="rollback below this acceptance ratio"
    )
    buffer_capacity: int = _opt(4096, flag=None, check=_POSITIVE, help="replay buffer size (rollouts)")
    buffer_entries: int = _opt(1 << 24, flag=None, check=_POSITIVE, help="replay buffer size (ids, log-probs, top-k)")
    max_post_bytes: int = _opt(1 << 22, flag=None, check=_POSITIVE, help="largest POST /respec/rollouts body")
    payback: bool = _opt(
        True, flag=None, help="skip updates that cost more than speculation could save (needs the adaptive profile)"
    )
    seed: int = _opt(0, flag=None, check=_in(0, MAX_SEED), help="learner random seed")


Probe = Tuple[Tuple[Tuple[int, ...], Tuple[int, ...]], ...]


@dataclass(frozen=True)
class LearnerSpec(_Section):
    """The online learner (``--respec-learner``): drafter checkpoint, HF target, training settings, probe set."""

    drafter: str = _opt(flag=None, check=(bool, "must not be empty"), help="EAGLE-3 drafter checkpoint dir")
    target: str = _opt(flag=None, check=(bool, "must not be empty"), help="HF model dir of the served model")
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    probe: Probe = _opt((), flag=None, help="[[prompt_ids, response_ids], ...] for the acceptance probe")
    server_url: Optional[str] = _opt(None, flag=None, help="server to hot-swap into (default: this one)")
    replica_urls: Tuple[str, ...] = _opt(
        (), flag=None, help="more servers that take every drafter version too (replicas of the same policy)"
    )


@dataclass(frozen=True)
class PluginConfig(_Section):
    """Everything the plugin's processes need: one object, one env var (``SGLANG_SPEX_CONFIG``)."""

    _flag_group = "sglang-spex: the learner spec (ReSpec) and the profile cache (SPEX, ReSpec)"

    spex: SpexConfig = field(default_factory=SpexConfig)
    respec: RespecConfig = field(default_factory=RespecConfig)
    learner: Optional[LearnerSpec] = _opt(
        None,
        flag="--respec-learner",
        parse=_json_object,
        help="online learner spec: a JSON object or the path of one (drafter, target, learner, probe, server_url, "
        "replica_urls)",
    )
    stats_path: str = _opt("", flag=None, help="batch-stats shared-memory file (picked by the launcher)")
    profile_max_age_s: float = _opt(
        7 * 24 * 3600.0,
        flag="--tot-profile-max-age",
        check=(lambda v: v > 0, "must be > 0"),
        help="seconds before a cached roofline profile is re-measured",
    )

    def validate(self, where: str = "") -> "PluginConfig":
        """Every section's field checks, then the checks that span fields."""
        super().validate(where)
        for section in (self.spex, self.respec, self.learner, self.learner and self.learner.learner):
            if section is not None:
                section.validate()
        if self.respec.enabled and self.respec.algorithm not in RESPEC_ALGORITHMS:
            raise ConfigError(
                f"--respec-adaptive needs --speculative-algorithm one of {RESPEC_ALGORITHMS} "
                f"(got {self.respec.algorithm})"
            )
        return self


SECTIONS = (SpexConfig, RespecConfig, LearnerConfig, PluginConfig)
LEARNER_FIELDS = tuple(f.name for f in dataclasses.fields(LearnerSpec))


# ---------------------------------------------------------------- one env var, parsed once per process
def load() -> PluginConfig:
    """This process's config (``SGLANG_SPEX_CONFIG``), parsed once per value and cached; defaults when unset."""
    return _parse_env(os.environ.get(ENV_VAR, ""))


@functools.lru_cache(maxsize=4)
def _parse_env(text: str) -> PluginConfig:
    return PluginConfig.from_json(text, where=ENV_VAR) if text.strip() else PluginConfig()


def reset() -> None:
    """Forget the parsed config (tests that change the environment)."""
    _parse_env.cache_clear()


def export(cfg: PluginConfig) -> None:
    """Validate ``cfg`` and write it to ``SGLANG_SPEX_CONFIG`` for this process and the ones it starts."""
    os.environ[ENV_VAR] = cfg.validate().to_json()


STATS_FILE_PREFIX = "sglang-spex-stats-"  # + the launcher's pid: its batch-stats rings (srt/batch_stats.py)


def default_stats_path() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"{STATS_FILE_PREFIX}{os.getpid()}")


def stats_channel() -> str:
    """The batch-stats file of this process tree: the config's ``stats_path``, or (server started without our
    launcher) one picked now and written back into ``SGLANG_SPEX_CONFIG`` for the processes started after this."""
    cfg = load()
    if not cfg.stats_path:
        cfg = dataclasses.replace(cfg, stats_path=default_stats_path())
        export(cfg)
    return cfg.stats_path


def replace(cfg: SpexConfig, **changes: Any) -> SpexConfig:
    """A copy of ``cfg`` with ``changes`` applied and validated."""
    return dataclasses.replace(cfg, **changes).validate()


# ---------------------------------------------------------------- helpers shared with the launcher
def flag_name(cls: type, f: dataclasses.Field) -> Optional[str]:
    if "flag" not in f.metadata or f.metadata["flag"] is None:
        return None
    return f.metadata["flag"] or cls._flag_prefix + f.name.replace("_", "-")


def flag_value(args: Sequence[str], flag: str) -> Optional[str]:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``), or None."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None
