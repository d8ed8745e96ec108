"""Starting test servers in a given scheduler mode (shared by the conftests)."""

from __future__ import annotations

from typing import List, Optional

import requests

from sglang_spex.serve import ServerProcess

# float32: the identity tests compare trees generated in different batch compositions; bf16 logits of one
# request shift with its batch neighbours (see docs/architecture.md), float32 keeps those shifts negligible.
TINY = ["--dtype", "float32", "--model-path"]
MODES = ("overlap", "no-overlap")
# The launcher's default is SGLang's: the overlap loop, on CPU too. The suite's shared ``spex_server`` uses it,
# ``spex_server_in_mode`` adds the non-overlap loop.
DEFAULT_MODE = "overlap"


def mode_args(mode: str) -> List[str]:
    """Launcher flags for a scheduler mode: none for the overlap loop (the default), SGLang's
    ``--disable-overlap-schedule`` for the other."""
    if mode not in MODES:
        raise ValueError(f"unknown scheduler mode {mode!r}")
    return [] if mode == "overlap" else ["--disable-overlap-schedule"]


def start_server(args: List[str], mode: str = DEFAULT_MODE, headers: Optional[dict] = None) -> ServerProcess:
    """Start a server in ``mode`` and check that SGLang really runs that scheduler loop (``headers``: the
    API key, for a server started with one)."""
    srv = ServerProcess([*args, *mode_args(mode)])
    srv.start()
    try:
        info = requests.get(srv.url + "/get_server_info", headers=headers, timeout=60).json()
        if bool(info["disable_overlap_schedule"]) != (mode == "no-overlap"):
            raise RuntimeError(
                f"asked for {mode} scheduling, SGLang runs disable_overlap_schedule={info['disable_overlap_schedule']}"
                f" (launcher flags {mode_args(mode)})"
            )
    except Exception:
        srv.stop()
        raise
    return srv


def spex_args(tiny_model: str) -> List[str]:
    return [*TINY, tiny_model, "--tot-speculation", "--tot-k-total", "8", "--enable-metrics"]


# The flags review's reproducer: a width-4 search with 200-token steps, whose own fan-out fills a small KV pool
# (``--max-total-tokens 700``) or a capped request queue (``--max-queued-requests 2``).
FANOUT_SEARCH = {
    "spec": {
        "policy": {"name": "rebase", "width": 4, "max_depth": 2},
        "step": {"max_tokens": 200, "stop": [], "temperature": 1.0},
        "reward": {"type": "logprob"},
        "seed": 0,
    },
    "question": "What is 12 + 7?",
}
