"""REBASE: softmax-over-rewards width allocation (width 8), intrinsic log-prob reward."""

from _common import SMOLLM2_CHAT, main

import sglang_spex.lang as tot


@tot.search
def rebase_program(s):
    s.policy(tot.rebase(width=8, softmax_temperature=0.2))
    s.prompt(SMOLLM2_CHAT)
    s.step(stop=["\n"], max_tokens=64, temperature=1.0, seed=0, max_total_tokens=256)
    s.reward(tot.logprob())
    s.answer(r"[Tt]he answer is[:\s]*\$?(-?[\d,.]+)", aggregate="weighted", score="mean")


if __name__ == "__main__":
    main(rebase_program, __doc__)
