"""EAGLE-3 drafters in the ecosystem's layout (SpecForge / SGLang: config.json with LlamaForCausalLMEagle3,
safetensors, ``midlayer.*`` names, optional embedding and d2t/t2d): load as the learner's starting point, save,
round trip, and a real CPU SGLang server started with ``--speculative-draft-model-path`` on such a checkpoint
serves the plain greedy tokens with speculation on."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from workloads import COMMON, WORKLOADS, generate

from sglang_spex.respec.checkpoint import normalize_name, read_tensors
from sglang_spex.respec.drafter import ARCH, DrafterConfig, Eagle3Drafter
from sglang_spex.serve import ServerProcess

EAGLE = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]


def _specforge_dir(drafter: Eagle3Drafter, path, keep=("t2d", "d2t"), embed: bool = False):
    """A checkpoint written the way SpecForge does it (by hand here): ``midlayer.`` names, its config keys only
    (no ``respec`` section, no ``head_dim``), the embedding left out unless ``embed``."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in drafter.state_dict().items():
        if name in ("t2d", "d2t") and name not in keep:
            continue
        if name == "embed_tokens.weight" and not embed:
            continue
        tensors[name.replace("layers.0.", "midlayer.")] = t.detach().clone().contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    c = drafter.cfg
    config = {
        "architectures": [ARCH],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.aux_layer_ids]},
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def _same(a: Eagle3Drafter, b: Eagle3Drafter) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_specforge_checkpoint_loads_with_the_target_embedding(tiny_drafter, tiny_target, tmp_path):
    ckpt = _specforge_dir(tiny_drafter, tmp_path / "sf")
    assert "embed_tokens.weight" not in load_file(str(ckpt / "model.safetensors"))
    loaded = Eagle3Drafter.from_pretrained(ckpt, target_model=tiny_target)
    _same(loaded, tiny_drafter)  # for_target copied the target's embedding, the loader borrowed the same one
    assert loaded.cfg.aux_layer_ids == tiny_drafter.cfg.aux_layer_ids
    with pytest.raises(KeyError, match="embed_tokens"):
        Eagle3Drafter.from_pretrained(ckpt)  # no target to take the embedding from


@pytest.mark.parametrize("keep", [("t2d",), ("d2t",)])
def test_either_vocab_tensor_is_enough(tiny_drafter, tiny_target, tmp_path, keep):
    loaded = Eagle3Drafter.from_pretrained(_specforge_dir(tiny_drafter, tmp_path, keep), target_model=tiny_target)
    assert torch.equal(loaded.t2d, tiny_drafter.t2d) and torch.equal(loaded.d2t, tiny_drafter.d2t)


def test_full_vocab_drafter_without_vocab_tensors_or_head(tiny_target, tmp_path):
    """draft vocabulary = target vocabulary: no d2t/t2d needed; a missing lm_head comes from the target."""
    full = Eagle3Drafter.for_target(tiny_target, tiny_target.config.vocab_size, seed=1)
    ckpt = _specforge_dir(full, tmp_path, keep=())
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    loaded = Eagle3Drafter.from_pretrained(ckpt, target_model=tiny_target)
    assert bool(loaded.t2d.all()) and not bool(loaded.d2t.any())
    assert torch.equal(loaded.lm_head.weight, tiny_target.get_output_embeddings().weight)


def test_save_load_round_trip_in_both_layouts(tiny_drafter, tmp_path):
    with torch.no_grad():
        for p in tiny_drafter.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)  # not the for_target initialisation
    sf = tiny_drafter.save_pretrained(tmp_path / "sf", dtype=torch.float32, layout="specforge")
    names = set(load_file(str(sf / "model.safetensors")))
    assert any(n.startswith("midlayer.") for n in names) and not any(n.startswith("layers.") for n in names)
    assert {"d2t", "t2d", "embed_tokens.weight", "fc.weight", "lm_head.weight", "norm.weight"} <= names
    back = Eagle3Drafter.from_pretrained(sf)
    _same(back, tiny_drafter)
    sg = back.save_pretrained(tmp_path / "sg", dtype=torch.float32, layout="sglang")
    assert any(n.startswith("layers.0.") for n in load_file(str(sg / "model.safetensors")))
    _same(Eagle3Drafter.from_pretrained(sg), tiny_drafter)
    assert read_tensors(sf).keys() == read_tensors(sg).keys()
    with pytest.raises(ValueError):
        tiny_drafter.save_pretrained(tmp_path / "x", layout="bogus")


