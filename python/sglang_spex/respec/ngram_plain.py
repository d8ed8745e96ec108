"""ReSpec Adaptive Server, NGRAM: run true plain decode steps inside SGLang's NGRAM worker when the FSM says
"no speculation" (hook R1).

Where it sits (SGLang 0.5.23): with a speculative algorithm the scheduler's ``model_worker`` *is* the spec worker
(``Scheduler.__init__``: ``self.model_worker = self.draft_worker``) and every batch goes through
``NGRAMWorker.forward_batch_generation``, in both scheduler loops. An AROUND hook on that method asks the runtime
(:mod:`sglang_spex.respec.adaptive`, kept on the worker) once per decode batch:

* spec: SGLang's own path (draft from the n-gram corpus, tree verify, KV compaction);
* plain: :func:`plain_decode_step` -- one token per request through the target worker in ``ForwardMode.DECODE``
  with no spec_info (no draft, no tree mask, no verify). Its input is the last committed token, taken on the
  device from ``batch.spec_info`` (the previous step's accepted tokens, which SGLang relays through its
  ``FutureMap`` under overlap scheduling, where ``req.output_ids`` still lacks them); it writes that token's KV
  into the slot SGLang's spec allocator already reserved at position ``seq_len``, publishes the new lengths
  through the scheduler's ``on_publish`` (as NGRAM's own verify does, so the next batch resolves them), and
  returns the result in the shape of a verify that accepted only the bonus token (``accept_lens = 1``), so the
  scheduler's spec bookkeeping (``process_batch_result_decode``, seq-lens, KV frees at finish) is unchanged:
  switching either way keeps the KV, drops nothing, allocates nothing extra. The n-gram corpus is still fed,
  so drafts are warm when speculation comes back.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from sglang_spex.adapters import spec_workers as sw
from sglang_spex.respec.adaptive import UNDECIDED, opted_out, runtime_of

logger = logging.getLogger(__name__)


def plain_decode_step(worker: Any, batch: Any, on_publish: Optional[Callable] = None) -> Any:
    """One true plain decode step for a decode batch of SGLang's NGRAM worker (see module doc)."""
    n = sw.ngram_width(worker)
    bs = len(batch.reqs)
    committed = batch.seq_lens  # KV written for positions < committed; the last committed token sits at committed
    sw.ngram_stage_corpus(worker, batch)  # its host copy before the launch (on a GPU, after it would wait for it)
    target = sw.plain_decode_forward(worker, batch, sw.ngram_last_tokens(batch, n))
    device = committed.device
    accept_lens = torch.ones(bs, dtype=torch.int32, device=device)
    accept_tokens = torch.zeros(bs, n, dtype=torch.int32, device=device)
    accept_tokens[:, 0] = target.next_token_ids
    accept_tokens = accept_tokens.flatten()
    new_seq_lens = committed + 1
    if on_publish is not None:
        on_publish(new_seq_lens)
    sw.ngram_feed_corpus(worker, batch)
    return sw.ngram_result(worker, target, accept_tokens, accept_lens, new_seq_lens)


def note_eager_off_steps(worker: Any) -> bool:
    """Once per worker, at its first off step: warn when its target replays CUDA graphs. SGLang captures an NGRAM
    target's graphs in ``TARGET_VERIFY`` mode only (one row per draft token) and refuses them for a one-token step,
    so ReSpec's off step runs the target eagerly, while the plan prices "plain" from a plain server's graph-replayed
    steps. Returns True when it warned."""
    if sw.attached(worker, sw.EAGER_NOTED_ATTR):
        return False
    sw.attach(worker, sw.EAGER_NOTED_ATTR, True)
    if not sw.target_uses_graphs(worker):
        return False
    logger.warning(
        "respec: NGRAM off steps run the target without CUDA graphs (SGLang captured them for verify only), but the"
        " plan prices plain steps with graphs: it may turn speculation off where it would still gain"
    )
    return True


def h_ngram_forward(original, worker, batch, *args, **kwargs):
    """AROUND NGRAMWorker.forward_batch_generation: a plain decode step when the FSM says "no speculation"."""
    state, rt = UNDECIDED, None
    try:
        rt = runtime_of(worker)
        decode = sw.is_decode(batch)
        rt.begin_step(decode)
        if decode and not sw.keeps_spec_path(batch):
            state = rt.decide(len(batch.reqs), opted_out(batch), sw.samples(batch))
    except Exception:  # never break the scheduler: fall back to SGLang's path
        logger.exception("respec: FSM failed; speculating")
        state = UNDECIDED
    if state is None:
        note_eager_off_steps(worker)
        on_publish = sw.hook_arg(original, "on_publish", worker, batch, *args, **kwargs)
        result = plain_decode_step(worker, batch, on_publish)
    else:
        result = original(worker, batch, *args, **kwargs)
    if state is not UNDECIDED and rt is not None:
        rt.end_step(state, len(batch.reqs), result, sw.VERIFY_MODE if state is not None else sw.DECODE_MODE)
    return result
