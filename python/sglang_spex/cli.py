"""``python -m sglang_spex search "question" --policy rebase-8 [--url URL] [--speculation on|off] [--json] [--stream]``

Runs one server-side search (POST /tot/search) and prints the answer, the best path and the accounting. Without
--url it starts the default server (SmolLM2-135M, --tot-speculation) and stops it afterwards. The spec is the
demo's (sglang_spex.demo.search_spec: SmolLM2's chat prompt, one line per step, the arith verifier reward).
--stream prints each node as the server reports it.

Exit statuses: ``EXIT_STATUSES``, appended to this docstring at import and printed by ``search --help``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import textwrap
from typing import Any, Dict, List, Optional, Sequence, Tuple

import httpx

from sglang_spex.demo import search_spec
from sglang_spex.serve import start_for_one_run
from sglang_spex.tot.http_port import NotASpexServer, check_search_answer
from sglang_spex.tot.search import check_text
from sglang_spex.tot.search_spec import SearchSpec, SearchSpecError

REWARDS = {"arith": {"type": "verifier", "name": "arith"}, "logprob": {"type": "logprob"}}
EXIT_ANSWER = 0
EXIT_NO_ANSWER = 1
EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3
EXIT_REFUSED = 4
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
# the statuses a sglang-spex server refuses a search with before running it (exit 4), and why
REFUSED_STATUS: Dict[int, str] = {
    401: "the API key",
    403: "the API key",
    413: "the body's size",
    429: "busy",
    503: "not ready",
}
NO_POST_STATUS = (405, 501)  # the URL takes no POST: never a sglang-spex server's /tot/search
EXCERPT_CHARS = 120  # of a foreign answer's text in the error line


def _refused_reasons() -> str:
    """``401/403: the API key, 413: ...``: :data:`REFUSED_STATUS` grouped by reason."""
    by_reason: Dict[str, List[str]] = {}
    for status, reason in REFUSED_STATUS.items():
        by_reason.setdefault(reason, []).append(str(status))
    return ", ".join(f"{'/'.join(codes)}: {reason}" for reason, codes in by_reason.items())


EXIT_STATUSES: Tuple[Tuple[int, str], ...] = (
    (EXIT_ANSWER, "an answer"),
    (EXIT_NO_ANSWER, "the search ended without an answer, or failed (an error answer, a stream cut short)"),
    (
        EXIT_BAD_INPUT,
        "bad input: one line naming the field, checked before any server starts (the server's 400 answers are "
        "reported the same way)",
    ),
    (EXIT_UNREACHABLE, "the URL cannot be reached or is not a sglang-spex server (nothing was searched)"),
    (EXIT_REFUSED, f"the server refused the search before running it ({_refused_reasons()})"),
    (EXIT_INTERRUPTED, "Ctrl-C (the server aborts the search; a server this command started is stopped)"),
)


def exit_status_help(width: int = 100) -> str:
    """:data:`EXIT_STATUSES` as text: a heading, then one wrapped entry per status."""
    entries = [
        textwrap.fill(what, width, initial_indent=f"  {code:<5}", subsequent_indent=" " * 7)
        for code, what in EXIT_STATUSES
    ]
    return "\n".join(["exit status:", *entries])


__doc__ = f"{__doc__}\n{exit_status_help()}\n"


class StreamEnded(RuntimeError):
    """A streamed search ended without its ``result`` event."""


class InputError(Exception):
    """Bad input: ``field`` names it."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def build_parser() -> argparse.ArgumentParser:
    """The ``search`` command line; ``--help`` shows each default once and ends with :data:`EXIT_STATUSES`."""
    width = shutil.get_terminal_size().columns - 2  # argparse's own width for the options
    description = textwrap.fill(" ".join(__doc__.split("\n\n")[1].split()), width)
    ap = argparse.ArgumentParser(
        prog="python -m sglang_spex search",
        description=description,
        epilog=exit_status_help(width),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("question", help="the question to search")
    ap.add_argument(
        "--policy",
        default="rebase-8",
        help="a policy or preset: rebase-8, ets-8, rstar-5, rest-5, ... (default: %(default)s)",
    )
    ap.add_argument("--url", help="a running server (default: start the default server, and stop it afterwards)")
    ap.add_argument("--speculation", choices=("on", "off"), help="SPEX for this search (default: as the server has it)")
    ap.add_argument("--reward", choices=sorted(REWARDS), default="arith", help="the step reward (default: %(default)s)")
    ap.add_argument("--reference", help="the expected answer (the result then says whether it is correct)")
    ap.add_argument("--seed", type=int, default=0, help="the search's sampling seed (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per step (default: %(default)s)")
    ap.add_argument(
        "--answer-pattern",
        help="regex whose group 1 is a step's answer (default: the demo's: 'The answer is N' or '= N')",
    )
    ap.add_argument("--api-key", help="the server's --api-key")
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON")
    ap.add_argument("--stream", action="store_true", help="print nodes as they arrive")
    return ap


def make_body(args: argparse.Namespace) -> Dict[str, Any]:
    """The ``POST /tot/search`` body; raises :class:`InputError` for a bad spec (validated here first)."""
    if not args.question.strip():
        raise InputError("question", "must be a non-empty string")  # as the server's body check says it
    try:  # text the server refuses (a lone surrogate: an argv byte that is not UTF-8), refused before it starts
        check_text(args.question, "question")
        if args.reference is not None:
            check_text(args.reference, "reference", empty_ok=True)
    except SearchSpecError as e:
        raise InputError(e.field, e.reason) from None
    if args.url is not None:
        check_url(args.url)
    speculation = None if args.speculation is None else args.speculation == "on"
    spec = search_spec(
        args.policy, seed=args.seed, reward=REWARDS[args.reward], speculation=speculation, max_tokens=args.max_tokens
    )
    if args.answer_pattern is not None:
        spec["answer"]["pattern"] = args.answer_pattern
    try:
        SearchSpec.from_dict(spec)
    except SearchSpecError as e:
        raise InputError(e.field, e.reason) from None
    body: Dict[str, Any] = {"spec": spec, "question": args.question, "stream": bool(args.stream)}
    if args.reference is not None:
        body["reference"] = args.reference
    return body


def check_url(url: str) -> None:
    """An ``http(s)://host[:port]`` URL; :class:`InputError` naming ``--url`` otherwise."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as e:
        raise InputError("--url", f"{url!r}: {e}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise InputError("--url", f"{url!r}: expected http://HOST:PORT")


def node_line(event: Dict[str, Any]) -> str:
    """One ``node`` progress event as a line."""
    reward = "-" if event.get("reward") is None else f"{event['reward']:.3f}"
    end = " terminal" if event.get("terminal") else ""
    return f"node {event['path']:<12} {event['status']:<9} reward={reward} tokens={event.get('tokens', 0)}{end}"


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """The start of an answer's text on one line: an HTML page's visible text, at most ``limit`` characters."""
    text = re.sub(r"(?is)<(head|script|style)\b.*?</\1\s*>|<[^>]*>", " ", text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_object(r: httpx.Response) -> Optional[Dict[str, Any]]:
    """The answer's body as a JSON object; None when it is not one (an HTML page, plain text, nothing)."""
    try:
        body = r.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def not_a_spex_server(r: httpx.Response, what: str) -> NotASpexServer:
    """The error for an answer no sglang-spex server gives: its status, ``what`` it is, and a short excerpt."""
    said = excerpt(r.text)
    return NotASpexServer(
        f"POST {r.url.path}: HTTP {r.status_code} {what}{': ' + said if said else ''}: not a sglang-spex server"
    )


def check_answer(r: httpx.Response) -> None:
    """:func:`check_search_answer`, except that an error answer no sglang-spex server gives raises
    :class:`NotASpexServer` (exit 3, nothing was searched): a status meaning the URL takes no POST
    (:data:`NO_POST_STATUS`), or a body that is not a JSON object unless the status is 500 (a server's unhandled
    error, whose body is plain text). The plugin's and SGLang's own error answers are JSON objects."""
    try:
        check_search_answer(r)  # a 400 naming a field, a 404 (no /tot/search here), or HTTPStatusError
    except httpx.HTTPStatusError:
        if r.status_code in NO_POST_STATUS:
            raise not_a_spex_server(r, "(no POST here)") from None
        if r.status_code != 500 and json_object(r) is None:
            raise not_a_spex_server(r, "without a JSON error") from None
        raise


def run_search(url: str, body: Dict[str, Any], headers: Dict[str, str], out=sys.stdout) -> Dict[str, Any]:
    """POST the search; with ``stream`` print nodes, frontiers and answers as they come. Returns the result; a 200
    answer that is not one (not a JSON result, or a stream of another content type) raises :class:`NotASpexServer`."""
    if not body.get("stream"):
        r = httpx.post(url + "/tot/search", json=body, headers=headers, timeout=None)
        check_answer(r)
        result = json_object(r)
        if result is None or "status" not in result:
            raise not_a_spex_server(r, "with no search result")
        return result
    with httpx.stream("POST", url + "/tot/search", json=body, headers=headers, timeout=None) as r:
        ctype = r.headers.get("content-type", "text/event-stream")  # a 200 page of another type is not a search's
        events = r.status_code == 200 and ctype.startswith("text/event-stream")
        if not events:
            r.read()
        check_answer(r)
        if not events:
            raise not_a_spex_server(r, "with no event stream")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            kind = event.get("event")
            if kind == "node":
                print(node_line(event), file=out, flush=True)
            elif kind == "frontier":
                print(f"frontier depth {event['depth']}: {event['chosen']}", file=out, flush=True)
            elif kind == "answer":
                print(f"answer {event['answer']!r} at {event['path']}", file=out, flush=True)
            elif kind == "result":
                return event["result"]
    raise StreamEnded("the server closed the stream before the result")


def best_path(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The nodes (root excluded) of the best-scoring path that states the search's answer."""
    cands = [c for c in result["answers"] if c["answer"] == result["answer"]] or result["answers"]
    if not cands:
        return []
    nodes = {n["path"]: n for n in result["nodes"]}
    path: List[Dict[str, Any]] = []
    node = nodes.get(max(cands, key=lambda c: c["score"])["path"])
    while node is not None and node["parent"] is not None:
        path.append(node)
        node = nodes.get(node["parent"])
    return path[::-1]


def summary_lines(result: Dict[str, Any]) -> List[str]:
    """The answer, the best path and the accounting, for humans."""
    correct = "" if result["correct"] is None else ("  (correct)" if result["correct"] else "  (wrong)")
    lines = [f"answer: {result['answer']}{correct}", "best path:"]
    for n in best_path(result):
        reward = "-" if n["reward"] is None else f"{n['reward']:.3f}"
        lines.append(f"  {n['path']:<12} reward={reward}  {n['text'].strip()!r}")
    nodes = len(result["nodes"]) - 1
    lines.append(
        f"accounting: {result['status']}, {nodes} nodes, {result['num_requests']} requests, "
        f"{result['tokens_generated']} tokens, {result['wall_time']:.2f}s"
        + (f", stop: {result['stop_reason']}" if result.get("stop_reason") else "")
    )
    spec = result.get("speculation")
    if spec and spec.get("settings", {}).get("enabled", True):
        lines.append(
            f"speculation: {spec['hits']}/{spec['issued']} hits ({spec['in_flight_adopted']} adopted while running), "
            f"{spec['cancelled']} cancelled, {spec['never_used']} never used, {spec.get('failed', 0)} failed, "
            f"{spec['spec_tokens']} speculative "
            f"tokens, {spec['wasted_tokens']} wasted"
        )
    else:
        lines.append("speculation: off")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``search`` command; returns the exit status (130 after Ctrl-C: the server aborts the search when its
    connection closes, and a server this command started is stopped)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("cancelled", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    try:
        body = make_body(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    srv = None
    if args.url is None:
        srv = start_for_one_run()  # the default model (SmolLM2-135M); progress on stderr
    url = (args.url or srv.url).rstrip("/")
    try:
        result = run_search(url, body, headers)
    except (InputError, SearchSpecError) as e:  # the server's 400 names the field
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (httpx.TransportError, NotASpexServer) as e:
        print(f"error: {url}: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (httpx.HTTPStatusError, StreamEnded) as e:  # refused before it ran, or taken and failed
        print(f"error: {url}: {e}", file=sys.stderr)
        refused = isinstance(e, httpx.HTTPStatusError) and e.response.status_code in REFUSED_STATUS
        return EXIT_REFUSED if refused else EXIT_NO_ANSWER
    finally:
        if srv is not None:
            srv.stop()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print("\n".join(summary_lines(result)))
    return EXIT_ANSWER if result["status"] == "done" and result["answer"] is not None else EXIT_NO_ANSWER
