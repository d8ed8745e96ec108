"""The reviewer's live exploit, on a real server: a client's reference for a reasoning_gym task whose scorer
evaluates text (``rg:polynomial_multiplication``: sympy's ``parse_expr``) must not run as code in the server."""

from __future__ import annotations

import pytest
import requests

from .conftest import USER
from .helpers import QUESTION

pytestmark = pytest.mark.server


def test_a_reference_is_not_run_as_code_by_a_reasoning_gym_scorer(hardened_server, tmp_path):
    target = tmp_path / "pwned"
    reference = f"__import__('pathlib').Path({str(target)!r}).write_text('pwned')"
    spec = {
        "policy": {"name": "rebase", "width": 2, "max_depth": 1},
        "step": {"max_tokens": 8, "stop": [], "temperature": 1.0},
        "answer": {"pattern": "([a-z])"},
        "task": "rg:polynomial_multiplication",
    }
    answered = None
    for seed in range(8):  # a seed whose steps hold a lower-case letter (the tiny model's text is random)
        r = requests.post(
            hardened_server.url + "/tot/search",
            json={"spec": {**spec, "seed": seed}, "question": QUESTION, "reference": reference},
            headers=USER,
            timeout=300,
        )
        assert r.status_code == 200, r.text
        if r.json()["answer"] is not None:
            answered = r.json()
            break
    assert answered is not None and answered["correct"] is False, answered
    assert not target.exists()
