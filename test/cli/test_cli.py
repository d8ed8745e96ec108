"""``python -m sglang_spex search`` against the live tiny server, and its pure helpers."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import List

import httpx
import pytest

from sglang_spex import cli as cli_mod
from sglang_spex.cli import best_path, summary_lines

# the tiny random model never writes "The answer is N": take a step's first word as its answer
TINY = ["--max-tokens", "6", "--reward", "logprob", "--answer-pattern", r"(\S+)"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang_spex", "search", *args], capture_output=True, text=True, timeout=300
    )


def test_search_prints_the_answer_and_exits_0(spex_server):
    out = cli("What is 12 + 7?", "--policy", "rebase-8", "--url", spex_server.url, "--json", *TINY)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["status"] == "done" and res["answer"]
    text = cli("What is 12 + 7?", "--policy", "rebase-8", "--url", spex_server.url, "--speculation", "off", *TINY)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"answer: {res['answer']}"  # same seed, same tree, with or without SPEX
    assert lines[1] == "best path:" and lines[2].strip().startswith("r.")
    assert any(x.startswith("accounting: done") for x in lines) and "speculation: off" in lines


def test_stream_prints_nodes_as_they_arrive(spex_server):
    out = cli("What is 12 + 7?", "--policy", "rebase-8", "--url", spex_server.url, "--stream", *TINY)
    assert out.returncode == 0, out.stderr
    nodes = [x for x in out.stdout.splitlines() if x.startswith("node r.")]
    frontiers = [x for x in out.stdout.splitlines() if x.startswith("frontier depth")]
    assert len(nodes) >= 8 and frontiers and "answer: " in out.stdout


def test_bad_policy_exits_2_naming_the_field(spex_server):
    out = cli("What is 12 + 7?", "--policy", "rebase-9000", "--url", spex_server.url)
    assert out.returncode == 2 and out.stdout == ""
    lines: List[str] = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: policy.name: unknown policy 'rebase-9000'")


def test_bad_input_the_server_refuses_exits_2(spex_server):
    out = cli("word " * 3000, "--url", spex_server.url, *TINY)  # only the server knows its model's context
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: question: the prompt is"), lines


@pytest.mark.parametrize(
    "args, message",
    [
        (["   ", "--url", "http://127.0.0.1:1"], "error: question: must be a non-empty string"),
        (["1+1?", "--url", "notaurl"], "error: --url: 'notaurl': expected http://HOST:PORT"),
        (["1+1?", "--url", "ftp://host:1"], "error: --url: 'ftp://host:1': expected http://HOST:PORT"),
        # an argv byte that is not UTF-8 (a lone surrogate): before the server is asked (or started), not by its 400
        (
            ["\udcff", "--url", "http://127.0.0.1:1"],
            "error: question: is not valid Unicode: a lone surrogate at character 0",
        ),
        (
            ["1+1?", "--reference", "a\udcff", "--url", "http://127.0.0.1:1"],
            "error: reference: is not valid Unicode: a lone surrogate at character 1",
        ),
    ],
)
def test_bad_input_exits_2_before_any_request(args, message):
    out = cli(*args)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [message]


def test_ctrl_c_exits_130_with_one_line(monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_mod, "run_search", interrupted)
    assert cli_mod.main(["1+1?", "--url", "http://127.0.0.1:1"]) == cli_mod.EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip() == "cancelled"


def test_a_url_without_tot_search_says_what_it_is(monkeypatch, capsys):
    def not_found(url, **k):
        return httpx.Response(404, request=httpx.Request("POST", url), json={"detail": "Not Found"})

    monkeypatch.setattr(cli_mod.httpx, "post", not_found)
    assert cli_mod.main(["1+1?", "--url", "http://127.0.0.1:1"]) == cli_mod.EXIT_UNREACHABLE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a sglang-spex server" in err[0] and "client-side" in err[0]


def test_unreachable_server_and_failed_search_exit_differently(capsys):
    """Connection refused means nothing was searched (3); a server error answer is a failed search (1)."""
    assert cli_mod.main(["1+1?", "--url", "http://127.0.0.1:1"]) == cli_mod.EXIT_UNREACHABLE == 3
    assert capsys.readouterr().err.startswith("error: http://127.0.0.1:1: ")


@pytest.mark.parametrize("stream", [False, True])
def test_server_error_or_cut_stream_is_a_failed_search(monkeypatch, capsys, stream):
    def handler(request):
        if stream:  # a 200 stream that ends before its result event
            return httpx.Response(200, content=b'data: {"event": "node", "path": "r.0", "status": "done"}\n\n')
        return httpx.Response(500, json={"detail": "boom"})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    monkeypatch.setattr(cli_mod.httpx, "post", client.post)
    monkeypatch.setattr(cli_mod.httpx, "stream", client.stream)
    argv = ["1+1?", "--url", "http://127.0.0.1:1"] + (["--stream"] if stream else [])
    assert cli_mod.main(argv) == cli_mod.EXIT_NO_ANSWER
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: http://127.0.0.1:1: "), err


@pytest.mark.parametrize("status", [401, 429, 503])
@pytest.mark.parametrize("stream", [False, True])
def test_a_search_the_server_refused_exits_4_not_as_a_failed_search(monkeypatch, capsys, status, stream):
    """401 (key), 429 (busy), 503 (not ready): nothing was searched, which 1 ("no answer") would misreport."""
    client = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(status, json={"error": "no"})))
    monkeypatch.setattr(cli_mod.httpx, "post", client.post)
    monkeypatch.setattr(cli_mod.httpx, "stream", client.stream)
    argv = ["1+1?", "--url", "http://127.0.0.1:1"] + (["--stream"] if stream else [])
    assert cli_mod.main(argv) == cli_mod.EXIT_REFUSED == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"HTTP {status}" in err[0], err


def test_best_path_follows_the_best_candidate_of_the_answer():
    nodes = [
        {"path": "r", "parent": None, "text": "", "reward": None},
        {"path": "r.0", "parent": "r", "text": "a", "reward": 0.2},
        {"path": "r.1", "parent": "r", "text": "b", "reward": 0.9},
        {"path": "r.1.0", "parent": "r.1", "text": "c", "reward": 0.8},
        {"path": "r.0.0", "parent": "r.0", "text": "d", "reward": 0.1},
    ]
    answers = [
        {"answer": "7", "path": "r.0.0", "score": 0.1},
        {"answer": "5", "path": "r.1.0", "score": 0.99},  # best score, but not the search's answer
        {"answer": "7", "path": "r.1", "score": 0.9},
    ]
    res = {"answer": "7", "answers": answers, "nodes": nodes}
    assert [n["path"] for n in best_path(res)] == ["r.1"]
    res["answer"] = "5"
    assert [n["path"] for n in best_path(res)] == ["r.1", "r.1.0"]
    res.update(answers=[], answer=None, correct=None, status="done", num_requests=4, tokens_generated=9)
    res.update(wall_time=0.5, speculation=None)
    lines = summary_lines(res)
    assert lines[:2] == ["answer: None", "best path:"] and lines[-1] == "speculation: off"
