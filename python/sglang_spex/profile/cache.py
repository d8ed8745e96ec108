"""The one step-cost profile SPEX and ReSpec share, and its disk cache.

A :class:`Profile` holds decode measurements of one engine: per config key (:data:`PLAIN` = no speculation,
else a ReSpec config such as ``NGRAM:s4t1n4``) and batch size, one :class:`Point`. SPEX reads the plain curve's
roofline fit (the knee sets ``--tot-k-total auto``) plus the context and prefill probes; ReSpec's solver reads
every curve.

SPEX's roofline profiles are cached as one JSON per (model, device, flags) under ``cache_dir("profiles")``
(``$SPEX_CACHE_DIR/profiles``). A cached profile is *stale* when it is older than ``max_age_s`` (default: the
config's ``profile_max_age_s``, ``--tot-profile-max-age``, 7 days) or was measured by another sglang /
sglang-spex version or file format; stale or missing profiles are re-measured by
:func:`sglang_spex.profile.measure.ensure_profile`. A profile measured under load (other requests in flight, or a
disturbed sweep: ``meta["load"]``) is never written to, nor read from, the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from sglang_spex.config import cache_dir as config_cache_dir
from sglang_spex.config import load as load_config
from sglang_spex.profile.roofline import KneeFit, find_knee, k_total_from_knee

CACHE_DIR = config_cache_dir("profiles")
FORMAT = 2  # 1: roofline-only layout (key, batch_sizes, step_times), still read
PLAIN = "none"  # config key of plain decode (no speculation)
_KEY_FIELDS = {"model", "hardware", "flags", "drafter"}


def _versions() -> Dict[str, str]:
    from sglang_spex import __version__

    try:
        import sglang

        sgl = sglang.__version__
    except Exception:  # the simulator may run without sglang
        sgl = "none"
    return {"sglang": sgl, "sglang_spex": __version__, "format": str(FORMAT)}


def device_name() -> str:
    """GPU name, or the CPU model plus the core count and the thread count torch uses."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu:{cpu}:{os.cpu_count()}c:omp{os.environ.get('OMP_NUM_THREADS', '?')}"


@dataclass
class Point:
    """Decode measurements of one config at one batch size."""

    batch_size: int
    step_s: float  # seconds per decode step of the whole batch (draft + verify for a speculative config)
    tokens_per_step: float = 1.0  # tokens a sequence gains per step (1 for plain decode)
    throughput: float = 0.0  # output tokens per second of the batch
    accept_length: Optional[float] = None  # SGLang's mean spec_accept_length over the batch (None: plain)
    verify_ct: Optional[int] = None  # verify steps of the measuring runs (max over each batch, summed over batches)

    @classmethod
    def plain(cls, batch: int, step_s: float) -> "Point":
        return cls(int(batch), float(step_s), 1.0, batch / step_s if step_s > 0 else 0.0)


