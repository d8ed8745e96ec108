"""Overlap-scheduler on/off columns shared by the CPU benchmarks: flags, the server's actual state, medians."""

from __future__ import annotations

import signal
import statistics
from typing import Dict, List, Sequence

import httpx

OVERLAP_MODES = ("on", "off")


def parse_overlap(text: str) -> List[str]:
    """``on,off`` (either order, or one of them) -> the list of modes."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in OVERLAP_MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise ValueError(f"--overlap {text!r}: expected a comma list of on/off")
    return modes


def overlap_flags(mode: str) -> List[str]:
    """The launcher's flags for ``mode``: none for on (the default, CPU included), SGLang's
    ``--disable-overlap-schedule`` for off."""
    return [] if mode == "on" else ["--disable-overlap-schedule"]


def actual_overlap(url: str) -> str:
    """``on`` / ``off`` as the running server reports it (``/get_server_info`` ``disable_overlap_schedule``)."""
    info = httpx.get(url + "/get_server_info", timeout=60).json()
    return "off" if info.get("disable_overlap_schedule") else "on"


def spread(values: Sequence[float]) -> Dict[str, float]:
    """Median with min and max of the valid (non-NaN) values; ``n`` of them, ``invalid`` the rest."""
    ok = [v for v in values if v == v]
    if not ok:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0, "invalid": len(values)}
    return {
        "median": statistics.median(ok),
        "min": min(ok),
        "max": max(ok),
        "n": len(ok),
        "invalid": len(values) - len(ok),
    }


def fmt(s: Dict[str, float], digits: int = 1) -> str:
    bad = f" [{s['invalid']} invalid]" if s.get("invalid") else ""
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f}){bad}"


def _terminate(signum, frame) -> None:  # noqa: ARG001
    raise SystemExit(128 + signum)


def stop_servers_on_sigterm() -> None:
    """Turn SIGTERM (e.g. from ``timeout``) into SystemExit, so ``finally`` blocks stop the servers we started."""
    signal.signal(signal.SIGTERM, _terminate)
