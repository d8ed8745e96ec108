"""The command line after the first-hour review: foreign servers exit 3, the exit statuses are stated once,
``search --help`` shows one default per option, the top-level help lists the commands, and the examples report
progress. Fakes only (a local ``http.server``, ``httpx.MockTransport``); no SGLang server."""

from __future__ import annotations

import importlib.util
import re
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Dict, Iterator, List

import httpx
import pytest

from sglang_spex import __main__ as top
from sglang_spex import cli as cli_mod

ROOT = Path(__file__).resolve().parents[2]
URL = "http://127.0.0.1:1"
PLUGIN_ERROR = {"error": {"field": "search", "reason": "busy; retry later"}}


# ---- 6: an answer that is not a sglang-spex server's exits 3 -----------------------------------------------------


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def plain_http_server(tmp_path: Path) -> Iterator[str]:
    """``python -m http.server``: answers a POST with an HTML 501 page."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: QuietHandler(*a, directory=str(tmp_path)))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(5)


def _serve(monkeypatch: pytest.MonkeyPatch, status: int, **content: Any) -> None:
    """Answer every request with a new ``httpx.Response(status, **content)``."""
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(status, **content)))
    monkeypatch.setattr(cli_mod.httpx, "post", client.post)
    monkeypatch.setattr(cli_mod.httpx, "stream", client.stream)


def _one_error_line(capsys: pytest.CaptureFixture) -> str:
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert out.out == "" and len(lines) == 1, out
    return lines[0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_plain_http_server_exits_3_with_a_short_line(plain_http_server, capsys, stream):
    """Its 501 HTML page exited 1 (a failed search) and dumped the whole page into the error line."""
    argv = ["What is 1+1?", "--url", plain_http_server] + (["--stream"] if stream else [])
    assert cli_mod.main(argv) == cli_mod.EXIT_UNREACHABLE == 3
    line = _one_error_line(capsys)
    assert "HTTP 501" in line and "not a sglang-spex server" in line and "Unsupported method" in line, line
    assert "<" not in line and len(line) < 300, line


HTML = "<!DOCTYPE html><html><head><title>oops</title><style>p{}</style></head><body><p>Bad gateway</p></body></html>"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "status, content",
    [
        (405, {"json": {"detail": "Method Not Allowed"}}),  # another app with the path, but no POST
        (502, {"html": HTML}),  # a proxy's page
        (403, {"html": HTML}),  # a proxy's key check, not SGLang's
        (429, {"text": "slow down " * 200}),  # plain text, not the plugin's JSON
        (200, {"html": HTML}),  # a page for any path
    ],
    ids=["405-json", "502-html", "403-html", "429-text", "200-html"],
)
def test_a_foreign_answer_exits_3_not_1_or_4(monkeypatch, capsys, status, content, stream):
    _serve(monkeypatch, status, **content)
    assert cli_mod.main(["1+1?", "--url", URL] + (["--stream"] if stream else [])) == cli_mod.EXIT_UNREACHABLE
    line = _one_error_line(capsys)
    assert f"HTTP {status}" in line and "not a sglang-spex server" in line, line
    assert "<" not in line and len(line) < 300 and "oops" not in line, line


@pytest.mark.parametrize(
    "status, body",
    [
        (401, {"error": "Unauthorized"}),  # SGLang's API-key middleware
        (403, {"error": "Forbidden"}),
        (413, {"error": {"field": "body", "reason": "over this server's limit"}}),
        (429, PLUGIN_ERROR),
        (503, {"error": {"field": "engine", "reason": "not ready"}}),
    ],
)
def test_a_spex_server_refusal_still_exits_4(monkeypatch, capsys, status, body):
    _serve(monkeypatch, status, json=body)
    assert cli_mod.main(["1+1?", "--url", URL]) == cli_mod.EXIT_REFUSED == 4
    assert f"HTTP {status}" in _one_error_line(capsys)


def test_an_unhandled_server_error_is_a_failed_search(monkeypatch, capsys):
    """A 500's plain text (Starlette's answer to an unhandled error) may come from a sglang-spex server."""
    _serve(monkeypatch, 500, text="Internal Server Error")
    assert cli_mod.main(["1+1?", "--url", URL]) == cli_mod.EXIT_NO_ANSWER
    assert "HTTP 500" in _one_error_line(capsys)


# ---- 7, 10: the exit statuses and search --help ------------------------------------------------------------------


def _search_help(capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as e:
        cli_mod.main(["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _docs_exit_paragraph() -> str:
    text = (ROOT / "docs" / "ui.md").read_text()
    start = text.index("Exit status", text.index("## `python -m sglang_spex search`"))
    return " ".join(text[start : text.index("\n\n", start)].split())


def test_exit_statuses_are_one_list_in_the_docstring_help_and_docs(capsys):
    """The docstring called an HTTP error a failed search (1) and left out 4; ``--help`` listed no statuses."""
    codes = [code for code, _ in cli_mod.EXIT_STATUSES]
    assert codes == [0, 1, 2, 3, 4, 130]
    assert codes == [
        cli_mod.EXIT_ANSWER,
        cli_mod.EXIT_NO_ANSWER,
        cli_mod.EXIT_BAD_INPUT,
        cli_mod.EXIT_UNREACHABLE,
        cli_mod.EXIT_REFUSED,
        cli_mod.EXIT_INTERRUPTED,
    ]
    help_text = " ".join(_search_help(capsys).split())
    doc = " ".join(cli_mod.__doc__.split())
    docs = _docs_exit_paragraph()
    assert "failed search (1)" not in doc
    for code, what in cli_mod.EXIT_STATUSES:
        entry = f"{code} {' '.join(what.split())}"
        assert entry in help_text and entry in doc, entry
        assert re.search(rf"\b{code} (with|when|for|after)\b", docs), (code, docs)
    for status in cli_mod.REFUSED_STATUS:
        assert str(status) in help_text and str(status) in docs, status


def test_search_help_shows_one_default_per_option_and_no_markup(capsys):
    """``--speculation``/``--answer-pattern`` showed two defaults, ``--reward``/``--seed`` none, and the description
    had reST markup."""
    text = _search_help(capsys)
    assert "``" not in text and ":func:" not in text and ":mod:" not in text
    options = text[text.index("options:") : text.index("exit status:")]
    blocks: Dict[str, str] = {}
    for block in re.split(r"\n(?=  -)", options)[1:]:
        blocks[block.split()[0].rstrip(",")] = " ".join(block.split())
    for name in ("--policy", "--url", "--speculation", "--reward", "--seed", "--max-tokens", "--answer-pattern"):
        assert blocks[name].count("(default:") == 1, blocks[name]
    assert all(b.count("(default:") <= 1 and "(default: None)" not in b for b in blocks.values()), blocks
    assert "(default: arith)" in blocks["--reward"] and "(default: 0)" in blocks["--seed"]


# ---- 11: python -m sglang_spex ------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_top_level_help_lists_the_commands_on_stdout(capsys, flag):
    assert top.main([flag]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    lines = out.out.splitlines()
    for name in ("search", "demo"):
        [line] = [x for x in lines if x.split()[:1] == [name]]
        assert len(line.split()) > 3, line  # the command and what it does, on one line


def test_an_unknown_command_is_named(capsys):
    assert top.main(["bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'bogus'" in err and "search" in err and "demo" in err


# ---- 9: the examples' help and progress ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def common() -> ModuleType:
    spec = importlib.util.spec_from_file_location("examples_common_review39", ROOT / "examples" / "_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_help_shows_the_defaults(common):
    text = " ".join(common.parser("doc").format_help().split())
    assert "(default: http://127.0.0.1:30000)" in text and "(default: 3)" in text and "(default: toy_add)" in text


def test_examples_print_a_start_line_and_one_line_per_finished_question(common, monkeypatch, capsys):
    """An example printed nothing until every question was done (500 s of silence in the review)."""
    printed: List[str] = []

    def run_batch(questions, backend, references=None, on_result=None, **kw):
        printed.extend(capsys.readouterr().out.splitlines())  # what the user sees before any search ends
        results = []
        for i in reversed(range(len(questions))):  # finishing out of order
            results.insert(0, SimpleNamespace(answer="7", correct=True, tokens_generated=5, num_requests=2))
            results[0].wall_time, results[0].failures = 0.5, []
            on_result(i, results[0])
            printed.extend(capsys.readouterr().out.splitlines())
        return results

    program = SimpleNamespace(run_batch=run_batch, to_json=lambda **kw: "{}")
    monkeypatch.setattr("sys.argv", ["example", "-n", "2", "--url", "http://127.0.0.1:9"])
    common.main(program, "doc")
    printed.extend(capsys.readouterr().out.splitlines())
    assert printed[0] == "searching 2 toy_add questions on http://127.0.0.1:9 ...", printed
    assert printed[1].startswith("[1/2] ") and printed[2].startswith("[2/2] ") and "answer='7'" in printed[1]
    assert printed[3].startswith("done: 2 questions in ") and len(printed) == 4, printed
