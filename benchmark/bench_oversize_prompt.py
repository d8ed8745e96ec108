"""Oversize prompts: how long a prompt text far past the context takes to refuse, and what other clients wait meanwhile.

One server (the tiny Llama, or ``--model smollm2``; ``--tot-speculation`` with ``--spex``). For each route
(``/generate`` text, ``/v1/completions`` prompt, ``/v1/chat/completions`` message) and each size in ``--mb``, repeated
``--repeats`` times: ``--concurrent`` oversize requests are sent at once while a probe client sends one small request
of the same route after another; then the probe runs alone. Prints, per route and size, the oversize answers' status
and seconds (median, max) and the probe's latency during them against alone (median, max), and writes JSON (``--out``).

Before hooks U3/U4 SGLang tokenized every such text in full, ``/generate`` on its event loop: one 64 MB text answered
its 400 after 229 s and a small request sent meanwhile waited 228.6 s (tiny Llama, this 2-core host).

    .venv/bin/python benchmark/bench_oversize_prompt.py --mb 8 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import httpx
from overlap import stop_servers_on_sigterm

from sglang_spex.models import prepare_smollm2, prepare_tiny_llama
from sglang_spex.serve import ServerProcess

WORDS = "alpha beta7 "  # 12 characters, about 3 tokens


def bodies(route: str, text: str, max_tokens: int = 2) -> Dict[str, Any]:
    """A request of ``route`` whose prompt text is ``text``."""
    if route == "/generate":
        return {"text": text, "sampling_params": {"max_new_tokens": max_tokens}}
    if route == "/v1/completions":
        return {"model": "m", "prompt": text, "max_tokens": max_tokens}
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}


ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def timed(client: httpx.Client, route: str, body: Dict[str, Any]) -> tuple:
    t = time.monotonic()
    r = client.post(route, json=body)
    return r.status_code, time.monotonic() - t


def probe_while(client: httpx.Client, route: str, busy: Callable[[], bool]) -> List[float]:
    """Small requests one after another while ``busy()``; their latencies (at least one)."""
    out = []
    while True:
        out.append(timed(client, route, bodies(route, "hello world"))[1])
        if not busy():
            return out


def one_round(url: str, route: str, mb: float, concurrent: int) -> Dict[str, Any]:
    text = WORDS * int(mb * (1 << 20) / len(WORDS))
    answers: List[tuple] = []
    with httpx.Client(base_url=url, timeout=1200) as probe:

        def send() -> None:
            with httpx.Client(base_url=url, timeout=1200) as c:
                answers.append(timed(c, route, bodies(route, text)))

        threads = [threading.Thread(target=send) for _ in range(concurrent)]
        for th in threads:
            th.start()
        time.sleep(0.2)  # the bodies are on their way
        during = probe_while(probe, route, lambda: any(th.is_alive() for th in threads))
        for th in threads:
            th.join()
        alone = [timed(probe, route, bodies(route, "hello world"))[1] for _ in range(3)]
    return {
        "status": sorted({s for s, _ in answers}),
        "oversize_s": [round(t, 3) for _, t in answers],
        "probe_during_s": [round(t, 3) for t in during],
        "probe_alone_s": [round(t, 3) for t in alone],
    }


def summary(rounds: List[Dict[str, Any]]) -> str:
    over = [t for r in rounds for t in r["oversize_s"]]
    during = [t for r in rounds for t in r["probe_during_s"]]
    alone = [t for r in rounds for t in r["probe_alone_s"]]
    status = sorted({s for r in rounds for s in r["status"]})
    return (
        f"status {status}; oversize {statistics.median(over):.2f} s (max {max(over):.2f}); probe during "
        f"{statistics.median(during):.2f} s (max {max(during):.2f}) vs alone {statistics.median(alone):.2f} s "
        f"(max {max(alone):.2f})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--spex", action="store_true", help="launch with --tot-speculation --tot-k-total 8")
    ap.add_argument("--mb", type=float, nargs="+", default=[8.0, 64.0], help="oversize text sizes (MiB)")
    ap.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
    ap.add_argument("--concurrent", type=int, default=1, help="oversize requests sent at once")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmark/results/oversize_prompt.json"))
    args = ap.parse_args()
    model = prepare_tiny_llama() if args.model == "tiny" else prepare_smollm2()
    flags = ["--model-path", str(model), *(["--tot-speculation", "--tot-k-total", "8"] if args.spex else [])]
    srv = ServerProcess(flags)
    stop_servers_on_sigterm()
    srv.start()
    results: Dict[str, Dict[str, Any]] = {}
    try:
        for mb in args.mb:
            for route in args.routes:
                rounds = [one_round(srv.url, route, mb, args.concurrent) for _ in range(args.repeats)]
                results[f"{route} {mb:g} MiB"] = {"rounds": rounds, "summary": summary(rounds)}
                print(f"{route:22s} {mb:6g} MiB x{args.concurrent}: {summary(rounds)}", flush=True)
    finally:
        srv.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
