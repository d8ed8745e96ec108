"""ETS (efficient tree search): REBASE plus an integer program that chooses which leaves to keep.

For the candidate leaves of a depth, maximise
  Σ O_i x_i − λc·Σ_j cost·y_j − λc·Σ_i cost·x_i + (λs / K)·Σ_k z_k
with x_i (keep leaf i), y_j (keep ancestor j), z_k (semantic cluster k covered), subject to y_j ≥ x_i for each
leaf i under j, y_j ≤ Σ x_i under j, z_k ≤ Σ x_i in cluster k, Σ x ≥ 1. O_i is the REBASE allocation of
leaf i normalised to sum 1, cost = 1/(M+N) for every node (M ancestors, N leaves). Clusters: embeddings of
the leaves' last steps, average linkage, cosine distance, cut at 0.05. Then REBASE's softmax allocation runs
again over the kept leaves. Solver: CBC through PuLP. SPEX's early expansion predicts ETS's widths with ETS's
own rule over the leaves scored so far (:meth:`Ets.predict_keep`, the ILP, then the allocation over the kept
ones and the still-pending siblings), so a leaf the ILP would drop is not expanded early.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
from pulp import PULP_CBC_CMD, LpMaximize, LpProblem, LpVariable, lpSum

from sglang_spex.tot.embed import cluster_texts
from sglang_spex.tot.policies.base import SearchHost
from sglang_spex.tot.policies.rebase import Rebase, RebaseParams, allocate_widths
from sglang_spex.tot.tree import Node
from sglang_spex.tot.validation import check, check_finite

EMBEDDERS = ("auto", "minilm", "tfidf")
TIE_WEIGHT = 1e-9  # ilp_select_exact's tie-break weight (objective differences are >= ~1e-5 at these sizes)
EXACT_MAX_LEAVES = 16  # up to this many candidates a prediction enumerates every subset (<= 2^16) instead of CBC
LAMBDA_C_ZERO_BONUS = 1e-4  # the reference's per-node bonus in place of the cost at lambda_c = 0 (node_cost_weight)


@dataclass
class EtsParams(RebaseParams):
    lambda_c: float = 1.0
    lambda_s: float = 1.5
    cluster_threshold: float = 0.05
    embedder: str = "auto"  # auto | minilm | tfidf

    def validate(self) -> None:
        super().validate()
        check_finite(self.lambda_c, "policy.lambda_c", 0)
        check_finite(self.lambda_s, "policy.lambda_s", 0)
        check(0 < self.cluster_threshold < 2, "policy.cluster_threshold", "must be in (0, 2)")
        check(self.embedder in EMBEDDERS, "policy.embedder", "must be auto, minilm or tfidf")


def outcome_scores(scores: Sequence[float], width: int, temperature: float) -> List[float]:
    """O_i: the REBASE allocation normalised to sum 1."""
    alloc = allocate_widths(scores, width, temperature)
    total = sum(alloc)
    return [a / total if total else 0.0 for a in alloc]


def node_cost_weight(lambda_c: float) -> float:
    """λc as the program uses it: at 0 the reference (ETS ``rebase.py``) turns the cost into a bonus of 1e-4 per
    kept node (x 1/(M+N)), so among leaves no term tells apart every one is kept, not an arbitrary subset."""
    return -LAMBDA_C_ZERO_BONUS if lambda_c == 0 else lambda_c


def ilp_select(
    outcome: Sequence[float],
    leaf_ancestors: Sequence[Sequence[str]],
    clusters: Optional[Sequence[int]] = None,
    lambda_c: float = 1.0,
    lambda_s: float = 1.5,
) -> List[bool]:
    """Which leaves to keep. ``leaf_ancestors[i]``: ids of the nodes above leaf i (any hashable ids);
    ``clusters[i]``: leaf i's semantic cluster, or None to drop the coverage term."""
    n = len(outcome)
    branches: Dict[str, List[int]] = {}
    for i, anc in enumerate(leaf_ancestors):
        for a in anc:
            branches.setdefault(a, []).append(i)
    m = len(branches)
    cost = 1.0 / (m + n)
    lambda_c = node_cost_weight(lambda_c)
    prob = LpProblem("ets_leaf_selection", LpMaximize)
    x = [LpVariable(f"x_{i}", cat="Binary") for i in range(n)]
    y = {a: LpVariable(f"y_{j}", cat="Binary") for j, a in enumerate(branches)}
    objective = lpSum(outcome[i] * x[i] for i in range(n))
    objective -= lpSum(lambda_c * cost * v for v in y.values()) + lpSum(lambda_c * cost * xi for xi in x)
    if clusters is not None and lambda_s > 0:
        labels = sorted(set(clusters))
        z = {k: LpVariable(f"z_{j}", cat="Binary") for j, k in enumerate(labels)}
        for k in labels:
            prob += lpSum(x[i] for i in range(n) if clusters[i] == k) >= z[k]
        objective += lpSum((lambda_s / len(labels)) * zk for zk in z.values())
    prob += objective
    for a, leaves in branches.items():
        prob += y[a] <= lpSum(x[i] for i in leaves)
        for i in leaves:
            prob += y[a] >= x[i]
    prob += lpSum(x) >= 1
    prob.solve(PULP_CBC_CMD(msg=0))
    return [bool(round(v.value() or 0)) for v in x]


