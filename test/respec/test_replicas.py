"""One learner feeding every replica: a tiny EAGLE3 CPU server, a ``--dp-size 2`` one (two DP ranks) and a dead URL
behind one ``ReplicaPublisher``.

Both servers start with drafter version 0. The learner (in this process) distils on the servers' own greedy
continuations of a few prompts and publishes version 1 to the list. Served acceptance must change on the single
server and on *each* DP rank of the other (requests pinned with SGLang's ``routed_dp_rank``; fewer verify passes for
the same greedy tokens: the drafter they run is the new one), each server reports drafter version 1
(``/respec/drafter``, ``/spex/info``) while SGLang's ``weight_version`` (the policy's) stays ``default``, and the dead
replica is reported as failed while the others update. SGLang 0.5.23's own ``/update_weights_from_tensor`` refuses
``--dp-size`` > 1; the publisher's client sends the DP server's update step to the plugin's
``/respec/drafter/update_weights_from_tensor`` (touch point W6), which reaches every rank.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import pytest
import requests
import torch
from respec_servers import RespecServer
from workloads import COMMON

from sglang_spex.config import LearnerConfig
from sglang_spex.respec.drafter import Eagle3Drafter
from sglang_spex.respec.hotswap import ReplicaPublisher
from sglang_spex.respec.learner import OnlineLearner
from sglang_spex.respec.target import TargetFeatures
from sglang_spex.serve import free_port

EAGLE = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
DRAFT_VOCAB = 64
N_NEW = 24


def _prompts() -> List[List[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 344, (6,), generator=g).tolist() for _ in range(4)]


@pytest.fixture(scope="module")
def drafter_v0(tiny_target) -> Eagle3Drafter:
    counts = torch.zeros(tiny_target.config.vocab_size)
    for p in _prompts():
        for x in p:
            counts[x] += 1
    counts += torch.rand(tiny_target.config.vocab_size, generator=torch.Generator().manual_seed(1))
    return Eagle3Drafter.for_target(tiny_target, DRAFT_VOCAB, counts, seed=0).float()


@pytest.fixture(scope="module")
def replicas(tiny_model, drafter_v0, tmp_path_factory) -> Iterator[List[RespecServer]]:
    path = drafter_v0.save_pretrained(tmp_path_factory.mktemp("replica-drafter"), dtype=torch.float32)
    args = ["--model-path", tiny_model, *COMMON, "--max-total-tokens", "4096"]
    args += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(path), *EAGLE]
    with RespecServer(args, "overlap") as a, RespecServer([*args, "--dp-size", "2"], "overlap") as b:
        yield [a, b]


def _served(url: str, rank: Optional[int] = None) -> Tuple[List[List[int]], List[int]]:
    """Greedy tokens and verify passes of every prompt (one batch; on DP rank ``rank`` when given)."""
    body = {"input_ids": _prompts(), "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}}
    if rank is not None:
        body["routed_dp_rank"] = rank
    r = requests.post(url + "/generate", json=body, timeout=300)
    r.raise_for_status()
    return [x["output_ids"] for x in r.json()], [x["meta_info"]["spec_verify_ct"] for x in r.json()]


def _targets(urls: List[str]) -> List[Tuple[str, Optional[int]]]:
    """(url, rank) of every scheduler: the single server, then each rank of the DP server."""
    return [(urls[0], None), (urls[1], 0), (urls[1], 1)]


def test_one_learner_updates_every_replica_and_reports_the_dead_one(replicas, drafter_v0, tiny_target):
    urls = [s.url for s in replicas]
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert requests.get(urls[1] + "/get_server_info", timeout=60).json()["dp_size"] == 2
    before: Dict[Tuple[str, Optional[int]], Tuple[List[List[int]], List[int]]] = {
        t: _served(*t) for t in _targets(urls)
    }
    assert all(sum(v) > 0 for _, v in before.values())  # the EAGLE3 draft/verify path serves these
    tokens = before[(urls[0], None)][0]
    assert all(out == tokens for out, _ in before.values())

    feats = TargetFeatures(tiny_target, drafter_v0.cfg.aux_layer_ids, drafter_v0.t2d)
    cfg = LearnerConfig(variant="unweighted", mode="sync", lr=3e-3, train_steps=80, update_interval=1)
    publisher = ReplicaPublisher([*urls, dead], timeout=120)
    learner = OnlineLearner(drafter_v0, feats.batch, cfg, publish=publisher)
    rollouts = [{"prompt_ids": p, "response_ids": r, "reward": 1.0} for p, r in zip(_prompts(), tokens)]
    learner.submit(rollouts)  # sync: trains and publishes version 1 before returning

    rec = learner.history[-1]
    assert rec.outcome == "published" and learner.version == 1, (rec.outcome, rec.reason)
    assert rec.reason == f"replicas_failed: {dead}"
    by_url = {r["url"]: r for r in rec.replicas}
    assert all(by_url[u]["ok"] and by_url[u]["version"] == 1 and by_url[u]["version_recorded"] for u in urls)
    assert not by_url[dead]["ok"] and by_url[dead]["step"] == "connect" and by_url[dead]["version"] is None
    assert {s["url"]: s["version"] for s in learner.state()["replicas"]} == {urls[0]: 1, urls[1]: 1, dead: None}

    for t in _targets(urls):  # each scheduler, each DP rank included, serves the new drafter
        out, verify = _served(*t)
        print(f"{t}: verify passes before {before[t][1]} after {verify}")
        assert out == tokens  # lossless: the same greedy tokens
        assert sum(verify) < sum(before[t][1]), (t, before[t][1], verify)  # the new drafter is accepted more
    for u in urls:
        assert requests.get(u + "/respec/drafter", timeout=30).json()["drafter_version"] == 1
        assert requests.get(u + "/spex/info", timeout=30).json()["drafter_version"] == 1
        assert requests.get(u + "/model_info", timeout=30).json()["weight_version"] == "default"
