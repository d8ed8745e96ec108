"""Drafter checkpoints: SGLang's own LlamaForCausalLMEagle3 (CPU, no server) loads every tensor we save and
every tensor a hot-swap sends; our save/load round-trips; vocabulary mapping and TTT attention layout."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from sglang_spex.respec.drafter import ARCH, Eagle3Drafter, default_aux_layers
from sglang_spex.respec.hotswap import serialize_named_tensors
from sglang_spex.respec.ttt import unroll

PROBE = Path(__file__).with_name("sglang_probe.py")


def test_default_aux_layers():
    assert default_aux_layers(30) == [2, 15, 27]
    assert default_aux_layers(2) == [0, 1]


def test_config_fields_and_roundtrip(tiny_drafter, tmp_path):
    tiny_drafter.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [ARCH]
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == 64 and cfg["vocab_size"] == 344
    # SGLang captures at (id + 1): ids are stored as capture index − 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 0]
    back = Eagle3Drafter.from_pretrained(tmp_path)
    assert torch.equal(back.t2d, tiny_drafter.t2d) and torch.equal(back.d2t, tiny_drafter.d2t)
    for (n, a), (_, b) in zip(tiny_drafter.state_dict().items(), back.state_dict().items()):
        assert torch.allclose(a.float(), b.float(), atol=1e-2), n  # saved in bf16


def test_vocab_mapping(tiny_drafter):
    ids = tiny_drafter.draft_to_target
    assert torch.equal(ids, torch.nonzero(tiny_drafter.t2d).flatten())
    assert bool((ids[1:] > ids[:-1]).all())


def test_ttt_step_sees_only_its_prefix_and_chain(tiny_drafter, tiny_batch):
    """Step i at position t reads tokens up to t+1+i; changing later tokens leaves it unchanged."""
    base = unroll(tiny_drafter, tiny_batch, steps=3)
    changed = tiny_batch.select(range(len(tiny_batch)))
    changed.input_ids = changed.input_ids.clone()
    changed.input_ids[:, 8:] = 3
    other = unroll(tiny_drafter, changed, steps=3)
    for i in range(3):
        last = 8 - 1 - i  # position t reads x_{t+1+i} (and x_{<=t+1+i} through attention)
        assert torch.allclose(base[i].log_q[:, :last], other[i].log_q[:, :last], atol=1e-5)


def _run_probe(ckpt: Path, target: str, payload: str = "") -> dict:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, str(PROBE), str(ckpt), target, payload],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_sglang_loads_checkpoint_and_hot_swap(tiny_drafter, tiny_model, tmp_path):
    ckpt = tiny_drafter.save_pretrained(tmp_path / "ckpt")
    # a hot-swap payload: every trainable weight changed
    moved = Eagle3Drafter.from_pretrained(ckpt)
    with torch.no_grad():
        for p in moved.parameters():
            if p.requires_grad:
                p.add_(0.5)
    payload = tmp_path / "payload.json"
    payload.write_text(json.dumps(serialize_named_tensors(moved.hot_swap_tensors())))
    rep = _run_probe(ckpt, tiny_model, str(payload))

    assert rep["config"]["architectures"] == [ARCH]
    assert rep["config"]["draft_vocab_size"] == 64 and rep["config"]["num_aux"] == 2
    assert rep["config"]["load_lm_head_from_target"] is False
    assert rep["hot_token_id_ok"]
    for name, d in rep["checkpoint_diff"].items():  # every SGLang parameter written with our values
        assert isinstance(d, float) and math.isfinite(d) and d < 1e-6, (name, d)
    names = set(rep["payload_names"])
    assert "embed_tokens.weight" not in names and "d2t" not in names and "t2d" not in names
    for name, d in rep["payload_diff"].items():  # the swap reached every trainable tensor, embedding kept
        assert isinstance(d, float) and d < 1e-6, (name, d)
