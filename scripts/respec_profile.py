"""Profile speculative (s, t, n) configs on real SGLang servers and write a ReSpec profile (JSON).

    python scripts/respec_profile.py --model tiny --configs NGRAM:s4t1n4 NGRAM:s8t1n8 --batch-sizes 1 4 16
    python scripts/respec_profile.py --model smollm2 --configs EAGLE3:s1t1n2 EAGLE3:s3t1n4 --drafter bootstrap \
        --prompts task:toy_add --batch-sizes 1 4 16 32 [--temperature 1.0]

One server per config plus one without speculation, started one after another (never two at once). The profile
lands in ``~/.cache/sglang-spex/profiles/respec/<model>__<drafter>__<device>.json`` (``...__t<T>.json`` for
``--temperature T`` > 0) unless ``--out`` is given;
the solver's plan for it is printed at the end.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from sglang_spex.respec.profiler import (
    SpecConfig,
    default_drafter,
    default_profile_path,
    profile_configs,
    prompt_set,
)
from sglang_spex.respec.solver import solve


def _model(name: str) -> str:
    from sglang_spex.models import prepare_smollm2, prepare_tiny_llama

    if name == "tiny":
        return str(prepare_tiny_llama())
    if name == "smollm2":
        return str(prepare_smollm2())
    return name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="'tiny', 'smollm2' or a model path")
    ap.add_argument("--configs", nargs="+", default=["NGRAM:s4t1n4", "NGRAM:s8t1n8"], help="ALG:s<S>t<T>n<N>")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--n-short", type=int, default=8)
    ap.add_argument("--n-long", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2, help="runs per length; the fastest counts")
    ap.add_argument("--attention-backend", default="spex_cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 for tiny, the launcher's otherwise")
    ap.add_argument("--drafter", default=None, help="EAGLE/EAGLE3 draft model path, or 'bootstrap' (cached one)")
    ap.add_argument("--prompts", default="calibration", help="'calibration' or 'task:NAME' (chat-formatted)")
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="the requests' sampling temperature (profile at the served one)"
    )
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    model = _model(a.model)
    dtype = a.dtype or ("float32" if a.model == "tiny" else None)
    server_args = ["--attention-backend", a.attention_backend, *(["--dtype", dtype] if dtype else [])]
    configs = [None, *(SpecConfig.parse(k) for k in a.configs)]
    drafter = ""
    if any(c is not None and c.algorithm != "NGRAM" for c in configs):
        drafter = default_drafter(model) if a.drafter in (None, "bootstrap") else a.drafter
    prompts = prompt_set(a.prompts, model)
    prof = profile_configs(
        model, configs, a.batch_sizes, a.n_short, a.n_long, a.repeats, server_args, drafter, prompts=prompts,
        temperature=a.temperature,
    )  # fmt: skip
    path = prof.save(a.out or default_profile_path(prof.model, prof.drafter, prof.device, a.temperature))
    print(f"profile: {path}")
    for key, pts in prof.points.items():
        for b, p in sorted(pts.items()):
            acc = "" if p.accept_length is None else f" accept={p.accept_length:.2f}"
            print(
                f"  {key:16s} B={b:3d} step={p.step_s * 1e3:7.1f} ms tok/step={p.tokens_per_step:.2f}"
                f" {p.throughput:7.1f} tok/s{acc}"
            )
    plan = solve(prof, max_batch=max(a.batch_sizes))
    print("plan:", plan.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
