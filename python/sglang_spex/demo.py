"""``make demo``: the story in one screen, on SmolLM2-135M served by CPU SGLang with ``--tot-speculation``.

1. Accuracy: one sampled answer (a REBASE search of width 1: a single chain of steps) vs a REBASE tree search of
   width 8 on the same toy-addition questions, both scored by the ``arith`` rule verifier (a step whose
   ``a + b = c`` is right gets reward 1, a wrong one 0, one without an equation 0.5); the search answers with its
   best path (best of n, a path scored by its lowest step reward).
2. Speed: the same tree search without SPEX (baseline) and with it, questions/min side by side (interleaved when
   repeated; medians with min–max), the ratio, speculative hits / issued and wasted tokens.

It prints a compact table and writes the JSON and a PNG bar chart (``--out``, default
``$SPEX_CACHE_DIR/demo``). The same seeds every run: questions, search seeds and node seeds are fixed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import httpx

from sglang_spex.config import cache_dir
from sglang_spex.flags import count_flag
from sglang_spex.serve import start_for_one_run
from sglang_spex.tot.http_port import NotASpexServer, check_search_answer
from sglang_spex.tot.tasks import Question, get_task
from sglang_spex.tot.validation import SearchSpecError

TASK = "toy_add"
CHAT = (
    "<|im_start|>user\n{question} Answer with a short calculation, then 'The answer is N.'<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# the first "The answer is N" or "= N" of a step: a step that writes the sum out states its answer
ANSWER = r"(?:[Tt]he answer is|=)[:\s\"*$]*(-?\d+(?:,\d{3})*(?:\.\d+)?)"  # "9," is 9, "1,000" is 1000
ARITH = {"type": "verifier", "name": "arith"}
SINGLE, BASELINE, SPEX = "single sample", "tree search", "tree search + SPEX"


def search_spec(
    policy: Union[str, Dict[str, Any]],
    seed: int = 0,
    reward: Optional[Dict[str, Any]] = None,
    speculation: Optional[bool] = None,
    max_tokens: int = 32,
    temperature: float = 0.7,
) -> Dict[str, Any]:
    """The JSON spec of a search over SmolLM2's chat prompt (one line per step, ``arith`` reward by default);
    ``speculation`` None leaves SPEX as the server has it."""
    spec: Dict[str, Any] = {
        "policy": policy,
        "step": {
            "prompt_template": CHAT,
            "stop": ["\n"],
            "max_tokens": max_tokens,
            "temperature": temperature,
            "max_total_tokens": 3 * max_tokens,
        },
        "reward": reward or ARITH,
        "answer": {"pattern": ANSWER, "aggregate": "best_of_n", "score": "min"},
        "seed": seed,
        "task": TASK,
    }
    if speculation is not None:
        spec["speculation"] = {"enabled": speculation}
    return spec


class DemoError(RuntimeError):
    """The server answered a search with an error."""


def run_arm(
    url: str, spec: Dict[str, Any], questions: Sequence[Question], concurrency: int = 4, timeout: float = 900.0
) -> Dict[str, Any]:
    """Search every question server-side (``concurrency`` at once); results in question order, and the wall."""

    def one(q: Question) -> Dict[str, Any]:
        body = {"spec": spec, "question": q.text, "reference": q.reference}
        r = httpx.post(url + "/tot/search", json=body, timeout=timeout)
        try:
            check_search_answer(r)
        except (SearchSpecError, NotASpexServer, httpx.HTTPStatusError) as e:
            raise DemoError(f"{url}/tot/search: {e}") from None
        return r.json()

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        results = list(pool.map(one, questions))
    return {"wall_s": time.monotonic() - t0, "results": results}


def arm_summary(name: str, runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Accuracy (of the first run), questions/min (median, min, max over runs), tokens and SPEX accounting."""
    first = runs[0]["results"]
    n = len(first)
    qpm = [n / r["wall_s"] * 60.0 for r in runs]
    spec_acc = [r["speculation"] for run in runs for r in run["results"] if r.get("speculation")]
    return {
        "name": name,
        "questions": n,
        "correct": sum(bool(r["correct"]) for r in first),
        "accuracy": sum(bool(r["correct"]) for r in first) / n if n else 0.0,
        "questions_per_min": statistics.median(qpm),
        "questions_per_min_range": [min(qpm), max(qpm)],
        "runs": len(runs),
        "tokens": sum(r["tokens_generated"] for r in first),
        "answers": [r["answer"] for r in first],
        "issued": sum(a["issued"] for a in spec_acc),
        "hits": sum(a["hits"] for a in spec_acc),
        "wasted_tokens": sum(a["wasted_tokens"] for a in spec_acc),
        "speculative": bool(spec_acc) and any(a["issued"] for a in spec_acc),
    }


