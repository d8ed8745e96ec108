"""Speculative decoding on CPU is lossless at temperature 1 (hook V1), on real SGLang servers.

Model: the tiny random Llama with its ``lm_head`` scaled by ``LM_HEAD_SCALE`` (its raw logits are almost flat,
so every distribution would look alike), served in float32. For one prompt, ``N`` requests per population
(T=1; T=1 with top_p=0.8) are sent in one batch, with a few greedy requests mixed in. The first ``K`` generated
tokens of each population are compared between no speculation and each speculative algorithm by a chi-square
test of homogeneity (2 x cells, cells with fewer than ``MIN_CELL`` samples in both arms together pooled into
one), at ``ALPHA``. The test of the test builds today's behaviour (SGLang's CPU verify commits the target's
argmax: the first token is sampled at prefill, every later one is the greedy continuation) from the
no-speculation server itself, and the same statistic must reject it; ``test_power_against_argmax_collapse``
simulates the test on the model's exact distribution (transformers) to bound its power and size.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Sequence, Tuple

import numpy as np
import pytest
import requests
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaForCausalLM

from sgl_kernel_ext import spec_sampling
from sglang_spex.serve import ServerProcess
from sglang_spex.srt import lossless_verify

sys.path.insert(0, str(Path(__file__).parent.parent / "kernel_ext"))  # eagle3_head helper
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))  # the shared homogeneity test

import check_on_policy  # noqa: E402

PROMPT = "a b c a b c a b c a b c"
N = 300  # samples per population and arm
K = 3  # generated tokens compared
MIN_CELL = 10
ALPHA = 1e-4
LM_HEAD_SCALE = 20.0
GREEDY_PROMPTS = ["a b c a b c", "Step 1: add the numbers.", "the answer is 4 2"]
POPULATIONS = {
    "t1": {"temperature": 1.0},
    "t1_top_p": {"temperature": 1.0, "top_p": 0.8},
    "t1_min_p": {"temperature": 1.0, "min_p": 0.1},  # SGLang's verify leaves min-p out (V3 applies it)
    "t1_top_k_top_p": {"temperature": 1.0, "top_k": 5, "top_p": 0.7},  # the joint filter, not two renorms
}
SERVER = ["--dtype", "float32", "--attention-backend", "spex_cpu"]

Sample = Tuple[int, ...]


def homogeneity_pvalue(a: Sequence[Sample], b: Sequence[Sample], min_cell: int = MIN_CELL) -> float:
    """Chi-square homogeneity p-value of two samples of token tuples (``benchmark/check_on_policy.py``'s)."""
    return check_on_policy.homogeneity_pvalue(a, b, min_cell)


def _scaled_model(src: Path, out: Path) -> Path:
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    weights = load_file(str(src / "model.safetensors"))
    weights["lm_head.weight"] = (weights["lm_head.weight"].float() * LM_HEAD_SCALE).to(torch.bfloat16)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def peaked_model(tiny_model, tmp_path_factory) -> str:
    return str(_scaled_model(Path(tiny_model), tmp_path_factory.mktemp("tiny-peaked")))


def _generate(url: str, texts: List, params: List[dict], key: str = "text") -> List[dict]:
    payload = {key: texts, "sampling_params": params}
    r = requests.post(url + "/generate", json=payload, timeout=600)
    r.raise_for_status()
    return r.json()


def collect(url: str) -> Dict[str, object]:
    """One batch: N requests per population plus the greedy prompts; samples, greedy ids and meta_info."""
    texts, params = [], []
    for pop in POPULATIONS.values():
        texts += [PROMPT] * N
        params += [{**pop, "max_new_tokens": K, "ignore_eos": True}] * N
    texts += GREEDY_PROMPTS
    params += [{"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}] * len(GREEDY_PROMPTS)
    out = _generate(url, texts, params)
    result: Dict[str, object] = {"meta": [o["meta_info"] for o in out]}
    for i, name in enumerate(POPULATIONS):
        result[name] = [tuple(o["output_ids"]) for o in out[i * N : (i + 1) * N]]
    result["greedy"] = [o["output_ids"] for o in out[len(POPULATIONS) * N :]]
    return result


def argmax_collapsed(url: str, prompt_ids: List[int], pop: dict) -> List[Sample]:
    """Today's CPU speculative output: first token sampled, the rest the greedy continuation of it."""
    first = _generate(url, [PROMPT] * N, [{**pop, "max_new_tokens": 1, "ignore_eos": True}] * N)
    starts = [prompt_ids + o["output_ids"] for o in first]
    greedy = {"temperature": 0, "max_new_tokens": K - 1, "ignore_eos": True}
    rest = _generate(url, starts, [greedy] * N, key="input_ids")
    return [tuple(f["output_ids"] + r["output_ids"]) for f, r in zip(first, rest)]


@pytest.fixture(scope="module")
def baseline(peaked_model) -> Dict[str, object]:
    with ServerProcess([*SERVER, "--model-path", peaked_model]) as srv:
        data = collect(srv.url)
        prompt_ids = AutoTokenizer.from_pretrained(peaked_model)(PROMPT).input_ids
        data["collapsed"] = {name: argmax_collapsed(srv.url, prompt_ids, pop) for name, pop in POPULATIONS.items()}
        data["independent"] = collect(srv.url)  # a second no-speculation sample (the test's size, on the server)
    return data


def _spec_args(algo: str, model: str, head_dir: Path) -> List[str]:
    from eagle3_head import make_random_eagle3_head

    tree = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"]
    if algo == "ngram":
        return ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"]
    if algo == "standalone_tree":
        return ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", model, *tree]
    head = str(make_random_eagle3_head(Path(model), head_dir))
    if algo == "eagle3_tree":
        return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", head, *tree]
    chain = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", head, *chain]


# The suite runs a chain verify (NGRAM) and a tree verify (EAGLE3, top-k 2); EAGLE3 chain and STANDALONE tree take
# the same verify (eagle_sample) and run with ``pytest --all-spec-algorithms`` (two more servers, ~2 min).
ALGORITHMS = ["ngram", "eagle3_tree"]
ALL_ALGORITHMS = [*ALGORITHMS, "eagle3_chain", "standalone_tree"]


def pytest_generate_tests(metafunc):
    if "speculative" in metafunc.fixturenames:
        algos = ALL_ALGORITHMS if metafunc.config.getoption("--all-spec-algorithms") else ALGORITHMS
        metafunc.parametrize("speculative", algos, indirect=True, scope="module")


@pytest.fixture(scope="module")
def speculative(request, peaked_model, tmp_path_factory) -> Dict[str, object]:
    args = _spec_args(request.param, peaked_model, tmp_path_factory.mktemp(f"eagle3-{request.param}"))
    with ServerProcess([*SERVER, "--model-path", peaked_model, *args]) as srv:
        data = collect(srv.url)
    data["algo"] = request.param
    return data


def _distinct(samples: Sequence[Sample]) -> int:
    return len(set(samples))


@pytest.mark.parametrize("population", list(POPULATIONS))
def test_speculative_distribution_equals_no_speculation(baseline, speculative, population):
    meta = speculative["meta"]
    assert all(m["spec_verify_ct"] > 0 for m in meta[:N])  # the samples did go through verify
    assert max(m["spec_accept_length"] for m in meta) > 1.0  # and drafts were accepted somewhere
    p = homogeneity_pvalue(baseline[population], speculative[population])
    print(
        f"{speculative['algo']}/{population}: p={p:.3g} distinct {_distinct(speculative[population])}"
        f" vs {_distinct(baseline[population])} without speculation"
    )
    assert p > ALPHA


def test_greedy_requests_in_a_sampling_batch_stay_exact(baseline, speculative):
    assert speculative["greedy"] == baseline["greedy"]


@pytest.mark.parametrize("population", list(POPULATIONS))
def test_test_rejects_argmax_collapse(baseline, population):
    """Test of the test on the server's own data: today's argmax verify fails, a fresh no-spec sample passes."""
    collapsed = baseline["collapsed"][population]
    p_collapsed = homogeneity_pvalue(baseline[population], collapsed)
    p_same = homogeneity_pvalue(baseline[population], baseline["independent"][population])
    print(
        f"{population}: collapsed p={p_collapsed:.3g} (distinct {_distinct(collapsed)}), no-spec twice p={p_same:.3g}"
    )
    assert p_collapsed < ALPHA
    assert p_same > ALPHA


def test_v1_switches_only_cpu_sampling_batches(monkeypatch):
    """V1 on SGLang's real predicate: CPU sampling batches take the sampling branch, with the CPU ops bound."""
    import sglang.srt.speculative.eagle_utils as eagle_utils

    for name in lossless_verify.OP_NAMES:
        monkeypatch.setattr(eagle_utils, name, None)  # as SGLang resolves them on CPU
    original = getattr(eagle_utils._verify_uses_greedy, "__wrapped__", eagle_utils._verify_uses_greedy)
    flags = {"is_hip": False, "is_xpu": False, "use_rejection_sampling": False}

    def v1(**kwargs):
        return lossless_verify.v1_verify_uses_greedy(original, **{**flags, **kwargs})

    assert v1(is_all_greedy=True, is_cpu=True) is True  # greedy stays greedy
    assert eagle_utils.tree_speculative_sampling_target_only is None  # and binds nothing
    assert v1(is_all_greedy=False, is_cpu=True) is False
    for name in lossless_verify.OP_NAMES:
        assert getattr(eagle_utils, name) is getattr(spec_sampling, name)
    assert v1(is_all_greedy=False, is_cpu=False, is_hip=True) is True  # other platforms: SGLang's answer
    assert v1(is_all_greedy=False, is_cpu=False) is False


def test_v1_never_replaces_a_real_kernel():
    class Module:
        tree_speculative_sampling_target_only = staticmethod(lambda **kw: None)
        top_k_renorm_prob = None
        top_p_renorm_prob = None

    real = Module.tree_speculative_sampling_target_only
    assert lossless_verify.bind_cpu_ops(Module) is True
    assert Module.tree_speculative_sampling_target_only is real
    assert Module.top_k_renorm_prob is spec_sampling.top_k_renorm_prob


def test_v3_applies_min_p_to_the_verify_sampling_of_its_call_only(monkeypatch):
    """V3 on SGLang's module: the sampling op sees min-p applied (per row) during the call, and is restored."""
    import sglang.srt.speculative.eagle_utils as eagle_utils

    for name in lossless_verify.OP_NAMES:
        monkeypatch.setattr(eagle_utils, name, None)
    seen: List[torch.Tensor] = []

    def op(**kwargs):
        seen.append(kwargs["target_probs"])

    monkeypatch.setattr(eagle_utils, lossless_verify.SAMPLING_OP, op)
    probs = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], [[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])

    def eagle_sample(verify_input, batch, logits_output, grammar_mask=None):  # calls the op as SGLang does
        eagle_utils.tree_speculative_sampling_target_only(target_probs=probs, deterministic=True)
        if grammar_mask == "raise":
            raise RuntimeError("verify failed")
        return "sampled"

    def batch(min_ps, need=True, greedy=False):
        info = SimpleNamespace(need_min_p_sampling=need, is_all_greedy=greedy, min_ps=torch.tensor(min_ps))
        return SimpleNamespace(sampling_info=info)

    assert lossless_verify.v3_eagle_sample(eagle_sample, None, batch([0.5, 0.0]), None) == "sampled"
    expected = torch.tensor([[[0.625, 0.375, 0.0], [0.0, 0.0, 1.0]], [[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])
    assert torch.allclose(seen[-1], expected)  # row 0: min_p 0.5 of each row's max; row 1: min_p 0 keeps all
    assert eagle_utils.tree_speculative_sampling_target_only is op  # restored after the call
    for kwargs in ({"need": False}, {"greedy": True}):  # no min-p request, or an all-greedy batch: untouched
        lossless_verify.v3_eagle_sample(eagle_sample, None, batch([0.5, 0.5], **kwargs), None)
        assert seen[-1] is probs
    with pytest.raises(RuntimeError):
        lossless_verify.v3_eagle_sample(eagle_sample, None, batch([0.5, 0.5]), None, "raise")
    assert eagle_utils.tree_speculative_sampling_target_only is op  # restored when verify raises too


def _filtered(logits: torch.Tensor, pop: dict, two_renorms: bool = False, min_p: bool = True) -> torch.Tensor:
    """T=1 probabilities after the non-speculative sampler's joint filter for ``pop`` (SGLang's rules: rank below
    top-k, mass strictly before a token <= top_p, probability >= min_p * max).

    ``two_renorms`` gives top-p on the top-k-renormalised row instead (SGLang's verify before our ops), ``min_p=False``
    leaves min-p out (SGLang's verify before V3).
    """
    probs = torch.softmax(logits.float(), -1)
    values, order = probs.sort(dim=-1, descending=True, stable=True)
    values[:, pop.get("top_k", values.shape[-1]) :] = 0
    if two_renorms:
        values = values / values.sum(-1, keepdim=True)
    values[(values.cumsum(-1) - values) > pop.get("top_p", 1.0)] = 0
    if min_p:
        values[values < pop.get("min_p", 0.0) * values[:, :1]] = 0
    probs = torch.zeros_like(probs).scatter_(-1, order, values)
    return probs / probs.sum(-1, keepdim=True)


def exact_distributions(model_dir: str, pop: dict, floor: float = 1e-3):
    """(categories, {name: probs}) of the first K=3 tokens, from transformers.

    ``true``: every token from the joint filter; ``collapsed``: the first token sampled, the rest greedy (SGLang's
    CPU verify); ``two_renorms`` / ``no_min_p``: the first token sampled by the non-speculative sampler, the rest by
    SGLang's verify filter before our ops / before V3. Exact except that (t1, t2) pairs below ``floor`` are merged
    into one category (the test pools such rare tuples into one cell anyway).
    """
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    ids = tok(PROMPT, return_tensors="pt").input_ids[0].tolist()

    def logits(prefixes: List[List[int]]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids + p for p in prefixes])).logits[:, -1]

    p1 = _filtered(logits([[]]), pop)[0]
    vocab = p1.numel()
    l2 = logits([[t] for t in range(vocab)])  # [t1, t2]
    dists: Dict[str, Dict[Sample, float]] = {}
    for name, rule in {"true": {}, "two_renorms": {"two_renorms": True}, "no_min_p": {"min_p": False}}.items():
        joint2 = p1[:, None] * _filtered(l2, pop, **rule)
        pairs = [tuple(x) for x in (joint2 >= floor).nonzero().tolist()]
        p3 = _filtered(logits([list(x) for x in pairs]), pop, **rule)
        dist = dists[name] = {}
        for (t1, t2), row in zip(pairs, p3):
            for t3 in row.nonzero()[:, 0].tolist():
                dist[(t1, t2, t3)] = float(joint2[t1, t2] * row[t3])
        dist[(-1, -1, -1)] = max(0.0, 1.0 - sum(dist.values()))
    a1 = l2.argmax(-1)  # greedy t2 after each t1; collapsed only where p1 > 0
    firsts = p1.nonzero()[:, 0].tolist()
    a2 = logits([[t, int(a1[t])] for t in firsts]).argmax(-1)
    dists["collapsed"] = {(t, int(a1[t]), int(b)): float(p1[t]) for t, b in zip(firsts, a2.tolist())}
    cats = sorted(set().union(*dists.values()))
    return cats, {name: np.array([d.get(c, 0.0) for c in cats]) for name, d in dists.items()}


POWER_REPLICATES = 500


def _rejections(cats: List[Sample], a: np.ndarray, b: np.ndarray, seed: int = 0) -> float:
    """Share of ``POWER_REPLICATES`` simulated pairs of ``N`` draws from ``a`` and ``b`` that the test rejects."""
    rng = np.random.default_rng(seed)

    def draw(probs: np.ndarray) -> List[Sample]:
        return [cats[i] for i in rng.choice(len(cats), size=N, p=probs / probs.sum())]

    return float(np.mean([homogeneity_pvalue(draw(a), draw(b)) < ALPHA for _ in range(POWER_REPLICATES)]))


# what each population's samples would be drawn from if its verify still had the bug the population is there for
WRONG_VERIFY = {"t1": "collapsed", "t1_top_p": "collapsed", "t1_min_p": "no_min_p", "t1_top_k_top_p": "two_renorms"}


@pytest.mark.parametrize("population", list(POPULATIONS))
def test_power_against_argmax_collapse(peaked_model, population):
    """Simulated on the model's exact distribution: the test rejects argmax collapse in every replicate (and the
    population's own verify bug: min-p left out, top-k then top-p as two renormalisations)."""
    cats, dists = exact_distributions(peaked_model, POPULATIONS[population])
    size = _rejections(cats, dists["true"], dists["true"])
    power = {name: _rejections(cats, dists["true"], dists[name]) for name in {"collapsed", WRONG_VERIFY[population]}}
    print(f"{population}: simulated size {size:.4f}, power {power} over {POWER_REPLICATES} replicates")
    assert all(p == 1.0 for p in power.values())  # 500/500 rejections: power >= 0.994 at 95 % confidence
    assert size <= 0.01
