"""ETS: REBASE plus the ILP that keeps a cheap, semantically diverse set of leaves (width 8)."""

from _common import SMOLLM2_CHAT, main

import sglang_spex.lang as tot


@tot.search
def ets_program(s):
    s.policy(tot.ets(width=8, lambda_c=1.0, lambda_s=1.5))
    s.prompt(SMOLLM2_CHAT)
    s.step(stop=["\n"], max_tokens=64, temperature=1.0, seed=0, max_total_tokens=256)
    s.reward(tot.logprob())
    s.answer(r"[Tt]he answer is[:\s]*\$?(-?[\d,.]+)", aggregate="weighted", score="mean")


if __name__ == "__main__":
    main(ets_program, __doc__)
