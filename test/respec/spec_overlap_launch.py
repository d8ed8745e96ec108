"""Test launcher: ``sglang_spex.launch_server`` with SGLang's CPU guard against speculative overlap lifted.

SGLang 0.5.23 turns the overlap scheduler off for NGRAM and EAGLE-family speculative decoding on CPU
(``arg_groups/speculative_hook.py: _disable_overlap_schedule_for_cpu``) and our launcher does not lift that, so on
this machine the ReSpec hooks could never run under the overlap loop every GPU server uses. NGRAM's overlap path
itself runs on CPU (greedy output equals plain SGLang's), so the ReSpec server tests start NGRAM servers in overlap
mode through this module: the same launcher, the same flags, only that startup guard replaced (in the launcher
process, where SGLang resolves its server arguments). EAGLE's overlap path does not run on CPU (its ``FutureMap``
gathers with a Triton kernel), so it is not started this way.
"""

from __future__ import annotations

from sglang.srt.arg_groups import speculative_hook

from sglang_spex import launch_server


def _keep_overlap(server_args) -> None:
    """Leave ``disable_overlap_schedule`` as the launcher resolved it."""


if __name__ == "__main__":
    speculative_hook._disable_overlap_schedule_for_cpu = _keep_overlap
    launch_server.main()
