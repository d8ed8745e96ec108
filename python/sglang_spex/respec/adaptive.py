"""ReSpec Adaptive Server, online part: the runtime of one spec worker -- FSM, forced modes, per-request opt-out,
step clock, online re-profiling, counters -- shared by both speculative paths:

* NGRAM: hook R1 runs a true plain decode step when the runtime says "no speculation" (:mod:`.ngram_plain`);
* EAGLE / EAGLE3: the runtime is SGLang's ``AdaptiveSpecPolicy`` (hooks R3/R4, :mod:`.eagle_policy`), so SGLang's
  ``AdaptiveController`` switches among (s, t=1, n=s+1) runtime states and to steps=0 for "no speculation".

The runtime lives on the spec worker SGLang's scheduler drives (:func:`runtime_of`; the scheduler reaches it as
``scheduler.draft_worker``), not in a module global. A *state* is a profile config key (``NGRAM:s4t1n4``,
``EAGLE3:s3t1n4``), ``SPEC`` (forced on, no profile) or ``None`` (plain decode). A request opts out with
``sampling_params.custom_params = {"respec": "off"}``: a decode batch holding one runs without speculation (the
batch shares one forward, so its mates do too; counted). A request with frequency / presence / repetition
penalties, ``min_new_tokens`` or a custom logit processor is opted out the same way (SGLang's spec path applies
the first relaxed and the last not at all).

Configuration: :meth:`~sglang_spex.config.RespecConfig.from_env` (the launcher's ``--respec-*`` flags).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any, Deque, Dict, List, Optional, Tuple

from sglang_spex.adapters import spec_workers as sw
from sglang_spex.config import RespecConfig
from sglang_spex.respec.drift import OnlineReprofiler
from sglang_spex.respec.fsm import AdaptiveFSM, Hysteresis, State
from sglang_spex.respec.profiler import PROFILE_DIR, Profile, SpecConfig, _slug, cached_at_t_above_zero
from sglang_spex.respec.solver import MIN_GAIN, Plan, best_case_speedup, solve
from sglang_spex.srt.metrics import RespecMetrics

logger = logging.getLogger(__name__)

SPEC = "spec"  # FSM state used when no profile names configs (force modes)
UNDECIDED = ""  # a hook's "no ReSpec decision for this batch" (SGLang's path runs, no step is recorded)
OPT_OUT = {"respec": "off"}  # custom_params entry of a request that never speculates
_MAX_STEP_GAP_S = 5.0  # a longer gap between decode steps is idle time, not a step
_MAX_UNREAD = 4  # closed steps waiting for SGLang's host copy of their accept lengths (overlap: 1-2)


def runnable_configs(profile: Profile, cfg: RespecConfig) -> List[str]:
    """Profile configs this server can switch to: NGRAM its own key; EAGLE chains (t=1, n=s+1) of its algorithm."""
    keys = [k for k in profile.configs if not cfg.algorithm or SpecConfig.parse(k).algorithm == cfg.algorithm]
    if cfg.eagle:
        keys = [
            k
            for k in keys
            if SpecConfig.parse(k).topk == 1
            and SpecConfig.parse(k).num_draft_tokens == SpecConfig.parse(k).num_steps + 1
        ]
    elif cfg.server_key in keys:
        keys = [cfg.server_key]
    elif keys and cfg.server_key:
        logger.warning("respec: server config %s not profiled; using the profile's %s", cfg.server_key, keys)
    return keys


def switchable_configs(cfg: RespecConfig, plan: Optional[Plan], profile: Optional[Profile]) -> List[str]:
    """Every config a (re-)plan may pick: the plan's and the profile's runnable ones."""
    keys = {c.config for c in plan.choices.values() if c.config} if plan else set()
    return sorted(keys | set(runnable_configs(profile, cfg) if profile is not None else ()))


def find_profile(cfg: RespecConfig, model_path: str = "", sampled: bool = False) -> Optional[Path]:
    """``cfg.profile`` as a path, or for ``auto`` the cached profile of the model (and algorithm, when known) for
    greedy decode batches (``sampled`` False) or batches that sample at T > 0: of several, those measured the same
    way first (greedy ones, or those profiled at T > 0: ``__t<T>`` in the name), then the others, each by name."""
    if cfg.profile != "auto":
        return Path(cfg.profile)
    if not model_path:
        return None
    found = PROFILE_DIR.glob(f"{_slug(model_path)}__*.json") if PROFILE_DIR.exists() else []
    found = sorted(found, key=lambda p: (cached_at_t_above_zero(p) != sampled, p.name))
    for path in found:
        if not cfg.algorithm or runnable_configs(Profile.load(path), cfg):
            return path
    return None


def load_profile_and_plan(cfg: RespecConfig, model_path: str = "", sampled: bool = False) -> tuple:
    """(profile, plan restricted to :func:`runnable_configs`) for greedy or sampled decode batches
    (:func:`find_profile`), or (None, None) in force modes / without a profile."""
    if cfg.force is not None:
        return None, None
    return _profile_and_plan(cfg, find_profile(cfg, model_path, sampled))


def _profile_and_plan(cfg: RespecConfig, path: Optional[Path]) -> tuple:
    if path is None or not path.exists():
        logger.warning("respec: no profile (%s); speculating always", cfg.profile)
        return None, None
    profile = Profile.load(path)
    logger.info("respec: profile %s (measured at temperature %s)", path, profile.meta.get("temperature", 0.0))
    return profile, solve(profile, max_batch=cfg.max_batch, configs=runnable_configs(profile, cfg))


def best_case(cfg: RespecConfig, model_path: str = "") -> Optional[Tuple[float, Optional[str], int]]:
    """(speedup, config, batch) of the best any runnable config could do at full acceptance on this server's
    profile (:func:`~.solver.best_case_speedup`); None in force modes, without the adaptive server or a profile."""
    if not cfg.enabled:
        return None
    profile, _ = load_profile_and_plan(cfg, model_path)
    if profile is None:
        return None
    return best_case_speedup(profile, cfg.max_batch, runnable_configs(profile, cfg))


def drafter_never_pays(
    cfg: RespecConfig, model_path: str = "", best: Optional[Tuple[float, Optional[str], int]] = None
) -> Optional[str]:
    """Why training a drafter is pointless on this server (None: it may pay): with the adaptive server on and a
    profile, no runnable config beats plain decode at any batch size it measured even if every draft were accepted
    (:func:`best_case`, or ``best`` when already computed), so no update could ever be served. Force modes and
    servers without a profile always train."""
    best = best if best is not None else best_case(cfg, model_path)
    if best is None or best[0] >= 1.0 + MIN_GAIN:
        return None
    speedup, key, batch = best
    return f"no profiled config beats plain decode even at full acceptance (best: {key} x{speedup:.2f} at B={batch})"


def load_plan(cfg: RespecConfig, model_path: str = "") -> Optional[Plan]:
    """The solver's plan for ``cfg.profile`` (a JSON profile path, or ``auto``: the cached profile of the model)."""
    return load_profile_and_plan(cfg, model_path)[1]


