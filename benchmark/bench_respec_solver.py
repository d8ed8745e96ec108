"""ReSpec's solver against measurement: for every profiled (s, t, n) state -- EAGLE3 chains and trees (t > 1),
NGRAM draft lengths -- the speedup over plain decode the solver's model predicts and the one a server running that
state measures, per batch size; and per batch size the plan's choice against the measured best (the oracle).

    python scripts/respec_profile.py --model smollm2 --drafter bootstrap --prompts task:toy_add \
        --configs EAGLE3:s1t1n2 EAGLE3:s3t1n4 EAGLE3:s2t2n4 NGRAM:s4t1n4 NGRAM:s8t1n8 --batch-sizes 1 4 16 \
        --out /tmp/respec_profile.json
    python benchmark/bench_respec_solver.py --profile /tmp/respec_profile.json --batch-sizes 1 2 4 8 16 32

The check runs one server per state (plus plain decode), one at a time, the order reversed every repeat, at batch
sizes the profile did and did not measure (the model interpolates between profiled sizes and extrapolates the
step cost past them), with other lengths than the profile's; each point is the profiler's own two-length
difference (``measure_point``: pure decode, prefill and request overhead cancelled; a fixed batch that drains, so
its tokens per step are its slowest request's). ``--continuous`` measures instead with the batch refilled as
requests finish, ``B`` in flight (a full server; two run lengths, their difference). Speedup of a state = its
throughput / plain decode's of the same repeat. Next to the solver's prediction, the same profile's step costs
with SGLang's mean accept length per request as the gain (what a refilled batch gains per step). Printed and
written as JSON.

What the runtime can switch among at run time is narrower than what the solver may pick: SGLang 0.5.23's
adaptive EAGLE states are chains (``adaptive_unsupported_reason``: topk must be 1), and an NGRAM worker's draft
length sizes its buffers at start-up; a tree or another NGRAM length is a launch-time choice (this table says
when it would pay).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from bench_respec_server import post_in_flight
from overlap import spread, stop_servers_on_sigterm
from simbench import write_results

from sglang_spex.profile.cache import PLAIN, Profile
from sglang_spex.respec.profiler import SpecConfig, batch_prompts, default_drafter, flush, measure_point, prompt_set
from sglang_spex.respec.solver import Plan, SpeedupModel, solve

RESULTS = Path(__file__).parent / "results"


def predicted_table(
    profile: Profile, batch_sizes: Sequence[int], gain: str = "tokens_per_step"
) -> Dict[str, Dict[int, float]]:
    """The predicted speedup of every profiled state at every batch size: the solver's (``gain`` =
    ``tokens_per_step``: a fixed batch's tokens per step, set by its slowest request) or the same step costs with
    SGLang's mean accept length per request as the gain (``accept_length``: what a server that refills its batch
    gains per step)."""
    model = SpeedupModel(profile)
    if gain == "tokens_per_step":
        return {key: {b: model.speedup(key, b) for b in batch_sizes} for key in model.configs}
    return {
        key: {b: model.accept_length(key, b) * model.step_s(PLAIN, b) / model.step_s(key, b) for b in batch_sizes}
        for key in model.configs
    }


def continuous_throughput(url: str, batch: int, n_tokens: int, prompts: Sequence[str], waves: int = 2) -> float:
    """Tokens/s with ``batch`` requests kept in flight, a finished one replaced at once (a full server), as the
    difference of two runs of ``waves`` and ``2 * waves`` requests per slot (the ramp-up and the drain cancel)."""

    def run(n_req: int) -> tuple:
        flush(url)
        params = {"temperature": 0, "max_new_tokens": n_tokens, "ignore_eos": True}
        return post_in_flight(
            url, [{"text": t, "sampling_params": params} for t in batch_prompts(n_req, prompts)], batch
        )

    (tok1, t1), (tok2, t2) = run(waves * batch), run(2 * waves * batch)
    return (tok2 - tok1) / max(t2 - t1, 1e-6)


def measured_speedups(throughput: Dict[str, Dict[int, List[float]]]) -> Dict[str, Dict[int, dict]]:
    """Per state and batch size: the paired ratios (repeat ``r`` over plain decode's repeat ``r``) as median
    (min-max). ``throughput`` maps ``PLAIN`` and each state to per-batch lists of tokens/s, one per repeat."""
    base = throughput[PLAIN]
    return {
        key: {b: spread([x / y for x, y in zip(runs[b], base[b]) if y > 0]) for b in runs}
        for key, runs in throughput.items()
        if key != PLAIN
    }


def choices_vs_oracle(
    plan: Plan, measured: Dict[str, Dict[int, dict]], batch_sizes: Sequence[int], min_gain: float = 0.02
) -> Dict[int, dict]:
    """Per batch size: the plan's state, the measured best (plain decode unless a state measured ``min_gain``
    faster, the solver's own rule) and what the plan's choice measured against the oracle's (1.0 = optimal)."""
    out = {}
    for b in batch_sizes:
        best, best_x = None, 1.0
        for key, per in measured.items():
            x = per[b]["median"]
            if x == x and x > best_x and x >= 1.0 + min_gain:
                best, best_x = key, x
        chosen = plan.choose(b)
        chosen_x = 1.0 if chosen is None else measured.get(chosen, {}).get(b, {}).get("median", float("nan"))
        out[b] = {"plan": chosen, "oracle": best, "plan_measured": chosen_x, "of_oracle": chosen_x / best_x}
    return out


def measure_states(
    model: str, states: Sequence[Optional[str]], server_args: List[str], drafter: str, a: argparse.Namespace,
    prompts: List[str],
) -> Dict[str, Dict[int, List[float]]]:  # fmt: skip
    """Tokens/s per state and batch size, one per repeat; one server alive at a time, order reversed per repeat."""
    from sglang_spex.serve import ServerProcess

    out: Dict[str, Dict[int, List[float]]] = {s or PLAIN: {b: [] for b in a.batch_sizes} for s in states}
    for rep in range(a.repeats):
        for state in states if rep % 2 == 0 else states[::-1]:
            args = ["--model-path", model, *server_args]
            if state is not None:
                cfg = SpecConfig.parse(state)
                args += cfg.server_args() + (
                    ["--speculative-draft-model-path", drafter] if cfg.algorithm != "NGRAM" else []
                )
            with ServerProcess(args) as srv:
                measure_point(srv.url, 1, 2, 4, prompts, repeats=1)  # warm-up: the first batch of a fresh server
                for b in a.batch_sizes:
                    if a.continuous:
                        tput = continuous_throughput(srv.url, b, a.n_long, prompts)
                    else:
                        tput = measure_point(srv.url, b, a.n_short, a.n_long, prompts, repeats=1).throughput
                    out[state or PLAIN][b].append(tput)
            line = " ".join(f"B={b}:{out[state or PLAIN][b][-1]:.1f}" for b in a.batch_sizes)
            print(f"repeat {rep} {state or PLAIN:15s} {line} tok/s", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="ReSpec profile JSON (scripts/respec_profile.py)")
    ap.add_argument("--states", nargs="+", default=None, help="states to check (default: every profiled one)")
    ap.add_argument("--drafter", default="bootstrap", help="EAGLE draft model path or 'bootstrap'")
    ap.add_argument("--prompts", default="task:toy_add", help="'calibration' or 'task:NAME'")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--n-short", type=int, default=16)
    ap.add_argument("--n-long", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--continuous", action="store_true", help="measure with the batch refilled as requests finish (a full "
        "server) instead of fixed batches that drain (the profile's own measurement)"
    )  # fmt: skip
    ap.add_argument("--server-args", default=None, help="launcher flags, one string (default: the profile's)")
    ap.add_argument("--out", default=str(RESULTS / "respec_solver.json"))
    a = ap.parse_args(argv)
    stop_servers_on_sigterm()
    t0 = time.monotonic()
    profile = Profile.load(a.profile)
    states = a.states or profile.configs
    unknown = [s for s in states if s not in profile.configs]
    if unknown:
        ap.error(f"--states {unknown}: not in the profile ({sorted(profile.configs)})")
    model = profile.model
    eagle = any(SpecConfig.parse(s).algorithm != "NGRAM" for s in states)
    drafter = (default_drafter(model) if a.drafter == "bootstrap" else a.drafter) if eagle else ""
    plan = solve(profile, max_batch=max(a.batch_sizes), configs=states)
    predicted = predicted_table(profile, a.batch_sizes)
    predicted_mean = predicted_table(profile, a.batch_sizes, gain="accept_length")
    # refilled batches send 4 requests per slot: distinct prompts, or NGRAM learns a repeated prompt's greedy output
    prompts = prompt_set(a.prompts, model, n=4 * max(a.batch_sizes) if a.continuous else 16)
    server_args = a.server_args.split() if a.server_args is not None else list(profile.meta.get("server_args", []))
    tput = measure_states(model, [None, *states], server_args, drafter, a, prompts)
    measured = measured_speedups(tput)
    verdict = choices_vs_oracle(plan, measured, a.batch_sizes)
    profiled = sorted(profile.points[PLAIN])
    print(f"\nprofiled batch sizes {profiled}; plan: {plan.summary()}")
    print(
        f"speedup over plain decode ({'batch refilled' if a.continuous else 'fixed batches'}), predicted by the "
        "solver / with mean accept length / measured median (min-max) of paired repeats:"
    )
    for s in states:
        cells = [
            f"B={b}: {predicted[s][b]:.2f} / {predicted_mean[s][b]:.2f} / {measured[s][b]['median']:.2f} "
            f"({measured[s][b]['min']:.2f}-{measured[s][b]['max']:.2f})"
            for b in a.batch_sizes
        ]
        print(f"  {s:15s} " + "  ".join(cells))
    for b, v in verdict.items():
        print(
            f"  B={b}: plan {v['plan'] or 'plain'} measured {v['plan_measured']:.2f}x, oracle {v['oracle'] or 'plain'}"
            f" -> {v['of_oracle']:.2f} of the best"
        )
    for name, table in (("solver", predicted), ("mean accept", predicted_mean)):
        errors = [table[s][b] / measured[s][b]["median"] - 1 for s in states for b in a.batch_sizes]
        print(f"{name} model error, predicted/measured - 1: median {statistics.median(errors):+.2f}, "
              f"median |error| {statistics.median(map(abs, errors)):.2f}, max {max(map(abs, errors)):.2f}")  # fmt: skip
    write_results(
        a.out, __file__, a, t0, None, plan=plan.summary(), predicted=predicted,
        predicted_mean_accept=predicted_mean, measured=measured, continuous=a.continuous,
        throughput=tput, choices=verdict, profiled_batch_sizes=profiled,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
