"""Every SGLang touch point of sglang-spex: one record each, and the code that registers them.

``TOUCH_POINTS`` is the table (``docs/upstream.md`` lists the same ids; ``test/srt/test_hook_contracts.py`` checks
that, and that every target resolves with the signature recorded for SGLang 0.5.23 in ``hook_signatures.json``).
``register_all`` walks it feature by feature (``FEATURES``): a feature whose condition holds is registered only if
every SGLang target it touches resolves in the installed SGLang; otherwise none of its hooks is registered, an
ERROR names the feature and the target, and ``scheduler_report()["hooks"]`` (``/spex/info``) lists it as disabled.

Our code is named by ``"module:qualname"`` strings and imported only when its feature is on (the ReSpec and
scheduler modules never load in a process that does not need them). ``"sglang_spex.srt.hooks:HookPlan.x"`` names a
method of the process's :class:`HookPlan`, bound at registration. A hook must never raise into SGLang (that kills
the scheduler), so each hook body guards itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import sglang
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_spex import __version__
from sglang_spex.config import SpexConfig, load

logger = logging.getLogger(__name__)

SIGNATURES_FILE = Path(__file__).with_name("hook_signatures.json")
HTTP_SERVER_MODULE = "sglang.srt.entrypoints.http_server"
HOOK_KINDS = tuple(t.name for t in HookType)  # BEFORE AFTER AROUND REPLACE: a HookRegistry hook
OTHER_KINDS = ("registry", "types", "routes", "call", "patch")  # made without HookRegistry (patch: by our launcher)

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
SAMPLING_INFO = "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
PREFILL_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
RADIX = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
NGRAM_WORKER = "sglang.srt.speculative.ngram_worker.NGRAMWorker"
EAGLE_WORKER = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2"
EAGLE_DRAFT_WORKER = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
ADAPTIVE_CONTROLLER = "sglang.srt.speculative.adaptive_runtime_state.AdaptiveController"
DRAFT_FACTORY = "sglang.srt.speculative.draft_utils.DraftBackendFactory"
SELF = "sglang_spex.srt.hooks"
SCHED = "sglang_spex.srt.scheduling"
PROTECT = "sglang_spex.srt.prefix_protection"
SEEDS = "sglang_spex.srt.seeded_sampling"
SCHED_ADAPTER = "sglang_spex.adapters.scheduler"
SPEC_ADAPTER = "sglang_spex.adapters.spec_workers"
KERNEL_EXT = "sgl_kernel_ext.attention"


@dataclass(frozen=True)
class TouchPoint:
    """One place where sglang-spex touches SGLang."""

    id: str
    target: str  # dotted path of the SGLang object
    kind: str  # a HookType name (HookRegistry hook) or one of OTHER_KINDS
    feature: str
    why: str
    fn: str = ""  # "module:qualname" of our hook body ('' for touch points that are calls into SGLang)
    by: str = ""  # who makes or calls it, when not register_all: "module:qualname" or the using "module"

    @property
    def is_hook(self) -> bool:
        return self.kind in HOOK_KINDS

    @property
    def registered_here(self) -> bool:
        """A hook ``register_all`` registers itself (the others are made by ``by`` or are plain calls)."""
        return self.is_hook and not self.by


@dataclass(frozen=True)
class Feature:
    """A group of touch points that is registered whole or not at all."""

    name: str
    condition: str  # a key of CONDITIONS
    setup: str = ""  # "module:qualname" called (no arguments) before the feature's own hooks are registered


def _respec_on(cfg: SpexConfig) -> bool:
    return load().respec.enabled


CONDITIONS: Mapping[str, Callable[[SpexConfig], bool]] = MappingProxyType(
    {
        "always": lambda cfg: True,
        "HTTP process": lambda cfg: HTTP_SERVER_MODULE in sys.modules,
        "launcher only": lambda cfg: False,  # made by launch_server before SGLang starts, never by register_all
        "sgl-kernel-ext installed": lambda cfg: importlib.util.find_spec("sgl_kernel_ext") is not None,
        "--tot-speculation": lambda cfg: cfg.enabled,
        "--respec-adaptive": _respec_on,
    }
)

FEATURES: Tuple[Feature, ...] = (
    Feature("report", "always"),
    Feature("launcher", "launcher only"),
    Feature("cpu_attention", "sgl-kernel-ext installed", f"{KERNEL_EXT}:register"),
    Feature("lossless_verify", "always"),
    Feature("cpu_spec_overlap", "always"),
    Feature("weight_update_guard", "always"),
    Feature("input_guard", "always"),
    Feature("respec_ngram", "--respec-adaptive"),
    Feature("respec_report", "--respec-adaptive"),
    Feature("respec_eagle", "--respec-adaptive"),
    Feature("seeded_sampling", "--tot-speculation"),
    Feature("scheduler", "--tot-speculation", f"{SELF}:HookPlan.setup_scheduler"),
    Feature("routes", "HTTP process", f"{SELF}:HookPlan.install_routes"),
)

# fmt: off
_T = TouchPoint
TOUCH_POINTS: Tuple[TouchPoint, ...] = (
    # ---- report (always): /spex/info proves the plugin runs in the scheduler
    _T("H1", f"{SCHEDULER}.get_internal_state", "AFTER", "report",
       "the plugin's scheduler-side report (pid, config, hooks applied) for /spex/info",
       f"{SELF}:HookPlan.report_state"),
    # ---- launcher (before SGLang resolves its arguments)
    _T("L1", "sglang.srt.arg_groups.speculative_hook._disable_overlap_schedule_for_cpu", "patch", "launcher",
       "(private) on CPU, speculative decoding keeps the overlap scheduler unless disabled (needs V2)",
       "sglang_spex.launch_server:keep_overlap", by="sglang_spex.launch_server:allow_spec_overlap_on_cpu"),
    # ---- routes (HTTP process)
    _T("W1", f"{HTTP_SERVER_MODULE}.app", "routes", "routes",
       "/spex/*, /tot/*, /respec/* routes added to SGLang's FastAPI app (a module global)",
       by="sglang_spex.srt.routes:install"),
    _T("W2", f"{HTTP_SERVER_MODULE}.get_global_state", "call", "routes",
       "the tokenizer manager the routes send requests through", by="sglang_spex.srt.routes"),
    _T("W3", f"{TOKENIZER_MANAGER}.get_internal_state", "call", "routes",
       "one round trip to the scheduler: /spex/info's scheduler part, the control channel's acknowledgement, "
       "the engine's capacity for the search limits",
       by="sglang_spex.srt.routes"),
    _T("W4", f"{TOKENIZER_MANAGER}._dispatch_to_scheduler", "call", "routes",
       "(private) sends SpexControlReq on the tokenizer manager's socket, in order with generate requests",
       by="sglang_spex.srt.control"),
    _T("W5", "sglang.srt.utils.auth.auth_level", "call", "routes",
       "marks the routes that change server-wide state ADMIN_OPTIONAL, read by SGLang's API-key middleware",
       by="sglang_spex.srt.admin_scope"),
    _T("W6", "sglang.srt.managers.tokenizer_control_mixin._COMMUNICATOR_SPECS", "call", "routes",
       "(private) a drafter push to every --dp-size rank through the tokenizer manager's update_weights_from_tensor "
       "communicator (SGLang's method asserts dp_size == 1)", by="sglang_spex.srt.dp_drafter_update"),
    # ---- cpu_attention (sgl-kernel-ext installed): the spex_cpu attention backend, selectable with any flags
    _T("A1", "sglang.srt.layers.attention.attention_registry.register_attention_backend", "registry",
       "cpu_attention", "the spex_cpu batched CPU attention backend in SGLang's backend registry",
       by=f"{KERNEL_EXT}:register"),
    _T("A2", "sglang.srt.arg_groups.choices.add_attention_backend_choices", "registry", "cpu_attention",
       "--attention-backend spex_cpu passes argparse (also run by the sgl-kernel-ext .pth import hook)",
       by=f"{KERNEL_EXT}:register"),
    _T("A3", f"{DRAFT_FACTORY}.create_decode_backend", "AROUND", "cpu_attention",
       "EAGLE/EAGLE3/STANDALONE multi-step draft decode on spex_cpu (the factory's backend map is a local dict)",
       f"{KERNEL_EXT}.draft:h_create_decode_backend", by=f"{KERNEL_EXT}.draft:register_draft_hooks"),
    _T("A4", f"{DRAFT_FACTORY}.create_draft_extend_backend", "AROUND", "cpu_attention",
       "draft extend with a plain spex_cpu backend",
       f"{KERNEL_EXT}.draft:h_create_draft_extend_backend", by=f"{KERNEL_EXT}.draft:register_draft_hooks"),
    # ---- lossless_verify (always: a correctness fix; the hook acts only on CPU batches that are not all greedy)
    _T("V1", "sglang.srt.speculative.eagle_utils._verify_uses_greedy", "AROUND", "lossless_verify",
       "CPU speculative verify at temperature > 0 samples (rejection sampling) instead of committing the argmax",
       "sglang_spex.srt.lossless_verify:v1_verify_uses_greedy"),
    _T("V3", "sglang.srt.speculative.eagle_utils.eagle_sample", "AROUND", "lossless_verify",
       "a verify batch with a min-p request applies min-p (SGLang's sampling branch leaves it out on every device): "
       "the tree sampling op is rebound on eagle_utils for that call", "sglang_spex.srt.lossless_verify:v3_eagle_sample"),
    # ---- cpu_spec_overlap (always: acts only on CPU tensors)
    _T("V2", "sglang.srt.managers.overlap_utils.gather_spec_extras", "AROUND", "cpu_spec_overlap",
       "the overlap scheduler's EAGLE draft-state relay gathers rows on CPU without SGLang's Triton kernel",
       "sglang_spex.srt.cpu_overlap:v2_gather_spec_extras"),
    # ---- weight_update_guard (always: a crash fix; it changes nothing while loading succeeds)
    _T("U1", "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
       ".update_weights_from_tensor", "AROUND", "weight_update_guard",
       "a tensor update the model cannot load (shape, name) answers success false instead of killing the scheduler",
       "sglang_spex.srt.weight_update_guard:u1_update_weights_from_tensor"),
    # ---- input_guard (always: a crash fix; it changes nothing for prompts of valid token ids)
    _T("U2", f"{TOKENIZER_MANAGER}._validate_one_request", "AROUND", "input_guard",
       "(private) prompt token ids outside the vocabulary, or top_logprobs_num above it, answer 400 instead of "
       "killing the scheduler",
       "sglang_spex.srt.input_guard:u2_validate_one_request"),
    _T("U3", f"{TOKENIZER_MANAGER}._tokenize_texts", "AROUND", "input_guard",
       "(private) a prompt text far past the context length is a 400 after tokenizing a bounded prefix, instead of "
       "holding the event loop (every client) while SGLang tokenizes all of it",
       "sglang_spex.srt.input_guard:u3_tokenize_texts"),
    _T("U4", "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._validate_request", "AFTER", "input_guard",
       "(private) U3's check on a chat's message text, before SGLang renders and tokenizes all of it",
       "sglang_spex.srt.input_guard:u4_validate_chat"),
    # ---- respec_* (--respec-adaptive), independent of --tot-speculation
    _T("R1", f"{NGRAM_WORKER}.forward_batch_generation", "AROUND", "respec_ngram",
       "a decode batch runs a true plain decode step (no draft, no verify) when the ReSpec FSM says no spec",
       "sglang_spex.respec.ngram_plain:h_ngram_forward"),
    _T("R2", f"{SCHEDULER}.get_internal_state", "AFTER", "respec_report",
       "FSM state, switch/step counts and KV pool figures in /get_server_info (internal_states[0]['respec'])",
       "sglang_spex.respec.adaptive:h_report_state"),
    _T("R3", f"{ADAPTIVE_CONTROLLER}.__init__", "AFTER", "respec_eagle",
       "the ReSpec runtime becomes SGLang's AdaptiveSpecPolicy (steps per batch, 0 = no drafting)",
       "sglang_spex.respec.eagle_policy:h_controller_init"),
    _T("R4", f"{EAGLE_WORKER}.forward_batch_generation", "AROUND", "respec_eagle",
       "per decode batch: request opt-out in, step wall time and acceptance out; drafter catch-up on resume",
       "sglang_spex.respec.eagle_policy:h_eagle_forward"),
    _T("R5", f"{EAGLE_DRAFT_WORKER}._draft_extend_for_decode", "AROUND", "respec_eagle",
       "a plain step skips the draft extend; R4 replays it in one catch-up when speculation resumes",
       "sglang_spex.respec.eagle_policy:h_draft_extend"),
    _T("P1", "sglang.srt.speculative.eagle_utils.get_draft_recurrent_hidden_state_spec", "call", "respec_eagle",
       "shape of the drafter's recurrent state rows the catch-up restores", by=SPEC_ADAPTER),
    _T("P2", "sglang.srt.managers.utils.GenerationBatchResult", "call", "respec_ngram",
       "the plain step's (and the catch-up's) result in the form SGLang's spec bookkeeping expects", by=SPEC_ADAPTER),
    _T("P3", "sglang.srt.speculative.ngram_info.NgramVerifyInput", "call", "respec_ngram",
       "a verify that accepted only the bonus token, for the plain step", by=SPEC_ADAPTER),
    _T("P7", "sglang.srt.speculative.eagle_info.EagleDraftInput", "call", "respec_eagle",
       "the draft input the catch-up builds for SGLang's batched draft extend", by=SPEC_ADAPTER),
    _T("P8", "sglang.srt.layers.logits_processor.LogitsProcessorOutput", "call", "respec_eagle",
       "carries the captured target hidden states into the catch-up's draft extend", by=SPEC_ADAPTER),
    _T("P17", f"{NGRAM_WORKER}._update_ngram_corpus", "call", "respec_ngram",
       "(private) a plain step feeds the n-gram corpus as SGLang's verify does (overlap staging included)",
       by=SPEC_ADAPTER),
    _T("P18", f"{EAGLE_WORKER}.activate_step_by_batch", "call", "respec_eagle",
       "switches SGLang's pre-built runtime state to the plan's step count for the batch", by=SPEC_ADAPTER),
    _T("P19", f"{EAGLE_DRAFT_WORKER}._draft_extend_for_decode", "call", "respec_eagle",
       "(private) the catch-up replays skipped positions through SGLang's own batched draft extend",
       by=SPEC_ADAPTER),
    # ---- seeded_sampling (--tot-speculation)
    _T("H2", f"{SAMPLING_INFO}.from_schedule_batch", "AFTER", "seeded_sampling",
       "honour per-request sampling_seed: a node's sample depends on (seed, position), not on its batch",
       f"{SEEDS}:h2_seeded_sampling"),
    _T("H2b", f"{SAMPLING_INFO}.merge_batch", "BEFORE", "seeded_sampling",
       "give the unseeded side random seeds so seeded and unseeded batches merge with matching lengths",
       f"{SEEDS}:h2_merge_seeds"),
    _T("H2c", "sglang.srt.layers.sampler.Sampler.forward", "AROUND", "seeded_sampling",
       "a step whose seeded batch SGLang's sampler refuses (min-p; top-k/top-p under flashinfer or intel_xpu) "
       "samples unseeded instead of asserting; its seeds are put back after the step",
       f"{SEEDS}:h2c_sample"),
    _T("P21", "sglang.srt.runtime_context.get_exec", "call", "seeded_sampling",
       "the process's sampling backend, as SGLang's sampler reads it, for H2c", by=SEEDS),
    _T("P23", "sglang.srt.managers.tp_worker.TpModelWorker.model_runner", "call", "scheduler",
       "the model runner whose Sampler (ModelRunner.sampler) carries H2c's count of steps sampled unseeded, "
       "read for the scheduler's report", by=SCHED_ADAPTER),
    # ---- scheduler (--tot-speculation): ranking, admission cap, immediate cancel, prefix protection, stats
    _T("C1", "sglang.srt.managers.io_struct.hook_custom_types", "types", "scheduler",
       "the IPC decoder of every process learns SpexControlReq", "sglang_spex.srt.control:SpexControlReq",
       by="sglang_spex.srt.control:register_types"),
    _T("H3", f"{SCHEDULER}.init_request_dispatcher", "AFTER", "scheduler",
       "our control messages (budget, cancel, protect, release, knobs, promote) stay in order with requests",
       "sglang_spex.srt.control:h_add_dispatch"),
    _T("H4", f"{SCHEDULER}._add_request_to_queue", "BEFORE", "scheduler",
       "speculative requests get the lowest priority, unlabelled/primary ones a neutral one",
       f"{SCHED}:h_assign_priority"),
    _T("H5", f"{SCHEDULE_BATCH}._get_decode_retraction_order", "AFTER", "scheduler",
       "under KV pressure in decode, speculative requests are retracted before any primary one",
       f"{SCHED}:h_retraction_order"),
    _T("H6", f"{PREFILL_ADDER}.add_one_req", "AROUND", "scheduler",
       "speculative prompt tokens beside primary work only within the step's measured prefill allowance; "
       "a primary short of KV preempts running speculative work instead of waiting for it to finish",
       f"{SCHED}:h_add_one_req"),
    _T("H7", f"{SCHEDULER}._get_new_batch_prefill_raw", "AROUND", "scheduler",
       "the speculative gate: room = min(budget, knee - primary work), no speculative-only prefill while primaries "
       "decode unless SGLang mixes it into their decode step, primaries first; a lowered room retracts",
       f"{SCHED}:h_cap_prefill"),
    _T("H8", f"{SCHEDULER}.update_running_batch", "BEFORE", "scheduler",
       "the same budget trim on the decode-only path", f"{SCHED}:h_cap_decode"),
    _T("H9", f"{SCHEDULER}.abort_request", "AROUND", "scheduler",
       "remember cancelled running requests (immediate finish, its measurement); end their searches",
       f"{SCHED}:h_abort"),
    _T("H10", f"{SCHEDULER}.get_next_batch_to_run", "BEFORE", "scheduler",
       "at the next scheduling point, finish cancelled running requests without another decode step",
       f"{SCHED}:h_pre_step"),
    _T("H11", f"{SCHEDULER}.get_next_batch_to_run", "BEFORE", "scheduler",
       "lock the cached prefixes of finished nodes of live searches before any allocation; expire leases",
       f"{PROTECT}:h_pre_step"),
    _T("H12", f"{RADIX}.on_release", "AFTER", "scheduler",
       "a node of a live search that finished normally is queued for protection once it is in the tree",
       f"{PROTECT}:h_on_release"),
    _T("H13", f"{SCHEDULER}.get_next_batch_to_run", "AFTER", "scheduler",
       "publish each step's batch size, role split, KV use, step time, gate fields and hook time to shared memory",
       "sglang_spex.srt.batch_stats:h_publish"),
    _T("P4", f"{PREFILL_ADDER}.preempt_to_schedule", "call", "scheduler",
       "H6 preempts lower-priority running requests with SGLang's own preemption", by=SCHED_ADAPTER),
    _T("P5", "sglang.srt.mem_cache.common.release_kv_cache", "call", "scheduler",
       "H10 frees a cancelled request's KV (with checkpoint) as SGLang's finish path does", by=SCHED_ADAPTER),
    _T("P6", "sglang.srt.mem_cache.common._req_radix_key", "call", "scheduler",
       "(private) the radix key of a finished node's tokens, for H11's lock", by="sglang_spex.adapters.radix_cache"),
    _T("P9", f"{SCHEDULER}._reqs_finishing_inflight", "call", "scheduler",
       "(private) under overlap, requests whose finish is in the in-flight batch (H10 leaves them to SGLang)",
       by=SCHED_ADAPTER),
    _T("P10", f"{SCHEDULER}.collect_inflight_reqs", "call", "scheduler",
       "requests of the batch in flight under overlap, so a cancel or trim never frees KV a running forward uses",
       by=SCHED_ADAPTER),
    _T("P11", f"{SCHEDULER}._add_request_to_queue", "call", "scheduler",
       "(private) retracted speculative requests go back to the waiting queue after admission, as preemption does",
       by=SCHED_ADAPTER),
    _T("P12", f"{SCHEDULE_BATCH}.release_req", "call", "scheduler",
       "H7/H8 budget trim retracts a running speculative request with SGLang's own release", by=SCHED_ADAPTER),
    _T("P13", f"{SCHEDULE_BATCH}.filter_batch", "call", "scheduler",
       "H7/H8/H10 drop retracted or finished requests from the running batch", by=SCHED_ADAPTER),
    _T("P14", "sglang.srt.managers.schedule_batch.Req.update_finish_state", "call", "scheduler",
       "H10 applies a cancelled request's pending finish (to_finish) now", by=SCHED_ADAPTER),
    _T("P15", "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.stream_output",
       "call", "scheduler", "H10 streams the abort of an immediately finished request", by=SCHED_ADAPTER),
    _T("P16", f"{RADIX}.supports_mamba", "call", "scheduler",
       "immediate cancel falls back to SGLang's abort path for mamba state", by=SCHED_ADAPTER),
    _T("P22", "sglang.srt.managers.schedule_batch.Req.init_next_round_input", "call", "scheduler",
       "after P4 preempts, H6 matches the primary's prefix again before retrying (the release changed the tree)",
       by=SCHED_ADAPTER),
    _T("P24", "sglang.srt.managers.schedule_policy.CLIP_MAX_NEW_TOKENS", "call", "scheduler",
       "the output a waiting request reserves at admission, for prefix protection's yield to a held-out request",
       by=SCHED_ADAPTER),
    _T("P20", "sglang.srt.runtime_context.get_parallel", "call", "scheduler",
       "the DP rank of a scheduler process: names its stats ring, labels its report and gauges",
       by="sglang_spex.srt.dp_ranks"),
)
# fmt: on


def load_ref(spec: str) -> Any:
    """The object a ``"module:qualname"`` string names (imports the module)."""
    module, _, qualname = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def resolve_target(target: str) -> Any:
    """The SGLang object at a dotted ``target``: import the leading modules, then follow attributes.

    Raises ``ImportError`` or ``AttributeError`` naming the first part that is missing.
    """
    parts = target.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if inspect.ismodule(obj):
            name = ".".join(parts[: i + 1])
            try:
                obj = importlib.import_module(name)
                continue
            except ModuleNotFoundError as e:
                if e.name != name:
                    raise  # the module exists but one of its own imports is missing
        raise AttributeError(f"{'.'.join(parts[:i])} has no attribute {part!r}")
    return obj


def describe(obj: Any) -> str:
    """The recorded form of a target: its ``inspect.signature`` for a callable, else its type."""
    if isinstance(obj, type) or inspect.isroutine(obj):
        try:
            return str(inspect.signature(obj))
        except (TypeError, ValueError):
            return f"<{type(obj).__name__}>"
    return f"<{type(obj).__module__}.{type(obj).__qualname__}>"


def recorded_signatures(path: Path = SIGNATURES_FILE) -> Dict[str, Any]:
    """``{"sglang_version": ..., "targets": {target: signature}}`` as recorded by scripts/record_hook_signatures.py."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"sglang_version": None, "targets": {}}