def load_lanes(cfg: RespecConfig, model_path: str = "") -> Dict[bool, tuple]:
    """(profile, plan) per kind of decode batch, keyed by "samples at T > 0": one entry (``False``) when both
    kinds find the same profile file (an explicit ``--respec-profile``, or ``auto`` with one cached kind)."""
    if cfg.force is not None:
        return {False: (None, None)}
    paths = {sampled: find_profile(cfg, model_path, sampled) for sampled in (False, True)}
    lanes = {False: _profile_and_plan(cfg, paths[False])}
    if paths[True] != paths[False]:
        lanes[True] = _profile_and_plan(cfg, paths[True])
    return lanes


class Lane:
    """The plan, FSM and online re-profiler that decide one kind of decode batch (greedy, or sampled at T > 0)."""

    def __init__(self, cfg: RespecConfig, plan: Optional[Plan], profile: Optional[Profile] = None):
        self.plan = plan
        self.configs = switchable_configs(cfg, plan, profile)
        self.fsm = AdaptiveFSM(plan, Hysteresis.parse(cfg.hysteresis), max_batch=cfg.max_batch) if plan else None
        self.reprofiler: Optional[OnlineReprofiler] = None
        if plan is not None and profile is not None and cfg.drift > 0:
            self.reprofiler = OnlineReprofiler(
                profile, self.configs, max_batch=cfg.max_batch, threshold=cfg.drift, base=plan
            )

    def info(self) -> dict:
        out: dict = {}
        if self.fsm is not None:
            out["fsm"] = self.fsm.info()
        if self.plan is not None:
            out["plan"] = self.plan.summary()
        if self.reprofiler is not None:
            out["reprofile"] = self.reprofiler.info()
        return out


