"""Stages of the prepared GPU check (``scripts/gpu_check.sh``): SPEX and ReSpec on SGLang's GPU defaults.

Each stage runs under a hard timeout (SIGALRM) and a global deadline; a stage that fails or times out is FAIL in
the table, one whose inputs are missing is SKIP, and the run goes on. The table is rewritten to ``--out`` after
every stage, so a run killed from outside still leaves what it measured.

    python scripts/gpu_check.py [--dry-run] [--budget-s 470] [--out DIR]

``--dry-run`` (or ``GPU_CHECK_DRY=1``) runs the same stages against CPU servers with the tiny test model and
small searches, to exercise the logic without a GPU; the GPU-default expectations (overlap scheduler and CUDA
graphs on, ``flashinfer`` sampling) are then reported, not enforced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import httpx
from gpu_check_server import (  # noqa: E402  (scripts/ is on the path: run as a script, or tests add it)
    _flush_cache,
    _generate,
    _healthy,
    _post_all,
    _post_each,
    _profile_note,
    _profile_status,
    _profiler_ran,
    _ratio_spread,
    _settle_profiler,
    _start_and_cancel,
    _timed_generate,
    _tree,
    _wait_idle,
)

from sglang_spex.profile.cache import PLAIN, Point, Profile
from sglang_spex.respec.profiler import SpecConfig
from sglang_spex.serve import ServerProcess
from sglang_spex.tot.rewards import reward_section
from sglang_spex.tot.tasks import get_task

ROOT = Path(__file__).resolve().parents[1]
NGRAM = SpecConfig("NGRAM", 4, 1, 4)
EAGLE3 = SpecConfig("EAGLE3", 3, 1, 4)
CHAT = (
    "<|im_start|>system\nSolve the problem step by step, one short step per paragraph. "
    "Finish with 'The answer is N.'<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
)
PROMPTS = [
    "The history of the old harbour town begins with a small settlement near the river, where farmers",
    "Step 1: add 3 and 4 to get 7. Step 2: add 7 and 4 to get 11. Step 3: add 11 and 4 to get",
    "a b c a b c a b c a b c a b c a b c",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,",
    "Once upon a time there was a little fox who lived in a forest full of tall trees and",
    "The list of colours is red, green, blue, red, green, blue, red, green,",
    "Question: what is the capital of France? Answer: Paris. Question: what is the capital of Spain? Answer:",
]


STAGES = (
    "env",
    "model",
    "server_spex",
    "decode",
    "search",
    "cancel_kv",
    "top_p",
    "mixed",
    "respec_ngram",
    "drafter",
    "respec_eagle3",
)


class StageTimeout(Exception):
    pass


class Skip(Exception):
    """A stage whose inputs are missing (reported SKIP)."""


@dataclass
class Sizes:
    """How big each stage is (GPU run vs CPU dry run)."""

    decode_batches: Sequence[int]
    decode_tokens: Sequence[int]  # (short, long) new tokens of the two-point decode measurement
    questions: int
    rstar: Dict[str, Any]
    step_tokens: int
    rebase_width: int
    respec_tokens: int
    search_pairs: int  # timed baseline/SPEX pairs of the search stage (order alternating); median (min-max) ratio
    profile_wait_s: float  # bound on waiting for the roofline profiler to finish before a timed stage
    timeouts: Dict[str, float]


GPU = Sizes(
    decode_batches=(1, 8),
    decode_tokens=(16, 144),
    questions=4,
    rstar={"name": "rstar", "num_rollouts": 8, "max_depth": 4},
    step_tokens=48,
    rebase_width=8,
    respec_tokens=96,
    search_pairs=3,
    profile_wait_s=90,
    timeouts={
        "env": 120,  # imports torch and sglang; an import cut short by the alarm breaks later stages
        "model": 120,
        "server_spex": 240,
        "decode": 150,  # the start-up roofline sweep (profile_wait_s, measured there before timing) + 60 s
        "search": 180,  # warm-up of both modes + search_pairs pairs
        "cancel_kv": 60,
        "top_p": 60,
        "mixed": 90,
        "drafter": 240,
        "respec_ngram": 180,
        "respec_eagle3": 180,
    },
)
DRY = Sizes(
    decode_batches=(1, 4),
    decode_tokens=(4, 20),
    questions=2,
    rstar={"name": "rstar", "num_rollouts": 2, "max_depth": 2, "branch": 2},
    step_tokens=8,
    rebase_width=3,
    respec_tokens=24,
    search_pairs=3,
    profile_wait_s=135,
    timeouts={k: v * 1.5 for k, v in GPU.timeouts.items()},
)


@dataclass
class StageResult:
    stage: str
    status: str  # PASS | FAIL | SKIP
    seconds: float
    detail: str
    data: Dict[str, Any] = field(default_factory=dict)


def _alarm(signum, frame):  # noqa: ARG001
    raise StageTimeout()


def _terminate(signum, frame):  # noqa: ARG001
    raise SystemExit(128 + signum)  # unwinds through GpuCheck.run's cleanup


class GpuCheck:
    """Runs the stages in order; ``self.state`` carries what later stages need (server, model, measurements)."""

    def __init__(self, dry: bool, budget_s: float, out: Path):
        self.dry = dry
        self.sizes = DRY if dry else GPU
        self.deadline = time.monotonic() + budget_s
        self.out = out
        self.results: List[StageResult] = []
        self.state: Dict[str, Any] = {}
        self.server: Optional[ServerProcess] = None
        self.bootstrap: Optional[subprocess.Popen] = None

    # --- plumbing -----------------------------------------------------------------------------------------

    def run_stage(self, name: str, fn: Callable[[], Dict[str, Any]]) -> StageResult:
        left = self.deadline - time.monotonic()
        timeout = min(self.sizes.timeouts[name], left)
        t0 = time.monotonic()
        if timeout < 5:
            res = StageResult(name, "SKIP", 0.0, "global time budget spent")
        else:
            signal.signal(signal.SIGALRM, _alarm)
            signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                data = fn() or {}
                status = "FAIL" if data.pop("_fail", None) else "PASS"
                res = StageResult(name, status, time.monotonic() - t0, data.pop("_detail", ""), data)
            except StageTimeout:
                res = StageResult(name, "FAIL", time.monotonic() - t0, f"timed out after {timeout:.0f} s")
            except Skip as e:
                res = StageResult(name, "SKIP", time.monotonic() - t0, str(e))
            except Exception as e:  # a failing stage is reported, the run goes on
                res = StageResult(name, "FAIL", time.monotonic() - t0, f"{type(e).__name__}: {str(e)[:300]}")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        self.results.append(res)
        print(f"[gpu_check] {res.stage}: {res.status} ({res.seconds:.0f} s) {res.detail}", flush=True)
        self.write()
        return res

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(
            json.dumps({"dry_run": self.dry, "stages": [asdict(r) for r in self.results]}, indent=1)
        )
        (self.out / "gpu_check.txt").write_text(self.table())

    def table(self) -> str:
        lines = [f"{'stage':14s} {'result':6s} {'s':>5s}  detail", "-" * 100]
        for r in self.results:
            lines.append(f"{r.stage:14s} {r.status:6s} {r.seconds:5.0f}  {r.detail}")
        passed = sum(r.status == "PASS" for r in self.results)
        lines.append(f"{passed}/{len(self.results)} passed ({'CPU dry run' if self.dry else 'GPU'})")
        return "\n".join(lines) + "\n"

    def serve(self, args: List[str], tag: str) -> ServerProcess:
        """Stop the current server, start one with ``args`` (startup bounded by the stage's alarm)."""
        self.stop_server()
        log = str(self.out / f"server-{tag.replace(':', '_')}.log")
        self.server = ServerProcess(args, log_path=log, startup_timeout=3600)  # kept before start: a timeout stops it
        self.server.start()
        self.state["server_tag"] = tag
        return self.server

    def stop_server(self) -> None:
        self.state["server_tag"] = None
        if self.server is not None:
            self.server.stop()
            self.server = None

    def need_server(self, tag: str) -> str:
        srv = self.server
        if srv is None or self.state.get("server_tag") != tag:
            raise Skip(f"no {tag} server")
        try:
            if httpx.get(srv.url + "/health", timeout=10).status_code == 200:
                return srv.url
        except httpx.HTTPError:
            pass
        raise RuntimeError(f"{tag} server is down; log tail: {srv.log_tail(5)}")

    def model_args(self) -> List[str]:
        return ["--model-path", self.state["model"]] + (["--dtype", "float32"] if self.dry else [])

    # --- stages -------------------------------------------------------------------------------------------

    def stage_env(self) -> Dict[str, Any]:
        import sglang
        import torch

        gpu = torch.cuda.is_available()
        name = torch.cuda.get_device_name(0) if gpu else "none"
        detail = f"sglang {sglang.__version__}, torch {torch.__version__}, GPU: {name}"
        if not self.dry and not gpu:
            return {"_fail": True, "_detail": detail + " (no GPU: use --dry-run)"}
        return {"_detail": detail, "gpu": name}

    def stage_model(self) -> Dict[str, Any]:
        from sglang_spex.models import prepare_smollm2, prepare_tiny_llama

        self.state["model"] = str(prepare_tiny_llama() if self.dry else prepare_smollm2())
        self.state["template"] = "{question}\n" if self.dry else CHAT
        if not self.dry:
            self.start_bootstrap()
        return {"_detail": self.state["model"]}

    def start_bootstrap(self) -> None:
        """The EAGLE3 bootstrap drafter trains on CPU threads while the GPU stages run."""
        from sglang_spex.respec.profiler import default_drafter

        try:
            self.state["drafter"] = default_drafter(self.state["model"])
            return
        except FileNotFoundError:
            pass
        cmd = [sys.executable, str(ROOT / "scripts" / "respec_bootstrap.py"), "--minutes", "1.5", "--threads", "8"]
        with open(self.out / "bootstrap.log", "w") as log:  # the child keeps its own descriptor
            self.bootstrap = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stage_server_spex(self) -> Dict[str, Any]:
        # SGLang's GPU default sampler, named: the launcher's --tot-speculation default is pytorch, and flashinfer's
        # top-k/top-p path refuses seeds (hook H2c must keep the scheduler up; stage top_p checks it)
        sampler = [] if self.dry else ["--sampling-backend", "flashinfer"]
        srv = self.serve([*self.model_args(), "--tot-speculation", "--enable-metrics", *sampler], "spex")
        info = httpx.get(srv.url + "/get_server_info", timeout=60).json()
        keys = ("disable_overlap_schedule", "disable_cuda_graph", "sampling_backend", "enable_mixed_chunk")
        flags = {k: info.get(k) for k in keys}
        self.state["server_flags"] = flags
        detail = (
            f"overlap {'off' if flags['disable_overlap_schedule'] else 'on'}, "
            f"cuda graphs {'off' if flags['disable_cuda_graph'] else 'on'}, sampling {flags['sampling_backend']}"
        )
        bad = not self.dry and (flags["disable_overlap_schedule"] or flags["disable_cuda_graph"])
        return {"_fail": bad, "_detail": detail + ("" if not bad else " (expected SGLang's GPU defaults)"), **flags}

    def stage_decode(self) -> Dict[str, Any]:
        url = self.need_server("spex")
        prof = _settle_profiler(url, self.sizes.profile_wait_s)  # the start-up roofline sweep runs after health
        short, long = self.sizes.decode_tokens
        steps, rates = {}, {}
        # untimed warm-up on the timed prompts: both points of the two-point measure then find them cached
        _generate(url, [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(max(self.sizes.decode_batches))], short)
        before = _profile_status(url)
        for b in self.sizes.decode_batches:
            texts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(b)]
            t_s = _timed_generate(url, texts, short)
            t_l = _timed_generate(url, texts, long)
            steps[b] = max(t_l - t_s, 1e-6) / (long - short)
            rates[b] = b / steps[b]
        ran = _profiler_ran(before, _profile_status(url))
        self.state["plain_step_s"] = steps
        refs = _generate(url, PROMPTS[:4], self.sizes.respec_tokens)
        self.state["greedy_ref"] = [o["output_ids"] for o in refs]
        detail = "decode " + ", ".join(f"B={b}: {rates[b]:.0f} tok/s" for b in rates)
        detail += f"; {_profile_note(prof, int(ran))}"
        return {"_fail": not prof["settled"] or ran, "_detail": detail, "tok_s": rates, "profile": prof}

    def _search_body(
        self, policy: Dict[str, Any], q, speculation: Dict[str, Any], reward: str = "logprob", **step: Any
    ) -> Dict[str, Any]:
        spec = {
            "policy": policy,
            "step": {
                "max_tokens": self.sizes.step_tokens,
                "stop": ["\n\n"],
                "temperature": 0.8,
                "prompt_template": self.state["template"],
                "max_total_tokens": 8 * self.sizes.step_tokens,
                **step,
            },
            "reward": reward_section(reward),
            "answer": {"aggregate": "weighted"},
            "seed": 0,
            "speculation": speculation,
        }
        return {"spec": spec, "question": q.text, "reference": q.reference}

    def stage_search(self) -> Dict[str, Any]:
        """rSTAR, baseline vs SPEX T1+T2 (the same seeds, so the same tree): once the roofline profiler is quiet,
        one untimed search per mode (first-use costs of either mode land there), then ``search_pairs`` timed
        pairs, the order alternating, each run on a flushed radix cache. Reports the median (min-max) of the
        per-pair SPEX/baseline q/min ratios, and whether the profiler ran during a timed run."""
        url = self.need_server("spex")
        prof = _settle_profiler(url, self.sizes.profile_wait_s)
        questions = get_task("toy_add").questions(self.sizes.questions, split="test", seed=0)
        modes = {"baseline": {"enabled": False}, "spex": {"enabled": True, "components": ["t1", "t2"]}}
        warm = {**self.sizes.rstar, "max_depth": min(2, self.sizes.rstar["max_depth"])}
        for spx in modes.values():
            _flush_cache(url)
            asyncio.run(_post_all(url + "/tot/search", [self._search_body(warm, questions[0], spx)], 600))
        runs: Dict[str, List[dict]] = {m: [] for m in modes}
        ratios, ran = [], 0
        for i in range(self.sizes.search_pairs):
            q_min = {}
            for mode in list(modes) if i % 2 == 0 else list(modes)[::-1]:
                _flush_cache(url)
                bodies = [self._search_body(self.sizes.rstar, q, modes[mode]) for q in questions]
                before = _profile_status(url)
                t0 = time.monotonic()
                results = asyncio.run(_post_all(url + "/tot/search", bodies, timeout=600))
                wall = time.monotonic() - t0
                ran += _profiler_ran(before, _profile_status(url))
                q_min[mode] = len(questions) / wall * 60
                runs[mode].append({"q_min": q_min[mode], "results": results})
            ratios.append(q_min["spex"] / q_min["baseline"])
        bad = [r for m in runs.values() for run in m for r in run["results"] if r.get("status") != "done"]
        same = sum(
            _tree(a) == _tree(b)
            for base, spex in zip(runs["baseline"], runs["spex"])
            for a, b in zip(base["results"], spex["results"])
        )
        hits = sum((r.get("speculation") or {}).get("hits", 0) for run in runs["spex"] for r in run["results"])
        q = {m: [run["q_min"] for run in v] for m, v in runs.items()}
        detail = (
            f"rSTAR {self.sizes.rstar['num_rollouts']} rollouts, {len(questions)} q, {len(ratios)} alternating pairs "
            f"after a warm-up of both modes: baseline {statistics.median(q['baseline']):.2f} q/min, "
            f"SPEX {statistics.median(q['spex']):.2f} q/min (medians); SPEX/baseline per pair {_ratio_spread(ratios)}; "
            f"same tree {same}/{len(ratios) * len(questions)}, hits {hits}; {_profile_note(prof, ran)}"
        )
        if bad:
            detail += f"; not done: {[r.get('status', r.get('error')) for r in bad][:3]}"
        return {
            "_fail": bool(bad) or not prof["settled"] or ran > 0,
            "_detail": detail,
            "q_min": q,
            "ratios": ratios,
            "ratio_median": statistics.median(ratios),
            "profile": prof,
        }

    def stage_cancel_kv(self) -> Dict[str, Any]:
        url = self.need_server("spex")
        before = _wait_idle(url)
        policy = {"name": "rebase", "width": 8, "max_depth": 25}
        q = get_task("toy_add").questions(1, split="test", seed=1)[0]
        body = {**self._search_body(policy, q, {"enabled": True}, max_tokens=96), "search_id": "gpu-check-cancel"}
        body["spec"]["step"]["max_total_tokens"] = 100000
        latency = asyncio.run(_start_and_cancel(url, body))
        after = _wait_idle(url)
        b, a = before["pool"], after["pool"]
        free_b, free_a = b["kv_available"] + b["kv_evictable"], a["kv_available"] + a["kv_evictable"]
        leaked = "memory leak detected" in Path(self.server.log_path).read_text(errors="replace")
        ok = free_a == free_b and a["kv_protected"] == b["kv_protected"] and a["req_slots_free"] == b["req_slots_free"]
        detail = f"cancel {latency * 1e3:.0f} ms; KV free {free_b} -> {free_a}, protected {a['kv_protected']}"
        return {"_fail": not ok or leaked, "_detail": detail + ("; SGLang: memory leak" if leaked else "")}

    def stage_top_p(self) -> Dict[str, Any]:
        url = self.need_server("spex")
        q = get_task("toy_add").questions(1, split="test", seed=2)[0]
        policy = {"name": "rebase", "width": self.sizes.rebase_width, "max_depth": 2}
        body = self._search_body(policy, q, {"enabled": True}, top_p=0.9)
        # an unseeded min_p request beside the seeded search: SGLang's sampler refuses seeded min-p on every backend
        min_p = {"text": PROMPTS[0], "sampling_params": {"temperature": 0.8, "min_p": 0.1, "max_new_tokens": 32}}
        try:  # answers well inside the stage's alarm, so a dead scheduler is reported with the log's evidence
            r, r_min_p = asyncio.run(
                _post_each(url, [("/tot/search", body), ("/generate", min_p)], 0.6 * self.sizes.timeouts["top_p"])
            )
            res = r.json() if r.status_code == 200 else {"status": f"HTTP {r.status_code}"}
            min_p_ok = r_min_p.status_code == 200
        except httpx.HTTPError as e:
            res, min_p_ok = {"status": f"no answer ({type(e).__name__})"}, False
        alive = _healthy(url)
        try:  # H2c's count of steps it sampled without their seeds (each such node is not reproducible)
            unseeded = httpx.get(url + "/spex/stats", timeout=60).json()["scheduler"]["unseeded_sampling"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            unseeded = f"unread ({type(e).__name__})"
        log = Path(self.server.log_path).read_text(errors="replace")
        seed_assert = "AssertionError" in log and "seed" in log  # SGLang: "Sampling seed is not supported ..."
        sampling = self.state.get("server_flags", {}).get("sampling_backend")
        detail = f"seeded top_p=0.9 search under {sampling} sampling: {res.get('status')}, "
        detail += f"{len(res.get('failures') or [])} failed nodes, min_p beside it {'ok' if min_p_ok else 'FAILED'}, "
        detail += f"server {'up' if alive else 'DOWN'}, sampled unseeded (H2c) {unseeded}"
        if seed_assert:
            detail += "; log shows a seed AssertionError"
        ok = res.get("status") == "done" and not res.get("failures") and alive and min_p_ok
        return {"_fail": not ok, "_detail": detail}

    def stage_mixed(self) -> Dict[str, Any]:
        """REBASE with a reward that needs no logprobs: speculative prefill runs in SGLang's mixed step (extend, not
        the decode graph) beside the primaries' decode, and SPEX still returns the baseline's tree."""
        url = self.need_server("spex")
        q = get_task("toy_add").questions(1, split="test", seed=3)[0]
        policy = {"name": "rebase", "width": self.sizes.rebase_width, "max_depth": 3}
        seq0 = httpx.get(url + "/spex/stats", timeout=60).json()["batch"]["seq"]
        out = {}
        for mode, spx in (("baseline", {"enabled": False}), ("spex", {"enabled": True, "components": ["t1", "t2"]})):
            _flush_cache(url)
            body = self._search_body(policy, q, spx, reward="verifier:arith")
            out[mode] = httpx.post(url + "/tot/search", json=body, timeout=0.8 * self.sizes.timeouts["mixed"]).json()
        rows, since = [], seq0
        while True:  # an answer holds a page of rows (batch_stats.HISTORY_PAGE): read on from its cursor
            page = httpx.get(url + "/spex/stats", params={"history_since": since}, timeout=60).json()["batch"][
                "history"
            ]
            rows += page["rows"]
            if not page["rows"] or page["next"] >= page["seq"]:
                break
            since = page["next"]
        mixed = sum(1 for r in rows if r["mode"] == 3 and r["n_spec"] > 0 and r["n_primary"] > 0)
        same = _tree(out["baseline"]) == _tree(out["spex"])
        done = all(r.get("status") == "done" for r in out.values())
        flags = self.state.get("server_flags", {})
        detail = f"enable_mixed_chunk={flags.get('enable_mixed_chunk')}; REBASE-{policy['width']} verifier reward: "
        detail += f"same tree {same}, {mixed} mixed steps with speculative prefill, server {'up' if _healthy(url) else 'DOWN'}"
        return {"_fail": not (same and done and _healthy(url)), "_detail": detail, "mixed_spec_steps": mixed}

    def stage_drafter(self) -> Dict[str, Any]:
        if self.dry:
            self.state["drafter"] = _tiny_drafter(self.state["model"], self.out / "drafter")
            return {"_detail": f"tiny untrained drafter {self.state['drafter']}"}
        if "drafter" in self.state:
            return {"_detail": f"cached {self.state['drafter']}"}
        if self.bootstrap is None:
            raise Skip("bootstrap not started")
        self.bootstrap.wait()
        if self.bootstrap.returncode != 0:
            tail = (self.out / "bootstrap.log").read_text(errors="replace").splitlines()[-3:]
            return {"_fail": True, "_detail": f"respec_bootstrap exit {self.bootstrap.returncode}: {tail}"}
        from sglang_spex.respec.profiler import default_drafter

        self.state["drafter"] = default_drafter(self.state["model"])
        return {"_detail": f"bootstrapped {self.state['drafter']}"}

    def _respec(self, cfg: SpecConfig, extra: List[str]) -> Dict[str, Any]:
        """A server with ``cfg`` under ``--respec-adaptive`` and a plan that speculates at B=1 only."""
        plain = self.state.get("plain_step_s") or {}
        path = _switching_profile(cfg.key, plain, self.out / f"profile-{cfg.algorithm}.json")
        respec = ["--respec-adaptive", "--respec-profile", str(path), "--respec-hysteresis", "0,0,1"]
        srv = self.serve([*self.model_args(), *cfg.server_args(), *extra, *respec, "--respec-drift", "0"], cfg.key)
        n = self.sizes.respec_tokens
        out = {}
        for b in (1, 8):
            texts = PROMPTS[:1] if b == 1 else [PROMPTS[i % len(PROMPTS)] + f" [{i}]" for i in range(b)]
            t0 = time.perf_counter()
            res = _generate(srv.url, texts, n)
            out[b] = {"tok_s": b * n / (time.perf_counter() - t0), "ids": [o["output_ids"] for o in res]}
        got = [o["output_ids"] for o in _generate(srv.url, PROMPTS[:4], n)]
        # one sampling request at B=1 (a speculating state): hook V3 wraps the real verify kernel for min-p
        params = {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "min_p": 0.1, "max_new_tokens": n}
        sampled = httpx.post(srv.url + "/generate", json={"text": PROMPTS[0], "sampling_params": params}, timeout=120)
        ref = self.state.get("greedy_ref")
        same = "n/a" if ref is None else f"{sum(a == b for a, b in zip(got, ref))}/{len(got)}"
        info = httpx.get(srv.url + "/get_server_info", timeout=60).json()
        st = info["internal_states"][0].get("respec") or {}
        overlap = "off" if info.get("disable_overlap_schedule") else "on"
        spec_steps, plain_steps = st.get("spec_steps", 0), st.get("plain_steps", 0)
        switches = (st.get("fsm") or {}).get("switches")
        detail = (
            f"B=1 {out[1]['tok_s']:.0f} tok/s, B=8 {out[8]['tok_s']:.0f} tok/s; spec steps {spec_steps}, "
            f"plain steps {plain_steps}, switches {switches}; greedy = plain {same}; overlap {overlap}; "
            f"top-k/top-p/min-p request {sampled.status_code}"
        )
        return {"_fail": not (spec_steps > 0 and plain_steps > 0 and sampled.status_code == 200), "_detail": detail}

    def stage_respec_ngram(self) -> Dict[str, Any]:
        return self._respec(NGRAM, [])

    def stage_respec_eagle3(self) -> Dict[str, Any]:
        if not self.state.get("drafter"):
            raise Skip("no drafter")
        return self._respec(EAGLE3, ["--speculative-draft-model-path", self.state["drafter"]])

    def run(self, stages: Optional[Sequence[str]] = None) -> int:
        """Run ``stages`` (default :data:`STAGES`, in that order; ``env`` and ``model`` always run)."""
        wanted = set(stages or STAGES) | {"env", "model"}
        try:
            for name in [s for s in STAGES if s in wanted]:
                if name in ("env", "model") or "model" in self.state:
                    self.run_stage(name, getattr(self, f"stage_{name}"))
                else:
                    self.results.append(StageResult(name, "SKIP", 0.0, "no model"))
        finally:
            self.stop_server()
            if self.bootstrap is not None and self.bootstrap.poll() is None:
                os.killpg(self.bootstrap.pid, signal.SIGTERM)
            self.write()
        print("\n" + self.table(), flush=True)
        return 0 if all(r.status != "FAIL" for r in self.results) else 1


# --- helpers ---------------------------------------------------------------------------------------------


def _switching_profile(key: str, plain_step_s: Dict[int, float], path: Path) -> Path:
    """A profile whose plan speculates at B=1 (2 tokens per 1.2x step) and not from B=8 (1.5 per 3x step), from
    the measured plain step times (10 ms if none): both ReSpec states run in one check."""
    prof = Profile("gpu-check", key.split(":")[0], "synthetic", meta={"note": "synthetic plan for gpu_check"})
    for b in (1, 8):
        step = float(plain_step_s.get(b) or plain_step_s.get(min(plain_step_s, default=1), 0.010) or 0.010)
        prof.add(PLAIN, Point(b, step, 1.0, b / step))
        cost, tps = (1.2, 2.0) if b == 1 else (3.0, 1.5)
        prof.add(key, Point(b, step * cost, tps, b * tps / (step * cost), tps))
    return prof.save(path)


def _tiny_drafter(model: str, out: Path) -> str:
    """An untrained EAGLE-3 drafter for the tiny model (the dry run checks wiring, not acceptance)."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_spex.respec.drafter import Eagle3Drafter

    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    vocab = target.config.vocab_size
    drafter = Eagle3Drafter.for_target(target, min(128, vocab), torch.arange(vocab).float())
    return str(drafter.save_pretrained(out, dtype=torch.float32))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dry-run", action="store_true", help="CPU servers, tiny model, small stages (also GPU_CHECK_DRY=1)"
    )
    ap.add_argument("--budget-s", type=float, default=470.0, help="global deadline for all stages, seconds")
    ap.add_argument("--out", type=Path, default=Path("/tmp/gpu_check"), help="table, JSON and server logs")
    ap.add_argument("--stages", default="", help=f"comma list of stages to run (default all: {','.join(STAGES)})")
    a = ap.parse_args(argv)
    stages = [x for x in a.stages.split(",") if x]
    unknown = [x for x in stages if x not in STAGES]
    if unknown:
        ap.error(f"--stages: unknown {unknown}")
    dry = a.dry_run or os.environ.get("GPU_CHECK_DRY") == "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check = GpuCheck(dry, a.budget_s, a.out)
    signal.signal(signal.SIGTERM, _terminate)
    return check.run(stages)


if __name__ == "__main__":
    sys.exit(main())
