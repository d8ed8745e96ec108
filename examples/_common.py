"""Shared command line for the example programs: where to run, which questions."""

from __future__ import annotations

import argparse

import sglang_spex.lang as tot
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
    ap.add_argument("--url", default="http://127.0.0.1:30000", help="our launcher's server (or any SGLang server)")
    ap.add_argument("--api-key", default=None, help="the server's --api-key (sent as Authorization: Bearer)")
    ap.add_argument("--client-side", action="store_true", help="run the search loop here against --url")
    ap.add_argument("--task", default="toy_add", help="toy_add or rg:<reasoning_gym dataset>")
    ap.add_argument("-n", type=positive_int, default=3, help="questions (>= 1)")
    ap.add_argument("--print-spec", action="store_true", help="print the JSON spec and exit")
    return ap


def main(program: tot.Program, doc: str) -> None:
    args = parser(doc).parse_args()
    if args.print_spec:
        print(program.to_json(indent=2))
        return
    qs = get_task(args.task).questions(args.n, split="dev")
    backend = tot.Endpoint(args.url, server_side=not args.client_side, api_key=args.api_key)
    results = program.run_batch([q.text for q in qs], backend, references=[q.reference for q in qs])
    for q, r in zip(qs, results):
        print(
            f"{q.text!r}: answer={r.answer!r} correct={r.correct} tokens={r.tokens_generated} "
            f"requests={r.num_requests} {r.wall_time:.1f}s failures={len(r.failures)}"
        )