class Runtime:
    """One spec worker's FSM and switch bookkeeping (kept on the worker, see :func:`runtime_of`).

    A decode batch whose requests all decode greedily is decided by the greedy lane, one that samples at T > 0 by
    the sampled lane (:func:`load_lanes`; one lane serves both when one profile does): acceptance, and so the
    plan, differ between the two. ``plan``, ``fsm`` and ``reprofiler`` are those of the lane that decided last.

    Step clock: a decode step lasts from its forward's start to the next forward's start (as the offline profile
    measures a step, and the same under overlap scheduling, where forwards are launched back to back); step
    times are also summed per target forward mode the step ran (``DECODE`` for a plain step of ours,
    ``TARGET_VERIFY`` for SGLang's spec path). Its accept length is read from SGLang's own host copy of the result (``copy_to_cpu``) once that copy is done,
    usually one or two steps later; a step is fed to online re-profiling then. No extra device sync is made.
    """

    def __init__(
        self,
        cfg: RespecConfig,
        plan: Optional[Plan],
        profile: Optional[Profile] = None,
        sampled: Optional[Tuple[Optional[Profile], Optional[Plan]]] = None,
    ):
        """``plan``/``profile``: the greedy lane's, and the sampled lane's too unless ``sampled`` = (profile, plan)."""
        self.cfg = cfg
        greedy = Lane(cfg, plan, profile)
        self.lanes: Dict[bool, Lane] = {False: greedy, True: Lane(cfg, sampled[1], sampled[0]) if sampled else greedy}
        self.lane = greedy  # the lane of the last decision
        self.configs = sorted(set(greedy.configs) | set(self.lanes[True].configs))
        self.ledger: Optional[Any] = None  # EAGLE plain mode: the drafter's DraftLedger (respec/eagle_catchup.py)
        self.decode_steps = 0
        self.plain_steps = 0
        self.spec_steps = 0
        self.opt_out_steps = 0
        self.spec_tokens = 0.0  # sum over read spec steps of mean tokens per sequence (accept length incl. bonus)
        self.read_spec_steps = 0  # spec steps whose accept length has been read
        self.accept_ewma: Optional[float] = None
        self.last_state: State = None
        self._open: Optional[list] = None  # [start, state, batch, result, target mode, lane] of the step in flight
        self._unread: Deque[Tuple[State, int, Optional[float], Any, str, Lane]] = deque()  # (.., step_s, result, ..)
        self.target_modes: Dict[str, Dict[str, int]] = {"plain": {}, "spec": {}}  # target forward modes per kind
        self.step_time: Dict[str, List[float]] = {}  # target forward mode -> [timed steps, seconds]
        self.metrics = RespecMetrics()

    @property
    def plan(self) -> Optional[Plan]:
        return self.lane.plan

    @property
    def fsm(self) -> Optional[AdaptiveFSM]:
        return self.lane.fsm

    @property
    def reprofiler(self) -> Optional[OnlineReprofiler]:
        return self.lane.reprofiler

    @property
    def on_state(self) -> str:
        """The state a forced "spec" step runs: the server's own config key when known."""
        return self.cfg.server_key or SPEC

    def decide(self, batch_size: int, opted_out: bool = False, sampled: bool = False) -> State:
        """Observe one decode step of ``batch_size`` sequences (``sampled``: one of them samples at T > 0); the state
        it should run (None: plain decode)."""
        self.decode_steps += 1
        self.lane = self.lanes[sampled]
        force = self.cfg.force
        state: State
        if force == "plain":
            state = None
        elif force == "spec":
            state = self.on_state
        elif force and force.startswith("alternate:"):
            k = max(1, int(force.split(":", 1)[1]))
            state = self.on_state if ((self.decode_steps - 1) // k) % 2 == 0 else None
        elif self.fsm is not None:
            state = self._fsm_observe(batch_size)
        else:
            state = self.on_state  # no profile: SGLang as configured
        if opted_out and state is not None:
            state = None
            self.opt_out_steps += 1
        if self.fsm is not None and self.reprofiler is not None and self.reprofiler.probe.count(batch_size, state):
            self.fsm.replan(self.plan)  # type: ignore[arg-type]  # probe over: back to the live plan
        if state is None:
            self.plain_steps += 1
        else:
            self.spec_steps += 1
        switched = self.decode_steps > 1 and state != self.last_state
        self.last_state = state
        self.metrics.step(state is not None, switched, self.steps_of(state))
        return state

    def _fsm_observe(self, batch_size: int) -> State:
        """The FSM's state for this step; where a drift probe starts (:class:`~.drift.DriftProbe`), the FSM
        follows the probe's plan from this step on, with its hysteresis."""
        fsm, rp = self.fsm, self.reprofiler
        if rp is not None and self.plan is not None:
            probe_plan = rp.probe.begin(batch_size, fsm.state, self.plan, fsm.vote)  # type: ignore[union-attr]
            if probe_plan is not None:
                fsm.replan(probe_plan)  # type: ignore[union-attr]
        return fsm.observe(batch_size)  # type: ignore[union-attr]

    def speculate(self, batch_size: int) -> bool:
        return self.decide(batch_size) is not None

    def steps_of(self, state: State, default: int = 0) -> int:
        """speculative_num_steps of a state (0 for plain decode, ``default`` for ``SPEC``)."""
        if state is None:
            return 0
        return default if state == SPEC else SpecConfig.parse(state).num_steps

    # --- step clock -----------------------------------------------------------------------------------------
    def begin_step(self, decode: bool) -> None:
        """A forward is starting: closes the previous decode step (its wall time ends here), reads finished ones."""
        now = time.perf_counter()
        if self._open is not None:
            start, state, batch, result, mode, lane = self._open
            timed = decode and now - start < _MAX_STEP_GAP_S
            self._unread.append((state, batch, now - start if timed else None, result, mode, lane))
        self._open = [now, None, 0, None, "", self.lane] if decode else None
        self.read_finished()

    def end_step(self, state: State, batch: int, result: Any, target_mode: str = "") -> None:
        """The decode step begun last ran ``state`` on ``batch`` sequences, its target forward in ``target_mode``
        (a ``ForwardMode`` name); ``result`` is its SGLang result."""
        kind = self.target_modes["plain" if state is None else "spec"]
        kind[target_mode] = kind.get(target_mode, 0) + 1
        if self._open is not None:
            self._open[1:] = [state, batch, result, target_mode, self.lane]

    def read_finished(self) -> None:
        """Account every closed step whose accept lengths SGLang has copied to the host (oldest first)."""
        while self._unread:
            state, batch, step_s, result, mode, lane = self._unread[0]
            tokens = 1.0
            if state is not None:
                lens = sw.host_accept_lens(result)
                if lens is None:
                    if len(self._unread) < _MAX_UNREAD:
                        return  # SGLang's copy is still in flight (overlap): read it at a later step
                    self._unread.popleft()  # no host copy came (not a sampled result): left out of the stats
                    continue
                tokens = float(lens.float().mean()) if lens.numel() else 1.0
                self.spec_tokens += tokens
                self.read_spec_steps += 1
                a = self.accept_ewma
                self.accept_ewma = tokens if a is None else 0.9 * a + 0.1 * tokens
                self.metrics.accept(self.accept_ewma)
            self._unread.popleft()
            if step_s is not None:
                timed = self.step_time.setdefault(mode, [0, 0.0])
                timed[0] += 1
                timed[1] += step_s
                self.record(state, batch, step_s, tokens, lane)

    def record(
        self, state: State, batch: int, step_s: float, tokens_per_step: float, lane: Optional[Lane] = None
    ) -> None:
        """One finished decode step, decided by ``lane`` (default: the last decision's): feeds that lane's online
        re-profiling; a refit re-plans its FSM."""
        lane = lane or self.lane
        if lane.reprofiler is None or state == SPEC:
            return
        plan = lane.reprofiler.observe(state, batch, step_s, tokens_per_step)
        if plan is not None:
            logger.info("respec: drift past %.0f%%, re-profiled online: %s", 100 * self.cfg.drift, plan.summary())
            lane.plan = plan
            lane.fsm.replan(plan)  # type: ignore[union-attr]
            self.metrics.reprofile()

    def info(self) -> dict:
        self.read_finished()
        out: dict = {
            "state": self.last_state or "none",
            "decode_steps": self.decode_steps,
            "plain_steps": self.plain_steps,
            "spec_steps": self.spec_steps,
            "opt_out_steps": self.opt_out_steps,
            "mean_accept_length": self.spec_tokens / self.read_spec_steps if self.read_spec_steps else None,
            "accept_length_ewma": self.accept_ewma,
            "target_forward_modes": {k: dict(v) for k, v in self.target_modes.items()},
            "step_time_by_mode": {m: {"steps": n, "mean_s": t / n} for m, (n, t) in self.step_time.items() if n},
        }
        out["config"] = asdict(self.cfg)
        out.update(self.lanes[False].info())  # the greedy lane (the only one when one profile serves both)
        if self.lanes[True] is not self.lanes[False]:
            out["sampled_lane"] = self.lanes[True].info()
        return out


def new_runtime(model_path: str = "") -> Runtime:
    """A runtime for this process's ReSpec config (``RespecConfig.from_env``) and its profile's plan."""
    cfg = RespecConfig.from_env()
    lanes = load_lanes(cfg, model_path)
    profile, plan = lanes[False]
    return Runtime(cfg, plan, profile, sampled=lanes.get(True))


def runtime_of(worker: Any) -> Runtime:
    """The ReSpec runtime of an SGLang spec worker (NGRAM or EAGLE V2), created on first use and kept on it."""
    rt = sw.attached(worker, sw.RUNTIME_ATTR)
    if rt is None:
        rt = new_runtime(sw.model_path(worker))
        sw.attach(worker, sw.RUNTIME_ATTR, rt)
    return rt


def opted_out(batch: Any) -> bool:
    """True if a request of the batch asked for no speculation (``custom_params={"respec": "off"}``), or needs
    penalties, ``min_new_tokens`` or a custom logit processor (:func:`~sglang_spex.adapters.spec_workers.
    needs_plain_steps`): SGLang's spec path applies the first relaxed, once per verify step, and the last not at
    all, so such a request's output would depend on which of its steps speculated (on load); plain steps apply
    them exactly, as a plain server does."""
    if sw.needs_plain_steps(batch):
        return True
    for req in batch.reqs:
        params = sw.custom_params(req)
        if params is not None and params.get("respec") == OPT_OUT["respec"]:
            return True
    return False


def h_report_state(result, scheduler, *args, **kwargs):
    """AFTER Scheduler.get_internal_state: FSM state, switch and step counts, KV pool figures."""
    try:
        worker = sw.spec_worker(scheduler)
        rt = runtime_of(worker) if worker is not None else None
        info = rt.info() if rt is not None else {}
        running = len(scheduler.running_batch.reqs) if scheduler.running_batch is not None else 0
        if rt is not None and rt.ledger is not None:
            if not running:
                rt.ledger.keep_only([])  # the requests of the last decode step have finished
            info["drafter_ledger"] = rt.ledger.info()
        info["pool"] = {
            "kv_available": int(scheduler.token_to_kv_pool_allocator.available_size()),
            "kv_evictable": int(scheduler.tree_cache.evictable_size()),
            "req_slots_free": int(scheduler.req_to_token_pool.available_size()),
            "running": running,
        }
        result.internal_state["respec"] = info
    except Exception:  # never break the scheduler for a report
        logger.exception("respec: report failed")
    return result
