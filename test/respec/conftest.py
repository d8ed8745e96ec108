"""Fixtures for the ReSpec tests: the tiny Llama target (float32), a drafter for it, fixed sequences, and the
greedy reference outputs of the suite's plain server (``plain_server``), shared by every ReSpec server test."""

from __future__ import annotations

import copy
from typing import Dict

import pytest
import requests
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from workloads import COMMON, reference_outputs

from sglang_spex.respec import routes
from sglang_spex.respec.drafter import Eagle3Drafter
from sglang_spex.respec.learner import LearnerConfig, OnlineLearner
from sglang_spex.respec.target import TargetFeatures

DRAFT_VOCAB = 64


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def respec_reference(plain_server) -> Dict[str, dict]:
    """Plain SGLang's greedy outputs (no speculation) of every ReSpec prompt set (``workloads.reference_outputs``),
    from the session's plain server, which runs ReSpec's ``COMMON`` flags (``spex_cpu`` is the CPU default)."""
    info = requests.get(plain_server.url + "/server_info", timeout=60).json()
    assert (info["attention_backend"], info["dtype"]) == (COMMON[3], COMMON[1]), "plain_server no longer runs COMMON"
    return reference_outputs(plain_server.url)


@pytest.fixture(scope="session")
def tiny_target(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_seqs():
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randint(3, 344, (5,), generator=g).tolist(), torch.randint(3, 344, (9,), generator=g).tolist())
        for _ in range(6)
    ]


def make_drafter(target, seqs, seed: int = 0) -> Eagle3Drafter:
    counts = torch.zeros(target.config.vocab_size)
    for p, r in seqs:
        for x in list(p) + list(r):
            counts[x] += 1
    return Eagle3Drafter.for_target(target, DRAFT_VOCAB, counts, seed=seed)


@pytest.fixture(scope="session")
def drafter_dir(tiny_target, tmp_path_factory):
    """An untrained EAGLE-3 drafter for the tiny target (draft vocabulary: the first 128 ids), saved for a server."""
    drafter = Eagle3Drafter.for_target(tiny_target, 128, torch.arange(tiny_target.config.vocab_size).float())
    return drafter.save_pretrained(tmp_path_factory.mktemp("drafter"), dtype=torch.float32)


@pytest.fixture
def tiny_drafter(tiny_target, tiny_seqs) -> Eagle3Drafter:
    return make_drafter(tiny_target, tiny_seqs)


@pytest.fixture
def tiny_features(tiny_target, tiny_drafter) -> TargetFeatures:
    return TargetFeatures(tiny_target, tiny_drafter.cfg.aux_layer_ids, tiny_drafter.t2d)


@pytest.fixture
def tiny_batch(tiny_features, tiny_seqs):
    return tiny_features.batch(tiny_seqs)


@pytest.fixture
def served(tiny_target, tiny_drafter):
    """``(client, policy copy, learner)``: an app with the learner routes whose policy copy is its own (the session's
    tiny target stays as it is); server errors come back as 500 answers."""
    feats = TargetFeatures(copy.deepcopy(tiny_target), tiny_drafter.cfg.aux_layer_ids, tiny_drafter.t2d)
    lrn = OnlineLearner(
        tiny_drafter, feats.batch, LearnerConfig(variant="frozen", mode="sync"), policy_sync=feats.load_weights
    )
    app = FastAPI()
    routes.install(app, lrn)
    return TestClient(app, raise_server_exceptions=False), feats.model, lrn
