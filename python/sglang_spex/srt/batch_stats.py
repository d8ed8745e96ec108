"""Per-step batch statistics, published by the scheduler through a shared-memory file any process can read.

The scheduler writes one row per scheduled batch into a ring of ``RING`` rows (``FIELDS``) plus a few
counters, in a file under ``/dev/shm`` named by the plugin config's ``stats_path`` (``config.stats_channel``:
picked by the launcher, or by the first process that asks, and inherited by SGLang's subprocesses). Reading costs
one ``mmap`` slice: no IPC round trip, no lock. The writer bumps ``seq`` after a row is complete; a reader that lags
by more than ``RING`` rows sees overwritten rows (``history`` reports the gap). The first step without a batch after
one ran writes one idle row (``batch_size`` 0, ``mode`` 0; the KV pool, queue and gate's census as they are now) and
sets the rank's gauges from it; further steps without a batch write nothing.

Under ``--dp-size N`` every rank's scheduler writes its own ring, ``<stats_path>.<dp_rank>`` (:func:`rank_path`;
header slot 7 holds ``dp_rank + 1``); without DP the one ring is ``<stats_path>`` itself. A reader given no rank
reads the single ring, or rank 0's under DP (the single-rank semantics of every reader written before DP);
:class:`RankReaders` reads every rank and sums them (:func:`aggregate_rows`) for callers that want one figure.

Why not SGLang's own load snapshot (``sglang.srt.managers.load_snapshot``, the ``/dev/shm`` file behind
``/v1/loads``): it holds one latest ``LoadSnapshot`` per DP rank (a fixed msgspec struct, msgpack-encoded
under a file lock), written every ``publish_interval`` steps. The SPEX controllers and tests need every step
(a ring with sequence numbers, so a reader can prove no step was missed), and per-role fields SGLang's
struct has no room for (primary/speculative split, budget, protected KV, cancel histograms).

The writer lives in the scheduler's plugin state (``scheduling.state_of(scheduler).stats``). Under overlap
scheduling a row describes the batch chosen at the scheduling point; ``step_s`` is the time between two
scheduling points, i.e. the loop period that overlap shortens. On CPU a batch's forward ends before the loop goes on,
so that period is the row's own step. On a GPU SGLang's overlap loop launches batch k and then waits for batch k-1,
so when the device is the bottleneck the period is mostly batch k-1's device time: the row, and the live curve and
prefill price fed from it, are charged one step late there (not corrected yet: never measured on a GPU).
"""

from __future__ import annotations

import atexit
import glob
import logging
import math
import operator
import os
import struct
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from sglang_spex.adapters import scheduler as sa
from sglang_spex.config import stats_channel
from sglang_spex.srt import scheduling
from sglang_spex.srt.dp_ranks import process_dp_rank
from sglang_spex.srt.hook_guard import HookGuard
from sglang_spex.srt.metrics import RankGauges

logger = logging.getLogger(__name__)

