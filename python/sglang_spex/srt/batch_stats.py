"""Per-step batch statistics, published by the scheduler through a shared-memory file any process can read.

The scheduler writes one row per scheduled batch into a ring of ``RING`` rows (``FIELDS``) plus a few
counters, in a file under ``/dev/shm`` named by the plugin config's ``stats_path`` (``config.stats_channel``:
picked by the launcher, or by the first process that asks, and inherited by SGLang's subprocesses). Reading costs one ``mmap``
slice: no IPC round trip, no lock. The writer bumps ``seq`` after a row is complete; a reader that lags
by more than ``RING`` rows sees overwritten rows (``history`` reports the gap).

Why not SGLang's own load snapshot (``sglang.srt.managers.load_snapshot``, the ``/dev/shm`` file behind
``/v1/loads``): it holds one latest ``LoadSnapshot`` per DP rank (a fixed msgspec struct, msgpack-encoded
under a file lock), written every ``publish_interval`` steps. The SPEX controllers and tests need every step
(a ring with sequence numbers, so a reader can prove no step was missed), and per-role fields SGLang's
struct has no room for (primary/speculative split, budget, protected KV, cancel histograms).

The writer lives in the scheduler's plugin state (``scheduling.state_of(scheduler).stats``). Under overlap
scheduling a row describes the batch chosen at the scheduling point; ``step_s`` is the time between two
scheduling points, i.e. the loop period that overlap shortens.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from typing import Any, Dict, Optional, Tuple

import numpy as np

from sglang_spex.adapters import radix_cache as rc
from sglang_spex.adapters import scheduler as sa
from sglang_spex.config import stats_channel
from sglang_spex.srt import scheduling
from sglang_spex.srt.hook_guard import HookGuard

logger = logging.getLogger(__name__)

MAGIC = 0x5350455853544154  # "SPEXSTAT"
VERSION = 2  # 2: the speculative gate fields (spec_room .. hook_s) and counters
RING = 8192
FIELDS = (
    "time",  # wall clock (time.time()) when the batch was chosen
    "step",  # scheduler step counter (only steps that run a batch)
    "mode",  # 1 prefill/extend, 2 decode, 3 mixed, 0 other
    "batch_size",  # requests in the batch that runs this step
    "n_primary",  # ... of which primary (or unlabelled)
    "n_spec",  # ... of which speculative
    "spec_total",  # speculative requests in the running batch and the batch to run together
    "budget",  # speculative admission cap in force (-1 = none)
    "kv_used",  # KV tokens held by requests and protected prefixes (total - available - evictable)
    "kv_available",  # KV tokens free in the allocator
    "kv_evictable",  # KV tokens cached and evictable in the radix cache
    "kv_protected",  # KV tokens locked in the radix cache (running requests + spex protection)
    "kv_total",  # KV pool size
    "waiting",  # requests in the waiting queue
    "waiting_spec",  # ... of which speculative
    "step_s",  # wall time of this step (filled in when the next step is scheduled; NaN until then)
    "spec_room",  # speculative requests the gate allowed in the running batch this step (-1 = no limit)
    "knee",  # knee in force: the given one or the live one, whichever is smaller (-1 = unknown)
    "primary_live",  # primary requests running, chunked or waiting when the gate decided
    "primary_running",  # live primary requests of the running batch that are not in this step's batch
    "spec_held",  # waiting speculative requests the gate kept out of this step's prefill
    "decode_protected",  # 1: held because a spec-only prefill would have replaced the primaries' decode step
    "hook_s",  # seconds spent in the plugin's scheduler hooks since the previous row (SGLang's work excluded)
)
COUNTERS = (
    "cancel_extra_immediate_0",
    "cancel_extra_immediate_1",
    "cancel_extra_immediate_2",
    "cancel_extra_immediate_3",
    "cancel_extra_immediate_4plus",
    "cancel_extra_plain_0",
    "cancel_extra_plain_1",
    "cancel_extra_plain_2",
    "cancel_extra_plain_3",
    "cancel_extra_plain_4plus",
    "preempt_for_primary",
    "spec_retracted_for_budget",
    "protect_locks",
    "protect_locked_tokens",
    "last_step_s",
    "ema_step_s",
    "spec_before_primary",  # steps that admitted speculative work while a primary stayed waiting (expected 0)
    "hook_s_total",
    "live_knee",  # knee of the live decode step times (-1 = none seen)
)
DECODE = 2  # the "mode" of a decode row
_HDR = 8  # magic, version, n_fields, ring, seq, writer pid, n_counters, reserved
_F = {name: i for i, name in enumerate(FIELDS)}
_C = {name: i for i, name in enumerate(COUNTERS)}
_NBYTES = 8 * (_HDR + len(COUNTERS) + RING * len(FIELDS))


def prepare_channel() -> str:
    """Fix the stats path for this process tree (call in the launching process, before SGLang forks)."""
    return stats_channel()


def _views(mm: np.memmap):
    header = np.ndarray((_HDR,), dtype=np.int64, buffer=mm, offset=0)
    counters = np.ndarray((len(COUNTERS),), dtype=np.float64, buffer=mm, offset=8 * _HDR)
    ring = np.ndarray((RING, len(FIELDS)), dtype=np.float64, buffer=mm, offset=8 * (_HDR + len(COUNTERS)))
    return header, counters, ring


class StatsWriter:
    """The scheduler side: owns the file, writes rows."""

    def __init__(self, path: str):
        self.path = path
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.truncate(_NBYTES)
        self.mm = np.memmap(tmp, dtype=np.uint8, mode="r+", shape=(_NBYTES,))
        self.header, self.counters, self.ring = _views(self.mm)
        self.ring[:] = np.nan
        self.header[:] = [MAGIC, VERSION, len(FIELDS), RING, 0, os.getpid(), len(COUNTERS), 0]
        os.replace(tmp, path)  # readers never see a half-initialised file
        atexit.register(self.close)
        self.seq = 0
        self.last_t: Optional[float] = None
        self.ema: Optional[float] = None

    def write(self, row: Dict[str, float], counters: Dict[str, float]) -> Optional[Tuple[float, float, float]]:
        """Write ``row``; returns the previous row's (mode, batch size, step_s) once its step time is known."""
        now = time.monotonic()
        done = None
        if self.last_t is not None and self.seq > 0:
            dt = now - self.last_t
            prev = self.ring[(self.seq - 1) % RING]
            prev[_F["step_s"]] = dt
            done = (float(prev[_F["mode"]]), float(prev[_F["batch_size"]]), dt)
            self.ema = dt if self.ema is None else 0.9 * self.ema + 0.1 * dt
            counters = {**counters, "last_step_s": dt, "ema_step_s": self.ema}
        self.last_t = now
        self.ring[self.seq % RING] = [row.get(k, np.nan) for k in FIELDS]  # one array write per row
        if counters.keys() >= _C.keys():
            self.counters[:] = [counters[k] for k in COUNTERS]
        else:
            for k, v in counters.items():
                self.counters[_C[k]] = v
        self.seq += 1
        self.header[4] = self.seq
        return done

    def idle(self) -> None:
        self.last_t = None  # the gap to the next batch is idle time, not step time

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass


class StatsReader:
    """Any process: read the latest row, the counters and recent history without IPC."""

    def __init__(self, path: Optional[str] = None):
        self.path = path or stats_channel()
        self.mm = np.memmap(self.path, dtype=np.uint8, mode="r", shape=(_NBYTES,))
        self.header, self.counters_arr, self.ring = _views(self.mm)
        if int(self.header[0]) != MAGIC or int(self.header[1]) != VERSION:
            raise ValueError(f"{self.path} is not a sglang-spex stats file of version {VERSION}")

    @property
    def seq(self) -> int:
        return int(self.header[4])

    def _row(self, i: int) -> Dict[str, float]:
        vals = self.ring[i % RING].copy()
        return {k: (None if np.isnan(v) else float(v)) for k, v in zip(FIELDS, vals)}

    def latest(self) -> Optional[Dict[str, float]]:
        seq = self.seq
        return self._row(seq - 1) if seq > 0 else None

    def counters(self) -> Dict[str, float]:
        vals = self.counters_arr.copy()
        return {k: float(v) for k, v in zip(COUNTERS, vals)}

    def history(self, since: int = 0) -> Dict[str, Any]:
        """Rows with sequence numbers in ``[since, seq)``; ``lost`` counts rows already overwritten."""
        seq = self.seq
        start = max(since, seq - RING)
        rows = [self._row(i) for i in range(start, seq)]
        return {"seq": seq, "start": start, "lost": start - since if since < start else 0, "rows": rows}


