"""Every ``HookRegistry`` registration sglang-spex makes, each with its one-line reason.

The list is mirrored in ``docs/upstream.md``; a hook must never raise into SGLang (that kills the
scheduler), so each one guards its own body.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Dict

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_spex import __version__
from sglang_spex.config import SpexConfig

logger = logging.getLogger(__name__)

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
SAMPLING_INFO = "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
PREFILL_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
RADIX = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
NGRAM_WORKER = "sglang.srt.speculative.ngram_worker.NGRAMWorker"
EAGLE_WORKER = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2"
EAGLE_DRAFT_WORKER = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
ADAPTIVE_CONTROLLER = "sglang.srt.speculative.adaptive_runtime_state.AdaptiveController"
_registered = False
_config = SpexConfig()


def scheduler_report() -> Dict[str, Any]:
    """What the scheduler process says about the plugin (pid and module prove where it ran)."""
    import sglang

    return {
        "plugin_loaded": True,
        "process": "scheduler",
        "pid": os.getpid(),
        "hooks_module": __name__,
        "hooked_in": sorted(m for m in ("sglang.srt.managers.scheduler",) if m in sys.modules),
        "sglang_version": sglang.__version__,
        "spex_version": __version__,
        "config": json.loads(_config.to_json()),
    }


def _h1_report_state(result, scheduler, *args, **kwargs):
    """H1 (AFTER Scheduler.get_internal_state): add the plugin's scheduler-side report."""
    try:
        report = scheduler_report()
        if _config.enabled:
            from sglang_spex.srt.control import sched_report

            report["sched"] = sched_report(scheduler)
        result.internal_state["spex"] = report
    except Exception:  # never break the scheduler for a report
        logger.exception("spex: H1 report failed")
    return result


def _random_seeds(n: int, device):
    import torch

    return torch.randint(0, 2**62, (n,), dtype=torch.int64, device=device)


def _h2_seeded_sampling(result, cls, batch, *args, **kwargs):
    """H2 (AFTER SamplingBatchInfo.from_schedule_batch): honour ``sampling_seed`` per request.

    SGLang 0.5.23 reads seeds only under ``--enable-deterministic-inference`` (which the CPU
    torch_native path refuses). ToT trees need (seed, position)-determined samples so a speculative
    node equals the one the search would generate later; rows without a seed get a fresh random one.
    """
    try:
        if result.sampling_seed is not None:
            return result
        seeds = [r.sampling_params.sampling_seed for r in batch.reqs]
        if all(s is None for s in seeds):
            return result
        import torch

        fill = _random_seeds(len(seeds), "cpu").tolist()
        values = [s if s is not None else f for s, f in zip(seeds, fill)]
        result.sampling_seed = torch.tensor(values, dtype=torch.int64).to(batch.device)
    except Exception:
        logger.exception("spex: H2 seeded sampling failed; falling back to unseeded sampling")
    return result


def _h2_merge_seeds(self, other, *args, **kwargs):
    """H2b (BEFORE SamplingBatchInfo.merge_batch): give the unseeded side random seeds so lengths match."""
    try:
        a, b = self.sampling_seed, other.sampling_seed
        if (a is None) != (b is None):
            side = self if a is None else other
            side.sampling_seed = _random_seeds(len(side), side.temperatures.device)
    except Exception:
        logger.exception("spex: H2b seed merge failed")
    return None


def _register_cpu_attention() -> None:
    """The ``spex_cpu`` attention backend (sgl-kernel-ext) in SGLang's registry, if that package is installed."""
    try:
        from sgl_kernel_ext.attention import register
    except ImportError:
        return
    try:
        register()
    except Exception:
        logger.exception("spex: registering the spex_cpu attention backend failed")


