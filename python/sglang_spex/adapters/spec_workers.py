"""SGLang speculative-worker internals used by ReSpec (SGLang 0.5.23): NGRAM, EAGLE V2, their results and inputs.

Everything ReSpec reads or builds from SGLang's spec workers goes through this module, so a version bump touches
this file: SGLang's own classes (``GenerationBatchResult``, ``NgramVerifyInput``, ``EagleDraftInput``,
``LogitsProcessorOutput``) are built through their constructors here, and worker / batch attributes are read here.

Overlap scheduling (``Scheduler.event_loop_overlap`` with a V2 spec worker): the scheduler launches batch N+1
before it processes batch N's result, so ``req.output_ids`` lacks the tokens of the step in flight. What a spec
worker needs from the previous step reaches it through SGLang's ``FutureMap``: ``resolve_forward_inputs`` fills
``batch.spec_info`` (NGRAM: the accepted tokens and counts, EAGLE: bonus token, top-k, hidden state) and
``resolve_seq_lens_cpu`` sets ``batch.seq_lens`` to the committed lengths before the worker runs. The worker calls
``on_publish(new_seq_lens)`` once its verify is done, and the scheduler reads the result on the host only after
``copy_to_cpu`` (``result.copy_done``). ReSpec follows the same protocol: last tokens come from
``batch.spec_info`` on the device, ``on_publish`` is called by every step ReSpec runs itself, and accept lengths
are read from the result's own host copy once it is done (:func:`host_accept_lens`), never by an extra sync.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.eagle_utils import get_draft_recurrent_hidden_state_spec
from sglang.srt.speculative.ngram_info import NgramVerifyInput

from sglang_spex.adapters.scheduler import hook_args

RUNTIME_ATTR = "respec_runtime"  # the ReSpec runtime, on the spec worker SGLang's scheduler drives
LEDGER_ATTR = "respec_plain_ledger"  # set on the EAGLE draft worker while a plain step runs (R4 -> R5)
EAGER_NOTED_ATTR = "respec_eager_off_noted"  # on the NGRAM worker once R1 has looked at its target's graphs
DRAFT_STATE_FIELDS = ("topk_p", "topk_index", "hidden_states", "draft_probs")  # per-request rows of EagleDraftInput


# ---------------------------------------------------------------- where ReSpec state lives
def spec_worker(scheduler: Any) -> Optional[Any]:
    """The speculative worker a scheduler drives (SGLang sets ``model_worker = draft_worker``), or None."""
    return getattr(scheduler, "draft_worker", None)


def attached(obj: Any, attr: str) -> Optional[Any]:
    return getattr(obj, attr, None) if obj is not None else None


def attach(obj: Any, attr: str, value: Any) -> None:
    setattr(obj, attr, value)


def hook_arg(method: Callable, name: str, *args: Any, **kwargs: Any) -> Any:
    """Argument ``name`` (SGLang's parameter name) of a hooked call, however it was passed; None if absent."""
    return hook_args(method, *args, **kwargs).get(name)


def model_path(worker: Any) -> str:
    return getattr(getattr(worker, "server_args", None), "model_path", "") or ""


def overlap_enabled(worker: Any) -> bool:
    """True when the worker runs under the overlap scheduler (SGLang's own flag on NGRAM/EAGLE V2 workers)."""
    return bool(getattr(worker, "enable_overlap", False))


# ---------------------------------------------------------------- batches
def is_decode(batch: Any) -> bool:
    """A decode batch of a V2 spec worker (not prefill/extend, not an idle DP batch)."""
    return not (batch.forward_mode.is_extend() or batch.is_extend_in_batch) and not batch.forward_mode.is_idle()


def keeps_spec_path(batch: Any) -> bool:
    """Grammar batches: their vocabulary masks and grammar state advance inside SGLang's verify (ReSpec's plain
    step does not rebuild them). Log-prob batches take the plain step (:func:`one_token_verify_logprobs`)."""
    return bool(batch.has_grammar)


def needs_plain_steps(batch: Any) -> bool:
    """True when a request of the batch needs what SGLang's spec path does not apply exactly: frequency / presence /
    repetition penalties or ``min_new_tokens`` (``eagle_prepare_for_decode`` counts one output token per verify
    step: "relaxed") or a custom logit processor (``eagle_sample`` never calls one); a plain decode step applies
    them all. Read from SGLang's own state: the scheduler's ``penalizer_orchestrator.is_required``, or inside a
    forward (``Scheduler._forward_isolation`` swaps in ``copy_for_forward``, which drops the orchestrator) the
    penalty buffers ``update_penalties`` left for it; ``has_custom_logit_processor``."""
    info = getattr(batch, "sampling_info", None)
    if info is None:
        return False
    if getattr(info, "has_custom_logit_processor", False):
        return True
    orchestrator = getattr(info, "penalizer_orchestrator", None)
    if orchestrator is not None:
        return bool(orchestrator.is_required)
    return info.acc_additive_penalties is not None or info.acc_scaling_penalties is not None


def samples(batch: Any) -> bool:
    """True when a request of the batch samples (T > 0), by SGLang's own rule (``SamplingBatchInfo``: greedy is
    top-k <= 1, as temperature 0 sets it) read from the requests: the batch's ``is_all_greedy`` is not recomputed when
    requests leave it, so it stays False after a sampling request finished."""
    return any(req.sampling_params.top_k > 1 for req in batch.reqs)


def rids(batch: Any) -> List[str]:
    return [r.rid for r in batch.reqs]


def custom_params(req: Any) -> Optional[dict]:
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return params if isinstance(params, dict) else None


_BATCH_FIELDS = (
    "seq_lens",
    "seq_lens_cpu",
    "seq_lens_sum",
    "orig_seq_lens",
    "out_cache_loc",
    "input_ids",
    "spec_info",
    "forward_mode",
    "prefix_lens",
    "extend_lens",
    "extend_num_tokens",
)


@contextlib.contextmanager
def batch_restored(batch: Any) -> Iterator[None]:
    """Put back the ``ScheduleBatch`` fields a ReSpec step rewrites (SGLang's forward isolation does too)."""
    saved = {f: getattr(batch, f, None) for f in _BATCH_FIELDS}
    try:
        yield
    finally:
        for f, v in saved.items():
            setattr(batch, f, v)


def set_seq_lens(batch: Any, seq_lens: torch.Tensor, cpu: Optional[torch.Tensor]) -> None:
    """Point a batch at other sequence lengths (device, host mirror, sum, orig), as SGLang's attention reads them;
    ``cpu`` is their host copy (None: the batch keeps no host mirror, as SGLang's GPU-only path)."""
    orig = batch.orig_seq_lens
    batch.seq_lens = seq_lens
    batch.orig_seq_lens = seq_lens.to(orig.dtype) if orig is not None else None
    if cpu is None:
        batch.seq_lens_cpu, batch.seq_lens_sum = None, None
        return
    if batch.seq_lens_cpu is not None:
        batch.seq_lens_cpu = cpu.to(batch.seq_lens_cpu.dtype)
    batch.seq_lens_sum = int(cpu.sum())


def set_decode(batch: Any) -> None:
    batch.forward_mode = ForwardMode.DECODE


def kv_slots(batch: Any, start: torch.Tensor, width: int = 1, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """KV slot of positions ``start .. start+width-1`` of every request (``req_to_token`` rows), flattened;
    with ``valid``, position j of request i only when j < valid[i], else SGLang's padding slot 0."""
    r2t = batch.req_to_token_pool.req_to_token
    offsets = torch.arange(width, device=start.device)
    pos = (start.long().unsqueeze(1) + offsets).clamp(max=r2t.shape[1] - 1)
    slots = r2t[batch.req_pool_indices.long().unsqueeze(1), pos].to(torch.int64)
    if valid is not None:
        slots = torch.where(offsets < valid.long().unsqueeze(1), slots, torch.zeros_like(slots))
    return slots.flatten()


def committed_lens(batch: Any) -> List[int]:
    """Committed sequence lengths on the host: SGLang's host mirror when it keeps one, else one device copy."""
    return (batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens).tolist()


def point_at_window(batch: Any, seq: torch.Tensor, seq_cpu: torch.Tensor, valid: torch.Tensor, width: int) -> None:
    """Make a decode batch describe a draft-extend window of ``width`` positions from ``seq`` (KV slots of the
    first ``valid[i]`` positions of request i, padding slot 0 for the rest)."""
    set_seq_lens(batch, seq, seq_cpu)
    batch.out_cache_loc = kv_slots(batch, seq, width, valid)
    set_decode(batch)


# ---------------------------------------------------------------- results
def host_accept_lens(result: Any) -> Optional[torch.Tensor]:
    """A decode result's accept lengths on the host once SGLang's ``copy_to_cpu`` of it is done, else None.

    ``copy_to_cpu`` swaps ``accept_lens`` for a host tensor and records ``copy_done``; before that (or while the
    copy is in flight under overlap) this returns None instead of syncing.
    """
    lens, done = getattr(result, "accept_lens", None), getattr(result, "copy_done", None)
    if lens is None or done is None or lens.device.type != "cpu":
        return None
    return lens if done.query() else None


# ---------------------------------------------------------------- NGRAM worker
def ngram_width(worker: Any) -> int:
    return int(worker.draft_token_num)


def ngram_last_tokens(batch: Any, n: int) -> torch.Tensor:
    """The last committed token of every request: the previous step's last accepted one (``NgramVerifyInput``).

    Under overlap it is not in ``req.output_ids`` yet; SGLang's ``FutureMap`` put it in ``batch.spec_info``
    (NGRAM's prefill and verify both leave ``accept_tokens``/``accept_lens`` there), in both scheduler modes.
    """
    info = batch.spec_info
    tokens = info.accept_tokens.reshape(-1, n)
    last = (info.accept_lens.long() - 1).clamp(min=0)
    return tokens[torch.arange(tokens.shape[0], device=tokens.device), last].to(torch.int64)


DECODE_MODE = ForwardMode.DECODE.name  # the target forward mode of a ReSpec plain step
VERIFY_MODE = ForwardMode.TARGET_VERIFY.name  # the target forward mode of SGLang's spec steps (steps = 0 included)


def plain_decode_forward(worker: Any, batch: Any, last_tokens: torch.Tensor, capture_hidden: bool = False) -> Any:
    """One target-only decode step of a spec decode batch (no draft, no tree mask, no verify); the target's result.

    It writes the KV of the last committed token into the slot SGLang's spec allocator already reserved at
    position ``seq_len`` (the slot a verify's tree root would use) and leaves the batch as it found it. With
    ``capture_hidden`` the result carries the target's hidden state of that position (SGLang's ``LAST`` capture:
    EAGLE3's concatenated auxiliary layers), which a drafter catch-up consumes later.
    """
    committed = batch.seq_lens
    cpu = batch.seq_lens_cpu + 1 if batch.seq_lens_cpu is not None else None
    capture = CaptureHiddenMode.LAST if capture_hidden else None
    with batch_restored(batch):
        set_decode(batch)
        batch.spec_info = None
        batch.input_ids = last_tokens
        batch.out_cache_loc = kv_slots(batch, committed)
        set_seq_lens(batch, committed + 1, cpu)
        return worker.target_worker.forward_batch_generation(batch, capture_hidden_mode=capture)


def ngram_stage_corpus(worker: Any, batch: Any) -> None:
    """Stage the previous step's accepted tokens for :func:`ngram_feed_corpus`, as ``NGRAMWorker._prepare_draft_tokens``
    does: under overlap SGLang splices them in from ``batch.spec_info`` (one host copy); without overlap
    ``req.output_ids`` is complete. Call it *before* launching the step's forward, as SGLang does: on a GPU the host
    copy after the launch would wait for that forward and take away the scheduler's overlap."""
    bs = len(batch.reqs)
    if overlap_enabled(worker) and not batch.grammar_needs_sync():
        info = batch.spec_info
        worker.prev_token_ids = info.accept_tokens.cpu().tolist()
        worker.prev_accept_lens = info.accept_lens.cpu().tolist()
    else:
        worker.prev_token_ids, worker.prev_accept_lens = [], [0] * bs


def ngram_feed_corpus(worker: Any, batch: Any) -> None:
    """Feed the n-gram corpus with the batch's tokens after a step ReSpec ran, as NGRAM's verify does (the tokens
    :func:`ngram_stage_corpus` staged)."""
    worker._update_ngram_corpus(batch)


def one_token_verify_logprobs(logits_output: Any, bs: int) -> None:
    """A plain step's log-probs in a verify's layout: SGLang reads a speculative batch's ``next_token_logprobs`` as
    one row of accepted tokens per request (here one token); the top-k and token-id rows a plain sampler returns
    are already one per request, which is a verify's layout when one token is accepted."""
    if logits_output is not None and logits_output.next_token_logprobs is not None:
        logits_output.next_token_logprobs = logits_output.next_token_logprobs.view(bs, 1)


def verify_hidden_rows(logits_output: Any, bs: int, n: int) -> None:
    """A plain step's hidden states (one row per request) in a verify's layout: SGLang reads a speculative batch's
    ``hidden_states`` with the result's row stride (``speculative_num_draft_tokens``: request i from row i*n, as its
    token ids), so request i's row moves to row i*n (the rows between are never read: one token accepted)."""
    hidden = logits_output.hidden_states if logits_output is not None else None
    if hidden is None or n <= 1 or hidden.shape[0] != bs:
        return
    rows = hidden.new_zeros((bs * n, *hidden.shape[1:]))
    rows[::n] = hidden
    logits_output.hidden_states = rows


def ngram_result(
    worker: Any, target: Any, accept_tokens: torch.Tensor, accept_lens: torch.Tensor, new_seq_lens: torch.Tensor
) -> GenerationBatchResult:
    """An NGRAM decode result in the shape of a verify (``accept_tokens`` flat, ``n`` per request)."""
    n = ngram_width(worker)
    bs = new_seq_lens.shape[0]
    one_token_verify_logprobs(target.logits_output, bs)
    verify_hidden_rows(target.logits_output, bs, n)
    return GenerationBatchResult(
        logits_output=target.logits_output,
        next_token_ids=accept_tokens,
        can_run_cuda_graph=target.can_run_cuda_graph,
        accept_lens=accept_lens,
        new_seq_lens=new_seq_lens,
        next_draft_input=NgramVerifyInput(
            draft_token_num=n, new_seq_lens=new_seq_lens, accept_tokens=accept_tokens, accept_lens=accept_lens
        ),
        speculative_num_draft_tokens=worker.speculative_num_draft_tokens,
    )


# ---------------------------------------------------------------- EAGLE V2 worker
def step_policy(worker: Any) -> Optional[Any]:
    """The ``AdaptiveSpecPolicy`` of an EAGLE V2 worker's ``AdaptiveController``, or None without one."""
    return getattr(getattr(worker, "adaptive_controller", None), "params", None)


def set_step_policy(controller: Any, policy: Any) -> None:
    controller.params = policy


def controller_policy(controller: Any) -> Any:
    return controller.params


def controller_worker(controller: Any) -> Any:
    return controller.worker


def server_steps(worker: Any) -> int:
    return int(worker.speculative_num_steps)


def activate_state(worker: Any, batch_size: int) -> None:
    """Switch the worker to the runtime state its policy picks for ``batch_size`` (SGLang's own call)."""
    worker.activate_step_by_batch(batch_size)


def eagle_draft_worker(worker: Any) -> Any:
    return worker.draft_worker


def eagle_width(worker: Any) -> int:
    return int(worker.speculative_num_draft_tokens)


def plain_step_outputs(result: Any) -> tuple:
    """(next token per request, target hidden state per request) of a steps = 0 verify or a plain decode step,
    on the device."""
    return result.next_token_ids, result.logits_output.hidden_states


def eagle_last_tokens(batch: Any) -> torch.Tensor:
    """The last committed token of every request of an EAGLE decode batch: the previous step's bonus token, on the
    device (``EagleDraftInput.bonus_tokens``; relayed through SGLang's ``FutureMap`` under overlap)."""
    return batch.spec_info.bonus_tokens.to(torch.int64)


def target_uses_graphs(worker: Any) -> bool:
    """True when the spec worker's target replays captured graphs (a GPU): SGLang captures them in
    ``TARGET_VERIFY`` mode for a spec worker, so a ``DECODE`` forward must not go through them."""
    return getattr(worker.target_worker.model_runner, "decode_cuda_graph_runner", None) is not None


def eagle_plain_result(draft_worker: Any, target: Any, new_seq_lens: torch.Tensor) -> GenerationBatchResult:
    """A plain decode step's result in the shape of a one-node verify that accepted only the bonus token
    (``speculative_num_draft_tokens = 1``, as SGLang's steps = 0 step reports it), with zero draft-state
    stand-ins (:func:`stub_draft_state`)."""
    tokens = target.next_token_ids.to(torch.int32)
    bs = tokens.shape[0]
    one_token_verify_logprobs(target.logits_output, bs)
    result = GenerationBatchResult(
        logits_output=target.logits_output,
        next_token_ids=tokens,
        can_run_cuda_graph=target.can_run_cuda_graph,
        speculative_num_draft_tokens=1,
        accept_lens=torch.ones(bs, dtype=torch.int32, device=tokens.device),
        new_seq_lens=new_seq_lens,
        next_draft_input=EagleDraftInput(bonus_tokens=tokens),
    )
    stub_draft_state(draft_worker, result, bs)
    return result


def stub_draft_state(draft_worker: Any, result: Any, bs: int) -> None:
    """Zero stand-ins for the draft state a skipped draft extend would have produced (as SGLang's
    ``_stub_skipped_draft_extend`` makes them): never read before a catch-up restores the rows."""
    nxt = result.next_draft_input
    device = result.next_token_ids.device
    nxt.topk_p = torch.zeros((bs, draft_worker.topk), dtype=torch.float32, device=device)
    nxt.topk_index = torch.zeros((bs, draft_worker.topk), dtype=torch.int64, device=device)
    size, dtype = get_draft_recurrent_hidden_state_spec(draft_worker.draft_runner)
    if size is not None:
        nxt.hidden_states = torch.zeros((bs, size), dtype=dtype, device=device)


def draft_state_rows(info: Any) -> Dict[str, torch.Tensor]:
    """Copies of the per-request draft-state tensors an ``EagleDraftInput`` carries."""
    return {f: getattr(info, f).clone() for f in DRAFT_STATE_FIELDS if getattr(info, f, None) is not None}


def set_draft_state_rows(info: Any, rows: Dict[str, torch.Tensor]) -> None:
    for f, v in rows.items():
        setattr(info, f, v)


def replay_draft_extend(
    draft_worker: Any,
    batch: Any,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    accept_lens: torch.Tensor,
    seq_lens: torch.Tensor,
) -> EagleDraftInput:
    """One batched ``_draft_extend_for_decode`` over given (token, target hidden) windows; the draft state it
    leaves. ``batch.seq_lens``/``out_cache_loc`` must already point at the window (see :func:`set_seq_lens`)."""
    out = EagleDraftInput()
    result = GenerationBatchResult(
        logits_output=LogitsProcessorOutput(next_token_logits=None, hidden_states=hidden),
        next_token_ids=tokens,
        accept_lens=accept_lens,
        new_seq_lens=seq_lens + accept_lens.to(seq_lens.dtype),
        next_draft_input=out,
    )
    draft_worker._draft_extend_for_decode(batch, result)
    return out


def copy_rows(dst: Dict[str, torch.Tensor], src: Any, rows: Sequence[int]) -> None:
    """Copy rows ``rows`` of every draft-state tensor of ``src`` (an ``EagleDraftInput``) into ``dst``."""
    if not rows:
        return
    idx = torch.tensor(list(rows), dtype=torch.long, device=next(iter(dst.values())).device)
    for f, t in dst.items():
        v = getattr(src, f, None)
        if v is not None:
            t[idx] = v[idx].to(t.dtype)
