"""The step price of SmolLM2-135M's architecture on this machine's accelerator, in bench_tot's terms.

bench_tot prices every run's schedule at one fitted price ``a + b·decode_rows + f·[prefill] + p·prefill_tokens +
c·kv_tokens`` (:mod:`step_cost`). This script measures such a price for the same architecture (random bf16 weights:
timing does not depend on them; SGLang is not needed) with transformers, on CUDA when present, so the schedules
recorded on the CPU host can be priced at a GPU's step costs (``bench_tot.py --summarise RUN.json --price OUT``).

Two prices come out of one sweep: ``wall`` (eager steps, with the launch overhead of ~30 layers in Python) and, on
CUDA, ``kernel`` (the sum of the step's GPU kernel times from torch.profiler: what a CUDA-graph step such as SGLang's
approaches, launch gaps removed), and ``graph`` (decode steps over a static KV cache replayed as a CUDA graph;
prefills at their kernel time; first written in session 22 after the lent GPU went back, so not yet run on one).
All are transformers' kernels, not SGLang's; the schedule they price is the one the CPU host's scheduler made.

    python benchmark/gpu_step_price.py --out benchmark/results/step_price_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_cost import fit_price  # noqa: E402  (a sibling script's module)

# SmolLM2-135M-Instruct's architecture (its config.json); the weights are random.
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def build_model(device: str, dtype: torch.dtype, layers: Optional[int] = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**SMOLLM2_135M, **({"num_hidden_layers": layers} if layers else {})})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _kernel_s(fn: Callable[[], Any]) -> float:
    """GPU kernel seconds of one call of ``fn`` (sum over its CUDA kernels, torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return sum(e.device_time_total for e in events if not e.cpu_children) * 1e-6 if events else float("nan")


def timed(fn: Callable[[], Any], device: str, reps: int) -> Dict[str, float]:
    """Median wall seconds of ``fn`` over ``reps`` calls (after two warm-ups), and its kernel seconds on CUDA."""
    for _ in range(2):
        fn()
    _sync(device)
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        walls.append(time.perf_counter() - t0)
    out = {"wall_s": statistics.median(walls), "wall_min_s": min(walls), "wall_max_s": max(walls)}
    if device.startswith("cuda"):
        try:
            out["kernel_s"] = statistics.median(_kernel_s(fn) for _ in range(3))
        except Exception as e:  # the wall price stands without it
            out["kernel_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def static_decode(model, batch: int, context: int):
    """A decode step over a static KV cache holding ``context`` prompt tokens (shapes fixed, as a graph needs)."""
    from transformers import StaticCache

    device, vocab = model.device, model.config.vocab_size
    cache = StaticCache(config=model.config, max_cache_len=context + 1)
    ids = torch.randint(0, vocab, (batch, context), device=device)
    model(ids, past_key_values=cache, position_ids=torch.arange(context, device=device)[None], use_cache=True)
    step = torch.randint(0, vocab, (batch, 1), device=device)
    pos = torch.tensor([[context]], device=device)
    lengths = [layer.cumulative_length for layer in getattr(cache, "layers", []) if hasattr(layer, "cumulative_length")]

    def decode():  # every call writes position ``context`` again (the cache's write index is reset in place)
        for n in lengths:
            if torch.is_tensor(n):
                n.fill_(context)
        return model(step, past_key_values=cache, position_ids=pos, use_cache=True)

    return decode


def graph_decode_s(model, batch: int, context: int, reps: int) -> float:
    """Median seconds of one CUDA-graph replay of a static-cache decode step (how SGLang runs decode on a GPU)."""
    step = static_decode(model, batch, context)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return timed(graph.replay, "cuda", reps)["wall_s"]


@torch.inference_mode()
def sweep(
    model,
    device: str,
    batches: Sequence[int],
    contexts: Sequence[int],
    prefills: Sequence[int],
    reps: int,
    graphs: bool = True,
) -> List[Dict[str, Any]]:
    """Decode steps at each (batch, context) and single-request prefills of each length, one row per point."""
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    rows = []
    for ctx in contexts:
        for b in batches:
            ids = torch.randint(0, vocab, (b, ctx), device=device)
            cache = DynamicCache()
            model(ids, past_key_values=cache, use_cache=True)
            step = torch.randint(0, vocab, (b, 1), device=device)
            n0 = cache.get_seq_length()

            def decode():  # one decode step over a context that stays ctx long (the new entries are cropped)
                model(step, past_key_values=cache, use_cache=True)
                cache.crop(n0)

            row = {"kind": "decode", "batch": b, "context": ctx, **timed(decode, device, reps)}
            if graphs and device.startswith("cuda"):
                try:
                    row["graph_s"] = graph_decode_s(model, b, ctx, reps)
                except Exception as e:  # the other prices stand without it
                    row["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
    for t in prefills:
        ids = torch.randint(0, vocab, (1, t), device=device)
        rows.append({"kind": "prefill", "tokens": t, **timed(lambda: model(ids, use_cache=True), device, reps)})
    return rows


def step_rows(rows: Sequence[Dict[str, Any]], key: str) -> List[List[float]]:
    """The sweep as :mod:`step_cost` rows ``[decode_rows, prefills, prefill_tokens, kv_tokens, step_s]``."""
    out = []
    for r in rows:
        if key == "graph_s" and r["kind"] == "prefill":
            r = {**r, key: r.get("kernel_s")}  # prefill is not graph-captured: its kernel time stands in
        if r.get(key) is None:
            continue
        if r["kind"] == "decode":
            out.append([float(r["batch"]), 0.0, 0.0, float(r["batch"] * r["context"]), r[key]])
        else:
            out.append([0.0, 1.0, float(r["tokens"]), float(r["tokens"]), r[key]])
    return out


def prices(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    out = {}
    for key, name in (("wall_s", "wall"), ("kernel_s", "kernel"), ("graph_s", "graph")):
        price = fit_price([step_rows(rows, key)], min_steps=6)
        if price is not None:
            out[name] = price.as_dict()
    return out


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--contexts", default="128,512")
    ap.add_argument("--prefills", default="16,64,256,1024")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int, help="fewer layers than SmolLM2's 30 (smoke tests)")
    ap.add_argument("--out", default="benchmark/results/step_price_gpu.json")
    a = ap.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    model = build_model(a.device, getattr(torch, a.dtype), a.layers)
    t0 = time.time()
    rows = sweep(model, a.device, ints(a.batches), ints(a.contexts), ints(a.prefills), a.reps)
    name = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"
    data = {
        "device": name,
        "torch": torch.__version__,
        "dtype": a.dtype,
        "layers": model.config.num_hidden_layers,
        "sweep_s": round(time.time() - t0, 1),
        "rows": rows,
        "price": prices(rows),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(data, indent=1))
    for r in rows:
        what = f"B={r['batch']:4d} ctx={r['context']:5d}" if r["kind"] == "decode" else f"prefill T={r['tokens']:5d}"
        kern = f"  kernels {1e3 * r['kernel_s']:7.3f} ms" if "kernel_s" in r else ""
        kern += f"  graph {1e3 * r['graph_s']:7.3f} ms" if "graph_s" in r else r.get("graph_error", "")[:80]
        print(f"{what}  wall {1e3 * r['wall_s']:7.3f} ms{kern}")
    print(json.dumps({"device": name, "price": data["price"]}, indent=1))
    return data


if __name__ == "__main__":
    main()
