"""The demo's functions on the tiny model (the full SmolLM2 demo stays a command: ``make demo``)."""

from __future__ import annotations

import json

import pytest

from sglang_spex.demo import ANSWER, BASELINE, SINGLE, SPEX, arm_summary, format_table, story, write_outputs
from sglang_spex.tot.answers import extract_answer
from sglang_spex.tot.search_spec import SearchSpec


def test_answer_pattern_reads_stated_and_written_out_sums():
    assert extract_answer("The answer is 55.", ANSWER) == "55"
    assert extract_answer('The answer is "18."', ANSWER) == "18"
    assert extract_answer("15 + 40 = 55", ANSWER) == "55"
    assert extract_answer("Let me add the tens first.", ANSWER) is None


def test_arm_summary_medians_and_accounting():
    def run(wall, correct, spec=None):
        results = [
            {"correct": c, "tokens_generated": 10, "answer": str(i), "speculation": spec} for i, c in enumerate(correct)
        ]
        return {"wall_s": wall, "results": results}

    acc = {"issued": 5, "hits": 3, "wasted_tokens": 7}
    a = arm_summary(SPEX, [run(60.0, [True, False]), run(30.0, [False, False]), run(20.0, [True, True])])
    assert a["correct"] == 1 and a["accuracy"] == 0.5  # accuracy of the first run
    assert a["questions_per_min"] == 4.0 and a["questions_per_min_range"] == [2.0, 6.0]
    assert not a["speculative"] and a["issued"] == 0
    b = arm_summary(SPEX, [run(60.0, [True, False], acc)])
    assert b["speculative"] and (b["issued"], b["hits"], b["wasted_tokens"]) == (10, 6, 14)


def test_story_on_the_tiny_model(spex_server, tmp_path):
    summary = story(spex_server.url, n=2, width=3, max_depth=2, repeats=2, concurrency=2, max_tokens=6)
    arms = {a["name"]: a for a in summary["arms"]}
    assert list(arms) == [SINGLE, BASELINE, SPEX]
    assert all(a["questions"] == 2 and a["runs"] == (1 if name == SINGLE else 2) for name, a in arms.items())
    assert arms[SINGLE]["tokens"] < arms[BASELINE]["tokens"]  # one chain vs a tree of width 3
    assert not arms[BASELINE]["speculative"] and arms[SPEX]["speculative"]
    assert 0 < arms[SPEX]["hits"] <= arms[SPEX]["issued"]
    assert arms[BASELINE]["answers"] == arms[SPEX]["answers"]  # T3 off: SPEX returns the baseline's search
    speedup = arms[SPEX]["questions_per_min"] / arms[BASELINE]["questions_per_min"]
    assert abs(summary["speedup"] - speedup) < 1e-9
    assert summary["questions"] == [{"text": "What is 15 + 40?", "reference": "55"}, summary["questions"][1]]
    table = format_table(summary)
    assert table.splitlines()[0].split()[:2] == ["arm", "correct"] and f"{arms[SPEX]['hits']}/" in table
    json_path, png_path = write_outputs(summary, tmp_path / "out")
    assert json.loads(json_path.read_text()) == summary
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_search_spec_is_valid_for_every_preset():
    from sglang_spex.demo import search_spec

    for preset in ("rebase-8", "ets-8", "rstar-5", "rest-5"):
        spec = SearchSpec.from_dict(search_spec(preset, speculation=False))
        assert spec.task == "toy_add" and spec.speculation == {"enabled": False}


@pytest.mark.parametrize(
    "args", [["-n", "0"], ["-n", "-3"], ["--concurrency", "0"], ["--repeats", "0"], ["--width", "0"]]
)
def test_counts_below_one_exit_2_before_any_server_starts(args, capsys, monkeypatch):
    import sglang_spex.demo as demo

    monkeypatch.setattr(demo, "start_for_one_run", None)  # starting a server would raise TypeError, not exit 2
    with pytest.raises(SystemExit) as e:
        demo.main(args)
    assert e.value.code == 2 and "expected an integer >= 1" in capsys.readouterr().err
