"""EAGLE3 off-state on the real CPU server: does the drafter's KV catch-up keep acceptance when speculation resumes?

    python benchmark/bench_respec_catchup.py --model smollm2 --alternate 4 --batch 4 --tokens 96

Every server runs EAGLE3 (our drafter) with ``--respec-adaptive --respec-force alternate:K`` (speculation off and on
every K decode steps, mid-generation), except ``on`` (``--respec-force spec``: always speculating, the reference
acceptance). Requests stop at EOS or ``--tokens`` (text after EOS is not what a drafter is trained on):

* ``warm``: SGLang's steps = 0 path -- a one-node verify plus the drafter's extend every off step;
* ``plain`` (ours, the default): the drafter does no work while off; its KV is caught up when speculation resumes;
* ``cold``: SGLang's ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1`` -- no drafter work while off and no catch-up,
  so the drafter resumes from zeroed state with holes in its KV.

Printed per mode: mean accept length of the speculative steps (tokens per spec step, from the ReSpec runtime),
drafter positions skipped / replayed, tokens/s, and whether greedy output equals ``warm``'s. JSON + PNG.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Dict, List

import requests
import simbench as sb
from overlap import stop_servers_on_sigterm
from tqdm import tqdm

from sglang_spex.respec.profiler import SpecConfig, default_drafter, flush, prompt_set
from sglang_spex.serve import ServerProcess

MODES = ("on", "warm", "plain", "cold")


def run_mode(args: List[str], env: Dict[str, str], prompts: List[str], tokens: int, repeats: int) -> dict:
    """Best-of-``repeats`` cold runs of one batch of greedy requests; the runtime's report after them."""
    with ServerProcess(args, env=env) as srv:
        best, outs = 0.0, []
        for _ in range(repeats):
            flush(srv.url)
            t0 = time.perf_counter()
            params = {"temperature": 0, "max_new_tokens": tokens}
            r = requests.post(srv.url + "/generate", json={"text": prompts, "sampling_params": params}, timeout=900)
            r.raise_for_status()
            outs = r.json()
            best = max(best, sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - t0))
        info = requests.get(srv.url + "/get_server_info", timeout=60).json()["internal_states"][0]
    rs = info.get("respec") or {}
    return {
        "tok_s": best,
        "output_ids": [o["output_ids"] for o in outs],
        "spec_accept": rs.get("mean_accept_length"),  # the runtime's mean tokens per speculative step
        "plain_steps": rs.get("plain_steps", 0),
        "spec_steps": rs.get("spec_steps"),
        "ledger": rs.get("drafter_ledger"),
        "loadavg": os.getloadavg()[0],
    }


def plot(res: Dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(8, 3))
    names = list(res)
    ax[0].bar(names, [res[m]["spec_accept"] or 0 for m in names])
    ax[0].set_ylabel("tokens per speculative step")
    ax[1].bar(names, [res[m]["tok_s"] for m in names])
    ax[1].set_ylabel("tokens/s")
    sb.save_figure(fig, path, "EAGLE3 off-state: warm vs plain+catch-up vs cold")


def main(argv=None) -> int:
    stop_servers_on_sigterm()  # a `timeout` or kill still stops the servers this run started
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2' or a model path")
    ap.add_argument("--drafter", default="bootstrap", help="EAGLE3 draft model path or 'bootstrap'")
    ap.add_argument("--config", default="EAGLE3:s3t1n4")
    ap.add_argument("--alternate", type=int, default=4, help="K: speculation off/on every K decode steps")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompts", default="task:toy_add")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="float32", help="float32: batch-shape-independent greedy, so modes compare")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--out", default="benchmark/results/respec_catchup.json")
    a = ap.parse_args(argv)
    t0 = time.monotonic()

    from sglang_spex.models import prepare_smollm2

    model = str(prepare_smollm2()) if a.model == "smollm2" else a.model
    drafter = default_drafter(model) if a.drafter == "bootstrap" else a.drafter
    prompts = prompt_set(a.prompts, model, a.batch)[: a.batch]
    base = ["--model-path", model, *SpecConfig.parse(a.config).server_args(), "--speculative-draft-model-path", drafter]
    base += ["--dtype", a.dtype]
    alt = ["--respec-adaptive", "--respec-force", f"alternate:{a.alternate}"]
    modes = {
        "on": (base + ["--respec-adaptive", "--respec-force", "spec"], {}),
        "warm": (base + alt + ["--respec-eagle-off", "warm"], {}),
        "plain": (base + alt + ["--respec-eagle-off", "plain"], {}),
        "cold": (base + alt + ["--respec-eagle-off", "warm"], {"SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND": "1"}),
    }
    res = {m: run_mode(*modes[m], prompts, a.tokens, a.repeats) for m in tqdm(a.modes, desc="modes")}
    ref = res.get("warm", res[a.modes[0]])["output_ids"]
    for m, r in res.items():
        r["same_output_as_warm"] = r.pop("output_ids") == ref
        acc = "-" if r["spec_accept"] is None else f"{r['spec_accept']:.3f}"
        print(
            f"{m:6s} accept/spec-step {acc:>6s}  {r['tok_s']:6.1f} tok/s  plain steps {r['plain_steps']:4d}"
            f"  ledger {r['ledger']}  same output as warm: {r['same_output_as_warm']}"
        )
    png = Path(a.out).with_suffix(".png")
    plot(res, png)
    sb.write_results(a.out, "real CPU server", a, t0, png, results=res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