def _register_respec() -> None:
    """ReSpec adaptive server hooks, only under ``--respec-adaptive`` (logic in :mod:`sglang_spex.respec.adaptive`)."""
    from sglang_spex.config import RespecConfig

    if not RespecConfig.from_env().enabled:
        return
    from sglang_spex.respec.adaptive import h_report_state
    from sglang_spex.respec.eagle_policy import h_controller_init, h_draft_extend, h_eagle_forward
    from sglang_spex.respec.ngram_plain import h_ngram_forward

    # R1: a decode batch runs a true plain decode step (no draft, no verify) when the ReSpec FSM says "no spec".
    HookRegistry.register(f"{NGRAM_WORKER}.forward_batch_generation", h_ngram_forward, HookType.AROUND)
    # R2: FSM state, switch/step counts and KV pool figures in /get_server_info (internal_states[0]["respec"]).
    HookRegistry.register(f"{SCHEDULER}.get_internal_state", h_report_state, HookType.AFTER)
    # R3: EAGLE/EAGLE3 -- the ReSpec runtime becomes SGLang's AdaptiveSpecPolicy (steps per batch, 0 = no drafting).
    HookRegistry.register(f"{ADAPTIVE_CONTROLLER}.__init__", h_controller_init, HookType.AFTER)
    # R4: EAGLE/EAGLE3 -- per decode batch: request opt-out in, step wall time and acceptance out.
    HookRegistry.register(f"{EAGLE_WORKER}.forward_batch_generation", h_eagle_forward, HookType.AROUND)
    # R5: EAGLE/EAGLE3 -- a plain step skips the draft extend; R4 replays it in one catch-up when speculation resumes.
    HookRegistry.register(f"{EAGLE_DRAFT_WORKER}._draft_extend_for_decode", h_draft_extend, HookType.AROUND)


def register_all(cfg: SpexConfig) -> None:
    """Register the hooks ``cfg`` needs (idempotent per process)."""
    global _registered, _config
    _config = cfg
    if _registered:
        return
    _registered = True
    HookRegistry.register(f"{SCHEDULER}.get_internal_state", _h1_report_state, HookType.AFTER)
    _register_cpu_attention()  # selectable with or without --tot-speculation
    _register_respec()  # --respec-adaptive, independent of --tot-speculation
    if not cfg.enabled:
        return  # without --tot-speculation the plugin only reports; SGLang runs unchanged
    HookRegistry.register(f"{SAMPLING_INFO}.from_schedule_batch", _h2_seeded_sampling, HookType.AFTER)
    HookRegistry.register(f"{SAMPLING_INFO}.merge_batch", _h2_merge_seeds, HookType.BEFORE)
    # H3-H13 (issue 6): ranking, admission cap, immediate cancel, prefix protection, batch stats.
    from sglang_spex.srt import batch_stats, control, prefix_protection, scheduling

    control.register_types()  # IPC decoder learns SpexControlReq (not a HookRegistry hook; see docs/upstream.md)
    batch_stats.prepare_channel()  # stats file path, fixed before SGLang forks its subprocesses
    scheduling.configure(cfg.k_total, cfg.spec_priority)
    reg, B, A, R = HookRegistry.register, HookType.BEFORE, HookType.AFTER, HookType.AROUND
    # H3: our control messages (budget, cancel, protect, release) reach the scheduler in order with requests.
    reg(f"{SCHEDULER}.init_request_dispatcher", control.h_add_dispatch, A)
    # H4: speculative requests get the lowest priority, unlabelled/primary ones a neutral one (not SGLang's lowest).
    reg(f"{SCHEDULER}._add_request_to_queue", scheduling.h_assign_priority, B)
    # H5: under KV pressure in decode, speculative requests are retracted before any primary one.
    reg(f"{SCHEDULE_BATCH}._get_decode_retraction_order", scheduling.h_retraction_order, A)
    # H6: a primary short of KV preempts running speculative work instead of waiting for it to finish.
    reg(f"{PREFILL_ADDER}.add_one_req", scheduling.h_preempt_on_kv_short, R)
    # H7: speculative admission never takes the running batch above the budget; a lowered budget retracts.
    reg(f"{SCHEDULER}._get_new_batch_prefill_raw", scheduling.h_cap_prefill, R)
    # H8: the same budget trim on the decode-only path.
    reg(f"{SCHEDULER}.update_running_batch", scheduling.h_cap_decode, B)
    # H9: remember cancelled running requests (for immediate finish and its measurement); end their searches.
    reg(f"{SCHEDULER}.abort_request", scheduling.h_abort, R)
    # H10: at the next scheduling point, finish cancelled running requests without another decode step.
    reg(f"{SCHEDULER}.get_next_batch_to_run", scheduling.h_pre_step, B)
    # H11: lock the cached prefixes of finished nodes of live searches before any allocation; expire leases.
    reg(f"{SCHEDULER}.get_next_batch_to_run", prefix_protection.h_pre_step, B)
    # H12: a node of a live search that finished normally is queued for protection once it is in the tree.
    reg(f"{RADIX}.on_release", prefix_protection.h_on_release, A)
    # H13: publish each step's batch size, role split, KV use and step time to shared memory.
    reg(f"{SCHEDULER}.get_next_batch_to_run", batch_stats.h_publish, A)
