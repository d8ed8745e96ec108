"""``python -m sglang_spex search "question" --policy rebase-8 [--url URL] [--speculation on|off] [--json] [--stream]``

Runs one server-side search (``POST /tot/search``) and prints the answer, the best path and the accounting.
Without ``--url`` it starts the default server (SmolLM2-135M, ``--tot-speculation``) and stops it afterwards.
The spec is the demo's (SmolLM2 chat prompt, one line per step, ``arith`` verifier reward; see
:func:`sglang_spex.demo.search_spec`). ``--stream`` prints each node as the server reports it.

Exit status: 0 with an answer, 1 when the search ends without one (or fails), 2 for bad input (a one-line
message naming the field, checked before any server starts; the server's 400 answers are reported the same way),
3 when the URL cannot be reached or has no ``/tot/search`` (nothing was searched), 130 after Ctrl-C; an HTTP error
answer from the server or a stream that ends early counts as a failed search (1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import httpx

from sglang_spex.demo import search_spec
from sglang_spex.serve import ServerProcess
from sglang_spex.tot.http_port import NotASpexServer, check_search_answer
from sglang_spex.tot.search import check_text
from sglang_spex.tot.search_spec import SearchSpec, SearchSpecError

REWARDS = {"arith": {"type": "verifier", "name": "arith"}, "logprob": {"type": "logprob"}}
EXIT_NO_ANSWER = 1
EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3  # connection refused, timed out, or not a sglang-spex server: nothing was searched
EXIT_REFUSED = 4  # the server refused the search before running it (401/403 key, 413 size, 429 busy, 503 not ready)
REFUSED_STATUS = (401, 403, 413, 429, 503)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C


class StreamEnded(RuntimeError):
    """A streamed search ended without its ``result`` event."""


class InputError(Exception):
    """Bad input: ``field`` names it."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m sglang_spex search",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("question")
    ap.add_argument("--policy", default="rebase-8", help="a policy or preset (rebase-8, ets-8, rstar-5, rest-5, ...)")
    ap.add_argument("--url", help="a running server; default: start the default one")
    ap.add_argument("--speculation", choices=("on", "off"), help="SPEX for this search (default: the server's)")
    ap.add_argument("--reward", choices=sorted(REWARDS), default="arith")
    ap.add_argument("--reference", help="the expected answer (the result then says whether it is correct)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per step")
    ap.add_argument("--answer-pattern", help="regex whose group 1 is a step's answer (default: the demo's)")
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


def run_search(url: str, body: Dict[str, Any], headers: Dict[str, str], out=sys.stdout) -> Dict[str, Any]:
    """POST the search; with ``stream`` print nodes, frontiers and answers as they come. Returns the result."""
    if not body.get("stream"):
        r = httpx.post(url + "/tot/search", json=body, headers=headers, timeout=None)
        check_search_answer(r)
        return r.json()
    with httpx.stream("POST", url + "/tot/search", json=body, headers=headers, timeout=None) as r:
        if r.status_code != 200:
            r.read()
        check_search_answer(r)
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
        t0 = time.monotonic()
        print("starting the default server (SmolLM2-135M, --tot-speculation) ...", file=sys.stderr, flush=True)
        srv = ServerProcess(["--tot-speculation"]).start()
        print(f"server ready in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
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
    return 0 if result["status"] == "done" and result["answer"] is not None else EXIT_NO_ANSWER
