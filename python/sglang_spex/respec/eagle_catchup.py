"""ReSpec EAGLE / EAGLE3 "no speculation" as a true plain step, and the drafter KV catch-up when speculation resumes.

SGLang's steps = 0 step is a one-node verify (one token per request: a plain decode of the target) followed by a
draft extend over the new token, so the drafter's KV never falls behind. In ``--respec-eagle-off plain`` mode (the
default) the draft extend of those steps is skipped (hook R5): the drafter does no work while speculation is off.
Instead a :class:`DraftLedger` keeps, per request, what the skipped extend would have consumed -- the next token
and the target's captured hidden state of each plain position. The drafter's state rows of the batch are zeroed
stand-ins (as SGLang's own ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND`` stubs them).

When a decode batch speculates again, :func:`catch_up` replays the ledger through the drafter's own
``_draft_extend_for_decode`` (SGLang's batched draft extend over ``n`` = num_draft_tokens positions per request)
in windows of ``n`` positions, writing the drafter's KV at the skipped positions and restoring each request's
draft state (top-k, hidden) from its last window: the drafter then proposes from the same state as if it had
run all along, and requests that finished while speculation was off never cost the drafter anything -- in an RL
rollout, most of them. Rows of requests with fewer windows write only SGLang's padding slot 0. The ledger lives
in host memory (one copy of the step's hidden states per plain step) and holds at most ``max_positions`` per
request; a request past that drops its ledger and resumes cold (its drafter KV keeps holes; counted).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

import torch

logger = logging.getLogger(__name__)

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


class DraftLedger:
    """(next token, target hidden state) of every plain position the drafter has not seen, per request id."""

    def __init__(self, max_positions: int = 4096) -> None:
        self.pending: Dict[str, List[Tuple[int, torch.Tensor]]] = {}
        self.max_positions = max_positions  # per request; past it the request resumes cold (counted in `lost`)
        self.lost: set = set()  # requests whose ledger overflowed: no catch-up, the drafter resumes cold
        self.plain_step = False  # R5 skips the draft extend while True (set by R4 around a plain step)
        self.skipped = 0  # draft-extend positions never run (requests finished while off, or still pending)
        self.replayed = 0  # positions replayed by catch-up
        self.catch_ups = 0

    def keep_only(self, rids: List[str]) -> None:
        """Forget requests no longer in the batch (finished, or retracted: a re-prefill resyncs the drafter)."""
        live = set(rids)
        for rid in [r for r in self.pending if r not in live]:
            del self.pending[rid]
        self.lost &= live

    def record(self, batch: Any, result: Any) -> None:
        """A plain step's output: one (token, hidden) per request, in batch order."""
        tokens = result.next_token_ids.tolist()
        host = result.logits_output.hidden_states.detach().to("cpu", copy=True)  # off the accelerator: one copy
        for i, req in enumerate(batch.reqs):
            if req.rid in self.lost:
                continue
            entries = self.pending.setdefault(req.rid, [])
            if len(entries) >= self.max_positions:
                del self.pending[req.rid]
                self.lost.add(req.rid)
                continue
            entries.append((int(tokens[i]), host[i]))
        self.skipped += len(batch.reqs)

    def info(self) -> dict:
        return {
            "pending_positions": sum(len(v) for v in self.pending.values()),
            "skipped_positions": self.skipped,
            "replayed_positions": self.replayed,
            "catch_ups": self.catch_ups,
            "overflowed_requests": len(self.lost),
        }


def stub_draft_state(draft_worker: Any, result: Any, bs: int) -> None:
    """Zero stand-ins for the draft state a skipped extend would have produced (never read before a catch-up)."""
    from sglang.srt.speculative.eagle_utils import get_draft_recurrent_hidden_state_spec

    nxt = result.next_draft_input
    topk = draft_worker.topk
    device = result.next_token_ids.device
    nxt.topk_p = torch.zeros((bs, topk), dtype=torch.float32, device=device)
    nxt.topk_index = torch.zeros((bs, topk), dtype=torch.int64, device=device)
    size, dtype = get_draft_recurrent_hidden_state_spec(draft_worker.draft_runner)
    if size is not None:
        nxt.hidden_states = torch.zeros((bs, size), dtype=dtype, device=device)