def check_contracts(points: Tuple[TouchPoint, ...] = TOUCH_POINTS, recorded: Optional[Mapping] = None) -> List[str]:
    """Every way the installed SGLang differs from the recorded contract (empty when all targets match)."""
    targets = (recorded if recorded is not None else recorded_signatures())["targets"]
    problems = []
    for tp in points:
        try:
            found = describe(resolve_target(tp.target))
        except Exception as e:
            problems.append(f"{tp.id} {tp.target}: does not resolve ({e})")
            continue
        if tp.target not in targets:
            problems.append(f"{tp.id} {tp.target}: no recorded signature")
        elif found != targets[tp.target]:
            problems.append(f"{tp.id} {tp.target}: signature {found} != recorded {targets[tp.target]}")
    return problems


def points_of(feature: str) -> List[TouchPoint]:
    """The touch points of one feature, in table order."""
    return [tp for tp in TOUCH_POINTS if tp.feature == feature]


class HookPlan:
    """What ``register_all`` did in this process; lives in ``HookRegistry`` as the owner of H1's bound hook."""

    def __init__(self, cfg: SpexConfig):
        self.cfg = cfg
        self.enabled: List[str] = []
        self.off: List[str] = []  # condition not met in this process
        self.disabled: Dict[str, str] = {}  # feature -> reason
        self.drift: List[str] = []  # targets whose signature differs from the recorded one
        self.fns: Dict[str, Callable] = {}  # hook id -> the hook callable handed to HookRegistry
        self._sched_report: Optional[Callable] = None

    # --------------------------------------------------------------- registration
    def bind(self, spec: str) -> Any:
        """``load_ref`` that binds ``HookPlan.*`` methods of this module to this plan."""
        prefix = f"{SELF}:HookPlan."
        return getattr(self, spec[len(prefix) :]) if spec.startswith(prefix) else load_ref(spec)

    def enable(self, feature: Feature, recorded: Mapping) -> None:
        """Register ``feature`` whole if its condition holds and every target resolves, else record why not."""
        if not CONDITIONS[feature.condition](self.cfg):
            self.off.append(feature.name)
            return
        points = points_of(feature.name)
        for tp in points:
            try:
                found = describe(resolve_target(tp.target))
            except Exception as e:  # ImportError/AttributeError, or a module that fails while importing
                self._disable(feature, f"{tp.id} target {tp.target} does not resolve: {type(e).__name__}: {e}")
                return
            expected = recorded["targets"].get(tp.target)
            if expected is not None and found != expected:
                self.drift.append(f"{tp.id} {tp.target}: {found} (recorded {expected})")
                logger.warning("spex: %s %s signature changed: %s (recorded for sglang %s: %s)", tp.id, tp.target,
                               found, recorded.get("sglang_version"), expected)  # fmt: skip
        try:
            fns = {tp.id: self.bind(tp.fn) for tp in points if tp.is_hook}
            if feature.setup:
                self.bind(feature.setup)()
        except Exception as e:  # our own module failed to import or set up: same treatment
            logger.exception("spex: setting up feature %r failed", feature.name)
            self._disable(feature, f"setup failed: {type(e).__name__}: {e}")
            return
        for tp in points:
            if tp.registered_here:
                HookRegistry.register(tp.target, fns[tp.id], HookType[tp.kind])
        self.fns.update(fns)
        self.enabled.append(feature.name)

    def _disable(self, feature: Feature, reason: str) -> None:
        self.disabled[feature.name] = reason
        logger.error("spex: feature %r DISABLED (none of its hooks registered) with sglang %s: %s",
                     feature.name, sglang.__version__, reason)  # fmt: skip

    def setup_scheduler(self) -> None:
        """Scheduler feature: IPC type, stats channel (fixed before SGLang forks), the report's scheduler part."""
        load_ref("sglang_spex.srt.control:register_types")()
        load_ref("sglang_spex.srt.batch_stats:prepare_channel")()
        self._sched_report = load_ref("sglang_spex.srt.control:sched_report")

    def install_routes(self) -> None:
        load_ref("sglang_spex.srt.routes:install")(sys.modules[HTTP_SERVER_MODULE].app, self.cfg)

    # --------------------------------------------------------------- report
    def hooks_report(self) -> Dict[str, Any]:
        """The touch points in effect (hooks: registered *and* applied by SGLang), and the features left out."""
        applied, not_applied = [], []
        for tp in TOUCH_POINTS:
            if tp.feature not in self.enabled:
                continue
            row = {"id": tp.id, "target": tp.target, "kind": tp.kind, "feature": tp.feature}
            if tp.is_hook:
                fn = self.fns.get(tp.id)
                if not any(h == fn for _, h, _ in HookRegistry._hooks.get(tp.target, ())):
                    not_applied.append({**row, "state": "not registered"})
                    continue
                if tp.target not in HookRegistry._patched:
                    not_applied.append({**row, "state": "registered, not applied"})
                    continue
            applied.append(row)
        return {
            "applied": applied,
            "not_applied": not_applied,
            "disabled": [{"feature": f, "reason": r} for f, r in self.disabled.items()],
            "off": list(self.off),
            "signature_drift": list(self.drift),
        }

    def report(self) -> Dict[str, Any]:
        """What the scheduler process says about the plugin (pid and module prove where it ran)."""
        return {
            "plugin_loaded": True,
            "process": "scheduler",
            "pid": os.getpid(),
            "hooks_module": __name__,
            "hooked_in": sorted(m for m in ("sglang.srt.managers.scheduler",) if m in sys.modules),
            "sglang_version": sglang.__version__,
            "spex_version": __version__,
            "config": json.loads(self.cfg.to_json()),
            "hooks": self.hooks_report(),
        }

    def report_state(self, result, scheduler, *args, **kwargs):
        """H1 (AFTER Scheduler.get_internal_state): add the plugin's scheduler-side report."""
        try:
            report = self.report()
            if self._sched_report is not None:
                report["sched"] = self._sched_report(scheduler)
            result.internal_state["spex"] = report
        except Exception:  # never break the scheduler for a report
            logger.exception("spex: H1 report failed")
        return result


def current_plan() -> Optional[HookPlan]:
    """This process's plan: the owner of the H1 hook in ``HookRegistry`` (None before ``register_all``)."""
    for _, hook, _ in HookRegistry._hooks.get(f"{SCHEDULER}.get_internal_state", ()):
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, HookPlan):
            return owner
    return None


def register_all(cfg: SpexConfig) -> HookPlan:
    """Register every feature ``cfg`` and this process need (idempotent per process; see the module docstring)."""
    plan = current_plan()
    if plan is not None:
        plan.cfg = cfg
        return plan
    plan = HookPlan(cfg)
    recorded = recorded_signatures()
    for feature in FEATURES:
        plan.enable(feature, recorded)
    return plan


def scheduler_report() -> Dict[str, Any]:
    """This process's plugin report (``/spex/info``'s scheduler part when run in the scheduler)."""
    return (current_plan() or HookPlan(SpexConfig())).report()
