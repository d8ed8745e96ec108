"""ReSpec Adaptive Server, EAGLE / EAGLE3: the ReSpec runtime as SGLang's ``AdaptiveSpecPolicy``.

SGLang 0.5.23 already switches an EAGLE worker among runtime states at run time: ``AdaptiveController`` holds one
``SpecRuntimeState`` (attention backends, graph runners) per candidate ``speculative_num_steps`` and activates the
one its policy returns for each decode batch (``EAGLEWorkerV2.activate_step_by_batch``); steps = 0 skips drafting
(a one-node verify: one token per request). Its own policy (``AdaptiveSpeculativeParams``) follows an acceptance
EMA; ours follows the profile's plan through the hysteresis FSM:

* R3 (AFTER ``AdaptiveController.__init__``): replaces the controller's policy with :class:`RespecStepPolicy`,
  whose candidate steps are the plan's chain configs (t = 1, n = s + 1: SGLang's adaptive states are chains),
  the server's own steps and 0;
* R4 (AROUND ``EAGLEWorkerV2.forward_batch_generation``): per decode batch, decides the state (FSM, request
  opt-out), catches the drafter up when speculation resumes, runs "no speculation" as a true plain DECODE step
  of the target (:func:`~.eagle_catchup.plain_decode_step`), and times the step for online re-profiling;
* R5 (AROUND ``EagleDraftWorker._draft_extend_for_decode``): where an off step still runs SGLang's steps = 0
  path (grammar batches, a target replaying graphs), skips the draft extend and records what it would
  have consumed (:mod:`.eagle_catchup`; ``--respec-eagle-off warm`` keeps SGLang's steps = 0 path with its draft
  extend, which keeps the drafter's KV current at every off step).

The launcher adds ``--speculative-adaptive --speculative-adaptive-config`` (:func:`sglang_adaptive_args`) so
SGLang sizes its buffers for every candidate, and ``--max-running-requests`` (:func:`running_cap_args`) unless
given, in place of SGLang's speculative default of 48.

State lives on SGLang's objects: the runtime on the ``EAGLEWorkerV2`` (:func:`~.adaptive.runtime_of`), the policy
and its drafter ledger on the worker's ``AdaptiveController`` (its ``params``), and R4 hands the ledger to R5 on
the ``EagleDraftWorker`` for the duration of an off step that runs SGLang's steps = 0 path. Under the overlap
scheduler SGLang's ``FutureMap`` relays the draft state (including the off step's stand-ins and the rows a
catch-up restores); ReSpec's plain step calls ``on_publish`` itself, as SGLang's verify does. R4 and R5 add no
device sync and no per-step copy to an off or speculative step (see :mod:`.eagle_catchup`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Iterable, List, Optional, Sequence

from sglang_spex.adapters import spec_workers as sw
from sglang_spex.config import RespecConfig, flag_value
from sglang_spex.respec.adaptive import Runtime, load_lanes, opted_out, runtime_of, switchable_configs
from sglang_spex.respec.eagle_catchup import DraftLedger, catch_up, plain_decode_step
from sglang_spex.respec.fsm import State
from sglang_spex.respec.profiler import PROFILE_DIR, SpecConfig

logger = logging.getLogger(__name__)


def candidate_steps(configs: Iterable[str], server_steps: int) -> List[int]:
    """Every ``speculative_num_steps`` the runtime may ask for: 0, the server's own, and its configs'."""
    return sorted({0, server_steps} | {SpecConfig.parse(k).num_steps for k in configs})


def running_cap_args(cfg: RespecConfig, args: Sequence[str]) -> List[str]:
    """``--max-running-requests`` = the plan's largest batch, unless given.

    SGLang caps a speculative server at 48 running requests when none is given (its per-request draft buffers
    and graphs are sized for always-on speculation); a server without speculation is capped only by its KV
    pool. A ReSpec server runs large batches as plain decode steps, so it takes the largest batch its plan covers
    (``RespecConfig.max_batch``) instead; its KV pool still bounds it, as a plain server's does.
    """
    return (
        [] if flag_value(args, "--max-running-requests") is not None else ["--max-running-requests", str(cfg.max_batch)]
    )


def sglang_adaptive_args(cfg: RespecConfig, args: Sequence[str]) -> List[str]:
    """SGLang flags that make it build an ``AdaptiveController`` with states for every candidate step count, and
    lift SGLang's speculative cap on running requests (:func:`running_cap_args`)."""
    out = [] if "--speculative-adaptive" in args else ["--speculative-adaptive"]
    out += running_cap_args(cfg, args)
    if flag_value(args, "--speculative-adaptive-config") is not None:
        return out
    server_steps = int(flag_value(args, "--speculative-num-steps") or 3)
    lanes = load_lanes(cfg, flag_value(args, "--model-path") or "").values()  # greedy and sampled batches' plans
    steps = candidate_steps(
        {k for profile, plan in lanes for k in switchable_configs(cfg, plan, profile)}, server_steps
    )
    body = json.dumps({"1": {"candidate_steps": steps}}, sort_keys=True)
    path = PROFILE_DIR / f"adaptive-{hashlib.sha1(body.encode()).hexdigest()[:12]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return out + ["--speculative-adaptive-config", str(path)]