MAGIC = 0x5350455853544154  # "SPEXSTAT"
VERSION = 4  # 2: the speculative gate fields (spec_room .. hook_s) and counters; 3: the live curve's line;
# 4: prefill tokens per step, decode rows and the speculative prefill allowance
RING = 8192
HISTORY_PAGE = 1024  # rows of one ring a GET /spex/stats answer holds at most (read on from ``history.next``)
FIELDS = (
    "time",  # wall clock (time.time()) when the batch was chosen
    "step",  # scheduler step counter (only steps that run a batch)
    "mode",  # 1 prefill/extend, 2 decode, 3 mixed, 0 other
    "batch_size",  # requests in the batch that runs this step (0: the rank's idle row, see above)
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
    "prefill_tokens",  # prompt tokens this step prefills (a mixed step's decode rows excluded)
    "spec_prefill_tokens",  # ... of which for speculative requests
    "spec_prefill_credit_s",  # what speculative prefill beside primaries could spend this step (-1 = no limit)
    "spec_prefill_cost_s",  # ... and the price of what it admitted (prefill_allowance.py)
    "decode_rows",  # requests this step decodes (a mixed step's running batch; a decode step's whole batch)
    "kv_tokens",  # context tokens this step's requests attend over (SGLang's ``seq_lens_sum`` of the batch)
)
COUNTERS = (
    "cancel_extra_immediate_0",  # the cancel histograms' bins (scheduling.EXTRA_BINS each), written in this order
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
    "curve_a_s",  # the live decode curve t = a + b·B: a, seconds (-1 = not fitted yet)
    "curve_b_s",  # ... b, seconds per sequence (0 when flat)
)
DECODE = scheduling.DECODE  # the "mode" of a decode row
DONE_FIELDS = ("mode", "batch_size", "n_primary", "decode_rows", "prefill_tokens")  # what a finished step reports
_HDR = 8  # magic, version, n_fields, ring, seq, writer pid, n_counters, dp_rank + 1 (0: no data parallelism)
_F = {name: i for i, name in enumerate(FIELDS)}
_C = {name: i for i, name in enumerate(COUNTERS)}
_NBYTES = 8 * (_HDR + len(COUNTERS) + RING * len(FIELDS))
# the writer packs rows and counters straight into the file (one struct call each, no numpy scalar per field)
_COUNTERS_AT = 8 * _HDR
_RING_AT = 8 * (_HDR + len(COUNTERS))
_ROW_BYTES = 8 * len(FIELDS)
_ROW = struct.Struct(f"{len(FIELDS)}d")
_ALL_COUNTERS = struct.Struct(f"{len(COUNTERS)}d")
_DOUBLE = struct.Struct("d")
_INT64 = struct.Struct("q")
_STEP_S_AT = 8 * _F["step_s"]
_COUNTER_VALUES = operator.itemgetter(*COUNTERS)
_DONE_VALUES = operator.itemgetter(*(_F[k] for k in DONE_FIELDS))  # a row's DONE_FIELDS values, in order
_SEQ_AT = 8 * 4  # header slot 4
_LAST_STEP_AT, _EMA_AT = _C["last_step_s"], _C["ema_step_s"]


# row fields and counters that add up over DP ranks (the others, e.g. knee or step time, are per rank only)
SUM_FIELDS = ("batch_size", "n_primary", "n_spec", "spec_total", "kv_used", "kv_available", "kv_evictable",
              "kv_protected", "kv_total", "waiting", "waiting_spec", "primary_live", "primary_running", "spec_held",
              "hook_s")  # fmt: skip
SUM_COUNTERS = tuple(c for c in COUNTERS if c.startswith("cancel_extra_")) + (
    "preempt_for_primary", "spec_retracted_for_budget", "protect_locks", "protect_locked_tokens",
    "spec_before_primary", "hook_s_total")  # fmt: skip


def prepare_channel() -> str:
    """Fix the stats path for this process tree (call in the launching process, before SGLang forks)."""
    return stats_channel()


def rank_path(base: str, dp_rank: Optional[int]) -> str:
    """The ring of one DP rank: ``<base>.<dp_rank>``; ``base`` itself without data parallelism."""
    return base if dp_rank is None else f"{base}.{dp_rank}"


def rank_paths(base: Optional[str] = None) -> Dict[Optional[int], str]:
    """The rings that exist, by rank: ``{0: base.0, 1: base.1, ...}`` under DP, else ``{None: base}``."""
    base = base or stats_channel()
    ranks: Dict[Optional[int], str] = {}
    for p in glob.glob(glob.escape(base) + ".*"):
        suffix = p[len(base) + 1 :]
        if suffix.isdigit():
            ranks[int(suffix)] = p
    return dict(sorted(ranks.items())) if ranks else {None: base}


def _float(v: Any) -> Any:
    """A value as the ring stores it: None is NaN (unknown)."""
    return math.nan if v is None else v


def _views(mm: np.memmap):
    header = np.ndarray((_HDR,), dtype=np.int64, buffer=mm, offset=0)
    counters = np.ndarray((len(COUNTERS),), dtype=np.float64, buffer=mm, offset=8 * _HDR)
    ring = np.ndarray((RING, len(FIELDS)), dtype=np.float64, buffer=mm, offset=8 * (_HDR + len(COUNTERS)))
    return header, counters, ring


