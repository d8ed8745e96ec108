"""An external process reward model, emulated for the benchmarks: a callback reward endpoint that answers with a
registered verifier's score after a fixed latency.

It stands for a PRM served on other hardware: the search waits ``latency_s`` for every score (the *reward barrier*
SPEX generates through), while the policy engine's own steps stay what they are. Scores are the verifier's, so both
modes of a benchmark see the same rewards and grow the same tree.
"""

from __future__ import annotations

from sglang_spex.tot.callback_server import CallbackRewardServer
from sglang_spex.tot.rewards import VERIFIERS


def delayed_verifier(name: str, latency_s: float) -> CallbackRewardServer:
    """Serve verifier ``name`` (``question``, ``trajectory`` of the callback body) after ``latency_s``."""
    if name not in VERIFIERS:
        raise KeyError(f"unknown verifier {name!r}; registered: {sorted(VERIFIERS)}")
    verify = VERIFIERS[name]
    return CallbackRewardServer(lambda body: verify(str(body["question"]), list(body["trajectory"])), latency_s)
