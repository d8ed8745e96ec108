"""ReSpec Adaptive Server, online part: a state machine over the active decode batch size with hysteresis.

States are "no speculation" (``None``) and "speculate with config k" (a profile key such as ``NGRAM:s4t1n4``);
the solver's :class:`~sglang_spex.respec.solver.Plan` says which one each batch size wants. Three guards keep a
batch size that oscillates around a threshold from switching every step:

* **band** (``margin`` batch sizes): a batch size B votes for a new state only if the plan picks that state for
  every size in ``[B - margin, B + margin]``; near a boundary it votes to stay -- when the plan picks the current
  state somewhere in the band (near a boundary between two other states, e.g. two configs, it votes for B's own
  choice: staying in a state no nearby size wants would hold it for good). For a single spec→plain boundary at T
  this gives ``exit_threshold = T + margin`` and ``enter_threshold = T - 1 - margin``;
* **confirm** (steps): this many consecutive steps must vote to leave the current state (for the state the last
  vote names: a batch alternating between two sizes whose configs differ, next to neither's boundary with the
  current state, still leaves it);
* **min dwell** (steps): no switch until the current state has lasted this many steps -- unless the batch size is
  *far* from every threshold: the plan picks the new state for every size from B/2 to 2B. A batch that oscillates
  around a threshold never is; one that jumps across it (a burst of arrivals after a small-batch tail, an RL step's
  rollouts starting together) would otherwise run ``min_dwell`` steps in a state the plan rejects (at B=64 one
  EAGLE3 verify step of SmolLM2 on CPU costs about five plain decode steps).

Steps with no decode batch (B = 0) are ignored. The machine is pure Python and knows nothing about SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

from sglang_spex.respec.solver import Plan

State = Optional[str]  # None = plain decode
_UNSET = object()


@dataclass(frozen=True)
class Hysteresis:
    """The three guards (see module doc); ``parse("margin,dwell[,confirm]")`` reads ``--respec-hysteresis``."""

    margin: int = 1
    min_dwell: int = 8
    confirm: int = 2

    def __post_init__(self) -> None:
        if self.margin < 0 or self.min_dwell < 0 or self.confirm < 1:
            raise ValueError(f"bad hysteresis {self}: margin >= 0, min_dwell >= 0, confirm >= 1")

    @classmethod
    def parse(cls, text: str) -> "Hysteresis":
        try:
            parts = [int(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"bad hysteresis {text!r}: expected MARGIN,MIN_DWELL[,CONFIRM] integers") from None
        if not 2 <= len(parts) <= 3:
            raise ValueError(f"bad hysteresis {text!r}: expected MARGIN,MIN_DWELL[,CONFIRM]")
        return cls(*parts)


class AdaptiveFSM:
    """Observe the active decode batch size once per step; :attr:`state` is what the next step should run."""

    def __init__(
        self,
        plan: Union[Plan, Callable[[int], State]],
        hysteresis: Hysteresis = Hysteresis(),
        initial: object = _UNSET,
        max_batch: int = 1024,
    ):
        """Without ``initial`` the first observed batch size sets the state directly (no dwell, no switch)."""
        self._choose = plan.choose if isinstance(plan, Plan) else plan
        self.hyst = hysteresis
        self.max_batch = max_batch
        self._adopt_first = initial is _UNSET
        self.state: State = None if initial is _UNSET else initial  # type: ignore[assignment]
        self.dwell = 0  # steps in the current state
        self._pending: Tuple[State, int] = (self.state, 0)  # candidate state, consecutive votes
        self.steps = 0
        self.switches = 0
        self.steps_per_state: Dict[str, int] = {}
        self.transitions: List[Tuple[int, State, State, int]] = []  # (step, from, to, batch size), last 64

    def vote(self, batch: int, plan: Optional[Callable[[int], State]] = None) -> State:
        """The state batch size ``batch`` asks for under the band rule (the current state near a boundary it lies
        on), under the plan the machine follows or, when given, ``plan``."""
        choose = self._choose if plan is None else plan
        lo, hi = max(1, batch - self.hyst.margin), min(self.max_batch, batch + self.hyst.margin)
        want = choose(batch)
        band = {choose(b) for b in range(lo, max(hi, lo) + 1)}
        return self.state if len(band) > 1 and self.state in band else want

    def _far(self, batch: int, want: State) -> bool:
        """The plan picks ``want`` for every batch size from ``batch // 2`` to ``2 * batch``: no threshold is near."""
        hi = min(self.max_batch, 2 * batch)
        return all(self._choose(b) == want for b in range(min(max(1, batch // 2), hi), hi + 1))

    def observe(self, batch: int) -> State:
        """Record one step of ``batch`` active decode sequences; return the state for the next step."""
        if batch <= 0:
            return self.state
        if self._adopt_first:
            self._adopt_first = False
            self.state = self._choose(min(batch, self.max_batch))
            self._pending = (self.state, 0)
        self.steps += 1
        self.dwell += 1
        label = self.state or "none"
        self.steps_per_state[label] = self.steps_per_state.get(label, 0) + 1
        want = self.vote(batch)
        if want == self.state:
            self._pending = (self.state, 0)
            return self.state
        self._pending = (want, self._pending[1] + 1)  # consecutive votes to leave; the latest names the state
        if self._pending[1] >= self.hyst.confirm and (self.dwell >= self.hyst.min_dwell or self._far(batch, want)):
            self.transitions = (self.transitions + [(self.steps, self.state, want, batch)])[-64:]
            self.state, self.dwell, self._pending = want, 0, (want, 0)
            self.switches += 1
        return self.state

    def replan(self, plan: Union[Plan, Callable[[int], State]]) -> None:
        """Follow a new plan (online re-profile) from the next step; the current state and dwell are kept."""
        self._choose = plan.choose if isinstance(plan, Plan) else plan
        self._pending = (self.state, 0)

    @property
    def speculating(self) -> bool:
        return self.state is not None

    def info(self) -> dict:
        """Current state, switch count and per-state step counts (for ``/spex/info`` and ``/metrics``)."""
        return {
            "state": self.state or "none",
            "switches": self.switches,
            "steps": self.steps,
            "steps_per_state": dict(self.steps_per_state),
            "hysteresis": {"margin": self.hyst.margin, "min_dwell": self.hyst.min_dwell, "confirm": self.hyst.confirm},
            "recent_transitions": [
                {"step": s, "from": a or "none", "to": b or "none", "batch": bs}
                for s, a, b, bs in self.transitions[-8:]
            ],
        }


def two_state_thresholds(plan: Plan, hysteresis: Hysteresis) -> Tuple[int, int]:
    """(enter_threshold, exit_threshold) of the two-state view: speculate when B <= enter, stop when B >= exit."""
    t = plan.spec_max_batch() + 1  # first batch size that does not speculate
    return max(0, t - 1 - hysteresis.margin), t + hysteresis.margin
