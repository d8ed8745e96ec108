"""Profiles on disk: one JSON per (model, device, flags) under ``~/.cache/sglang-spex/profiles``.

A cached profile is *stale* when it is older than ``max_age_s`` (default 7 days, env
``SPEX_PROFILE_MAX_AGE_S``) or was measured by another sglang / sglang-spex version; stale or missing
profiles are re-measured by :func:`sglang_spex.profile.measure.ensure_profile`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from sglang_spex.profile.roofline import KneeFit, find_knee, k_total_from_knee

CACHE_DIR = Path(os.environ.get("SPEX_PROFILE_CACHE", Path.home() / ".cache" / "sglang-spex" / "profiles"))
DEFAULT_MAX_AGE_S = float(os.environ.get("SPEX_PROFILE_MAX_AGE_S", 7 * 24 * 3600))
FORMAT = 1


def _versions() -> Dict[str, str]:
    from sglang_spex import __version__

    try:
        import sglang

        sgl = sglang.__version__
    except Exception:  # the simulator may run without sglang
        sgl = "none"
    return {"sglang": sgl, "sglang_spex": __version__, "format": str(FORMAT)}


@dataclass
class Profile:
    """Decode step time vs running batch size on one engine, and the knee found in it."""

    key: Dict[str, Any]  # model, device, flags the profile is valid for
    batch_sizes: List[int]
    step_times: List[float]  # seconds per decode step, one per batch size
    context_len: int  # mean context tokens per sequence while step times were measured
    fit: KneeFit
    k_total: int
    ctx_coef: Optional[float] = None  # extra seconds per context token (summed over the batch)
    prefill_tok_s: Optional[float] = None
    prefill_overhead_s: Optional[float] = None
    created_at: float = field(default_factory=time.time)
    duration_s: float = 0.0
    versions: Dict[str, str] = field(default_factory=_versions)
    raw: Dict[str, Any] = field(default_factory=dict)  # per-point measurements, for the record

    @classmethod
    def from_points(cls, key: Dict[str, Any], batch_sizes, step_times, context_len: int, **kw) -> "Profile":
        fit = find_knee(batch_sizes, step_times)
        return cls(
            key=dict(key),
            batch_sizes=[int(b) for b in batch_sizes],
            step_times=[float(t) for t in step_times],
            context_len=int(context_len),
            fit=fit,
            k_total=k_total_from_knee(fit),
            **kw,
        )

    @property
    def knee(self) -> float:
        return self.fit.knee

    def predict(self, batch: int) -> float:
        """Profiled seconds per decode step at ``batch``."""
        return float(self.fit.step_time(batch))

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["fit"] = self.fit.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Profile":
        d = dict(d)
        d["fit"] = KneeFit.from_dict(d["fit"])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def is_stale(self, max_age_s: float = DEFAULT_MAX_AGE_S) -> bool:
        return (time.time() - self.created_at) > max_age_s or self.versions != _versions()

    def summary(self) -> str:
        pts = ", ".join(f"B={b}: {t * 1e3:.1f} ms" for b, t in zip(self.batch_sizes, self.step_times))
        return f"{pts}; knee {self.knee:.1f} ({'bounded' if self.fit.bounded else '≥ range'}), k_total {self.k_total}"


def key_id(key: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def path_for(key: Dict[str, Any], cache_dir: Optional[Path] = None) -> Path:
    return Path(cache_dir or CACHE_DIR) / f"{key_id(key)}.json"


def save(profile: Profile, cache_dir: Optional[Path] = None) -> Path:
    """Write atomically (temp file + rename)."""
    path = path_for(profile.key, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".profile-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(profile.to_dict(), f, indent=1)
    os.replace(tmp, path)
    return path


def load(
    key: Dict[str, Any], cache_dir: Optional[Path] = None, max_age_s: float = DEFAULT_MAX_AGE_S
) -> Optional[Profile]:
    """The cached profile for ``key`` if present and fresh, else None."""
    path = path_for(key, cache_dir)
    try:
        prof = Profile.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None if prof.key != key or prof.is_stale(max_age_s) else prof


def latest_profile(cache_dir: Optional[Path] = None, model_contains: str = "") -> Optional[Profile]:
    """The most recently written cached profile (optionally for a model path containing a string)."""
    root = Path(cache_dir or CACHE_DIR)
    best = None
    for path in root.glob("*.json"):
        try:
            prof = Profile.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if model_contains and model_contains not in str(prof.key.get("model", "")):
            continue
        if best is None or prof.created_at > best.created_at:
            best = prof
    return best
