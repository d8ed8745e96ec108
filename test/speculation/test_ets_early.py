"""T1 BFS early expansion under ETS predicts with ETS's own rule (its ILP, then the allocation), not REBASE's."""

from __future__ import annotations

import asyncio

from unit.fake_port import FakePort

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.bfs_early import predict_is_costly, predicted_widths
from sglang_spex.speculation.runner import context_factory
from sglang_spex.tot.policies.ets import Ets, EtsParams
from sglang_spex.tot.policies.rebase import Rebase, RebaseParams
from sglang_spex.tot.search import run_search
from sglang_spex.tot.search_spec import SearchSpec
from sglang_spex.tot.tree import DONE, GENERATING, Tree


def level(*rewards):
    tree = Tree(0)
    out = []
    for i, r in enumerate(rewards):
        node = tree.child(tree.root, i)
        node.status, node.reward, node.text = (GENERATING, None, "") if r is None else (DONE, r, f"step {i}")
        out.append(node)
    return out


def test_ets_prediction_drops_what_its_ilp_drops():
    # O = REBASE allocation normalised: scores 1.0 / 0.7 at T 0.2 -> widths 7 / 1 -> O = 0.875 / 0.125;
    # node cost 1/(1 ancestor + 2 leaves) = 1/3 > 0.125, so without the coverage term the ILP keeps only r.0
    nodes = level(1.0, 0.7)
    assert predicted_widths(Rebase(RebaseParams(width=8)), nodes, 8) == {"r.0": 7, "r.1": 1}
    ets = Ets(EtsParams(width=8, lambda_s=0.0, embedder="tfidf"))
    assert predict_is_costly(ets) and not predict_is_costly(Rebase(RebaseParams(width=8)))
    assert predicted_widths(ets, nodes, 8) == {"r.0": 8, "r.1": 0}


def test_ets_prediction_keeps_width_for_pending_siblings():
    nodes = level(1.0, 0.7, None)  # the pending sibling is imputed with the mean score, as under REBASE
    widths = predicted_widths(Ets(EtsParams(width=8, lambda_s=0.0, embedder="tfidf")), nodes, 8)
    assert widths["r.1"] == 0 and 0 < widths["r.0"] < 8


def test_ets_search_with_threaded_predictions_returns_the_baseline_tree():
    spec = SearchSpec.from_dict(
        {
            "policy": {"name": "ets", "width": 4, "max_depth": 3, "embedder": "tfidf"},
            "step": {"max_tokens": 8},
            "reward": {"type": "verifier", "name": "arith"},
            "seed": 5,
        }
    )
    base = asyncio.run(run_search(spec, "What is 2 + 3?", FakePort(delay=0.002)))
    cfg = SpexConfig(enabled=True, k_total=8, components=("t1", "t2"))
    spx = asyncio.run(run_search(spec, "What is 2 + 3?", FakePort(delay=0.002), context_factory=context_factory(cfg)))
    sig = lambda r: sorted((n["path"], n["text"], n["status"]) for n in r.nodes)  # noqa: E731
    assert sig(spx) == sig(base)
    acc = spx.speculation
    assert acc["issued"] > 0 and acc["hits"] > 0  # the threaded ILP predictions were applied and used
    assert acc["hits"] + acc["cancelled"] + acc["never_used"] + acc["failed"] == acc["issued"]
