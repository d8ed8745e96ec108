"""ReSpec Adaptive Server, NGRAM: run true plain decode steps inside SGLang's NGRAM worker when the FSM says
"no speculation" (hook R1).

Where it sits (SGLang 0.5.23): with a speculative algorithm the scheduler's ``model_worker`` *is* the spec worker
(``Scheduler.__init__``: ``self.model_worker = self.draft_worker``) and every decode batch goes through
``NGRAMWorker.forward_batch_generation`` (``Scheduler.run_batch``, non-overlap V2 branch: CPU disables overlap).
An AROUND hook on that method asks the runtime (:mod:`sglang_spex.respec.adaptive`) once per decode batch:

* spec: SGLang's own path (draft from the n-gram corpus, tree verify, KV compaction);
* plain: :func:`plain_decode_step` -- one token per request through ``target_worker.forward_batch_generation``
  in ``ForwardMode.DECODE`` with no spec_info (no draft, no tree mask, no verify). It writes the KV of the last
  committed token into the slot SGLang's spec allocator already reserved at position ``seq_len``
  (``eagle_prepare_for_decode`` reserves ``committed + reserve`` slots), and returns the result in the shape
  of a verify that accepted only the bonus token (``accept_lens = 1``), so the scheduler's spec bookkeeping
  (``process_batch_result_decode``, seq-lens, KV frees at finish) is unchanged: switching either way keeps
  the KV, drops nothing, allocates nothing extra. The n-gram corpus is still fed, so drafts are warm when
  speculation comes back.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sglang_spex.respec.adaptive import mean_accept, opted_out, runtime

logger = logging.getLogger(__name__)


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
    state, rt = "", None
    try:
        rt = runtime(getattr(getattr(worker, "server_args", None), "model_path", "") or "")
        decode = batch.forward_mode.is_decode()
        rt.begin_step(decode)
        # grammar and logprob batches keep SGLang's spec path (their spec-shaped outputs are not rebuilt here)
        if decode and not batch.has_grammar and not batch.return_logprob:
            state = rt.decide(len(batch.reqs), opted_out(batch))
    except Exception:  # never break the scheduler: fall back to SGLang's path
        logger.exception("respec: FSM failed; speculating")
        state = ""
    result = plain_decode_step(worker, batch) if state is None else original(worker, batch, *args, **kwargs)
    if state != "" and rt is not None:
        rt.end_step(state, len(batch.reqs), mean_accept(result))
    return result
