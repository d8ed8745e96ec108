"""Spec validation, DSL serialisation, answers, task sets and the arithmetic verifier (no server)."""

from __future__ import annotations

import json

import pytest

import sglang_spex.lang as tot
from sglang_spex.tot.answers import Candidate, aggregate, check_answer, extract_answer, path_score
from sglang_spex.tot.policies import PRESETS
from sglang_spex.tot.rewards import arith_verifier, check_arith_equations
from sglang_spex.tot.search_spec import DEFAULT_ANSWER_PATTERN, SearchSpec, SearchSpecError
from sglang_spex.tot.tasks import get_task


def test_dsl_round_trip():
    @tot.search
    def prog(s):
        s.policy(tot.ets(width=8))
        s.step(stop="\n", max_tokens=32, temperature=0.7, seed=4)
        s.reward(tot.prm("http://127.0.0.1:1", good_token="+"), timeout=5)
        s.answer(r"answer: (\d+)", aggregate="best_of_n", score="min")
        s.speculation(k=3)

    d = json.loads(prog.to_json())
    assert d["policy"] == {"name": "ets", "width": 8}  # unset knobs keep the policy's own defaults
    assert SearchSpec.from_dict(d).policy.build().params.lambda_s == 1.5
    assert d["step"]["stop"] == ["\n"] and d["seed"] == 4 and d["reward_timeout"] == 5
    assert d["speculation"] == {"k": 3}
    assert SearchSpec.from_dict(d).to_dict() == d
    assert tot.Program.from_json(d).to_dict() == d


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_resolve(preset):
    policy = SearchSpec.from_dict({"policy": preset}).policy.build()
    assert policy.name == preset.split("-")[0] and isinstance(policy.params, policy.params_type)
    assert getattr(policy.params, "width", None) in (8, 16) or policy.params.target_answers in (5, 10)


@pytest.mark.parametrize(
    "data,field",
    [
        ({"policy": {"name": "rebase", "softmax_temperature": 0}}, "policy.softmax_temperature"),
        ({"policy": {"name": "rest", "alpha": 2}}, "policy.alpha"),
        ({"policy": {"name": "rstar", "target_answers": 0}}, "policy.target_answers"),
        ({"policy": {"name": "rest", "roll_forward_steps": -1}}, "policy.roll_forward_steps"),
        ({"policy": {"name": "ets", "lambda_s": -1}}, "policy.lambda_s"),
        ({"policy": {"name": "ets", "width": 0}}, "policy.width"),
        ({"policy": {"name": "rebase", "depth": 3}}, "policy.depth"),
        ({"policy": {"name": "rstar", "branch": "3"}}, "policy.branch"),
        ({"policy": "bogus"}, "policy.name"),
        ({"policy": {"name": "ets", "embedder": "bert"}}, "policy.embedder"),
        ({"step": {"stop": "\n"}}, "step.stop"),
        ({"step": {"prompt_template": "no placeholder"}}, "step.prompt_template"),
        ({"reward": {"type": "magic"}}, "reward.type"),
        ({"reward": {"type": "callback", "url": "ftp://x"}}, "reward.url"),
        ({"reward": {"type": "verifier", "name": "nope"}}, "reward.name"),
        ({"answer": {"aggregate": "vote"}}, "answer.aggregate"),
        ({"seed": "1"}, "seed"),
        ({"task": "nope"}, "task"),
        ({"reward_timeout": 0}, "reward_timeout"),
        ({"priority": 2**63}, "priority"),  # SGLang refuses it per request: every node would fail
        ({"priority": True}, "priority"),
    ],
)
def test_spec_errors_name_the_field(data, field):
    with pytest.raises(SearchSpecError) as e:
        SearchSpec.from_dict(data)
    assert e.value.field == field


def test_answers():
    assert extract_answer("so 3 + 4 = 7. The answer is 7.", DEFAULT_ANSWER_PATTERN) == "7"
    assert extract_answer("The final answer is $\\boxed{12}$.", DEFAULT_ANSWER_PATTERN) == "12"
    assert extract_answer("no answer here", DEFAULT_ANSWER_PATTERN) is None
    assert path_score([0.5, 0.2, 0.8], "min") == 0.2 and path_score([0.5, 0.5], "prod") == 0.25
    cands = [Candidate("7", "r.0", 0.9), Candidate("8", "r.1", 0.3), Candidate("8.0", "r.2", 0.3)]
    assert aggregate(cands, "majority") == "8"  # 8 and 8.0 vote together
    assert aggregate(cands, "weighted") == "7"  # 0.9 > 0.6
    assert aggregate(cands, "best_of_n") == "7"
    assert aggregate([], "majority") is None
    assert check_answer("1,000", "1000") and check_answer("\\frac{1}{2}", "0.5") and not check_answer("3", "4")


def test_arith_verifier():
    assert check_arith_equations("12 + 7 = 19 and 3 * 4 = 13") == [True, False]
    assert arith_verifier("q", ["We get 2 + 2 = 4."]) == 1.0
    assert arith_verifier("q", ["2 + 2 = 5"]) == 0.0
    assert arith_verifier("q", ["no equations"]) == 0.5


def test_task_sets_are_deterministic_with_splits():
    toy = get_task("toy_add")
    dev, dev2, test = toy.questions(5, "dev"), toy.questions(5, "dev"), toy.questions(5, "test")
    assert [q.text for q in dev] == [q.text for q in dev2] != [q.text for q in test]
    q = dev[0]
    assert toy.check_answer(q.reference, q) and not toy.check_answer("-1", q)
    assert toy.check_step(f"{q.meta['a']} + {q.meta['b']} = {q.reference}", q) == 1.0
    rg = get_task("rg:chain_sum")
    rq = rg.questions(3, "dev")
    assert [x.text for x in rq] == [x.text for x in rg.questions(3, "dev")]
    assert rg.check_answer(rq[0].reference, rq[0]) and not rg.check_answer("nonsense", rq[0])
