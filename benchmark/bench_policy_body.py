"""What one policy push to the learner (``POST /respec/policy``) costs the server: SGLang's JSON payload (pickled
tensors in base64) vs the binary body (``policy_wire``, a safetensors file).

The policy is SmolLM2-135M's trainable weights as the GRPO loop sends them (``PolicyModel.named_tensors``, fp32).
Each repeat hands both bodies, in alternating order, to what the route runs in its threadpool once the body is read
(``routes.decode_policy``, then ``TargetFeatures.load_weights`` into the learner's policy copy) on a worker thread,
while this thread runs an asyncio loop that wakes every millisecond: its longest gap is how long the push would
stall SGLang's HTTP event loop (Python's GIL). Also times the client's encode. Reports body bytes, medians with
min-max of the seconds and of the stall; writes JSON (``--out``).

    .venv/bin/python benchmark/bench_policy_body.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Dict, List

from bench_rollout_body import spread, timed_on_thread

from sglang_spex.respec import policy_wire
from sglang_spex.respec.hotswap import serialize_named_tensors
from sglang_spex.respec.routes import decode_policy

FORMATS = {"json": "application/json", "binary": policy_wire.CONTENT_TYPE}


def encode(name: str, named) -> bytes:
    if name == "binary":
        return policy_wire.encode(1, named)
    return json.dumps({"version": 1, "serialized_named_tensors": serialize_named_tensors(named)}).encode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmark/results/policy_body.json")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from sglang_spex.models import default_model_path
    from sglang_spex.respec.target import TargetFeatures

    path = str(default_model_path())
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    named = [(n, p.detach().contiguous()) for n, p in policy.named_parameters() if p.requires_grad]
    vocab = policy.config.vocab_size
    copy = TargetFeatures(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), (1,), torch.ones(vocab))
    bodies: Dict[str, bytes] = {}
    encode_s: Dict[str, float] = {}
    for name in FORMATS:
        t0 = time.perf_counter()
        bodies[name] = encode(name, named)
        encode_s[name] = time.perf_counter() - t0

    def push(name: str) -> None:
        _, got = decode_policy(bodies[name], FORMATS[name])
        copy.load_weights(got)

    runs: Dict[str, List[Dict[str, float]]] = {name: [] for name in FORMATS}
    for r in range(args.repeats):
        for name in list(FORMATS)[:: 1 if r % 2 == 0 else -1]:  # interleaved, the order alternating
            runs[name].append(timed_on_thread(lambda: push(name)))
    report = {"args": vars(args), "tensors": len(named), "formats": {}}
    for name in FORMATS:
        report["formats"][name] = {
            "body_mib": round(len(bodies[name]) / 2**20, 1),
            "client_encode_s": round(encode_s[name], 3),
            "seconds": spread([x["seconds"] for x in runs[name]]),
            "event_loop_stall_s": spread([x["stall"] for x in runs[name]]),
        }
        print(name, json.dumps(report["formats"][name]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
