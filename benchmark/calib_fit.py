"""Calibration, workload side: fit the simulator's synthetic workload to the trees of real runs.

The real trees (``SearchResult.nodes``, compacted to what the fit needs) give the step-length distribution
(cut at the step cap) and where paths end by depth; :func:`fit_workload` turns them into
:class:`~sglang_spex.sim.workload.WorkloadParams`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from typing import Any, Dict, List, Tuple

import numpy as np

from sglang_spex.sim.workload import WorkloadParams
from sglang_spex.tot.search import SearchResult
from sglang_spex.tot.search_spec import SearchSpec

NODE_KEYS = ("depth", "tokens", "finish_reason", "terminal", "status")


def compact_trees(results: List[SearchResult]) -> List[List[Dict[str, Any]]]:
    """What the workload fit needs from each result tree (kept in the JSON for ``--from-json`` reruns)."""
    return [[{k: n[k] for k in NODE_KEYS} for n in r.nodes] for r in results]


def _lognormal_cut_mean(median: float, sigma: float, cap: int) -> float:
    z = np.linspace(-4, 4, 801)
    w = np.exp(-z * z / 2)
    x = np.minimum(np.maximum(np.round(median * np.exp(sigma * z)), 1), cap)
    return float((x * w).sum() / w.sum())


def fit_workload(
    trees: List[List[Dict[str, Any]]], step_tokens: int, max_depth: int, question_words: int
) -> Tuple[WorkloadParams, Dict]:
    """WorkloadParams whose step lengths and path ends match the real trees.

    Lengths: a log-normal cut at the step cap, with (median, σ) chosen so that the share of steps cut at the
    cap and the mean step length both match. Path ends: the measured share of nodes at each depth < max_depth
    that end their path (answer or EOS), as a hazard ``h0 · growth^(d − d0)`` fitted in log space (a step cut at
    the cap never ends its path, so the hazard is the measured share over the uncut share)."""
    nodes = [n for t in trees for n in t if n["depth"] > 0 and n["status"] == "done"]
    toks = [max(int(n["tokens"]), 1) for n in nodes]
    p_cut = sum(t >= step_tokens for t in toks) / max(len(toks), 1)
    mean_tok = statistics.mean(toks) if toks else step_tokens / 2
    z_cut = statistics.NormalDist().inv_cdf(min(max(1 - p_cut, 0.01), 0.99))
    best = None
    for sigma in np.linspace(0.05, 2.5, 50):  # median from the cut share, σ from the mean
        median = step_tokens * math.exp(-sigma * z_cut)
        err = abs(_lognormal_cut_mean(median, sigma, step_tokens) - mean_tok)
        if best is None or err < best[0]:
            best = (err, median, sigma)
    _, median, sigma = best
    by_depth: Dict[int, List[bool]] = defaultdict(list)
    for n in nodes:
        by_depth[n["depth"]].append(bool(n["terminal"]) and n["finish_reason"] != "length")
    rates = {d: sum(v) / len(v) for d, v in sorted(by_depth.items()) if v and d < max_depth}
    # a simulated step that runs past the cap is cut before its answer: the hazard must be higher by 1/(1 - p_cut)
    # for the share of nodes that end their path to match the measured one
    ends = [(d, min(r / max(1.0 - p_cut, 0.05), 1.0)) for d, r in rates.items() if r > 0]
    min_d, h0, growth = (ends[0][0], ends[0][1], 1.0) if ends else (max_depth, 1e-3, 1.0)
    if len(ends) >= 2:  # least squares of log rate vs depth
        ds, ls = np.array([d for d, _ in ends], float), np.log([r for _, r in ends])
        slope, icpt = np.polyfit(ds, ls, 1)
        growth, h0 = math.exp(slope), math.exp(icpt + slope * min_d)
    params = WorkloadParams(
        lengths="bfs",
        bfs_median_tokens=float(median),
        bfs_sigma=float(sigma),
        min_tokens=1,
        min_answer_depth=int(min_d),
        answer_hazard=float(min(max(h0, 1e-3), 1.0)),
        answer_hazard_growth=float(min(max(growth, 0.2), 4.0)),
        question_words=int(question_words),
    )
    measured = {
        "nodes": len(nodes),
        "mean_step_tokens": round(mean_tok, 2),
        "cut_at_cap": round(p_cut, 3),
        "terminal_rate_by_depth": {str(d): round(r, 3) for d, r in rates.items()},
        "question_words": question_words,
    }
    return params, measured


def tree_stats(trees: List[List[Dict[str, Any]]]) -> Dict[str, Any]:
    """Nodes per question, mean step length and deepest node per question of compacted trees."""
    nodes = [n for t in trees for n in t if n["depth"] > 0 and n["status"] == "done"]
    n = max(len(trees), 1)
    return {
        "nodes_per_q": round(len(nodes) / n, 1),
        "mean_step_tokens": round(statistics.mean(x["tokens"] for x in nodes), 1) if nodes else None,
        "max_depth_per_q": round(sum(max((x["depth"] for x in t), default=0) for t in trees) / n, 2),
    }


def sim_spec_like(real: SearchSpec) -> SearchSpec:
    """The real spec minus the task checker (the simulated workload has its own references)."""
    return dataclasses.replace(real, task=None)


def match_tree_size(
    params: WorkloadParams,
    spec: SearchSpec,
    target_nodes_per_q: float,
    questions: int,
    seeds: List[int],
    iterations: int = 14,
) -> Tuple[WorkloadParams, Dict[str, float]]:
    """Scale the path-end hazard so the simulated baseline's nodes per question match the real trees'.

    Per-depth end rates do not pin the tree size: siblings in a real tree share their parent's text, so their
    ends are correlated, which the simulated workload (independent per node) does not model, and MCTS policies
    steer rollouts towards unfinished branches. The baseline tree does not depend on timing, so any cost model
    serves; the scale is found by bisection in log space."""
    from sglang_spex.sim.run import simulate
    from sglang_spex.sim.workload import Workload

    def nodes_per_q(scale: float) -> float:
        p = dataclasses.replace(params, answer_hazard=min(params.answer_hazard * scale, 1.0))
        total = 0.0
        for s in seeds:
            run = simulate(spec, cost=("A100-80G", "Llemma-7B"), workload=Workload(p, seed=s), questions=questions)
            total += tree_stats(compact_trees(run.results))["nodes_per_q"]
        return total / len(seeds)

    lo, hi = math.log(0.05), math.log(1.0 / max(params.answer_hazard, 1e-3))
    for _ in range(iterations):  # more hazard -> shorter paths -> fewer nodes
        mid = (lo + hi) / 2
        if nodes_per_q(math.exp(mid)) > target_nodes_per_q:
            lo = mid
        else:
            hi = mid
    scale = math.exp((lo + hi) / 2)
    fitted = dataclasses.replace(params, answer_hazard=min(params.answer_hazard * scale, 1.0))
    return fitted, {
        "hazard_scale": round(scale, 4),
        "nodes_per_q_target": target_nodes_per_q,
        "nodes_per_q_fitted": nodes_per_q(scale),
    }
