"""Specs and flags a review found accepted, crashing or blamed on the wrong field are refused naming the exact one.

Validation level (no server): what ``POST /tot/search`` answers with HTTP 400 is the :class:`SearchSpecError`
of :meth:`SearchSpec.from_dict` (and of ``speculation.settings.resolve``) shown here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_spex.config import ConfigError, SpexConfig
from sglang_spex.flags import parse_args
from sglang_spex.speculation.settings import resolve
from sglang_spex.tot.limits import SearchLimits
from sglang_spex.tot.rewards import MAX_TAG_CHARS, MAX_TEMPLATE_FIELDS
from sglang_spex.tot.search_spec import MAX_STOP_CHARS, MAX_STOP_STRINGS, SearchSpec, SearchSpecError

NAN, INF = float("nan"), float("inf")
PRM = {"type": "prm", "url": "http://127.0.0.1:1"}
QUESTION = "What is 12 + 7?"


def refused(data: dict) -> SearchSpecError:
    with pytest.raises(SearchSpecError) as e:
        SearchSpec.from_dict(data)
    return e.value


@pytest.mark.parametrize(
    "template",
    [
        "{question}{question:>300000000}",  # a format spec pads the prompt to any size
        "{question:>9}",
        "{question!r}",
        "{question.__class__}",
        "{question[0]}",
        "{}",
        "{0}",
        "{question}{steps}",
        "{question} {x}",
        "{question}" * (MAX_TEMPLATE_FIELDS + 1),  # each copy multiplies the prompt
        "{question",
        "{question}}",
        "no placeholder",
        5,
    ],
)
def test_prompt_template_allows_only_a_few_plain_question_fields(template):
    err = refused({"step": {"prompt_template": template}})
    assert err.field == "step.prompt_template" and err.reason


@pytest.mark.parametrize(
    "template", ["{question}", "Q: {question}\n{{not a field}}", "{question}" * MAX_TEMPLATE_FIELDS]
)
def test_an_accepted_prompt_template_renders_within_its_bound(template):
    spec = SearchSpec.from_dict({"step": {"prompt_template": template}})
    prompt = spec.step.prompt_template.format(question=QUESTION)
    assert len(prompt) <= len(template) + MAX_TEMPLATE_FIELDS * len(QUESTION)


@pytest.mark.parametrize(
    "template",
    ["{question}{steps:>300000000}", "{steps!s}", "{question.real}", "{answer}", "{steps}" * 9, "{", 7],
)
def test_prm_template_allows_only_plain_question_and_steps(template):
    assert refused({"reward": {**PRM, "prm_template": template}}).field == "reward.prm_template"


def test_prm_template_with_question_and_steps_is_accepted():
    spec = SearchSpec.from_dict({"reward": {**PRM, "prm_template": "Q: {question}\nSteps: {steps} {{x}}"}})
    assert spec.reward.prm_template.startswith("Q: ")


@pytest.mark.parametrize("name", ["good_token", "bad_token", "step_tag"])
@pytest.mark.parametrize("value", ["", "x" * (MAX_TAG_CHARS + 1), 5, None, ["+"]])
def test_prm_tokens_are_short_non_empty_strings(name, value):
    assert refused({"reward": {**PRM, name: value}}).field == f"reward.{name}"


@pytest.mark.parametrize("name", ["good_token", "bad_token"])
def test_prm_tokens_are_not_blank(name):
    """They are compared whitespace-stripped with the PRM's top tokens; the step tag may be whitespace."""
    assert refused({"reward": {**PRM, name: "  "}}).field == f"reward.{name}"
    assert SearchSpec.from_dict({"reward": {**PRM, "step_tag": " \n"}}).reward.step_tag == " \n"


@pytest.mark.parametrize(
    "data, field",
    [
        ({"reward": {"type": "verifier", "name": ["arith"]}}, "reward.name"),
        ({"reward": {"type": "verifier", "name": {}}}, "reward.name"),
        ({"reward": {"type": "logprob", "name": 5}}, "reward.name"),
        ({"task": 5}, "task"),
        ({"task": ["toy_add"]}, "task"),
        ({"task": {}}, "task"),
        ({"reward": {"type": "logprob", "url": 5}}, "reward.url"),
        ({"reward": {"type": "logprob", "url": ["http://x"]}}, "reward.url"),
        ({"reward": {"type": "verifier", "name": "arith", "url": {"h": 1}}}, "reward.url"),
        ({"reward": {"type": "prm", "url": ["http://x"]}}, "reward.url"),
    ],
)
def test_wrong_types_are_a_named_field_error_not_a_crash(data, field):
    assert refused(data).field == field


def test_a_string_url_with_a_logprob_reward_still_reaches_the_host_check():
    spec = SearchSpec.from_dict({"reward": {"type": "logprob", "url": "http://10.1.2.3/"}})
    with pytest.raises(SearchSpecError) as e:
        SearchLimits().check_spec(spec)
    assert e.value.field == "reward.url"


