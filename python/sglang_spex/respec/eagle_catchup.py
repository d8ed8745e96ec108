"""ReSpec EAGLE / EAGLE3 "no speculation" as a true plain decode step, and the drafter KV catch-up when
speculation resumes.

SGLang's own steps = 0 step is a one-node ``TARGET_VERIFY`` forward (custom mask, full hidden-state capture, the
verify sampler) followed by a draft extend over the new token. In ``--respec-eagle-off plain`` mode (the default)
ReSpec's off step is instead :func:`plain_decode_step`: one ``ForwardMode.DECODE`` forward of the target (no
draft, no tree mask, no verify, no draft extend), as a server without speculation runs it, into the KV slot the
spec allocator already reserved at ``seq_len``; its input is the previous step's bonus token from
``batch.spec_info`` (relayed by SGLang's ``FutureMap`` under overlap), its new lengths go to the scheduler's
``on_publish``, and it is reported as a one-node verify that accepted only the bonus token, so the scheduler's
spec bookkeeping is unchanged. The forward captures the target's hidden state of the position (SGLang's
``LAST`` capture), which a :class:`DraftLedger` keeps, per request, with the next token: what the skipped draft
extend would have consumed. The drafter's state rows of the batch are zeroed stand-ins (as SGLang's own
``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND`` stubs them).

The ledger keeps references to those device tensors -- no per-step copy, host or device, and no sync -- except
when the forward replayed a captured graph (its output buffers are reused, so the rows are copied on the
device). Batches that keep SGLang's spec path (grammar) and targets that replay graphs (a GPU: SGLang
captures a spec worker's target graphs in ``TARGET_VERIFY`` mode) run SGLang's steps = 0 step with the draft
extend skipped by hook R5 instead; their positions enter the same ledger.

When a decode batch speculates again, :func:`catch_up` replays the ledger through the drafter's own
``_draft_extend_for_decode`` (SGLang's batched draft extend over ``n`` = num_draft_tokens positions per request)
in windows of ``n`` positions, writing the drafter's KV at the skipped positions and restoring each request's
draft state (top-k, hidden) from its last window: the drafter then proposes from the same state as if it had
run all along, and requests that finished while speculation was off never cost the drafter anything -- in an RL
rollout, most of them. Rows of requests with fewer windows write only SGLang's padding slot 0. The ledger holds
at most ``max_positions`` per request; a request past that drops its ledger and resumes cold (its drafter KV
keeps holes; counted). All SGLang internals go through :mod:`sglang_spex.adapters.spec_workers`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from sglang_spex.adapters import spec_workers as sw

logger = logging.getLogger(__name__)


@dataclass
class _PlainStep:
    """One plain step's outputs, on the device (row i = request i of that step's batch)."""

    tokens: torch.Tensor
    hidden: torch.Tensor


class DraftLedger:
    """(next token, target hidden state) of every plain position the drafter has not seen, per request id."""

    def __init__(self, max_positions: int = 4096) -> None:
        self.pending: Dict[str, List[Tuple[int, int]]] = {}  # rid -> [(step id, row)] in position order
        self.max_positions = max_positions  # per request; past it the request resumes cold (counted in `lost`)
        self.lost: set = set()  # requests whose ledger overflowed: no catch-up, the drafter resumes cold
        self.skipped = 0  # draft-extend positions never run (requests finished while off, or still pending)
        self.replayed = 0  # positions replayed by catch-up
        self.catch_ups = 0
        self.copies = 0  # plain steps whose outputs had to be copied (graph-replayed forwards)
        self._steps: Dict[int, _PlainStep] = {}
        self._refs: Dict[int, int] = {}  # step id -> pending positions that point into it (dropped at 0)
        self._next_id = 0

    def keep_only(self, rids: List[str]) -> None:
        """Forget requests no longer in the batch (finished, or retracted: a re-prefill resyncs the drafter)."""
        live = set(rids)
        for rid in [r for r in self.pending if r not in live]:
            self._release(self.pending.pop(rid))
        self.lost &= live

    def record(self, batch: Any, result: Any) -> None:
        """A plain step's output: one (token, hidden) per request, in batch order (kept on the device)."""
        tokens, hidden = sw.plain_step_outputs(result)
        if getattr(result, "can_run_cuda_graph", False):  # graph output buffers are reused by the next replay
            tokens, hidden = tokens.clone(), hidden.clone()
            self.copies += 1
        step_id, self._next_id = self._next_id, self._next_id + 1
        refs = 0
        for i, rid in enumerate(sw.rids(batch)):
            if rid in self.lost:
                continue
            entries = self.pending.setdefault(rid, [])
            if len(entries) >= self.max_positions:
                self._release(self.pending.pop(rid))
                self.lost.add(rid)
                continue
            entries.append((step_id, i))
            refs += 1
        if refs:
            self._steps[step_id] = _PlainStep(tokens, hidden)
            self._refs[step_id] = refs
        self.skipped += len(batch.reqs)

    def flat(self, rids: List[str]) -> Tuple[torch.Tensor, torch.Tensor, List[List[int]]]:
        """All pending positions of ``rids`` as one (tokens [T], hidden [T, H]) on the device, and each request's
        indices into them, oldest first."""
        used = sorted({s for rid in rids for s, _ in self.pending.get(rid, [])})
        offset, at = {}, 0
        for s in used:
            offset[s], at = at, at + self._steps[s].tokens.shape[0]
        tokens = torch.cat([self._steps[s].tokens.reshape(-1) for s in used]).to(torch.int64)
        hidden = torch.cat([self._steps[s].hidden for s in used])
        return tokens, hidden, [[offset[s] + row for s, row in self.pending.get(rid, [])] for rid in rids]

    def pop(self, rids: List[str]) -> None:
        for rid in rids:
            self._release(self.pending.pop(rid, ()))

    def _release(self, entries: List[Tuple[int, int]]) -> None:
        """Positions leaving the ledger: a step's outputs are dropped once no pending position points into them
        (per-request work, never a walk over every pending position)."""
        for step_id, _ in entries:
            left = self._refs[step_id] - 1
            if left:
                self._refs[step_id] = left
            else:
                del self._refs[step_id], self._steps[step_id]

    def info(self) -> dict:
        return {
            "pending_positions": sum(len(v) for v in self.pending.values()),
            "kept_steps": len(self._steps),  # plain steps whose device outputs the ledger still holds
            "skipped_positions": self.skipped,
            "replayed_positions": self.replayed,
            "catch_ups": self.catch_ups,
            "overflowed_requests": len(self.lost),
            "copied_steps": self.copies,
        }