@dataclass
class Profile:
    """Decode step costs of one engine per config and batch size, with the plain curve's roofline fit."""

    model: str
    drafter: str = ""  # draft model of the speculative configs ("" for a plain profile)
    device: str = ""
    points: Dict[str, Dict[int, Point]] = field(default_factory=dict)
    meta: Dict[str, Any] = field(default_factory=dict)  # how it was measured, per-probe records
    flags: Dict[str, Any] = field(default_factory=dict)  # server flags that change step times
    fit: Optional[KneeFit] = None  # roofline fit of the plain curve (see :meth:`roofline`)
    k_total: Optional[int] = None  # SPEX's global speculative budget from the knee
    context_len: int = 0  # mean context tokens per sequence while plain step times were measured
    ctx_coef: Optional[float] = None  # extra seconds per context token (summed over the batch)
    prefill_tok_s: Optional[float] = None
    prefill_overhead_s: Optional[float] = None
    created_at: float = field(default_factory=time.time)
    duration_s: float = 0.0
    versions: Dict[str, str] = field(default_factory=_versions)

    @classmethod
    def from_points(
        cls, key: Dict[str, Any], batch_sizes: Sequence[int], step_times: Sequence[float], context_len: int, **kw: Any
    ) -> "Profile":
        """A plain-decode profile from measured step times, with its knee fitted (SPEX's roofline profile)."""
        unknown = set(key) - _KEY_FIELDS
        if unknown:
            raise ValueError(f"profile key: unknown fields {sorted(unknown)} (expected {sorted(_KEY_FIELDS)})")
        fit = find_knee(batch_sizes, step_times)
        prof = cls(
            model=str(key.get("model", "")),
            drafter=str(key.get("drafter", "")),
            device=str(key.get("hardware", "")),
            flags=dict(key.get("flags") or {}),
            fit=fit,
            k_total=k_total_from_knee(fit),
            context_len=int(context_len),
            **kw,
        )
        for b, t in zip(batch_sizes, step_times):
            prof.add(PLAIN, Point.plain(int(b), float(t)))
        return prof

    # --- curves -------------------------------------------------------------------------------------------

    def add(self, key: str, point: Point) -> None:
        self.points.setdefault(key, {})[point.batch_size] = point

    @property
    def configs(self) -> List[str]:
        """Speculative config keys (every curve but plain decode)."""
        return [k for k in self.points if k != PLAIN]

    @property
    def key(self) -> Dict[str, Any]:
        """What the profile is valid for: model, hardware, flags (and the drafter, when there is one)."""
        key = {"model": self.model, "hardware": self.device, "flags": self.flags}
        return {**key, "drafter": self.drafter} if self.drafter else key

    @property
    def batch_sizes(self) -> List[int]:
        return sorted(self.points.get(PLAIN, {}))

    @property
    def step_times(self) -> List[float]:
        plain = self.points.get(PLAIN, {})
        return [plain[b].step_s for b in sorted(plain)]

    def roofline(self) -> KneeFit:
        """The plain curve's knee fit (fitted now and kept, if the profile was built point by point)."""
        if self.fit is None:
            if len(self.batch_sizes) < 2:
                raise ValueError("profile has fewer than two plain-decode points: no roofline")
            self.fit = find_knee(self.batch_sizes, self.step_times)
            self.k_total = k_total_from_knee(self.fit)
        return self.fit

    @property
    def load_why(self) -> List[str]:
        """Why the sweep counts as measured under load (``meta["load"]["why"]``; empty: it does not)."""
        return list((self.meta.get("load") or {}).get("why") or [])

    @property
    def measured_under_load(self) -> bool:
        """Measured while other requests ran or with a disturbed curve: good for this run only, never cached."""
        return bool((self.meta.get("load") or {}).get("under_load"))

    @property
    def knee(self) -> float:
        return self.roofline().knee

    def predict(self, batch: int) -> float:
        """Fitted seconds per plain decode step at ``batch``."""
        return float(self.roofline().step_time(batch))

    # --- (de)serialisation --------------------------------------------------------------------------------

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready; also lists the plain curve as ``batch_sizes`` / ``step_times`` and the ``key``."""
        d: Dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("points", "fit")}
        d["points"] = {k: {str(b): asdict(p) for b, p in sorted(v.items())} for k, v in self.points.items()}
        d["fit"] = self.fit.to_dict() if self.fit is not None else None
        d.update(format=FORMAT, key=self.key, batch_sizes=self.batch_sizes, step_times=self.step_times)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Profile":
        """Read :meth:`to_dict`'s layout, format 1 roofline profiles and earlier ReSpec profiles."""
        d = dict(d)
        if "points" not in d:  # format 1: a roofline profile
            key = d.get("key") or {}
            d.update(model=key.get("model", ""), device=key.get("hardware", ""), flags=key.get("flags") or {})
            pts = zip(d.get("batch_sizes", []), d.get("step_times", []))
            d["points"] = {PLAIN: {str(b): asdict(Point.plain(b, t)) for b, t in pts}}
        if "raw" in d:  # format 1 kept its per-probe records under "raw"
            d["meta"] = {**(d.pop("raw") or {}), **(d.get("meta") or {})}
        d.setdefault("versions", {})  # unknown: stale for the cache
        points = {k: {int(b): Point(**p) for b, p in v.items()} for k, v in d.pop("points").items()}
        fit = KneeFit.from_dict(d.pop("fit")) if d.get("fit") else None
        names = {f.name for f in fields(cls)} - {"points", "fit"}
        return cls(points=points, fit=fit, **{k: v for k, v in d.items() if k in names})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        return cls.from_dict(json.loads(text))

    def save(self, path: Path) -> Path:
        """Write to ``path`` atomically (temp file + rename; the temp file is removed if either fails)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".profile-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: Path) -> "Profile":
        return cls.from_json(Path(path).read_text())

    def is_stale(self, max_age_s: Optional[float] = None) -> bool:
        """Older than ``max_age_s`` (default: the config's ``profile_max_age_s``) or from other versions."""
        max_age = load_config().profile_max_age_s if max_age_s is None else max_age_s
        return (time.time() - self.created_at) > max_age or self.versions != _versions()

    def summary(self) -> str:
        pts = ", ".join(f"B={b}: {t * 1e3:.1f} ms" for b, t in zip(self.batch_sizes, self.step_times))
        if self.fit is None:
            return pts or "no plain-decode points"
        bound = "bounded" if self.fit.bounded else "≥ range"
        return f"{pts}; knee {self.fit.knee:.1f} ({bound}), k_total {self.k_total}"


# --- the roofline cache (one file per key) -----------------------------------------------------------------


def key_id(key: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def path_for(key: Dict[str, Any], cache_dir: Optional[Path] = None) -> Path:
    return Path(cache_dir or CACHE_DIR) / f"{key_id(key)}.json"


def save(profile: Profile, cache_dir: Optional[Path] = None) -> Optional[Path]:
    """Write ``profile`` to its key's cache file; None (nothing written) for one measured under load."""
    if profile.measured_under_load:
        return None
    return profile.save(path_for(profile.key, cache_dir))


def _read(path: Path, keep: Callable[[Profile], bool]) -> Optional[Profile]:
    """The profile in ``path`` if ``keep`` accepts it; None for a missing or unreadable file, and for a malformed one
    (bad JSON, a list where a mapping belongs, a field of the wrong type), which counts as missing."""
    try:
        prof = Profile.load(path)
        return prof if keep(prof) else None
    except Exception:
        return None


def load(key: Dict[str, Any], cache_dir: Optional[Path] = None, max_age_s: Optional[float] = None) -> Optional[Profile]:
    """The cached profile for ``key`` if present, well-formed, fresh and not measured under load, else None."""
    return _read(
        path_for(key, cache_dir),
        lambda p: p.key == key and not p.is_stale(max_age_s) and not p.measured_under_load,
    )


def latest_profile(cache_dir: Optional[Path] = None, model_contains: str = "") -> Optional[Profile]:
    """The most recently written cached roofline profile (optionally for a model path containing a string)."""
    best = None
    for path in Path(cache_dir or CACHE_DIR).glob("*.json"):
        prof = _read(
            path, lambda p: p.fit is not None and model_contains in p.model and isinstance(p.created_at, (int, float))
        )
        if prof is None:
            continue
        if best is None or prof.created_at > best.created_at:
            best = prof
    return best