def test_step_stop_is_bounded_by_sglangs_limit():
    stops = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    assert SearchSpec.from_dict({"step": {"stop": stops}}).step.stop == stops
    assert refused({"step": {"stop": [*stops, "one more"]}}).field == "step.stop"
    longest = "x" * MAX_STOP_CHARS
    assert SearchSpec.from_dict({"step": {"stop": ["\n", longest]}}).step.stop == ["\n", longest]
    assert refused({"step": {"stop": ["\n", longest + "x"]}}).field == "step.stop[1]"


@pytest.mark.parametrize(
    "knob, value",
    [
        ("inf", NAN),
        ("inf", INF),
        ("inf", -1.0),
        ("low", NAN),
        ("low", -INF),
        ("low", 10**400),
        ("end_gate", NAN),
        ("end_gate", INF),
        ("exploration_constant", INF),
        ("exploration_constant", NAN),
    ],
)
def test_rest_value_knobs_are_finite(knob, value):
    assert refused({"policy": {"name": "rest", knob: value}}).field == f"policy.{knob}"


def test_rest_value_knobs_in_range_are_accepted():
    policy = SearchSpec.from_dict({"policy": {"name": "rest", "inf": 0, "low": -2.5, "end_gate": 3}}).policy
    assert policy.build().params.low == -2.5


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"early_stop": True, "early_stop_alpha": NAN}, "speculation.early_stop_alpha"),
        ({"early_stop": True, "early_stop_min_answers": 0}, "speculation.early_stop_min_answers"),
        ({"early_stop_min_answers": 0, "early_stop": True}, "speculation.early_stop_min_answers"),
        ({"early_stop": "yes"}, "speculation.early_stop"),
        ({"early_stop_alpha": 10**400}, "speculation.early_stop_alpha"),  # too large for a float
        ({"lookahead": 2, "max_lookahead": 0}, "speculation.max_lookahead"),
        ({"lookahead": "4"}, "speculation.lookahead"),
        ({"components": ["t1", "t9"]}, "speculation.components"),
    ],
)
def test_speculation_error_names_the_exact_field(overrides, field):
    with pytest.raises(SearchSpecError) as e:
        resolve(SpexConfig(), overrides)
    assert e.value.field == field


@pytest.mark.parametrize("hosts", ["10.0.0.0/33", "loopback,10.0.0.256", "prm host", "[::1]", "http://prm", ","])
def test_reward_hosts_flag_refuses_an_entry_it_could_never_match(hosts):
    with pytest.raises(ConfigError, match="--tot-reward-hosts") as e:
        parse_args(["--tot-reward-hosts", hosts])
    assert "is not a host name" in str(e.value)
    with pytest.raises(ConfigError, match="--tot-reward-hosts"):
        SpexConfig(reward_hosts=tuple(hosts.split(","))).validate()


def test_reward_hosts_flag_accepts_names_ips_networks_loopback_and_any():
    text = "loopback, 10.0.0.0/8,192.168.1.7/24,::1,fd00::/8,prm.internal.,my_prm,*"
    cfg, _ = parse_args(["--tot-reward-hosts", text])
    assert cfg.spex.reward_hosts == tuple(h.strip() for h in text.split(","))


def test_launcher_exits_2_naming_a_bad_reward_host():
    p = subprocess.run(
        [sys.executable, "-m", "sglang_spex.launch_server", "--tot-reward-hosts", "10.0.0.0/33"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert "--tot-reward-hosts" in p.stderr and "10.0.0.0/33" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "policy, field",
    [
        ({"name": "rstar", "exploration_weight": float("inf")}, "policy.exploration_weight"),
        ({"name": "ets", "lambda_c": float("inf")}, "policy.lambda_c"),
        ({"name": "ets", "lambda_s": 10**400}, "policy.lambda_s"),
        ({"name": "rebase", "softmax_temperature": float("inf")}, "policy.softmax_temperature"),
        ({"name": "rebase", "softmax_temperature": 0}, "policy.softmax_temperature"),
    ],
)
def test_other_policies_refuse_infinite_knobs(policy, field):
    with pytest.raises(SearchSpecError) as e:
        SearchSpec.from_dict({"policy": policy}).validate()
    assert e.value.field == field


@pytest.mark.parametrize(
    "data, field",
    [
        ({"step": {"temperature": INF}}, "step.temperature"),  # SGLang would refuse every node of the search
        ({"step": {"temperature": NAN}}, "step.temperature"),
        ({"step": {"max_tokens": True}}, "step.max_tokens"),  # a bool is not a token count
        ({"step": {"max_total_tokens": True}}, "step.max_total_tokens"),
        ({"reward_timeout": INF}, "reward_timeout"),
        ({"reward_timeout": NAN}, "reward_timeout"),
        ({"reward_timeout": "30"}, "reward_timeout"),
    ],
)
def test_infinite_times_and_bool_counts_are_refused(data, field):
    assert refused(data).field == field
