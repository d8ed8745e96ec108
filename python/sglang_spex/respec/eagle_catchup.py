"""ReSpec EAGLE / EAGLE3 "no speculation" as a true plain step, and the drafter KV catch-up when speculation resumes.

SGLang's steps = 0 step is a one-node verify (one token per request: a plain decode of the target) followed by a
draft extend over the new token, so the drafter's KV never falls behind. In ``--respec-eagle-off plain`` mode (the
default) the draft extend of those steps is skipped (hook R5): the drafter does no work while speculation is off.
Instead a :class:`DraftLedger` keeps, per request, what the skipped extend would have consumed -- the next token
and the target's captured hidden state of each plain position. The drafter's state rows of the batch are zeroed
stand-ins (as SGLang's own ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND`` stubs them).

The ledger copies each plain step's tokens and hidden states to host memory without waiting for them (pinned
memory, ``non_blocking``, an event recorded behind the copy, as SGLang's ``copy_to_cpu`` does), so a plain step
makes no device sync -- under the overlap scheduler the next batch is already being prepared. The copies are
waited for only when a catch-up needs them.

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
from typing import Any, Dict, List, Tuple

import torch

from sglang_spex.adapters import spec_workers as sw

logger = logging.getLogger(__name__)


@dataclass
class _PlainStep:
    """One plain step's outputs on their way to host memory (row i = request i of that step's batch)."""

    tokens: torch.Tensor
    hidden: torch.Tensor
    done: Any  # an event recorded after the copies (None: already on the host)

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()
            self.done = None


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` that does not wait for the device (pinned + non_blocking off CPU)."""
    if t.device.type == "cpu":
        return t.detach().clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t.detach(), non_blocking=True)
    return out


class DraftLedger:
    """(next token, target hidden state) of every plain position the drafter has not seen, per request id."""

    def __init__(self, max_positions: int = 4096) -> None:
        self.pending: Dict[str, List[Tuple[int, int]]] = {}  # rid -> [(step id, row)] in position order
        self.max_positions = max_positions  # per request; past it the request resumes cold (counted in `lost`)
        self.lost: set = set()  # requests whose ledger overflowed: no catch-up, the drafter resumes cold
        self.skipped = 0  # draft-extend positions never run (requests finished while off, or still pending)
        self.replayed = 0  # positions replayed by catch-up
        self.catch_ups = 0
        self._steps: Dict[int, _PlainStep] = {}
        self._next_id = 0

    def keep_only(self, rids: List[str]) -> None:
        """Forget requests no longer in the batch (finished, or retracted: a re-prefill resyncs the drafter)."""
        live = set(rids)
        for rid in [r for r in self.pending if r not in live]:
            del self.pending[rid]
        self.lost &= live
        self._drop_unreferenced()

    def record(self, batch: Any, result: Any) -> None:
        """A plain step's output: one (token, hidden) per request, in batch order (copied to host, not waited)."""
        tokens, hidden = sw.plain_step_outputs(result)
        step_id, self._next_id = self._next_id, self._next_id + 1
        step = _PlainStep(_to_host(tokens), _to_host(hidden), None)
        if tokens.device.type != "cpu":
            step.done = torch.get_device_module(tokens.device).Event()
            step.done.record()
        self._steps[step_id] = step
        for i, rid in enumerate(sw.rids(batch)):
            if rid in self.lost:
                continue
            entries = self.pending.setdefault(rid, [])
            if len(entries) >= self.max_positions:
                del self.pending[rid]
                self.lost.add(rid)
                continue
            entries.append((step_id, i))
        self.skipped += len(batch.reqs)
        self._drop_unreferenced()

    def entries(self, rid: str) -> List[Tuple[int, torch.Tensor]]:
        """(token, host hidden row) of each pending position of ``rid``, oldest first (waits for their copies)."""
        out = []
        for step_id, row in self.pending.get(rid, []):
            step = self._steps[step_id]
            step.wait()
            out.append((int(step.tokens[row]), step.hidden[row]))
        return out

    def pop(self, rids: List[str]) -> None:
        for rid in rids:
            self.pending.pop(rid, None)
        self._drop_unreferenced()

    def _drop_unreferenced(self) -> None:
        used = {s for entries in self.pending.values() for s, _ in entries}
        for step_id in [s for s in self._steps if s not in used]:
            del self._steps[step_id]

    def info(self) -> dict:
        return {
            "pending_positions": sum(len(v) for v in self.pending.values()),
            "skipped_positions": self.skipped,
            "replayed_positions": self.replayed,
            "catch_ups": self.catch_ups,
            "overflowed_requests": len(self.lost),
        }


_Window = Tuple[List[int], List[int], List[int], torch.Tensor, torch.Tensor, List[int]]


def _window(pend: List[List[Tuple[int, torch.Tensor]]], committed: List[int], r: int, n: int) -> _Window:
    """Round ``r`` on the host: (start positions, accept counts (1 for an idle row), positions to write (0 for an
    idle row), tokens [bs*n], hidden [bs*n, H], rows whose last window it is)."""
    first = next(p[0][1] for p in pend if p)
    bs = len(pend)
    starts, accept, valid, last = [0] * bs, [1] * bs, [0] * bs, []
    tokens = torch.zeros(bs * n, dtype=torch.int64)
    hidden = torch.zeros(bs * n, first.shape[-1], dtype=first.dtype)
    for i, p in enumerate(pend):
        chunk = p[r * n : (r + 1) * n]
        if not chunk:
            continue
        c = len(chunk)
        starts[i], accept[i], valid[i] = committed[i] - len(p) + r * n, c, c
        tokens[i * n : i * n + c] = torch.tensor([t for t, _ in chunk])
        hidden[i * n : i * n + c] = torch.stack([h for _, h in chunk])
        if (r + 1) * n >= len(p):
            last.append(i)
    return starts, accept, valid, tokens, hidden, last


def catch_up(worker: Any, batch: Any, ledger: DraftLedger) -> int:
    """Replay the ledger of the batch's requests through the drafter (see module doc); positions replayed."""
    rids = sw.rids(batch)
    pend = [ledger.entries(rid) for rid in rids]
    total = sum(len(p) for p in pend)
    if not total:
        return 0
    dw = sw.eagle_draft_worker(worker)
    n = sw.eagle_width(worker)
    device = batch.seq_lens.device
    committed = sw.committed_lens(batch)
    info = batch.spec_info  # EagleDraftInput: rows in batch order
    rows = sw.draft_state_rows(info)
    rounds = max((len(p) + n - 1) // n for p in pend)
    with sw.batch_restored(batch):
        for r in range(rounds):
            starts, accept, valid, tokens, hidden, last = _window(pend, committed, r, n)
            seq_cpu = torch.tensor(starts, dtype=torch.int64)
            seq = seq_cpu.to(device=device, dtype=batch.seq_lens.dtype)
            counts = torch.tensor(accept, dtype=torch.int32).to(device)
            sw.point_at_window(batch, seq, seq_cpu, torch.tensor(valid).to(device), n)
            out = sw.replay_draft_extend(dw, batch, tokens.to(device), hidden.to(device), counts, seq)
            sw.copy_rows(rows, out, last)
    sw.set_draft_state_rows(info, rows)
    ledger.pop(rids)
    ledger.replayed += total
    ledger.skipped -= total
    ledger.catch_ups += 1
    return total
