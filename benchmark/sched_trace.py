"""What the scheduler did during one benchmark run, from the batch-stats rows (``GET /spex/stats``) written
during it: steps by kind, their time, batch sizes, speculative work, primaries left waiting, the gate's counters,
and every step compacted for :mod:`step_cost`."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Dict, Optional

import psutil
import requests
from step_cost import compact

TRACE_COUNTERS = (
    "spec_retracted_for_budget",
    "preempt_for_primary",
    "promoted",
    "spec_before_primary",
    "spec_prefill_deferred",
    "spec_prefill_bucket",
    "spec_prefill_worth",
    "spec_prefill_free",
)


def spex_stats(url: str, since: Optional[int] = None) -> Dict[str, Any]:
    """The server's ``/spex/stats`` (batch-stats rows since ``since`` when given)."""
    params = {} if since is None else {"history_since": since}
    return requests.get(url + "/spex/stats", params=params, timeout=120).json()


def stats_history(url: str, since: int, get: Optional[Callable[[int], Dict[str, Any]]] = None) -> Dict[str, Any]:
    """The ``/spex/stats`` answer for ``since`` (``get(since)``, default :func:`spex_stats`) with ``batch.history``
    holding every row from ``since`` to the ring's ``seq`` at that first read: an answer holds at most a page of
    rows (1,024), so the rest are read page by page from ``history.next`` (``lost`` sums the pages')."""
    get = get or (lambda s: spex_stats(url, s))
    first = get(since)
    hist = dict(first["batch"]["history"])
    rows = list(hist["rows"])
    while hist["rows"] and hist["next"] < first["batch"]["history"]["seq"]:
        hist = get(hist["next"])["batch"]["history"]
        rows += hist["rows"]
        first["batch"]["history"]["lost"] += hist["lost"]
    first["batch"]["history"].update(rows=rows, next=hist["next"])
    return first


def scheduler_trace(url: str, before: Dict[str, Any]) -> Dict[str, Any]:
    """What the scheduler did during a run, from the batch-stats rows written since ``before`` (a
    ``/spex/stats`` answer): steps by kind, their time, batch sizes, speculative work, primaries left waiting,
    and the gate's counters (deltas). The idle rows (``batch_size`` 0: a rank that went idle) are left out."""
    after = stats_history(url, before["batch"]["seq"])
    hist = after["batch"]["history"]
    hist["rows"] = [r for r in hist["rows"] if r["batch_size"]]
    rows = [r for r in hist["rows"] if r["step_s"] is not None and r["step_s"] == r["step_s"]]
    decode = [r for r in rows if r["mode"] == 2]
    prefill = [r for r in rows if r["mode"] in (1, 3)]
    mixed = [r for r in rows if r["mode"] == 3]  # a prefill that also runs the running batch's decode step
    c0, c1 = before["scheduler"].get("counters", {}), after["scheduler"].get("counters", {})
    return {
        "steps": len(rows),
        "rows_lost": hist["lost"],
        "step_s": round(sum(r["step_s"] for r in rows), 3),
        "decode_steps": len(decode),
        "decode_s": round(sum(r["step_s"] for r in decode), 3),
        "mean_decode_batch": round(statistics.mean(r["batch_size"] for r in decode), 2) if decode else 0.0,
        "decode_spec_seqs": int(sum(r["n_spec"] for r in decode)),
        "prefill_steps": len(prefill),
        "prefill_s": round(sum(r["step_s"] for r in prefill), 3),
        "mixed_steps": len(mixed),
        "mixed_s": round(sum(r["step_s"] for r in mixed), 3),
        "spec_prefill_steps": sum(1 for r in prefill if r["n_spec"] > 0),
        "prefill_tokens": int(sum(r.get("prefill_tokens") or 0 for r in prefill)),
        "spec_prefill_tokens": int(sum(r.get("spec_prefill_tokens") or 0 for r in prefill)),
        "spec_prefill_tokens_beside_primaries": int(
            sum(r.get("spec_prefill_tokens") or 0 for r in prefill if r["primary_live"] > 0)
        ),
        "decode_with_primary_waiting": sum(1 for r in decode if r["waiting"] - r["waiting_spec"] > 0),
        "spec_held_steps": sum(1 for r in rows if r["spec_held"] > 0),
        **{k: c1.get(k, 0) - c0.get(k, 0) for k in TRACE_COUNTERS},
        "hook_s": round(after["scheduler"].get("hook_s", 0.0) - before["scheduler"].get("hook_s", 0.0), 3),
        "hook_by": hook_delta(before["scheduler"].get("hook_by", {}), after["scheduler"].get("hook_by", {})),
        "step_rows": compact(hist["rows"]),
        "step_waiting": [[r["waiting"], r["waiting_spec"], r["n_spec"]] for r in hist["rows"]],  # same order
    }


def hook_delta(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    """Seconds each plugin hook spent in the scheduler between two ``/spex/stats`` reads, largest first."""
    delta = {k: round(v - before.get(k, 0.0), 4) for k, v in after.items()}
    return dict(sorted(((k, v) for k, v in delta.items() if v > 0), key=lambda kv: -kv[1]))


def cpu_seconds(pid: Optional[int]) -> Dict[str, float]:
    """CPU seconds (user + system) so far of a server started by this benchmark, per process role: the launcher
    (HTTP, the TokenizerManager and the server-side searches on its event loop), SGLang's scheduler and
    detokenizer, anything else. Empty for a server this process did not start (``pid`` None) or that is gone."""
    if pid is None:
        return {}
    try:
        root = psutil.Process(pid)
        procs = [("tokenizer_manager", root)] + [(_role(c), c) for c in root.children(recursive=True)]
        out: Dict[str, float] = {}
        for role, p in procs:
            t = p.cpu_times()
            out[role] = out.get(role, 0.0) + t.user + t.system
        return out
    except psutil.Error:
        return {}


def _role(p: "psutil.Process") -> str:
    name = " ".join(p.cmdline()[:1]) or p.name()
    return next((r for r in ("scheduler", "detokenizer") if r in name), "other")


def cpu_delta(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    """Per-role CPU seconds between two :func:`cpu_seconds` snapshots."""
    return {k: round(after[k] - before.get(k, 0.0), 3) for k in after}
