"""ReSpec Adaptive Server, online part 2: run true plain decode steps inside SGLang's NGRAM worker when the FSM
says "no speculation".

Where it sits (SGLang 0.5.23): with a speculative algorithm the scheduler's ``model_worker`` *is* the spec worker
(``Scheduler.__init__``: ``self.model_worker = self.draft_worker``) and every decode batch goes through
``NGRAMWorker.forward_batch_generation`` (``Scheduler.run_batch``, non-overlap V2 branch: CPU disables overlap).
An AROUND hook on that method (``srt/hooks.py``) asks the FSM once per decode batch:

* spec: SGLang's own path (draft from the n-gram corpus, tree verify, KV compaction);
* plain: :func:`plain_decode_step` — one token per request through ``target_worker.forward_batch_generation``
  in ``ForwardMode.DECODE`` with no spec_info (no draft, no tree mask, no verify). It writes the KV of the last
  committed token into the slot SGLang's spec allocator already reserved at position ``seq_len``
  (``eagle_prepare_for_decode`` reserves ``committed + reserve`` slots), and returns the result in the shape
  of a verify that accepted only the bonus token (``accept_lens = 1``), so the scheduler's spec bookkeeping
  (``process_batch_result_decode``, seq-lens, KV frees at finish) is unchanged: switching either way keeps
  the KV, drops nothing, allocates nothing extra. The n-gram corpus is still fed, so drafts are warm when
  speculation comes back.

Configuration reaches the scheduler process in the environment variable ``SGLANG_SPEX_RESPEC`` (JSON, written
by the launcher for ``--respec-*``); see :class:`RespecConfig`.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch

from sglang_spex.config import RespecConfig
from sglang_spex.respec.fsm import AdaptiveFSM, Hysteresis
from sglang_spex.respec.profiler import Profile
from sglang_spex.respec.solver import Plan, solve

logger = logging.getLogger(__name__)

SPEC = "spec"  # FSM state used when no profile names configs (force modes)


class Runtime:
    """The scheduler process's FSM and switch bookkeeping (one per process, built on first use)."""

    def __init__(self, cfg: RespecConfig, plan: Optional[Plan]):
        self.cfg = cfg
        self.plan = plan
        self.fsm = AdaptiveFSM(plan, Hysteresis.parse(cfg.hysteresis), max_batch=cfg.max_batch) if plan else None
        self.decode_steps = 0
        self.plain_steps = 0
        self.spec_steps = 0

    def speculate(self, batch_size: int) -> bool:
        """Observe one decode step of ``batch_size`` sequences; True if it should speculate."""
        self.decode_steps += 1
        force = self.cfg.force
        if force == "plain":
            on = False
        elif force == "spec":
            on = True
        elif force and force.startswith("alternate:"):
            k = max(1, int(force.split(":", 1)[1]))
            on = ((self.decode_steps - 1) // k) % 2 == 0
        elif self.fsm is not None:
            on = self.fsm.observe(batch_size) is not None
        else:
            on = True  # no profile: SGLang as configured
        if on:
            self.spec_steps += 1
        else:
            self.plain_steps += 1
        return on

    def info(self) -> dict:
        out: dict = {"decode_steps": self.decode_steps, "plain_steps": self.plain_steps, "spec_steps": self.spec_steps}
        out["config"] = asdict(self.cfg)
        if self.fsm is not None:
            out["fsm"] = self.fsm.info()
        if self.plan is not None:
            out["plan"] = self.plan.summary()
        return out


_runtime: Optional[Runtime] = None


def load_plan(cfg: RespecConfig, model_path: str = "") -> Optional[Plan]:
    """The solver's plan for ``cfg.profile`` (a JSON profile path, or ``auto``: the cached profile of the model)."""
    if cfg.force is not None:
        return None
    path: Optional[Path] = None
    if cfg.profile != "auto":
        path = Path(cfg.profile)
    elif model_path:
        from sglang_spex.respec.profiler import PROFILE_DIR, _slug

        found = sorted(PROFILE_DIR.glob(f"{_slug(model_path)}__*.json")) if PROFILE_DIR.exists() else []
        path = found[0] if found else None
    if path is None or not path.exists():
        logger.warning("respec: no profile (%s); speculating always", cfg.profile)
        return None
    return solve(Profile.load(path), max_batch=cfg.max_batch)


def runtime(model_path: str = "") -> Runtime:
    global _runtime
    if _runtime is None:
        cfg = RespecConfig.from_env()
        _runtime = Runtime(cfg, load_plan(cfg, model_path))
    return _runtime


def plain_decode_step(worker: Any, batch: Any) -> Any:
    """One true plain decode step for a decode batch of SGLang's NGRAM worker (see module doc)."""
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.ngram_info import NgramVerifyInput

    bs = len(batch.reqs)
    device = batch.seq_lens.device
    n = worker.draft_token_num
    committed = batch.seq_lens  # KV written for positions < committed; the last output token sits at committed
    last = [r.output_ids[-1] if len(r.output_ids) else r.origin_input_ids[-1] for r in batch.reqs]
    slots = batch.req_to_token_pool.req_to_token[batch.req_pool_indices, committed.long()]

    saved = (batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.orig_seq_lens)
    batch.forward_mode = ForwardMode.DECODE
    batch.spec_info = None
    batch.input_ids = torch.tensor(last, dtype=torch.int64, device=device)
    batch.out_cache_loc = slots.to(torch.int64)
    batch.seq_lens = committed + 1
    if batch.seq_lens_cpu is not None:
        batch.seq_lens_cpu = batch.seq_lens_cpu + 1
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
    batch.orig_seq_lens = batch.seq_lens.to(saved[3].dtype) if saved[3] is not None else None
    try:
        res = worker.target_worker.forward_batch_generation(batch)
    finally:
        batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.orig_seq_lens = saved
    predict = res.next_token_ids
    accept_lens = torch.ones(bs, dtype=torch.int32, device=device)
    accept_tokens = torch.zeros(bs, n, dtype=torch.int32, device=device)
    accept_tokens[:, 0] = predict
    accept_tokens = accept_tokens.flatten()
    new_seq_lens = committed + 1

    worker.prev_token_ids, worker.prev_accept_lens = [], [0] * bs  # staging read by the corpus update (sync mode)
    worker._update_ngram_corpus(batch)
    batch.forward_mode = ForwardMode.DECODE
    return GenerationBatchResult(
        logits_output=res.logits_output,
        next_token_ids=accept_tokens,
        can_run_cuda_graph=res.can_run_cuda_graph,
        accept_lens=accept_lens,
        new_seq_lens=new_seq_lens,
        next_draft_input=NgramVerifyInput(
            draft_token_num=n, new_seq_lens=new_seq_lens, accept_tokens=accept_tokens, accept_lens=accept_lens
        ),
        speculative_num_draft_tokens=worker.speculative_num_draft_tokens,
    )


def h_ngram_forward(original, worker, batch, *args, **kwargs):
    """AROUND NGRAMWorker.forward_batch_generation: a plain decode step when the FSM says "no speculation"."""
    try:
        rt = runtime(getattr(getattr(worker, "server_args", None), "model_path", "") or "")
        # grammar and logprob batches keep SGLang's spec path (their spec-shaped outputs are not rebuilt here)
        eligible = batch.forward_mode.is_decode() and not batch.has_grammar and not batch.return_logprob
        plain = eligible and not rt.speculate(len(batch.reqs))
    except Exception:  # never break the scheduler: fall back to SGLang's path
        logger.exception("respec: FSM failed; speculating")
        plain = False
    if plain:
        return plain_decode_step(worker, batch)
    return original(worker, batch, *args, **kwargs)


def h_report_state(result, scheduler, *args, **kwargs):
    """AFTER Scheduler.get_internal_state: FSM state, switch and step counts, KV pool figures."""
    try:
        info = runtime().info()
        info["pool"] = {
            "kv_available": int(scheduler.token_to_kv_pool_allocator.available_size()),
            "kv_evictable": int(scheduler.tree_cache.evictable_size()),
            "req_slots_free": int(scheduler.req_to_token_pool.available_size()),
            "running": len(scheduler.running_batch.reqs) if scheduler.running_batch is not None else 0,
        }
        result.internal_state["respec"] = info
    except Exception:  # never break the scheduler for a report
        logger.exception("respec: report failed")
    return result
