"""ReST-MCTS*: value-guided UCT with partial rollouts and weighted backup, 5 target answers."""

from _common import SMOLLM2_CHAT, main

import sglang_spex.lang as tot


@tot.search
def rest_program(s):
    s.policy(tot.policy("rest-5", max_depth=4, exploration_constant=0.7, end_gate=0.9))
    s.prompt(SMOLLM2_CHAT)
    s.step(stop=["\n"], max_tokens=64, temperature=1.0, seed=0, max_total_tokens=256)
    s.reward(tot.logprob())
    s.answer(r"[Tt]he answer is[:\s]*\$?(-?[\d,.]+)", aggregate="weighted", score="last")


if __name__ == "__main__":
    main(rest_program, __doc__)
