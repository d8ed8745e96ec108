"""Shared helpers for the simulator benchmarks (bench_fig10/11/14, bench_calibration).

Runs the real search + SPEX code on :mod:`sglang_spex.sim` (virtual time) and condenses each run into one JSON
row: questions/min, accuracy, engine batch statistics and the summed speculation accounting, including hit rates
by prediction distance and by tree depth (both from SPEX's own accounting, ``SearchResult.speculation``).
"""

from __future__ import annotations

import os
import platform
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from tot_report import percentile

from sglang_spex.config import SpexConfig, replace
from sglang_spex.sim import workload as sim_workload
from sglang_spex.sim.cost import RooflineCost
from sglang_spex.sim.run import SimRun, resolve_cost, simulate, spex_factory
from sglang_spex.sim.workload import AnyWorkload
from sglang_spex.tot.policies import BFS_POLICIES, PRESETS
from sglang_spex.tot.search_spec import PolicyConfig, SearchSpec

FIG10_POLICIES = ("rest-5", "rest-10", "rstar-5", "rstar-10", "rebase-8", "rebase-16", "ets-8", "ets-16")
# mode name -> SpexConfig overrides (None = baseline)
SPEX_MODES: Dict[str, Optional[Dict[str, Any]]] = {
    "baseline": None,
    "spex_sched": dict(components=("t1", "t2", "t3"), early_stop=False),  # pure scheduling: identical search
    "spex_t3": dict(components=("t1", "t2", "t3"), early_stop=True),  # + early stop (changes the search)
}
ABLATION_MODES: Dict[str, Optional[Dict[str, Any]]] = {
    "baseline": None,
    "T1": dict(components=("t1",), early_stop=False),
    "T1+T2": dict(components=("t1", "t2"), early_stop=False),
    "T1+T2+T3": dict(components=("t1", "t2", "t3"), early_stop=True),
}


def is_bfs(preset: str) -> bool:
    return PRESETS[preset][0] in BFS_POLICIES


def sim_spec(preset: str, seed: int = 0, **params: Any) -> SearchSpec:
    """The preset's search spec for the simulator (ETS clusters with TF-IDF: no embedding model to load)."""
    if PRESETS[preset][0] == "ets":
        params.setdefault("embedder", "tfidf")
    return SearchSpec(policy=PolicyConfig(preset, params), seed=seed)


def mix_spec(preset: str, seed: int = 0) -> Union[SearchSpec, List[SearchSpec]]:
    """``preset``'s spec, or for a mix (``"rstar-10+rebase-16"``: searches of both programs on one engine, question
    ``i`` running part ``i % parts``) one spec per part."""
    parts = preset.split("+")
    return sim_spec(preset, seed) if len(parts) == 1 else [sim_spec(p, seed) for p in parts]


def workload_for(preset: str, seed: int = 0, **overrides: Any) -> AnyWorkload:
    """The simulated workload of ``preset`` (a mix: one part per preset, in :func:`mix_spec`'s order)."""
    parts = preset.split("+")
    return sim_workload.workload_for(parts[0] if len(parts) == 1 else parts, seed=seed, **overrides)


def merge_counts(dicts: Sequence[Dict[str, Dict[str, int]]]) -> Dict[str, Dict[str, Any]]:
    """Sum ``{key: {hits, issued}}`` dicts and add the hit rate."""
    out: Dict[str, Dict[str, Any]] = {}
    for d in dicts:
        for k, v in (d or {}).items():
            o = out.setdefault(k, {"hits": 0, "issued": 0})
            o["hits"] += v["hits"]
            o["issued"] += v["issued"]
    for v in out.values():
        v["hit_rate"] = round(v["hits"] / v["issued"], 4) if v["issued"] else None
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


# per-search gauges (a level, not a count): averaged over the searches, not summed
GAUGES = ("min_use",)


