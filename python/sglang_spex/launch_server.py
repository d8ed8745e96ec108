"""``python -m sglang_spex.launch_server``: SGLang's launcher plus our ``--tot-*`` flags and CPU defaults.

Our flags are parsed here (bad ones exit non-zero naming the flag, before any model loads); every other
argument goes to SGLang unchanged. The config reaches the scheduler process through the environment
variable ``SGLANG_SPEX_CONFIG`` (see :mod:`sglang_spex.config`), which SGLang's subprocesses inherit.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from sglang_spex.config import (
    ENV_VAR,
    LEARNER_ENV_VAR,
    RESPEC_ENV_VAR,
    ConfigError,
    SpexConfig,
    flag_value,
    parse_learner_args,
    parse_respec_args,
    parse_tot_args,
)

# Applied on a machine without a GPU unless the user passed the flag. Values measured on 2-core hosts.
CPU_DEFAULTS = {
    "--device": "cpu",
    "--attention-backend": "spex_cpu",  # sgl-kernel-ext: batched CPU attention (1.6x decode at batch 16)
    "--sampling-backend": "pytorch",
    "--max-total-tokens": "32768",
    # SGLang sizes KV as (available after load) - (1 - f) * (available before load): with a small f, memory
    # other processes take meanwhile makes startup fail; --max-total-tokens caps the pool anyway.
    "--mem-fraction-static": "0.5",
    "--dtype": "bfloat16",
    "--disable-overlap-schedule": None,
    "--sleep-on-idle": None,
    "--disable-cuda-graph": None,
}
CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # Default torch threading slowed decode 17x on a contended 2-core host; one thread per process.
    "OMP_NUM_THREADS": "1",
}
SPEX_DEFAULTS = {
    # Speculative requests carry low priorities: let SGLang order by them and evict their KV first.
    "--enable-priority-scheduling": None,
    # Requests without a priority would otherwise rank *below* speculative ones (None = lowest).
    "--default-priority-value": "0",
    "--schedule-policy": "fcfs",
    "--radix-eviction-policy": "priority",
}

# ReSpec's hooks (R1, R4/R5) act on the batch being run: the non-overlap scheduler (CPU's default anyway).
RESPEC_DEFAULTS = {"--disable-overlap-schedule": None}


def has_gpu() -> bool:
    if os.environ.get("SPEX_FORCE_CPU") == "1":
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _apply(args: List[str], defaults: dict) -> List[str]:
    out = list(args)
    for flag, value in defaults.items():
        if not _given(out, flag):
            out += [flag] if value is None else [flag, value]
    return out


def build_sglang_args(cfg: SpexConfig, rest: Sequence[str], gpu: bool) -> List[str]:
    """SGLang's argument list: the user's flags, then our defaults for whatever they left out."""
    args = list(rest)
    if not _given(args, "--model-path") and not _given(args, "--model"):
        from sglang_spex.models import default_model_path

        args += ["--model-path", str(default_model_path())]
    model = flag_value(args, "--model-path") or flag_value(args, "--model")
    if model is not None and not Path(model).exists() and model.startswith(("/", ".", "~")):
        raise ConfigError(f"--model-path {model}: no such file or directory")
    if not gpu:
        args = _apply(args, CPU_DEFAULTS)
    if cfg.enabled:
        args = _apply(args, SPEX_DEFAULTS)
    return args


def prepare(argv: Sequence[str]) -> List[str]:
    """Parse our flags, set the environment for SGLang's processes, return SGLang's arguments."""
    cfg, rest = parse_tot_args(argv)
    learner, rest = parse_learner_args(rest)  # before parse_respec_args, which rejects unknown --respec-* flags
    respec, rest = parse_respec_args(rest)
    gpu = has_gpu()
    args = build_sglang_args(cfg, rest, gpu)
    if respec.enabled:
        args = _apply(args, RESPEC_DEFAULTS)
    if respec.enabled and respec.eagle:
        from sglang_spex.respec.eagle_policy import sglang_adaptive_args

        args += sglang_adaptive_args(respec, args)
    os.environ[ENV_VAR] = cfg.to_json()
    os.environ[RESPEC_ENV_VAR] = respec.to_json()
    if learner is not None:  # /respec/* routes in the HTTP process (respec/routes.py)
        os.environ[LEARNER_ENV_VAR] = json.dumps(learner)
    if not gpu:
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = prepare(argv)
    except ConfigError as e:
        print(f"sglang_spex.launch_server: error: {e}", file=sys.stderr)
        raise SystemExit(2)
    if not has_gpu():
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    server_args = prepare_server_args(args)
    try:
        launch_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