def catch_up(worker: Any, batch: Any, ledger: DraftLedger) -> int:
    """Replay the ledger of the batch's requests through the drafter (see module doc); positions replayed."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    rids = [r.rid for r in batch.reqs]
    pend = [ledger.pending.get(rid, []) for rid in rids]
    total = sum(len(p) for p in pend)
    if not total:
        return 0
    dw = worker.draft_worker
    n = int(worker.speculative_num_draft_tokens)
    bs, device = len(rids), batch.seq_lens.device
    committed = batch.seq_lens.tolist()
    info = batch.spec_info  # EagleDraftInput: rows in batch order
    rows = [info.topk_p.clone(), info.topk_index.clone(), info.hidden_states.clone()]
    width = next(p[0][1] for p in pend if p).shape[-1]
    hdtype = next(p[0][1] for p in pend if p).dtype
    r2t = batch.req_to_token_pool.req_to_token
    pool = batch.req_pool_indices.tolist()
    saved = {f: getattr(batch, f, None) for f in _BATCH_FIELDS}
    rounds = max((len(p) + n - 1) // n for p in pend)
    try:
        for r in range(rounds):
            starts, accept = [0] * bs, [1] * bs
            tokens = torch.zeros(bs * n, dtype=torch.int64, device=device)
            hidden = torch.zeros(bs * n, width, dtype=hdtype, device=device)
            loc = torch.zeros(bs * n, dtype=torch.int64, device=device)  # slot 0: SGLang's padding slot
            last: List[int] = []
            for i, p in enumerate(pend):
                chunk = p[r * n : (r + 1) * n]
                if not chunk:
                    continue
                c, start = len(chunk), committed[i] - len(p) + r * n
                starts[i], accept[i] = start, c
                tokens[i * n : i * n + c] = torch.tensor([t for t, _ in chunk], device=device)
                hidden[i * n : i * n + c] = torch.stack([h for _, h in chunk]).to(device)
                loc[i * n : i * n + c] = r2t[pool[i], start : start + c].to(torch.int64)
                if (r + 1) * n >= len(p):
                    last.append(i)
            seq = torch.tensor(starts, dtype=saved["seq_lens"].dtype, device=device)
            batch.seq_lens = seq
            batch.orig_seq_lens = seq.to(saved["orig_seq_lens"].dtype) if saved["orig_seq_lens"] is not None else None
            if saved["seq_lens_cpu"] is not None:
                batch.seq_lens_cpu = seq.cpu().to(saved["seq_lens_cpu"].dtype)
            batch.seq_lens_sum = int(sum(starts))
            batch.out_cache_loc = loc
            batch.forward_mode = ForwardMode.DECODE
            out = SimpleNamespace()
            result = SimpleNamespace(
                prepared_draft_extend_inputs=None,
                accept_lens=torch.tensor(accept, dtype=torch.int32, device=device),
                next_token_ids=tokens,
                logits_output=SimpleNamespace(hidden_states=hidden),
                next_draft_input=out,
                new_seq_lens=seq + torch.tensor(accept, dtype=seq.dtype, device=device),
            )
            dw._draft_extend_for_decode(batch, result)
            for i in last:
                rows[0][i], rows[1][i], rows[2][i] = out.topk_p[i], out.topk_index[i], out.hidden_states[i]
    finally:
        for f, v in saved.items():
            setattr(batch, f, v)
    info.topk_p, info.topk_index, info.hidden_states = rows
    for rid in rids:
        ledger.pending.pop(rid, None)
    ledger.replayed += total
    ledger.skipped -= total
    ledger.catch_ups += 1
    return total