def plain_decode_step(worker: Any, batch: Any, ledger: DraftLedger, on_publish: Optional[Callable] = None) -> Any:
    """ReSpec's EAGLE off step: one DECODE forward of the target, recorded in the ledger (see module doc)."""
    committed = batch.seq_lens
    target = sw.plain_decode_forward(worker, batch, sw.eagle_last_tokens(batch), capture_hidden=True)
    new_seq_lens = committed + 1
    if on_publish is not None:
        on_publish(new_seq_lens)
    result = sw.eagle_plain_result(sw.eagle_draft_worker(worker), target, new_seq_lens)
    ledger.record(batch, result)
    return result


_Window = Tuple[List[int], List[int], List[int], torch.Tensor, List[int]]


def _window(pend: List[List[int]], committed: List[int], r: int, n: int) -> _Window:
    """Round ``r`` on the host: (start positions, accept counts (1 for an idle row), positions to write (0 for an
    idle row), index of each of the bs*n window slots into the ledger's flat tensors (-1: empty), rows whose last
    window it is)."""
    bs = len(pend)
    starts, accept, valid, last = [0] * bs, [1] * bs, [0] * bs, []
    index = torch.full((bs * n,), -1, dtype=torch.int64)
    for i, p in enumerate(pend):
        chunk = p[r * n : (r + 1) * n]
        if not chunk:
            continue
        c = len(chunk)
        starts[i], accept[i], valid[i] = committed[i] - len(p) + r * n, c, c
        index[i * n : i * n + c] = torch.tensor(chunk)
        if (r + 1) * n >= len(p):
            last.append(i)
    return starts, accept, valid, index, last


def catch_up(worker: Any, batch: Any, ledger: DraftLedger) -> int:
    """Replay the ledger of the batch's requests through the drafter (see module doc); positions replayed."""
    rids = sw.rids(batch)
    total = sum(len(ledger.pending.get(rid, ())) for rid in rids)
    if not total:
        return 0
    flat_tokens, flat_hidden, pend = ledger.flat(rids)
    dw = sw.eagle_draft_worker(worker)
    n = sw.eagle_width(worker)
    device = batch.seq_lens.device
    committed = sw.committed_lens(batch)
    info = batch.spec_info  # EagleDraftInput: rows in batch order
    rows = sw.draft_state_rows(info)
    rounds = max((len(p) + n - 1) // n for p in pend)
    with sw.batch_restored(batch):
        for r in range(rounds):
            starts, accept, valid, index, last = _window(pend, committed, r, n)
            seq_cpu = torch.tensor(starts, dtype=torch.int64)
            seq = seq_cpu.to(device=device, dtype=batch.seq_lens.dtype)
            counts = torch.tensor(accept, dtype=torch.int32).to(device)
            index = index.to(device)
            empty = index < 0
            index = index.clamp(min=0)
            tokens = flat_tokens[index].masked_fill(empty, 0)
            hidden = flat_hidden[index].masked_fill(empty.unsqueeze(1), 0)
            sw.point_at_window(batch, seq, seq_cpu, torch.tensor(valid).to(device), n)
            out = sw.replay_draft_extend(dw, batch, tokens, hidden, counts, seq)
            sw.copy_rows(rows, out, last)
    sw.set_draft_state_rows(info, rows)
    ledger.pop(rids)
    ledger.replayed += total
    ledger.skipped -= total
    ledger.catch_ups += 1
    return total