def test_sharded_checkpoint(tiny_drafter, tmp_path):
    state = {n.replace("layers.0.", "midlayer."): t for n, t in tiny_drafter.checkpoint_tensors(torch.float32).items()}
    names = sorted(state)
    half = len(names) // 2
    save_file({n: state[n] for n in names[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: state[n] for n in names[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {n: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, n in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    (tmp_path / "config.json").write_text(json.dumps(tiny_drafter.cfg.to_hf_dict()))
    _same(Eagle3Drafter.from_pretrained(tmp_path), tiny_drafter)


def test_config_defaults_and_unsupported_variants(tiny_drafter):
    d = tiny_drafter.cfg.to_hf_dict()
    d.pop("respec")
    d.pop("eagle_config")
    d.pop("head_dim")
    target8 = SimpleNamespace(num_hidden_layers=8)
    cfg = DrafterConfig.from_hf_dict(d, target8)
    assert cfg.aux_layer_ids == [2, 4, 5]  # SGLang's capture default {2, N/2, N-3}
    assert cfg.head_dim == d["hidden_size"] // d["num_attention_heads"]
    with pytest.raises(ValueError, match="eagle_config"):
        DrafterConfig.from_hf_dict(d)
    for key, value in (("num_hidden_layers", 2), ("fc_norm", True), ("tie_word_embeddings", True), ("bias", True)):
        with pytest.raises(ValueError, match="not supported"):
            DrafterConfig.from_hf_dict({**d, key: value}, target8)
    with pytest.raises(ValueError, match="EAGLE-3"):
        DrafterConfig.from_hf_dict({**d, "architectures": ["LlamaForCausalLM"]}, target8)
    assert normalize_name("model.midlayer.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"


def test_sglang_server_serves_a_specforge_checkpoint(tiny_model, tiny_drafter, respec_reference, tmp_path):
    """SGLang's own EAGLE3 loader takes the SpecForge-style directory (midlayer names, no embedding): the server
    starts, drafts (verify passes > 0) and, greedy, returns the plain server's tokens."""
    ckpt = _specforge_dir(tiny_drafter, tmp_path / "sf")
    spec = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(ckpt), *EAGLE]
    with ServerProcess(["--model-path", tiny_model, *COMMON, *spec]) as srv:
        res = {k: generate(srv.url, texts) for k, texts in WORKLOADS.items()}
    for k, outs in res.items():
        assert [x["output_ids"] for x in outs] == respec_reference["workloads"][k], k
    metas = [x["meta_info"] for outs in res.values() for x in outs]
    assert sum(m.get("spec_verify_ct") or 0 for m in metas) > 0


def _head_from_target_dir(tiny_target, path):
    """A full-vocabulary drafter whose config's ``draft_vocab_size`` is null (SGLang then serves the target's lm_head
    tensor itself), with an lm_head of its own in the file that is *not* the target's."""
    full = Eagle3Drafter.for_target(tiny_target, tiny_target.config.vocab_size, seed=2)
    with torch.no_grad():
        full.lm_head.weight.add_(torch.randn_like(full.lm_head.weight))
    ckpt = _specforge_dir(full, path, keep=())
    config = json.loads((ckpt / "config.json").read_text())
    config["draft_vocab_size"] = None
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


def test_a_drafter_serving_the_targets_head_keeps_it_frozen_and_never_pushes_it(tiny_target, tmp_path):
    loaded = Eagle3Drafter.from_pretrained(_head_from_target_dir(tiny_target, tmp_path / "h"), target_model=tiny_target)
    assert loaded.cfg.head_from_target
    assert torch.equal(loaded.lm_head.weight, tiny_target.get_output_embeddings().weight)  # as SGLang serves it
    assert not loaded.lm_head.weight.requires_grad
    assert "lm_head.weight" not in dict(loaded.hot_swap_tensors())
    saved = loaded.save_pretrained(tmp_path / "again", dtype=torch.float32)
    assert json.loads((saved / "config.json").read_text())["draft_vocab_size"] is None  # SGLang still shares the head
    assert Eagle3Drafter.from_pretrained(saved, target_model=tiny_target).cfg.head_from_target
    # a config that names the draft vocabulary keeps its own, trainable head, pushed with the rest
    own = Eagle3Drafter.for_target(tiny_target, tiny_target.config.vocab_size, seed=2)
    assert not own.cfg.head_from_target and own.lm_head.weight.requires_grad
    assert "lm_head.weight" in dict(own.hot_swap_tensors())


def test_a_learner_push_into_a_drafter_sharing_the_targets_head_leaves_the_policy_alone(
    tiny_model, tiny_target, respec_reference, tmp_path
):
    """SGLang's drafter with a null ``draft_vocab_size`` holds the target's lm_head tensor: an lm_head in a drafter push
    would be written into the served policy's output head. The learner's push of a trained drafter (every trainable
    weight moved) leaves the server's greedy tokens as the plain server's."""
    from sglang_spex.respec.hotswap import HotSwapClient

    ckpt = _head_from_target_dir(tiny_target, tmp_path / "h")
    drafter = Eagle3Drafter.from_pretrained(ckpt, target_model=tiny_target)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))  # what training may do to every weight it trains
    spec = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(ckpt), *EAGLE]
    with ServerProcess(["--model-path", tiny_model, *COMMON, *spec]) as srv:
        HotSwapClient(srv.url).push(1, drafter.hot_swap_tensors(torch.float32))
        outs = generate(srv.url, WORKLOADS["b1"])
    assert [x["output_ids"] for x in outs] == respec_reference["workloads"]["b1"]


def test_the_learner_follows_a_policy_push_into_the_shared_head(tiny_target, tmp_path, tiny_seqs):
    """The served drafter holds the target's lm_head tensor, so a policy push moves its head; the learner's drafter
    takes the policy copy's current head before it trains (review of session 34: it kept the first policy's)."""
    import copy

    from sglang_spex.respec.learner import LearnerConfig, OnlineLearner
    from sglang_spex.respec.target import TargetFeatures

    target = copy.deepcopy(tiny_target)  # (the session's target stays as it is)
    drafter = Eagle3Drafter.from_pretrained(_head_from_target_dir(target, tmp_path / "h"), target_model=target)
    feats = TargetFeatures(target, drafter.cfg.aux_layer_ids, drafter.t2d)
    cfg = LearnerConfig(mode="sync", variant="unweighted", update_interval=1, train_steps=1, micro_batch=2)
    lrn = OnlineLearner(drafter, feats.batch, cfg, publish=lambda v, t: None, policy_sync=feats.load_weights)
    moved = target.get_output_embeddings().weight.detach() * 1.5
    lrn.set_policy(1, [("lm_head.weight", moved)])
    lrn.submit([{"prompt_ids": list(p), "response_ids": list(r), "reward": 1.0} for p, r in tiny_seqs[:2]])
    assert lrn.history[-1].outcome == "published", lrn.history[-1]
    assert torch.equal(lrn.current()[1].lm_head.weight, moved)