G_STATS = HookGuard("batch_stats")


def _writer_of(state: scheduling.SpexSchedulerState) -> StatsWriter:
    if state.stats is None:
        state.stats = StatsWriter(stats_channel())
    return state.stats


def _publish(plan: Any, scheduler: Any) -> None:
    t0 = time.perf_counter()
    state = scheduling.state_of(scheduler)
    writer = _writer_of(state)
    batch = plan.batch_to_run
    reqs = sa.batch_reqs(batch)
    if not reqs:
        writer.idle()
        return
    n_spec = sum(map(sa.is_spec, reqs))
    spec_rest = primary_running = 0  # live requests of the running batch that do not run in this step's batch
    if plan.running_batch is not batch:  # a decode step runs the running batch itself: nothing else to count
        seen = set(map(id, reqs))
        for r in sa.batch_reqs(plan.running_batch):
            if id(r) not in seen and not r.finished():
                if sa.is_spec(r):
                    spec_rest += 1
                else:
                    primary_running += 1
    spec_total = n_spec + spec_rest
    pool = sa.pool(scheduler)
    waiting = sa.waiting(scheduler)
    total, available, evictable = pool["kv_total"], pool["kv_available"], pool["kv_evictable"]
    gate = state.gate
    row = {
        "time": time.time(),
        "step": writer.seq,
        "mode": sa.batch_mode(batch),
        "batch_size": len(reqs),
        "n_primary": len(reqs) - n_spec,
        "n_spec": n_spec,
        "spec_total": spec_total,
        "budget": -1 if state.budget is None else state.budget,
        "kv_used": total - available - evictable,
        "kv_available": available,
        "kv_evictable": evictable,
        "kv_protected": rc.protected_size(scheduler.tree_cache),
        "kv_total": total,
        "waiting": len(waiting),
        "waiting_spec": sum(map(sa.is_spec, waiting)),
        "spec_room": -1 if gate.room is None else gate.room,
        "knee": -1 if gate.knee is None else gate.knee,
        "primary_live": gate.primary_live,
        "primary_running": primary_running,
        "spec_held": gate.held,
        "decode_protected": int(gate.decode_protected),
        "hook_s": state.hook_s - state.hook_s_published,
    }
    pg = state.protection
    counters: Dict[str, float] = {
        "preempt_for_primary": state.counters.get("preempt_for_primary", 0),
        "spec_retracted_for_budget": state.counters.get("spec_retracted_for_budget", 0),
        "protect_locks": pg.num_locks,
        "protect_locked_tokens": pg.locked_tokens,
        "spec_before_primary": state.counters.get("spec_before_primary", 0),
        "hook_s_total": state.hook_s,
        "live_knee": state.curve.knee() or -1,
    }
    for mode, hist in state.extra_hist.items():
        for i, n in enumerate(hist):
            suffix = f"{i}" if i < len(hist) - 1 else f"{i}plus"
            counters[f"cancel_extra_{mode}_{suffix}"] = n
    state.hook_s_published = state.hook_s
    state.gate.held, state.gate.decode_protected = 0, False  # a step without a prefill attempt holds nothing
    done = writer.write(row, counters)
    if done is not None and done[0] == DECODE:
        state.curve.add(int(done[1]), done[2])  # the live decode curve (the gate's live knee)
    sa.charge_hook_time(scheduler, t0, "publish")


def h_publish(plan: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER Scheduler.get_next_batch_to_run: publish this step's batch statistics."""
    G_STATS.run(_publish, plan, scheduler)
    return plan


def read_stats(path: Optional[str] = None, history_since: Optional[int] = None) -> Dict[str, Any]:
    """Latest row + counters (+ history) from the stats file; ``{"available": False}`` if there is none."""
    try:
        reader = StatsReader(path)
    except (OSError, ValueError) as e:
        return {"available": False, "error": str(e)}
    out: Dict[str, Any] = {"available": True, "path": reader.path, "seq": reader.seq}
    out["latest"] = reader.latest()
    out["counters"] = reader.counters()
    if history_since is not None:
        out["history"] = reader.history(history_since)
    return out
