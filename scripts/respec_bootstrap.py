"""Bootstrap a first EAGLE-3 drafter for SmolLM2-135M-Instruct from the target's own greedy generations on the
bundled task prompts, with the training-time-test loss. Cached: generations and target features are reused,
the drafter lands in ``--out`` (SGLang ``LlamaForCausalLMEagle3`` format) with ``metrics.json``.

    timeout 900 .venv/bin/python scripts/respec_bootstrap.py --minutes 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from sglang_spex.models import CACHE_DIR, prepare_smollm2  # noqa: E402
from sglang_spex.respec.drafter import Eagle3Drafter  # noqa: E402
from sglang_spex.respec.target import Batch, TargetFeatures  # noqa: E402
from sglang_spex.respec.ttt import acceptance_length, ttt_loss  # noqa: E402
from sglang_spex.tot.tasks import get_task  # noqa: E402

WORK = Path(os.environ.get("SPEX_RESPEC_CACHE", Path.home() / ".cache" / "sglang-spex" / "respec"))


def generate(model, tok, prompts, max_new: int, batch: int):
    """Greedy generations (token ids) of the target for chat-formatted prompts."""
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    out = []
    for s in range(0, len(prompts), batch):
        texts = [
            tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts[s : s + batch]
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
        for i in range(len(texts)):
            prompt = enc.input_ids[i][enc.attention_mask[i].bool()].tolist()
            resp = gen[i, enc.input_ids.shape[1] :].tolist()
            if tok.eos_token_id in resp:
                resp = resp[: resp.index(tok.eos_token_id) + 1]
            out.append((prompt, resp))
        print(f"  generated {len(out)}/{len(prompts)}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="toy_add")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--minutes", type=float, default=4.0, help="training time budget")
    ap.add_argument("--max-iters", type=int, default=400)
    ap.add_argument("--holdout", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(CACHE_DIR / "SmolLM2-135M-Instruct-eagle3-respec"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir = prepare_smollm2()
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    key = hashlib.sha1(f"{args.task}|{args.num_prompts}|{args.max_new_tokens}".encode()).hexdigest()[:10]
    cache = WORK / f"bootstrap-{key}"
    cache.mkdir(parents=True, exist_ok=True)
    gen_file = cache / "generations.json"
    t0 = time.time()
    if gen_file.exists():
        seqs = [tuple(x) for x in json.loads(gen_file.read_text())]
        print(f"generations: cached {gen_file} ({len(seqs)})")
    else:
        prompts = [q.text for q in get_task(args.task).questions(args.num_prompts, split="dev", seed=0)]
        seqs = generate(target, tok, prompts, args.max_new_tokens, batch=24)
        gen_file.write_text(json.dumps(seqs))
    gen_s = time.time() - t0

    counts = torch.zeros(target.config.vocab_size)
    for p, r in seqs:
        for x in list(p) + list(r):
            counts[x] += 1
    drafter = Eagle3Drafter.for_target(target, args.draft_vocab, counts)
    feats = TargetFeatures(target, drafter.cfg.aux_layer_ids, drafter.t2d)
    feat_file = cache / f"features-v{args.draft_vocab}.pt"
    t1 = time.time()
    if feat_file.exists():
        batch = Batch(**torch.load(feat_file))
    else:
        batch = feats.batch(seqs, chunk=8)
        torch.save(batch.__dict__, feat_file)
    feat_s = time.time() - t1
    resp_tokens = sum(len(r) for _, r in seqs)
    covered = sum(int(drafter.t2d[x]) for _, r in seqs for x in r)
    print(f"{len(seqs)} sequences, {resp_tokens} response tokens, draft vocab covers {covered / resp_tokens:.1%}")

    rng = random.Random(0)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    held, train = batch.select(order[: args.holdout]), batch.select(order[args.holdout :])
    acc0 = acceptance_length(drafter, held, args.ttt_steps)
    print(f"held-out acceptance length before: {acc0:.3f}")

    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 20))
    curve = []
    t2 = time.time()
    it = 0
    while it < args.max_iters and time.time() - t2 < args.minutes * 60:
        idx = [rng.randrange(len(train)) for _ in range(args.micro_batch)]
        drafter.train()
        loss, accs = ttt_loss(drafter, train.select(idx), args.ttt_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        sched.step()
        curve.append({"iter": it, "loss": float(loss.detach()), "acc": [round(a, 4) for a in accs]})
        if it % 10 == 0:
            print(
                f"iter {it:4d} loss {float(loss.detach()):.3f} step-acc {[round(a, 2) for a in accs[:4]]}", flush=True
            )
        it += 1
    train_s = time.time() - t2
    drafter.eval()
    acc1 = acceptance_length(drafter, held, args.ttt_steps)
    acc_train = acceptance_length(drafter, train.select(range(min(len(train), 24))), args.ttt_steps)
    out = drafter.save_pretrained(args.out)
    metrics = {
        "target": str(target_dir),
        "sequences": len(seqs),
        "response_tokens": resp_tokens,
        "draft_vocab": args.draft_vocab,
        "draft_vocab_coverage": covered / resp_tokens,
        "aux_layer_ids": drafter.cfg.aux_layer_ids,
        "iters": it,
        "seconds": {"generate": gen_s, "features": feat_s, "train": train_s},
        "loss_first": curve[0]["loss"] if curve else None,
        "loss_last10": sum(c["loss"] for c in curve[-10:]) / max(1, len(curve[-10:])),
        "acceptance_length_heldout_before": acc0,
        "acceptance_length_heldout_after": acc1,
        "acceptance_length_train_after": acc_train,
        "curve": curve,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(json.dumps({k: v for k, v in metrics.items() if k != "curve"}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
