"""A run's schedule priced at one shared step price: the noise-free companion of a wall-time ratio.

On a shared 2-core host two runs with the same schedule can differ by 20 % in wall time. The scheduler's
batch-stats rows say what each step did (decode rows, prompt tokens prefilled, whether it prefilled, the context
its requests attend over), so one step price, fitted over every step of every mode of a benchmark,

    step_s ≈ a + b·decode_rows + f·[prefills] + p·prefill_tokens + c·kv_tokens

(robust least squares, coefficients ≥ 0), prices all modes alike: the ratio of two runs' priced schedules moves
only with what they scheduled, not with what the host did meanwhile. It leaves out everything a step row does not
carry (idle time between steps), so it complements the wall-time ratio and never replaces it. Rows traced before
``kv_tokens`` existed (four numbers) are read with no context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np
from scipy.optimize import least_squares

PREFILL_MODES = (1, 3)  # batch-stats "mode": 1 prefill/extend, 3 mixed (prefill + the running batch's decode)
NAMES = ("a_s", "b_s_per_row", "f_s", "p_s_per_token", "c_s_per_kv_token")


def compact(rows: Iterable[Dict[str, Any]]) -> List[List[float]]:
    """Batch-stats rows -> ``[decode_rows, prefills, prefill_tokens, kv_tokens, step_s]`` per step (``step_s`` may
    be NaN)."""
    out = []
    for r in rows:
        step_s = r.get("step_s")
        out.append(
            [
                float(r.get("decode_rows") or 0),
                1.0 if r["mode"] in PREFILL_MODES else 0.0,
                float(r.get("prefill_tokens") or 0),
                float(r.get("kv_tokens") or 0),
                float("nan") if step_s is None else float(step_s),
            ]
        )
    return out


def _features(step: Sequence[float]) -> List[float]:
    """A compacted step's inputs to the price, its time left off (a four-number row has no ``kv_tokens``)."""
    return [1.0, *step[:3], step[3] if len(step) == 5 else 0.0]


def _design(steps: Sequence[Sequence[float]]) -> np.ndarray:
    return np.asarray([_features(s) for s in steps], dtype=float).reshape(-1, len(NAMES))


@dataclass(frozen=True)
class StepPrice:
    """Seconds per step as ``a + b·rows + f·prefills + p·tokens + c·kv_tokens``; ``r2`` and ``n`` describe the
    fit."""

    coef: tuple
    r2: float
    n: int

    def cost_s(self, steps: Sequence[Sequence[float]]) -> float:
        """The priced schedule: the sum of every step's price."""
        if not len(steps):
            return 0.0
        return float((_design(steps) @ np.asarray(self.coef)).sum())

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "StepPrice":
        """A price written by :meth:`as_dict` (another benchmark's, another machine's)."""
        missing = [k for k in NAMES if k not in d]
        if missing:
            raise ValueError(f"step price: missing {missing} (expected {list(NAMES)})")
        return cls(tuple(float(d[k]) for k in NAMES), float(d.get("r2", float("nan"))), int(d.get("steps", 0)))

    def as_dict(self) -> Dict[str, float]:
        return {**{k: float(f"{v:.4g}") for k, v in zip(NAMES, self.coef)}, "r2": round(self.r2, 3), "steps": self.n}


def fit_price(step_lists: Iterable[Sequence[Sequence[float]]], min_steps: int = 8) -> Optional[StepPrice]:
    """One price over all steps with a measured time (None below ``min_steps`` of them). A soft-L1 loss keeps a
    step the host stalled from setting the price."""
    steps = [s for lst in step_lists for s in lst if len(s) in (4, 5) and not math.isnan(s[-1])]
    if len(steps) < min_steps:
        return None
    x = _design(steps)
    y = np.asarray([s[-1] for s in steps])
    scale = max(float(np.median(y)) * 0.1, 1e-6)
    x0 = np.zeros(len(NAMES))
    x0[0] = float(np.median(y))
    fit = least_squares(lambda c: x @ c - y, x0, bounds=(0.0, np.inf), loss="soft_l1", f_scale=scale)
    resid = y - x @ fit.x
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / total if total > 0 else 0.0
    return StepPrice(tuple(float(c) for c in fit.x), r2, len(steps))