class RespecStepPolicy:
    """``AdaptiveSpecPolicy`` (SGLang's protocol) driven by the ReSpec runtime instead of an acceptance EMA."""

    def __init__(self, rt: Runtime, server_steps: int, sglang_policy: Any):
        self.rt = rt
        self.server_steps = server_steps
        self._sglang = sglang_policy  # keeps SGLang's graph-batch bookkeeping (cuda_graph_bs_for_step)
        self._steps = candidate_steps(rt.configs, server_steps)
        self.state: State = None  # decided by R4 for the decode batch about to run
        self._cuda_graph_bs: Optional[List[int]] = None
        self.ledger = DraftLedger()

    @property
    def candidate_steps(self) -> List[int]:
        return list(self._steps)

    def set_cuda_graph_bs(self, cuda_graph_bs: Optional[List[int]]) -> None:
        self._cuda_graph_bs = cuda_graph_bs
        self._sglang.set_cuda_graph_bs(cuda_graph_bs)

    def cuda_graph_bs_for_step(self, step: int) -> Optional[List[int]]:
        return self._cuda_graph_bs

    def decide(self, batch_size: int, opted_out: bool = False, sampled: bool = False) -> State:
        """R4, once per decode batch: the runtime's state for it (read back by :meth:`get_steps_for_batch`)."""
        self.state = self.rt.decide(batch_size, opted_out, sampled)
        return self.state

    def get_steps_for_batch(self, batch_size: int) -> int:
        """SGLang asks in ``activate_step_by_batch``: the decided state as a step count."""
        steps = self.rt.steps_of(self.state, default=self.server_steps)
        if steps not in self._steps:  # a re-plan may name a config without a built state: nearest built one
            steps = min(self._steps, key=lambda s: (abs(s - steps), s))
        return steps

    def on_verify_complete(self, num_correct_drafts_per_req: List[int], batch_size: int) -> Optional[int]:
        return None  # the runtime decides per batch; acceptance reaches it through R4's step record


def h_controller_init(result, controller, *args, **kwargs):
    """AFTER AdaptiveController.__init__ (R3): our policy replaces SGLang's acceptance-EMA policy.

    The policy (and its drafter ledger) lives on SGLang's controller, the runtime on the worker (:func:`runtime_of`).
    """
    worker = sw.controller_worker(controller)
    rt = runtime_of(worker)
    policy = RespecStepPolicy(rt, sw.server_steps(worker), sw.controller_policy(controller))
    rt.ledger = policy.ledger
    sw.set_step_policy(controller, policy)
    logger.info("respec: EAGLE adaptive policy, candidate steps %s", policy.candidate_steps)
    return result


def h_eagle_forward(original, worker, batch, *args, **kwargs):
    """AROUND EAGLEWorkerV2.forward_batch_generation (R4): state, catch-up, the plain step, step clock.

    "No speculation" runs :func:`~.eagle_catchup.plain_decode_step` (a DECODE forward of the target) in
    ``--respec-eagle-off plain`` mode; a batch that keeps SGLang's spec path, or a target that replays graphs,
    runs SGLang's steps = 0 step with the ledger handed to R5 on the draft worker for the duration of the forward.
    Under overlap scheduling nothing here waits for the device: the ledger keeps device tensors, and the step's
    accept length is read later from SGLang's own host copy (:class:`Runtime`).
    """
    policy = sw.step_policy(worker)
    if not isinstance(policy, RespecStepPolicy):
        return original(worker, batch, *args, **kwargs)
    decode = sw.is_decode(batch)
    ledger, bs = policy.ledger, len(batch.reqs)
    off, own_step = False, False
    if decode:
        try:
            policy.rt.begin_step(True)
            state = policy.decide(bs, opted_out(batch), sw.samples(batch))
            ledger.keep_only(sw.rids(batch))
            if state is not None and ledger.pending:
                sw.activate_state(worker, bs)  # the window of the state about to run
                catch_up(worker, batch, ledger)
            off = state is None and policy.rt.cfg.eagle_off == "plain"
            own_step = off and not sw.keeps_spec_path(batch) and not sw.target_uses_graphs(worker)
        except Exception:
            logger.exception("respec: step bookkeeping failed")
    else:
        policy.rt.begin_step(False)
    if own_step:
        on_publish = sw.hook_arg(original, "on_publish", worker, batch, *args, **kwargs)
        result = plain_decode_step(worker, batch, ledger, on_publish)
    else:
        draft_worker = sw.eagle_draft_worker(worker)
        sw.attach(draft_worker, sw.LEDGER_ATTR, ledger if off else None)
        try:
            result = original(worker, batch, *args, **kwargs)
        finally:
            sw.attach(draft_worker, sw.LEDGER_ATTR, None)
    if decode:
        policy.rt.end_step(policy.state, bs, result, sw.DECODE_MODE if own_step else sw.VERIFY_MODE)
    return result


def h_draft_extend(original, draft_worker, batch, batch_result, *args, **kwargs):
    """AROUND EagleDraftWorker._draft_extend_for_decode (R5): skipped in a plain step, its inputs kept for later."""
    ledger = sw.attached(draft_worker, sw.LEDGER_ATTR)
    if ledger is None:
        return original(draft_worker, batch, batch_result, *args, **kwargs)
    ledger.record(batch, batch_result)
    sw.stub_draft_state(draft_worker, batch_result, len(batch.reqs))
    return None
