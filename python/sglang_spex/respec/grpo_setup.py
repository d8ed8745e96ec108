"""Setting up a GRPO + online-learner run on CPU: the initial policy (optionally a warm-started tiny model),
a bootstrap EAGLE-3 drafter fitted on the policy's own samples, and the EAGLE3 server with the learner inside
(``--respec-learner``). Shared by ``examples/grpo_rollouts.py`` and ``benchmark/bench_respec_learner.py``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from sglang_spex.respec.grpo import chat_prompt_ids
from sglang_spex.respec.policy import Policy
from sglang_spex.respec.ttt import fit_drafter
from sglang_spex.tot.tasks import Question, TaskSet, ToyAdd, get_task

EAGLE_ARGS = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]


def answer_pairs(tokenizer, questions: Sequence[Question]) -> List[tuple]:
    """(prompt ids, worked-answer ids + EOS) for a supervised warm start on a task (e.g. of a tiny random model)."""
    out = []
    for q in questions:
        body = f"{q.meta['a']} + {q.meta['b']} = {q.reference}. " if {"a", "b"} <= set(q.meta) else ""
        resp = tokenizer.encode(f"{body}The answer is {q.reference}.", add_special_tokens=False)
        out.append((chat_prompt_ids(tokenizer, q.text), resp + [tokenizer.eos_token_id]))
    return out


def warm_start(policy: Policy, pairs: Sequence[tuple], steps: int, batch: int = 16, seed: int = 0) -> List[float]:
    """``steps`` supervised steps on random batches of ``pairs`` (:func:`answer_pairs`); the loss curve."""
    rng = random.Random(seed)
    return [policy.sft_step(rng.sample(list(pairs), min(batch, len(pairs)))) for _ in range(steps)]


@torch.no_grad()
def hf_samples(model, tokenizer, questions: Sequence[Question], temperature: float, max_new_tokens: int) -> List[tuple]:
    """(prompt ids, response ids) sampled from an HF copy of the policy (drafter bootstrap data), EOS-trimmed."""
    model.eval()
    out = []
    for q in questions:
        ids = torch.tensor([chat_prompt_ids(tokenizer, q.text)])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.eos_token_id,
        )
        resp = gen[0, ids.shape[1] :].tolist()
        if tokenizer.eos_token_id in resp:
            resp = resp[: resp.index(tokenizer.eos_token_id) + 1]
        out.append((ids[0].tolist(), resp or [tokenizer.eos_token_id]))
    return out


def resolve_model(name: str) -> str:
    """``tiny`` | ``smollm2`` | an HF model directory."""
    from sglang_spex.models import prepare_smollm2, prepare_tiny_llama

    if name == "tiny":
        return str(prepare_tiny_llama())
    if name == "smollm2":
        return str(prepare_smollm2())
    if not (Path(name) / "config.json").exists():
        raise FileNotFoundError(f"--model {name!r}: not 'tiny', 'smollm2' or an HF model directory")
    return name


def resolve_task(name: str, toy_range: Optional[Sequence[int]] = None) -> TaskSet:
    """A task by name; ``toy_add`` with an operand range ``(lo, hi)`` when given (a tiny policy needs a small one
    for its rewards to vary within a group)."""
    if name == "toy_add" and toy_range:
        lo, hi = toy_range
        if not 0 <= lo <= hi:
            raise ValueError(f"toy range must satisfy 0 <= lo <= hi, got {lo},{hi}")
        return ToyAdd(lo, hi)
    return get_task(name)


@dataclass
class RunSetup:
    policy_dir: Path  # the initial policy (served, and loaded by the client and the learner)
    drafter_dir: Path
    probe: List[list]  # held-out [prompt_ids, response_ids] for the learner's collapse check
    info: Dict = field(default_factory=dict)


def prepare_run(
    model: str,
    task: TaskSet,
    work_dir: Path,
    warm_steps: int = 0,
    drafter_samples: int = 48,
    drafter_iters: int = 150,
    draft_vocab: int = 256,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    seed: int = 0,
    drafter_dir: Optional[str] = None,
) -> RunSetup:
    """Initial policy (``warm_steps`` supervised steps on the task's worked answers, then saved with its
    tokenizer) and a TTT bootstrap drafter on ``drafter_samples`` of its own samples, or ``drafter_dir`` as is
    (e.g. ``scripts/respec_bootstrap.py``'s SmolLM2 drafter; then the learner has no probe)."""
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    src = resolve_model(model)
    tok = AutoTokenizer.from_pretrained(src)
    policy = Policy.from_pretrained(src, lr=3e-3)
    info: Dict = {"model": src}
    if warm_steps > 0:
        pairs = answer_pairs(tok, task.questions(512, split="dev", seed=seed + 1000))
        losses = warm_start(policy, pairs, warm_steps, seed=seed)
        info["warm_start_loss"] = [losses[0], losses[-1]]
    policy_dir = policy.save_pretrained(Path(work_dir) / "policy0", tok) if warm_steps > 0 else Path(src)
    if drafter_dir is not None:
        if not (Path(drafter_dir) / "config.json").exists():
            raise FileNotFoundError(f"drafter {drafter_dir!r}: no config.json (an Eagle3Drafter.save_pretrained dir)")
        return RunSetup(Path(policy_dir), Path(drafter_dir), [], {**info, "drafter": str(drafter_dir)})
    qs = task.questions(drafter_samples + 8, split="dev", seed=seed + 2000)
    samples = hf_samples(policy.model, tok, qs, temperature, max_new_tokens)
    drafter = fit_drafter(policy.model.eval(), samples[8:], draft_vocab, drafter_iters, seed=seed)
    drafter_dir = drafter.save_pretrained(Path(work_dir) / "drafter0", dtype=torch.float32)
    info.update(drafter_samples=len(samples) - 8, drafter_iters=drafter_iters)
    return RunSetup(Path(policy_dir), drafter_dir, [[p, r] for p, r in samples[:8]], info)


def add_run_args(ap, max_new_tokens: int = 32) -> None:
    """The command-line knobs every GRPO + learner benchmark shares (model, task, warm start, GRPO, KD, drafter)."""
    ap.add_argument("--model", default="tiny", help="tiny | smollm2 | HF model dir")
    ap.add_argument("--task", default="toy_add")
    ap.add_argument("--toy-range", type=int, nargs=2, default=[2, 10], metavar=("LO", "HI"))
    ap.add_argument("--warm-steps", type=int, default=150)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per policy step")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (G)")
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--policy-lr", type=float, default=1e-4, help="AdamW lr of the policy (1e-3 made it degenerate)")
    ap.add_argument("--inner-steps", type=int, default=2)
    ap.add_argument("--kd-lr", type=float, default=3e-4)
    ap.add_argument("--kd-train-steps", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=256)
    ap.add_argument("--drafter-samples", type=int, default=48)
    ap.add_argument("--drafter-iters", type=int, default=150)
    ap.add_argument(
        "--drafter", default=None, help="a saved EAGLE-3 drafter to start from (e.g. scripts/respec_bootstrap.py's) "
        "instead of bootstrapping one on the policy's samples; the learner then has no probe set"
    )  # fmt: skip
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)


def learner_spec(setup: RunSetup, variant: str, mode: str = "async", **learner: object) -> str:
    """The ``--respec-learner`` JSON for a server whose learner distills into ``setup``'s drafter."""
    cfg = {"variant": variant, "mode": mode, "update_interval": 1, **learner}
    return json.dumps(
        {"drafter": str(setup.drafter_dir), "target": str(setup.policy_dir), "learner": cfg, "probe": setup.probe}
    )


def eagle3_server_args(setup: RunSetup, dtype: str = "float32", extra: Sequence[str] = ()) -> List[str]:
    """Launcher args: the initial policy with EAGLE3 speculation by the bootstrap drafter."""
    return [
        "--model-path",
        str(setup.policy_dir),
        "--dtype",
        dtype,
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(setup.drafter_dir),
        *EAGLE_ARGS,
        *extra,
    ]