class StatsWriter:
    """The scheduler side: owns the file, writes rows."""

    def __init__(self, path: str, dp_rank: Optional[int] = None):
        self.path = path
        self.dp_rank = dp_rank
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.truncate(_NBYTES)
        self.mm = np.memmap(tmp, dtype=np.uint8, mode="r+", shape=(_NBYTES,))
        self.header, self.counters, self.ring = _views(self.mm)
        self.ring[:] = np.nan
        rank = 0 if dp_rank is None else dp_rank + 1
        self.header[:] = [MAGIC, VERSION, len(FIELDS), RING, 0, os.getpid(), len(COUNTERS), rank]
        os.replace(tmp, path)  # readers never see a half-initialised file
        atexit.register(self.close)
        self.seq = 0
        self.last_t: Optional[float] = None
        self.ema: Optional[float] = None
        self.last_dt = 0.0  # the last step time written to the counters (the file starts with 0)
        self.gauges: Optional[Any] = None  # metrics.RankGauges, set by the scheduler hook
        self._done: Tuple[float, ...] = ()  # the last row's DONE_FIELDS values, as written

    def write(self, row: Dict[str, float], counters: Dict[str, float]) -> Optional[Dict[str, float]]:
        """Write ``row``; returns the previous row's ``DONE_FIELDS`` and its ``step_s`` once its step time is known."""
        return self.write_values([_float(row.get(k)) for k in FIELDS], counters)

    def write_values(self, values: Sequence[float], counters: Dict[str, float]) -> Optional[Dict[str, float]]:
        """:meth:`write` of a row given as its ``FIELDS`` values in order (floats; NaN for unknown)."""
        prev = self._done
        dt = self._close_previous()
        done = None
        if dt is not None:
            done = dict(zip(DONE_FIELDS, map(float, prev)))
            done["step_s"] = dt
            counters = {**counters, "last_step_s": dt, "ema_step_s": self.ema}
        self._put_row(values)
        try:
            every = _COUNTER_VALUES(counters)
        except KeyError:  # some counters only: the others keep their values
            for k, v in counters.items():
                _DOUBLE.pack_into(self.mm, _COUNTERS_AT + 8 * _C[k], _float(v))
        else:
            _ALL_COUNTERS.pack_into(self.mm, _COUNTERS_AT, *(map(_float, every) if None in every else every))
        self._bump_seq()
        return done

    def write_step(self, values: Sequence[float], counters: List[float]) -> Optional[Tuple[float, ...]]:
        """The scheduler's per-step write: ``values`` as in :meth:`write_values`, ``counters`` every ``COUNTERS``
        value in order (numbers, no None); its ``last_step_s`` and ``ema_step_s`` slots are filled in here (with
        the values the file holds while the previous step's time is unknown). Returns the previous row's
        ``DONE_FIELDS`` values and its ``step_s``, in that order, once its step time is known."""
        prev = self._done
        dt = self._close_previous()
        self._put_row(values)
        counters[_LAST_STEP_AT] = self.last_dt
        counters[_EMA_AT] = 0.0 if self.ema is None else self.ema
        _ALL_COUNTERS.pack_into(self.mm, _COUNTERS_AT, *counters)
        self._bump_seq()
        return None if dt is None else (*prev, dt)

    def _close_previous(self) -> Optional[float]:
        """Start a row now: the previous row's step time (written into it), or None when it is unknown."""
        now = time.monotonic()
        dt = None
        if self.last_t is not None and self.seq > 0:
            dt = now - self.last_t
            _DOUBLE.pack_into(self.mm, _RING_AT + _ROW_BYTES * ((self.seq - 1) % RING) + _STEP_S_AT, dt)
            self.ema = dt if self.ema is None else 0.9 * self.ema + 0.1 * dt
            self.last_dt = dt
        self.last_t = now
        return dt

    def _put_row(self, values: Sequence[float]) -> None:
        _ROW.pack_into(self.mm, _RING_AT + _ROW_BYTES * (self.seq % RING), *values)  # one write per row
        self._done = _DONE_VALUES(values)

    def _bump_seq(self) -> None:
        self.seq += 1
        _INT64.pack_into(self.mm, _SEQ_AT, self.seq)  # after the row: a reader never sees a half-written one

    def idle(self) -> None:
        self.last_t = None  # the gap to the next batch is idle time, not step time

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass


