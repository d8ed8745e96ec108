"""One learner feeding every replica: two tiny EAGLE3 CPU servers (and a dead URL) behind one ``ReplicaPublisher``.

Both servers start with drafter version 0. The learner (in this process) distils on the servers' own greedy
continuations of a few prompts and publishes version 1 to the list. Served acceptance must change on both servers
(fewer verify passes for the same greedy tokens: the drafter they run is the new one), each server reports drafter
version 1 (``/respec/drafter``, ``/spex/info``) while SGLang's ``weight_version`` (the policy's) stays
``default``, and the dead replica is reported as failed while the others update.

Why two servers and not one ``--dp-size 2`` server: SGLang 0.5.23 refuses ``update_weights_from_tensor`` under data
parallelism (``TokenizerManager.update_weights_from_tensor`` asserts ``dp_size == 1``), so DP ranks cannot take a
drafter push at all.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Tuple

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
    with RespecServer(args, "overlap") as a, RespecServer(args, "overlap") as b:
        yield [a, b]


def _served(url: str) -> Tuple[List[List[int]], List[int]]:
    """Greedy tokens and verify passes of every prompt (one batch)."""
    body = {"input_ids": _prompts(), "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}}
    r = requests.post(url + "/generate", json=body, timeout=300)
    r.raise_for_status()
    return [x["output_ids"] for x in r.json()], [x["meta_info"]["spec_verify_ct"] for x in r.json()]


def test_one_learner_updates_every_replica_and_reports_the_dead_one(replicas, drafter_v0, tiny_target):
    urls = [s.url for s in replicas]
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    before: Dict[str, Tuple[List[List[int]], List[int]]] = {u: _served(u) for u in urls}
    assert all(sum(v) > 0 for _, v in before.values())  # the EAGLE3 draft/verify path serves these
    tokens = before[urls[0]][0]
    assert before[urls[1]][0] == tokens

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

    for u in urls:
        out, verify = _served(u)
        print(f"{u}: verify passes before {before[u][1]} after {verify}")
        assert out == tokens  # lossless: the same greedy tokens
        assert sum(verify) < sum(before[u][1]), (u, before[u][1], verify)  # the new drafter is accepted more
        assert requests.get(u + "/respec/drafter", timeout=30).json()["drafter_version"] == 1
        assert requests.get(u + "/spex/info", timeout=30).json()["drafter_version"] == 1
        assert requests.get(u + "/model_info", timeout=30).json()["weight_version"] == "default"