def story(
    url: str,
    n: int = 8,
    seed: int = 0,
    width: int = 8,
    max_depth: int = 3,
    repeats: int = 1,
    concurrency: int = 4,
    max_tokens: int = 32,
) -> Dict[str, Any]:
    """Run the three arms on ``n`` questions of the dev split and return the summary the table and chart show."""
    qs = get_task(TASK).questions(n, split="dev", seed=seed)

    def spec(w: int, speculation: bool) -> Dict[str, Any]:
        policy = {"name": "rebase", "width": w, "max_depth": max_depth}
        return search_spec(policy, seed=seed, speculation=speculation, max_tokens=max_tokens)

    single = [run_arm(url, spec(1, False), qs, concurrency)]
    base: List[Dict[str, Any]] = []
    spex: List[Dict[str, Any]] = []
    for _ in range(max(1, repeats)):  # interleaved, so load changes hit both modes alike
        base.append(run_arm(url, spec(width, False), qs, concurrency))
        spex.append(run_arm(url, spec(width, True), qs, concurrency))
    arms = [arm_summary(SINGLE, single), arm_summary(BASELINE, base), arm_summary(SPEX, spex)]
    b, s = arms[1]["questions_per_min"], arms[2]["questions_per_min"]
    return {
        "task": TASK,
        "questions": [{"text": q.text, "reference": q.reference} for q in qs],
        "seed": seed,
        "width": width,
        "max_depth": max_depth,
        "repeats": max(1, repeats),
        "arms": arms,
        "speedup": s / b if b else float("nan"),
    }


def format_table(summary: Dict[str, Any]) -> str:
    """The compact table the demo prints."""
    rows = [("arm", "correct", "q/min (min–max)", "tokens", "hits/issued", "wasted tok")]
    for a in summary["arms"]:
        lo, hi = a["questions_per_min_range"]
        spec = (f"{a['hits']}/{a['issued']}", str(a["wasted_tokens"])) if a["speculative"] else ("–", "–")
        rows.append(
            (a["name"], f"{a['correct']}/{a['questions']}", f"{a['questions_per_min']:.1f} ({lo:.1f}–{hi:.1f})")
            + (str(a["tokens"]),)
            + spec
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"SPEX vs baseline tree search: {summary['speedup']:.2f}x questions/min")
    return "\n".join(lines)


def plot(summary: Dict[str, Any], path: Path) -> Path:
    """A two-panel bar chart: accuracy of each arm, questions/min of the two tree searches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = summary["arms"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    ax1.bar([a["name"] for a in arms], [a["accuracy"] for a in arms], color=["#999", "#3b78c2", "#2e9e52"])
    ax1.set_ylim(0, 1)
    ax1.set_title(f"accuracy on {arms[0]['questions']} {summary['task']} questions")
    speed = arms[1:]
    err = [
        [a["questions_per_min"] - a["questions_per_min_range"][0] for a in speed],
        [a["questions_per_min_range"][1] - a["questions_per_min"] for a in speed],
    ]
    ax2.bar([a["name"] for a in speed], [a["questions_per_min"] for a in speed], yerr=err, color=["#3b78c2", "#2e9e52"])
    ax2.set_title(f"questions/min (SPEX {summary['speedup']:.2f}x)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_outputs(summary: Dict[str, Any], out_dir: Path) -> Tuple[Path, Path]:
    """Write ``demo.json`` and ``demo.png`` into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "demo.json"
    json_path.write_text(json.dumps(summary, indent=1))
    return json_path, plot(summary, out_dir / "demo.png")


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m sglang_spex.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-n", type=count_flag, default=8, help="questions (toy_add dev split)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--width", type=count_flag, default=8, help="REBASE width of the tree search")
    ap.add_argument("--repeats", type=count_flag, default=1, help="baseline/SPEX rounds (interleaved)")
    ap.add_argument("--concurrency", type=count_flag, default=4, help="questions searched at once")
    ap.add_argument("--url", help="use this running server (started with --tot-speculation) instead of one")
    ap.add_argument("--out", type=Path, default=cache_dir("demo"), help="where demo.json and demo.png go")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    srv = None if args.url else start_for_one_run(out=sys.stdout)
    url = args.url or srv.url
    try:
        ready = f"using {url}" if args.url else f"server at {url} ready in {time.monotonic() - t0:.0f}s"
        print(f"{ready}; searching {args.n} questions ...", flush=True)
        summary = story(
            url, n=args.n, seed=args.seed, width=args.width, repeats=args.repeats, concurrency=args.concurrency
        )
    except (DemoError, httpx.HTTPError) as e:  # one line, not a traceback (a wrong --url, a server without SPEX)
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        if srv is not None:
            srv.stop()
    print(format_table(summary))
    json_path, png_path = write_outputs(summary, args.out)
    print(f"wrote {json_path} and {png_path} ({time.monotonic() - t0:.0f}s in all)")


if __name__ == "__main__":
    main()