class StatsReader:
    """Any process: read the latest row, the counters and recent history without IPC.

    ``path`` names a ring file; else ``dp_rank`` picks that rank's ring of this server; with neither, the server's
    single ring, or rank 0's under DP."""

    def __init__(self, path: Optional[str] = None, dp_rank: Optional[int] = None):
        if path is None:
            base = stats_channel()
            path = rank_path(base, dp_rank)
            if dp_rank is None and not os.path.exists(base) and os.path.exists(rank_path(base, 0)):
                path = rank_path(base, 0)
        self.path = path
        self.mm = np.memmap(self.path, dtype=np.uint8, mode="r", shape=(_NBYTES,))
        self.header, self.counters_arr, self.ring = _views(self.mm)
        if int(self.header[0]) != MAGIC or int(self.header[1]) != VERSION:
            raise ValueError(f"{self.path} is not a sglang-spex stats file of version {VERSION}")

    @property
    def seq(self) -> int:
        return int(self.header[4])

    @property
    def dp_rank(self) -> Optional[int]:
        """The writer's DP rank (None: a server without data parallelism)."""
        rank = int(self.header[7])
        return None if rank == 0 else rank - 1

    def _row(self, i: int) -> Dict[str, float]:
        vals = self.ring[i % RING].copy()
        return {k: (None if np.isnan(v) else float(v)) for k, v in zip(FIELDS, vals)}

    def _rows(self, start: int, end: int) -> List[Dict[str, Optional[float]]]:
        """Rows ``[start, end)`` (one copy of the ring slice; NaN as None)."""
        if end <= start:
            return []
        block = self.ring[np.arange(start, end) % RING].tolist()
        return [dict(zip(FIELDS, [None if v != v else v for v in vals])) for vals in block]

    def latest(self) -> Optional[Dict[str, float]]:
        seq = self.seq
        return self._row(seq - 1) if seq > 0 else None

    def counter(self, name: str) -> float:
        """One counter's value (without building :meth:`counters`' dict)."""
        return float(self.counters_arr[_C[name]])

    def counters(self) -> Dict[str, float]:
        vals = self.counters_arr.copy()
        return {k: float(v) for k, v in zip(COUNTERS, vals)}

    def history(self, since: int = 0, limit: Optional[int] = None) -> Dict[str, Any]:
        """Rows with sequence numbers in ``[since, seq)``, the first ``limit`` of them (None: all); ``start``: the
        first row's number, ``lost``: rows from ``since`` on already overwritten, ``next``: the ``since`` that
        continues after the last row (more rows follow while ``next < seq``). ValueError for ``since < 0``."""
        if since < 0:
            raise ValueError(f"history since {since}: must be >= 0")
        seq = self.seq
        start = max(since, seq - RING)
        end = seq if limit is None else min(seq, start + limit)
        rows = self._rows(start, end)
        lost = start - since if since < start else 0
        return {"seq": seq, "start": start, "lost": lost, "rows": rows, "next": start + len(rows)}


G_STATS = HookGuard("batch_stats")


def _writer_of(state: scheduling.SpexSchedulerState) -> StatsWriter:
    if state.stats is None:
        rank = process_dp_rank()
        state.stats = StatsWriter(rank_path(stats_channel(), rank), rank)
        state.stats.gauges = RankGauges(rank)  # the rank's spex_rank_* gauges on /metrics
    return state.stats


