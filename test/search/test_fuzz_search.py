"""Property-based fuzzing of ``POST /tot/search`` on a real server (hypothesis).

Random JSON, wrong types, huge numbers, huge strings, deep nesting and near-valid specs: every answer is 2xx or
4xx, the server stays healthy after each, and once the fuzzing ends the KV pool, the protected tokens and the
request slots are back at their start values. Derandomized, so CI runs the same examples every time.
"""

from __future__ import annotations

import json

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import ADMIN, USER
from .helpers import QUESTION, wait_until

POLICY_NAMES = ["rebase", "ets", "rstar", "rest", "rebase-8", "rstar-5", "nope", ""]
KNOBS = ["width", "max_depth", "num_rollouts", "iterations", "branch", "roll_branch", "roll_forward_steps",
         "target_answers", "softmax_temperature", "exploration_weight", "embedder", "bogus"]  # fmt: skip
HUGE = st.sampled_from([-(10**30), -1, 0, 1, 2, 3, 10**6, 10**18, 10**400, 1e308, float("inf"), float("nan")])
SCALARS = st.one_of(
    st.none(), st.booleans(), HUGE, st.integers(-10, 10), st.floats(allow_nan=True), st.text(max_size=20)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


# A value that is usually sensible for its field, sometimes of the wrong type or size.
def _near(valid: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(valid, valid, valid, JSON)


POLICY = st.fixed_dictionaries(
    {"name": _near(st.sampled_from(POLICY_NAMES))},
    optional={k: _near(st.integers(0, 5)) for k in KNOBS},
)
STEP = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": _near(st.integers(0, 20)),
        "temperature": _near(st.floats(0, 2)),
        "top_p": _near(st.floats(0, 1)),
        "stop": _near(st.lists(st.text(min_size=1, max_size=3), max_size=2)),
        "max_total_tokens": _near(st.integers(1, 64)),
        "prompt_template": _near(st.sampled_from(["{question}\n", "Q: {question}", "{question} {x}", "{", ""])),
    },
)
REWARD = st.fixed_dictionaries(
    {"type": _near(st.sampled_from(["logprob", "verifier", "callback", "prm", "nope"]))},
    optional={
        "name": _near(st.sampled_from(["arith", "nope"])),
        "url": _near(st.sampled_from(["http://127.0.0.1:9/score", "http://10.1.2.3/x", "ftp://x", "http://"])),
    },
)
ANSWER = st.fixed_dictionaries(
    {},
    optional={
        "pattern": _near(st.sampled_from([r"answer is (\d+)", "(", "(a+)+$", "x" * 2000])),
        "aggregate": _near(st.sampled_from(["majority", "weighted", "best_of_n", "nope"])),
    },
)
SPEC = st.fixed_dictionaries(
    {},
    optional={
        "policy": st.one_of(POLICY, st.sampled_from(POLICY_NAMES)),
        "step": STEP,
        "reward": REWARD,
        "answer": ANSWER,
        "seed": _near(st.integers(0, 3)),
        "priority": _near(st.integers(-5, 5)),
        "speculation": _near(st.just({"enabled": False})),
        "task": _near(st.sampled_from(["nope", None])),
        "bogus": JSON,
    },
)
BODY = st.fixed_dictionaries(
    {"question": _near(st.sampled_from([QUESTION, "", "   ", "x" * 300]))},
    optional={
        "spec": st.one_of(SPEC, SPEC, JSON),
        "stream": _near(st.booleans()),
        "reference": _near(st.sampled_from(["19", 19])),
        "search_id": _near(st.sampled_from(["fuzz", "bad id!", "a" * 80])),
        "extra": JSON,
    },
)
# Bodies the hardened server runs (within its limits), with one field of them fuzzed.
VALID_POLICY = st.one_of(
    st.fixed_dictionaries({"name": st.just("rebase"), "width": st.integers(1, 4), "max_depth": st.integers(1, 3)}),
    st.fixed_dictionaries(
        {"name": st.just("rstar"), "num_rollouts": st.integers(1, 2), "max_depth": st.integers(1, 2),
         "branch": st.integers(1, 2)}
    ),
)  # fmt: skip
VALID_BODY = st.fixed_dictionaries(
    {
        "question": st.just(QUESTION),
        "spec": st.fixed_dictionaries(
            {"policy": VALID_POLICY, "step": st.fixed_dictionaries({"max_tokens": st.integers(1, 8)})},
            optional={"seed": _near(st.integers(0, 3)), "answer": ANSWER, "reward": REWARD},
        ),
    },
    optional={"stream": st.booleans()},
)
RAW = st.one_of(
    VALID_BODY.map(lambda b: json.dumps(b).encode()),
    VALID_BODY.map(lambda b: json.dumps(b).encode()),
    BODY.map(lambda b: json.dumps(b).encode()),
    BODY.map(lambda b: json.dumps(b).encode()),
    JSON.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"",
            b"{",
            _deep(5000).encode(),  # nesting past the JSON decoder's recursion limit
            json.dumps({"question": "x" * 70000}).encode(),  # over --tot-max-body-bytes
            json.dumps({"question": QUESTION, "spec": {"policy": {"name": "rebase", "width": 10**100}}}).encode(),
        ]
    ),
)


def _pool(url: str) -> dict:
    return requests.get(url + "/spex/stats", headers=USER, timeout=30).json()["scheduler"]["pool"]


def _idle(url: str) -> dict:
    assert wait_until(lambda: (p := _pool(url))["running"] == 0 and p["waiting"] == 0, timeout=120)
    return _pool(url)


def test_any_search_body_is_answered_2xx_or_4xx_and_leaks_nothing(hardened_server):
    url = hardened_server.url
    requests.post(url + "/tot/search", json={"spec": {"policy": {"name": "rebase", "width": 1, "max_depth": 1}},
                                            "question": QUESTION}, headers=USER, timeout=120)  # fmt: skip
    start = _idle(url)
    seen = {}

    @settings(
        max_examples=30,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    )
    @given(raw=RAW)
    def fuzz(raw: bytes) -> None:
        headers = {**USER, "Content-Type": "application/json"}
        with requests.post(url + "/tot/search", data=raw, headers=headers, timeout=300, stream=True) as r:
            for _ in r.iter_content(chunk_size=None):  # a streamed search runs to its result
                pass
            assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, (r.status_code, raw[:300])
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert requests.get(url + "/health", timeout=30).status_code == 200

    fuzz()
    print("status codes:", seen)
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0  # the fuzzing reached both running and refused searches
    _idle(url)
    requests.post(url + "/spex/release", json={}, headers=ADMIN, timeout=30)  # protection of finished searches
    end = _idle(url)
    assert end["kv_protected"] == start["kv_protected"] == 0
    assert end["kv_available"] + end["kv_evictable"] == start["kv_available"] + start["kv_evictable"]
    assert end["req_slots_free"] == start["req_slots_free"]