def ilp_select_exact(
    outcome: Sequence[float],
    leaf_ancestors: Sequence[Sequence[str]],
    clusters: Optional[Sequence[int]] = None,
    lambda_c: float = 1.0,
    lambda_s: float = 1.5,
    prefer: Optional[Sequence[float]] = None,
) -> List[bool]:
    """:func:`ilp_select`'s program solved by enumerating every non-empty set of leaves, in process (numpy; for a
    few leaves: 2^n sets). Same optimum; among equal optima it keeps the one with the largest sum of ``prefer``
    (e.g. the leaves' scores: a cluster is covered by its best leaf), then the smallest bitmask, where CBC may
    return another."""
    n = len(outcome)
    branches: Dict[str, int] = {}  # ancestor -> bitmask of its leaves
    for i, anc in enumerate(leaf_ancestors):
        for a in anc:
            branches[a] = branches.get(a, 0) | (1 << i)
    cost = node_cost_weight(lambda_c) / (len(branches) + n)
    value = np.zeros(1 << n)  # value[s]: the objective of the set with bitmask s, built up one leaf at a time
    for i in range(n):
        tie = TIE_WEIGHT * prefer[i] if prefer is not None else 0.0  # below any real difference of the objective
        value[1 << i : 2 << i] = value[: 1 << i] + (outcome[i] - cost + tie)
    sets = np.arange(1 << n, dtype=np.int64)
    for leaves in branches.values():
        value -= cost * ((sets & leaves) != 0)
    if clusters is not None and lambda_s > 0:
        labels = sorted(set(clusters))
        for k in labels:
            members = sum(1 << i for i in range(n) if clusters[i] == k)
            value += (lambda_s / len(labels)) * ((sets & members) != 0)
    best = int(np.argmax(value[1:])) + 1  # a non-empty set
    return [bool(best >> i & 1) for i in range(n)]


class Ets(Rebase):
    """REBASE's BFS loop with the ILP choosing which candidates keep a width."""

    name = "ets"
    params_type = EtsParams

    def clusters(self, cands: Sequence[Node]) -> Optional[List[int]]:
        """Semantic cluster of each candidate's last step, or None when the coverage term is off or moot."""
        p = self.params
        texts = [n.text for n in cands]
        if p.lambda_s <= 0 or len(cands) < 2 or len(set(texts)) < 2:
            return None
        return cluster_texts(texts, p.cluster_threshold, p.embedder)

    def predict_keep(self, cands: Sequence[Node], width: int) -> List[bool]:
        """The ILP's keep/drop of each candidate (ETS's frontier rule), same order, for SPEX's prediction: solved in
        process up to :data:`EXACT_MAX_LEAVES` candidates (:func:`ilp_select_exact`), else by CBC."""
        if len(cands) > EXACT_MAX_LEAVES:
            return self.keep(cands, width, ilp_select)
        return self.keep(cands, width, functools.partial(ilp_select_exact, prefer=[self.score(n) for n in cands]))

    def keep(self, cands: Sequence[Node], width: int, solve: Callable[..., List[bool]] = ilp_select) -> List[bool]:
        """The ILP's keep/drop of each candidate, same order, solved by ``solve``."""
        p = self.params
        return solve(
            outcome_scores([self.score(n) for n in cands], width, p.softmax_temperature),
            [[a.path for a in n.ancestors()] for n in cands],
            self.clusters(cands),
            p.lambda_c,
            p.lambda_s,
        )

    def select_widths(self, cands: Sequence[Node], width: int) -> List[int]:
        """ILP keep/drop over the candidates, then the REBASE allocation over the kept ones."""
        scores = [self.score(n) for n in cands]
        kept = [i for i, k in enumerate(self.keep(cands, width)) if k]  # CBC, as ETS's own code
        sub = self.predict_widths([scores[i] for i in kept], width)
        out = [0] * len(cands)
        for i, w in zip(kept, sub):
            out[i] = w
        return out

    async def select(self, ctx: SearchHost, cands: List[Node], width: int, depth: int) -> List[int]:
        return await asyncio.to_thread(self.select_widths, cands, width)  # embeddings + CBC off the event loop