def _publish(plan: Any, scheduler: Any) -> None:
    t0 = time.perf_counter()
    state = scheduling.state_of(scheduler)
    writer = _writer_of(state)
    batch = plan.batch_to_run
    reqs = sa.reqs_view(batch)
    if not reqs:
        if writer.last_t is not None:  # the first step without a batch since one ran
            writer.idle()  # (the step before stays untimed, as before any idle gap)
            _publish_idle(plan, scheduler, state, writer)
            sa.charge_hook_time(scheduler, t0, "publish")
        writer.idle()
        return
    n_spec = sa.count_spec(reqs)
    spec_rest = primary_running = 0  # live requests of the running batch that do not run in this step's batch
    if plan.running_batch is not batch:  # a decode step runs the running batch itself: nothing else to count
        spec_rest, primary_running, _ = sa.live_roles(sa.reqs_view(plan.running_batch), skip=set(map(id, reqs)))
    prefill, spec_prefill, decode_rows = sa.prefill_tokens(batch)
    total, available, evictable, protected = sa.kv_figures(scheduler)
    waiting = sa.waiting(scheduler)
    gate = state.gate
    allowance = gate.spec_prefill
    # the row in FIELDS order, built as a tuple (no dict per step; the gauges build theirs when due)
    values = (
        time.time(),  # time
        writer.seq,  # step
        sa.batch_mode(batch),  # mode
        len(reqs),  # batch_size
        len(reqs) - n_spec,  # n_primary
        n_spec,  # n_spec
        n_spec + spec_rest,  # spec_total
        -1 if state.budget is None else state.budget,  # budget
        total - available - evictable,  # kv_used
        available,  # kv_available
        evictable,  # kv_evictable
        protected,  # kv_protected
        total,  # kv_total
        len(waiting),  # waiting
        sa.count_spec(waiting),  # waiting_spec
        math.nan,  # step_s: written with the next row
        -1 if gate.room is None else gate.room,  # spec_room
        -1 if gate.knee is None else gate.knee,  # knee
        gate.primary_live,  # primary_live
        primary_running,  # primary_running
        gate.held,  # spec_held
        int(gate.decode_protected),  # decode_protected
        state.hook_s - state.hook_s_published,  # hook_s
        prefill,  # prefill_tokens
        spec_prefill,  # spec_prefill_tokens
        -1 if allowance is None else allowance.credit_s,  # spec_prefill_credit_s
        0.0 if allowance is None else allowance.spent_s,  # spec_prefill_cost_s
        decode_rows,  # decode_rows
        sa.context_tokens(batch),  # kv_tokens
    )
    counters = _counters(state)
    state.hook_s_published = state.hook_s
    gate.step_done()  # a step without a prefill attempt holds nothing and has no allowance
    done = writer.write_step(values, counters)
    gauges = writer.gauges
    if gauges is not None and gauges.due():
        gauges.update(dict(zip(FIELDS, values)), {**dict(zip(COUNTERS, counters)), "ema_step_s": writer.ema})
    if done is not None:  # the live decode curve, the price of a prefill token, the allowance's earnings
        mode, batch_size, n_primary, rows, tokens, step_s = done
        state.measured(
            mode=mode,
            batch_size=batch_size,
            n_primary=n_primary,
            decode_rows=rows,
            prefill_tokens=tokens,
            step_s=step_s,
        )
    sa.charge_hook_time(scheduler, t0, "publish")


def _publish_idle(plan: Any, scheduler: Any, state: scheduling.SpexSchedulerState, writer: StatsWriter) -> None:
    """The row of a rank that went idle: no batch (``batch_size`` 0, ``mode`` 0), the KV pool and queue as they
    are, the gate's census taken again (readers of ``primary_live`` see the load the rank has now); the
    ``spex_rank_*`` gauges are set from it at once."""
    gate = state.gate
    counts = scheduling.census(scheduler, plan.running_batch, full=False)
    room = scheduling.spec_room(state, counts)  # sets the gate's primary_live, knee and room
    total, available, evictable, protected = sa.kv_figures(scheduler)
    waiting = sa.waiting(scheduler)
    values = dict.fromkeys(FIELDS, 0.0)
    values.update(
        time=time.time(),
        step=writer.seq,
        spec_total=counts.spec_running,
        budget=-1 if state.budget is None else state.budget,
        kv_used=total - available - evictable,
        kv_available=available,
        kv_evictable=evictable,
        kv_protected=protected,
        kv_total=total,
        waiting=len(waiting),
        waiting_spec=sa.count_spec(waiting),
        step_s=math.nan,
        spec_room=-1 if room is None else room,
        knee=-1 if gate.knee is None else gate.knee,
        primary_live=gate.primary_live,
        spec_held=gate.held,
        decode_protected=int(gate.decode_protected),
        hook_s=state.hook_s - state.hook_s_published,
        spec_prefill_credit_s=-1,
    )
    counters = _counters(state)
    state.hook_s_published = state.hook_s
    gate.step_done()
    writer.write_step([values[k] for k in FIELDS], counters)
    gauges = writer.gauges
    if gauges is not None:
        # (update() is rate-limited: an idle rank's gauges must not wait for its next step)
        gauges.update(values, {**dict(zip(COUNTERS, counters)), "ema_step_s": writer.ema}, force=True)


