"""Shared command line for the example programs: where to run, which questions."""

from __future__ import annotations

import argparse
import time

import sglang_spex.lang as tot
from sglang_spex.tot.search import SearchResult
from sglang_spex.tot.tasks import get_task

SMOLLM2_CHAT = (
    "<|im_start|>user\n{question} Solve it step by step. End with 'The answer is N.'<|im_end|>\n<|im_start|>assistant\n"
)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def parser(doc: str) -> argparse.ArgumentParser:
    """The examples' command line."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument(
        "--url",
        default="http://127.0.0.1:30000",
        help="our launcher's server, or any SGLang server (default: %(default)s)",
    )
    ap.add_argument("--api-key", help="the server's --api-key (sent as Authorization: Bearer)")
    ap.add_argument("--client-side", action="store_true", help="run the search loop here against --url")
    ap.add_argument("--task", default="toy_add", help="toy_add or rg:<reasoning_gym dataset> (default: %(default)s)")
    ap.add_argument("-n", type=positive_int, default=3, help="questions, >= 1 (default: %(default)s)")
    ap.add_argument("--print-spec", action="store_true", help="print the JSON spec and exit")
    return ap


def result_line(question: str, r: SearchResult) -> str:
    """One finished question's answer and accounting."""
    return (
        f"{question!r}: answer={r.answer!r} correct={r.correct} tokens={r.tokens_generated} "
        f"requests={r.num_requests} {r.wall_time:.1f}s failures={len(r.failures)}"
    )


def main(program: tot.Program, doc: str) -> None:
    """Search ``-n`` questions of ``--task``; prints a line when it starts, one per question as it finishes (in the
    order they finish) and one at the end."""
    args = parser(doc).parse_args()
    if args.print_spec:
        print(program.to_json(indent=2))
        return
    qs = get_task(args.task).questions(args.n, split="dev")
    backend = tot.Endpoint(args.url, server_side=not args.client_side, api_key=args.api_key)
    where = "client-side against" if args.client_side else "on"
    print(f"searching {len(qs)} {args.task} questions {where} {args.url} ...", flush=True)
    done, t0 = [0], time.monotonic()

    def on_result(i: int, r: SearchResult) -> None:
        done[0] += 1
        print(f"[{done[0]}/{len(qs)}] {result_line(qs[i].text, r)}", flush=True)

    program.run_batch([q.text for q in qs], backend, references=[q.reference for q in qs], on_result=on_result)
    print(f"done: {len(qs)} questions in {time.monotonic() - t0:.1f}s", flush=True)
