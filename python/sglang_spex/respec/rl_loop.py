"""One RL run against one SGLang server, the same for every speculation mode, so runs can be compared step by step:
``none`` (no speculation), ``naive`` (EAGLE3 always on, the bootstrap drafter frozen), ``learner`` (EAGLE3 always
on with the online learner inside: the drafter follows the policy, with no switching, so its acceptance is read on
every step) and ``respec`` (the adaptive server, ``--respec-adaptive``, plus the online learner, reward-weighted KD).

The policy starts from the same directory with the same seed in every mode and GRPO (``respec/grpo.py``) samples
its rollouts through the server at the configured temperature; its weights go back through SGLang's own
``update_weights_from_tensor``. With the learner, each rollout also carries the server's log-probs (top
``GRPOConfig.top_logprobs_num`` per token), from which the learner builds its KD target. Also a rule reward a random tiny model can learn within a few steps (tests).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from sglang_spex.respec.grpo import GRPOConfig, GRPOLoop, ServerClient, stats_dict
from sglang_spex.respec.grpo_setup import EAGLE_ARGS
from sglang_spex.respec.policy import Policy
from sglang_spex.tot.tasks import Question, TaskSet

MODES = ("none", "naive", "learner", "respec")
LEARNER_MODES = ("learner", "respec")  # the modes with the online learner inside the server


def digit_share_reward(text: str, question: Optional[Question] = None) -> float:
    """Share of the non-space characters of ``text`` that are digits (0 for an empty text): a dense rule reward."""
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def mode_server_args(
    mode: str,
    policy_dir: Path,
    drafter_dir: Optional[Path] = None,
    dtype: str = "float32",
    respec_profile: Optional[str] = None,
    learner_json: Optional[str] = None,
    extra: Sequence[str] = (),
) -> List[str]:
    """Launcher args of one mode (``learner`` and ``respec`` need a learner spec, ``respec`` also a profile for the
    adaptive server)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    args = ["--model-path", str(policy_dir), "--dtype", dtype, *extra]
    if mode == "none":
        return args
    if drafter_dir is None:
        raise ValueError(f"mode {mode!r} needs a drafter")
    args += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter_dir), *EAGLE_ARGS]
    if mode in LEARNER_MODES:
        if not learner_json:
            raise ValueError(f"mode {mode!r} needs a learner spec")
        args += ["--respec-learner", learner_json]
    if mode == "respec":
        if not respec_profile:
            raise ValueError("mode 'respec' needs a ReSpec profile")
        args += ["--respec-adaptive", "--respec-profile", str(respec_profile)]
    return args


def run_rl(
    server_args: Sequence[str],
    policy_dir: Path,
    task: TaskSet,
    config: GRPOConfig,
    steps: int,
    policy_lr: float,
    reward_fn: Optional[Callable[[str, Question], float]] = None,
    with_learner: bool = False,
    on_step: Optional[Callable[[Dict], None]] = None,
    on_start: Optional[Callable[[str], Dict]] = None,
    save_dir: Optional[Path] = None,
) -> Dict:
    """Start the server, run ``steps`` GRPO steps from ``policy_dir`` (seeded by ``config.seed``), stop it.
    Returns ``{"steps": [per-step dict], "server_start_s": float, "learner": final learner state or None,
    "on_start": what ``on_start(server_url)`` returned, called once the server is up, "respec_report": the
    adaptive server's counters or None}``. With ``save_dir`` the final policy is saved there (HF layout, with the
    tokenizer) and ``"policy_dir"`` names it."""
    from transformers import AutoTokenizer

    from sglang_spex.serve import ServerProcess

    torch.manual_seed(config.seed)
    policy = Policy.from_pretrained(policy_dir, lr=policy_lr, temperature=config.temperature)
    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    t0 = time.perf_counter()
    out: Dict = {"steps": [], "learner": None}
    with ServerProcess(list(server_args)) as srv:
        out["server_start_s"] = time.perf_counter() - t0
        out["on_start"] = on_start(srv.url) if on_start is not None else None
        client = ServerClient(srv.url)
        loop = GRPOLoop(client, policy, tok, task, config, reward_fn=reward_fn, post_rollouts=with_learner)
        for s in loop.run(steps, progress=False):
            row = stats_dict(s)
            row["distinct_per_group"] = loop.last_distinct
            if with_learner:
                state = client.learner_state()
                row["drafter_version"] = state["version"]
                row["learner_updating"] = state["updating"]
            out["steps"].append(row)
            if on_step is not None:
                on_step(row)
        if with_learner:
            out["learner"] = client.learner_state()
        out["respec_report"] = respec_report(srv.url)
    if save_dir is not None:
        out["policy_dir"] = str(policy.save_pretrained(save_dir, tok))
    return out


def respec_report(url: str) -> Optional[Dict]:
    """The adaptive server's own counters (plain vs spec decode steps, switches), None without ``--respec-adaptive``."""
    import httpx

    states = httpx.get(url + "/get_server_info", timeout=60).json().get("internal_states") or [{}]
    return states[0].get("respec")