def _counters(state: scheduling.SpexSchedulerState) -> List[float]:
    """``COUNTERS`` in order; the writer fills in ``last_step_s`` and ``ema_step_s``."""
    pg, curve, hist, counts = state.protection, state.curve, state.extra_hist, state.counters
    line = curve.line()
    return [
        *hist["immediate"],
        *hist["plain"],
        counts.get("preempt_for_primary", 0),
        counts.get("spec_retracted_for_budget", 0),
        pg.num_locks,
        pg.locked_tokens,
        0.0,  # last_step_s
        0.0,  # ema_step_s
        counts.get("spec_before_primary", 0),
        state.hook_s,  # hook_s_total
        curve.knee() or -1,  # live_knee
        -1 if line is None else line[0],  # curve_a_s
        -1 if line is None else line[1],  # curve_b_s
    ]


def h_publish(plan: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER Scheduler.get_next_batch_to_run: publish this step's batch statistics."""
    G_STATS.run(_publish, plan, scheduler)
    return plan


def read_stats(
    path: Optional[str] = None,
    history_since: Optional[int] = None,
    dp_rank: Optional[int] = None,
    history_limit: Optional[int] = HISTORY_PAGE,
) -> Dict[str, Any]:
    """Latest row + counters (+ history: at most ``history_limit`` rows, see :meth:`StatsReader.history`) of one
    ring (see :class:`StatsReader` for which); ``{"available": False}`` if there is none."""
    try:
        reader = StatsReader(path, dp_rank)
    except (OSError, ValueError) as e:
        return {"available": False, "error": str(e)}
    out: Dict[str, Any] = {"available": True, "path": reader.path, "dp_rank": reader.dp_rank, "seq": reader.seq}
    out["latest"] = reader.latest()
    out["counters"] = reader.counters()
    if history_since is not None:
        out["history"] = reader.history(history_since, history_limit)
    return out


def aggregate_rows(rows: Iterable[Optional[Dict[str, Any]]], keys: Tuple[str, ...] = SUM_FIELDS) -> Dict[str, float]:
    """The sum over ranks of ``keys`` (missing rows and values count 0)."""
    rows = [r for r in rows if r]
    return {k: float(sum(r.get(k) or 0 for r in rows)) for k in keys}


class RankReaders:
    """Every DP rank's ring of one server (a single ring without DP), found on first use and again whenever a rank
    is missing; readers stay open, so a read is one ``mmap`` slice per rank."""

    def __init__(self, base: Optional[str] = None):
        self.base = base
        self._readers: Dict[Optional[int], StatsReader] = {}

    def readers(self) -> Dict[Optional[int], StatsReader]:
        paths = rank_paths(self.base)
        if set(paths) != set(self._readers):
            found = {}
            for rank, p in paths.items():
                try:
                    found[rank] = self._readers.get(rank) or StatsReader(p)
                except (OSError, ValueError):  # that rank has not published its first step yet
                    continue
            self._readers = found
        return self._readers

    def latest_by_rank(self) -> Dict[Optional[int], Optional[Dict[str, float]]]:
        return {rank: r.latest() for rank, r in self.readers().items()}

    def aggregate_latest(self) -> Dict[str, float]:
        """:data:`SUM_FIELDS` of every rank's latest row, summed."""
        return aggregate_rows(self.latest_by_rank().values())


def read_all_ranks(
    base: Optional[str] = None, history_since: Optional[int] = None, history_skip: Sequence[Optional[int]] = ()
) -> Dict[str, Any]:
    """Every rank's :func:`read_stats`, by rank, and their sum (``aggregate``: latest rows' :data:`SUM_FIELDS`
    and :data:`SUM_COUNTERS`). ``history_since`` applies to every rank (each ring has its own sequence numbers)
    but those in ``history_skip``, whose entries carry no ``history``."""
    ranks: List[Dict[str, Any]] = [
        read_stats(p, None if rank in history_skip else history_since) for rank, p in rank_paths(base).items()
    ]
    up = [r for r in ranks if r["available"]]
    agg = {
        "latest": aggregate_rows(r["latest"] for r in up),
        "counters": aggregate_rows((r["counters"] for r in up), SUM_COUNTERS),
        "ranks": len(up),
    }
    return {"dp_ranks": ranks, "aggregate": agg}
