"""rSTAR-MCTS: UCT Q/N + 2·sqrt(ln N_p / N), rollouts to a terminal, 5 target answers, arithmetic verifier."""

from _common import SMOLLM2_CHAT, main

import sglang_spex.lang as tot


@tot.search
def rstar_program(s):
    s.policy(tot.policy("rstar-5", max_depth=4, branch=3))
    s.prompt(SMOLLM2_CHAT)
    s.step(stop=["\n"], max_tokens=64, temperature=1.0, seed=0, max_total_tokens=256)
    s.reward(tot.verifier("arith"))
    s.answer(r"[Tt]he answer is[:\s]*\$?(-?[\d,.]+)", aggregate="majority")


if __name__ == "__main__":
    main(rstar_program, __doc__)
