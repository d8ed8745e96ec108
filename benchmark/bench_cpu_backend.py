"""Decode tokens/s and SPEX rSTAR-10 q/min per CPU attention backend, overlap scheduler on and off, in one run.

For each backend one server per overlap mode, alive together (``--tot-speculation --tot-k-total K``, the overlap
mode passed explicitly: nothing (overlap, the default) / ``--disable-overlap-schedule``, checked against
``/get_server_info``). Repeats interleave the modes (order alternating), so load on a shared machine hits both
alike; every repeat counts: medians with min-max. Decode rate at batch B is isolated from prefill by timing two
runs that differ only in ``max_new_tokens``: rate = B * (n_long - n_short) / (t_long - t_short). The search
column is server-side SPEX (``POST /tot/search``, rSTAR-10 preset, ``--search-questions`` concurrent queries).

    python benchmark/bench_cpu_backend.py [--backends torch_native,spex_cpu] [--overlap on,off] \
        [--batch-sizes 1 4 16 32] [--repeats 3] [--search-questions 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any, Dict, List

import bench_tot
import httpx
from overlap import actual_overlap, fmt, overlap_flags, parse_overlap, spread, stop_servers_on_sigterm

from sglang_spex.serve import ServerProcess
from sglang_spex.tot.tasks import get_task

PROMPT = "Write a long story about a lighthouse keeper and the sea. Chapter {i}:"


def _run(url: str, bs: int, n: int) -> float:
    payload = {
        "text": [PROMPT.format(i=i) for i in range(bs)],
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
    }
    t0 = time.perf_counter()
    r = httpx.post(url + "/generate", json=payload, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0


def decode_rate(url: str, bs: int, n_short: int, n_long: int) -> float:
    """Decode tokens/s at batch ``bs`` (two-point difference, see module doc); NaN when the long run was not
    measurably longer (noise swamped the difference: raise ``--n-long``)."""
    t_short = _run(url, bs, n_short)
    t_long = _run(url, bs, n_long)
    if t_long - t_short < 0.1 * t_long:
        return float("nan")
    return bs * (n_long - n_short) / (t_long - t_short)


async def _searches(url: str, bodies: List[dict]) -> List[dict]:
    async with httpx.AsyncClient(timeout=1800) as client:
        rs = await asyncio.gather(*(client.post(url + "/tot/search", json=b) for b in bodies))
    for r in rs:
        r.raise_for_status()
    return [r.json() for r in rs]


def search_rate(url: str, spec: dict, questions) -> Dict[str, Any]:
    """SPEX rSTAR q/min for ``questions`` searched concurrently on the server (radix cache flushed first, with
    bench_tot's bounded retry: SGLang refuses a flush while an earlier search's aborted speculative requests still
    run). ``flush_wait_s``: the seconds the flush waited, ``"unflushed"`` when it gave up (the run then started
    with a warm cache; :func:`main` reports how many)."""
    waited = bench_tot.flush_cache(url)
    bodies = [{"spec": spec, "question": q.text, "reference": q.reference} for q in questions]
    t0 = time.monotonic()
    results = asyncio.run(_searches(url, bodies))
    wall = time.monotonic() - t0
    bad = [r.get("status") for r in results if r.get("status") != "done"]
    if bad:
        raise RuntimeError(f"searches not done: {bad}")
    return {
        "q_min": len(questions) / wall * 60,
        "tokens": sum(r["tokens_generated"] for r in results),
        "flush_wait_s": round(waited, 2) if waited != float("inf") else "unflushed",
    }


def measure_backend(model: str, backend: str, overlaps: List[str], a: argparse.Namespace) -> Dict[str, Any]:
    """Interleaved repeats over this backend's overlap modes: {mode: {"decode": {B: [..]}, "search": [..]}}."""
    spec = bench_tot.build_spec("rstar-10", a.search_depth, a.step_tokens, a.seed).to_dict()
    questions = get_task("toy_add").questions(a.search_questions, split="test", seed=a.seed)
    servers: Dict[str, ServerProcess] = {}
    out: Dict[str, Any] = {}
    try:
        for ov in overlaps:
            args = ["--model-path", model, "--attention-backend", backend, *overlap_flags(ov)]
            servers[ov] = ServerProcess([*args, "--tot-speculation", "--tot-k-total", str(a.k_total)])
            t0 = time.monotonic()
            servers[ov].start()  # registered first: an interrupted start is stopped too
            print(f"  {backend} overlap {ov}: server up in {time.monotonic() - t0:.0f} s", flush=True)
            actual = actual_overlap(servers[ov].url)
            if actual != ov:
                raise RuntimeError(f"{backend} overlap {ov}: the server runs with overlap {actual}")
            out[ov] = {
                "decode": {b: [] for b in a.batch_sizes},
                "search": [],
                "flush_wait_s": [],
                "overlap_actual": actual,
            }
            _run(servers[ov].url, 1, 4)  # warm-up (and prefix cache for the prompts)
            if a.search_questions:  # first-search costs must not land on one mode's first repeat
                search_rate(
                    servers[ov].url, {**spec, "policy": {"name": "rebase", "width": 2, "max_depth": 1}}, questions
                )
        for rep in range(a.repeats):
            for ov in overlaps if rep % 2 == 0 else overlaps[::-1]:
                url = servers[ov].url
                for bs in a.batch_sizes:
                    out[ov]["decode"][bs].append(decode_rate(url, bs, a.n_short, a.n_long))
                if a.search_questions:
                    sr = search_rate(url, spec, questions)
                    out[ov]["search"].append(sr["q_min"])
                    out[ov]["flush_wait_s"].append(sr["flush_wait_s"])
                dec = " ".join(f"B={b}:{out[ov]['decode'][b][-1]:.0f}" for b in a.batch_sizes)
                srch = f" rSTAR-10 {out[ov]['search'][-1]:.2f} q/min" if a.search_questions else ""
                print(f"  {backend:13s} overlap {ov:3s} repeat {rep}: {dec} tok/s{srch}", flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    return out


def table(res: Dict[str, Dict[str, Any]], batch_sizes: List[int], overlaps: List[str]) -> str:
    cols = [(b, ov) for b in res for ov in overlaps]
    head = f"{'':>14}" + "".join(f"{f'{b} overlap {ov}':>26}" for b, ov in cols)
    lines = [head]
    for bs in batch_sizes:
        row = f"{f'B={bs} tok/s':>14}" + "".join(f"{fmt(spread(res[b][ov]['decode'][bs])):>26}" for b, ov in cols)
        lines.append(row)
    if all(res[b][ov]["search"] for b, ov in cols):
        lines.append(
            f"{'rSTAR-10 q/min':>14}" + "".join(f"{fmt(spread(res[b][ov]['search']), 2):>26}" for b, ov in cols)
        )
    return "\n".join(lines)


def main() -> None:
    from sglang_spex.models import prepare_smollm2

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--backends", default="torch_native,spex_cpu", help="comma list of attention backends")
    ap.add_argument("--overlap", default="on,off", help="overlap scheduler modes, comma list of on/off")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--n-short", type=int, default=8)
    ap.add_argument("--n-long", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats per mode; all count")
    ap.add_argument("--search-questions", type=int, default=2, help="concurrent rSTAR-10 searches (0: no search)")
    ap.add_argument("--search-depth", type=int, default=4)
    ap.add_argument("--step-tokens", type=int, default=32)
    ap.add_argument("--k-total", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    stop_servers_on_sigterm()
    try:
        overlaps = parse_overlap(args.overlap)
    except ValueError as e:
        ap.error(str(e))
    model = args.model or str(prepare_smollm2())
    backends = [b for b in args.backends.split(",") if b]
    t0 = time.monotonic()
    res = {b: measure_backend(model, b, overlaps, args) for b in backends}
    print(f"\nmedian (min-max) of {args.repeats} interleaved repeats, {time.monotonic() - t0:.0f} s")
    print(table(res, args.batch_sizes, overlaps))
    unflushed = sum(w == "unflushed" for per in res.values() for r in per.values() for w in r["flush_wait_s"])
    if unflushed:
        print(f"warning: {unflushed} search run(s) started unflushed (warm radix cache): their q/min reads high")
    if args.json:
        summary = {
            b: {
                ov: {
                    "overlap_actual": r["overlap_actual"],
                    "decode_tok_s": {bs: spread(v) for bs, v in r["decode"].items()},
                    "rstar10_q_min": spread(r["search"]) if r["search"] else None,
                    "raw": r,
                }
                for ov, r in per.items()
            }
            for b, per in res.items()
        }
        with open(args.json, "w") as f:
            json.dump({"model": model, "args": vars(args), "results": summary}, f, indent=2)


if __name__ == "__main__":
    main()