def sum_speculation(accs: Sequence[Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
    """Sum the numeric fields of per-search accounting dicts (the :data:`GAUGES`: their mean); merge hit_distance /
    hit_depth."""
    accs = [a for a in accs if a]
    if not accs:
        return None
    out: Dict[str, Any] = {}
    for a in accs:
        for key, value in a.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "hit_rate":
                out[key] = out.get(key, 0) + value
    for key in GAUGES:
        if key in out:
            out[key] = out[key] / sum(1 for a in accs if key in a)
    out["early_stops"] = sum(bool(a.get("early_stopped")) for a in accs)
    out["hit_rate"] = round(out["hits"] / out["issued"], 4) if out.get("issued") else None
    out["hit_distance"] = merge_counts([a.get("hit_distance") for a in accs])
    out["hit_depth"] = merge_counts([a.get("hit_depth") for a in accs])
    return out


def run_row(run: SimRun) -> Dict[str, Any]:
    """One JSON row for a simulated run."""
    res = run.results
    n = max(len(res), 1)
    lat = [r.wall_time for r in res]
    return {
        "virtual_time_s": round(run.virtual_time, 3),
        "q_per_min": round(run.questions_per_min, 3),
        "accuracy": round(run.accuracy, 4),
        "answers": run.answers,
        "tokens": sum(r.tokens_generated for r in res),
        "requests_per_q": round(sum(r.num_requests for r in res) / n, 2),
        "max_depth_per_q": round(sum(max((nd["depth"] for nd in r.nodes), default=0) for r in res) / n, 2),
        # the longest root-to-node chain: tokens no scheduler that keeps the tree can generate in parallel
        "crit_path_tokens_per_q": round(
            sum(max((nd["cum_tokens"] or 0 for nd in r.nodes), default=0) for r in res) / n, 1
        ),
        "mean_batch": round(run.engine.get("mean_batch", 0.0), 2),
        "decode_steps": run.engine.get("decode_steps"),
        "decode_s": round(run.engine.get("decode_time", 0.0), 3),
        "prefill_s": round(run.engine.get("prefill_time", 0.0), 3),
        "prefill_passes": run.engine.get("prefill_passes"),
        "client_cpu_s": round(run.engine.get("client_cpu_time", 0.0), 3),
        "wall_s": round(run.wall_time, 2),
        # per question, virtual seconds from its start to its result (sim.run.baseline_driver)
        "latency_p50_s": percentile(lat, 50),
        "latency_p99_s": percentile(lat, 99),
        "speculation": sum_speculation([r.speculation for r in res]),
        # a mix of programs (simulate with a spec per part): each program's own latency and speculation
        "by_policy": by_policy(res) if len({r.policy for r in res}) > 1 else None,
    }


def by_policy(results: Sequence[Any]) -> Dict[str, Dict[str, Any]]:
    """Per program of a mixed run: its questions' p50/p99 latency (virtual s) and summed speculation."""
    out = {}
    for policy in dict.fromkeys(r.policy for r in results):
        mine = [r for r in results if r.policy == policy]
        spec = sum_speculation([r.speculation for r in mine]) or {}
        out[policy] = {
            "questions": len(mine),
            "latency_p50_s": percentile([r.wall_time for r in mine], 50),
            "latency_p99_s": percentile([r.wall_time for r in mine], 99),
            "issued": spec.get("issued", 0),
            "hit_rate": spec.get("hit_rate"),
        }
    return out


def run_mode(
    preset: str,
    mode: Optional[Dict[str, Any]],
    *,
    cost: Any,
    questions: int,
    concurrency: int,
    seed: int = 0,
    k_total: Optional[int] = None,
    lookahead: Optional[int] = None,
    max_lookahead: Optional[int] = None,
    bfs_lookahead: Optional[int] = None,
    reward_latency_s: float = 0.0,
    workload: Optional[AnyWorkload] = None,
    spec: Optional[Union[SearchSpec, List[SearchSpec]]] = None,
    keep_results: bool = False,
    gate: bool = True,
    mixed: bool = True,
    **sim_kwargs: Any,
) -> Dict[str, Any]:
    """Simulate ``questions`` searches of ``preset`` in one mode (None = baseline) and return its row
    (``keep_results``: the SearchResults too, under ``"_results"``; ``gate``: the engine runs the scheduler's
    speculative gate at SPEX's knee; ``mixed``: prefill passes also run the decode step, as the launcher's
    ``--tot-mixed-prefill``; ``sim_kwargs`` go to ``simulate``)."""
    cost_model = resolve_cost(cost)
    spec = spec or mix_spec(preset, seed)
    engine = dict(sim_kwargs.pop("engine_kwargs", None) or {})
    engine.setdefault("mixed_chunk", mixed)  # both modes: one server's flags (--tot-mixed-prefill)
    kw: Dict[str, Any] = {"engine_kwargs": engine}
    if mode is not None:
        cfg = SpexConfig(enabled=True, k_total=k_total, **mode)
        knobs = {"lookahead": lookahead, "max_lookahead": max_lookahead, "bfs_lookahead": bfs_lookahead}
        cfg = replace(cfg, **{k: v for k, v in knobs.items() if v is not None})
        kw["context_factory"] = spex_factory(cfg, cost_model)
        if gate:  # the scheduler's gate keeps speculation below the knee SPEX was given, as on a real server
            engine.setdefault("spec_knee", cfg.k_total if cfg.k_total is not None else cost_model.k_total())
    run = simulate(
        spec,
        cost=cost_model,
        workload=workload,
        questions=questions,
        concurrency=concurrency,
        reward_latency_s=reward_latency_s,
        **kw,
        **sim_kwargs,
    )
    row = run_row(run)
    if keep_results:
        row["_results"] = run.results
    return row


def add_ratios(rows: List[Dict[str, Any]], keys: Tuple[str, ...] = ("policy", "concurrency")) -> None:
    """Add ``speedup`` (q/min over the same key's baseline) to every row, in place."""
    base = {tuple(r[k] for k in keys): r["q_per_min"] for r in rows if r["mode"] == "baseline"}
    for r in rows:
        b = base.get(tuple(r[k] for k in keys))
        r["speedup"] = round(r["q_per_min"] / b, 3) if b else None


def fmt_speedup(speedup: Optional[float], suffix: str = "x") -> str:
    """``speedup`` as ``" 1.23x"``; a right-aligned ``-`` of the same width when there is none (its baseline's q/min
    was 0: :func:`add_ratios`)."""
    return f"{'-':>{5 + len(suffix)}}" if speedup is None else f"{speedup:>5.2f}{suffix}"


def why_row(base: Dict[str, Any], spex: Dict[str, Any], step_s: float) -> Dict[str, Any]:
    """Why a speedup is what it is (batch 1, pure scheduling).

    ``hit_share``: adopted speculative nodes / the baseline's requests; ``amdahl_bound``: the speedup if every
    adopted node had cost the primary search nothing (1 / (1 − hit_share)). ``crit_bound``: baseline time per
    question / the critical path — the longest root-to-node chain decoded at ``step_s`` per token (a child's
    prompt holds its parent's text, so no tree-preserving schedule beats it)."""
    s = spex.get("speculation") or {}
    base_req = base["requests_per_q"] * max(len(base["answers"]), 1)
    hits = s.get("hits", 0)
    share = hits / base_req if base_req else 0.0
    per_q = base["virtual_time_s"] / max(len(base["answers"]), 1)
    crit_s = base["crit_path_tokens_per_q"] * step_s
    return {
        "base_s_per_q": round(per_q, 2),
        "crit_path_s": round(crit_s, 2),
        "crit_bound": round(per_q / crit_s, 2) if crit_s else None,
        "requests_per_q": base["requests_per_q"],
        "max_depth_per_q": base["max_depth_per_q"],
        "hits": hits,
        "issued": s.get("issued", 0),
        "hit_rate": s.get("hit_rate"),
        "in_flight_share": round(s.get("in_flight_adopted", 0) / hits, 3) if hits else None,
        "hit_share": round(share, 3),
        "amdahl_bound": round(1.0 / (1.0 - share), 2) if share < 1 else None,
        "mean_batch": (base["mean_batch"], spex["mean_batch"]),
    }


def require_fit(device: str, model: str) -> None:
    """Exit with the simulator's message before any run when ``model``'s weights leave no KV room on ``device``."""
    try:
        RooflineCost(device, model).max_kv_tokens()
    except ValueError as e:
        raise SystemExit(f"--device {device} --model {model}: {e}")


def meta(source: str, args: Any) -> Dict[str, Any]:
    return {"source": source, "host_cpus": os.cpu_count(), "python": platform.python_version(), "args": vars(args)}


def parse_list(text: str, cast=str) -> List[Any]:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def save_figure(fig, path, title: Optional[str] = None, **suptitle_kw: Any) -> None:
    """Title, lay out, write (creating the folder) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    if title is not None:
        fig.suptitle(title, fontsize=9, **suptitle_kw)
    if "rect" not in suptitle_kw:
        fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_results(out: str, source: str, args: Any, t0: float, plot_path: Any, **sections: Any) -> None:
    """Write ``{"meta": ..., **sections}`` as JSON (creating the folder) and say where it went."""
    import json
    import time
    from pathlib import Path

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    m = meta(source, args)
    m["elapsed_s"] = round(time.monotonic() - t0, 1)
    path.write_text(json.dumps({"meta": m, **sections}, indent=1))
    print(f"wrote {path} and {plot_path} ({m['elapsed_s']} s)")
