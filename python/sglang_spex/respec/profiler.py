"""ReSpec Adaptive Server, offline part 1: profile speculative (s, t, n) configs against real SGLang servers.

For every candidate config (and the no-speculation baseline) one server is started; for each batch size a batch
of calibration prompts (several batches of different prompts below ``min_sequences``, as acceptance varies from
prompt to prompt) is decoded twice (greedily, or sampled at ``temperature`` > 0), with ``n_short`` and ``n_long``
new tokens, each after ``/flush_cache`` (empties the radix cache *and* the NGRAM corpus, which otherwise learns the
calibration outputs and inflates acceptance on the next run). The difference of the two wall times removes prefill
and request overhead, so a :class:`Point` holds pure decode numbers (over at least ``min_steps`` decode steps; a point that
reads slower per step than a bigger batch's is measured once more and the faster reading kept, as the SPEX
profiler does):

* ``step_s``: seconds per decode step of the whole batch (draft + verify for a speculative config);
* ``tokens_per_step``: tokens each sequence gains per step (the accept length incl. the bonus token; 1 plain);
* ``throughput``: output tokens per second of the batch.

Acceptance comes from SGLang itself: ``meta_info.spec_accept_length`` / ``spec_verify_ct`` per request and
``/get_server_info`` ``avg_spec_accept_length``. The result is the shared
:class:`~sglang_spex.profile.cache.Profile` (one curve per config plus :data:`PLAIN`), saved as JSON, one per
(model, drafter, device, and temperature when above 0: ``__t<T>`` in the name).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import httpx

from sglang_spex.profile.cache import CACHE_DIR, PLAIN, Point, Profile, device_name
from sglang_spex.profile.roofline import out_of_order

logger = logging.getLogger(__name__)

PROFILE_DIR = CACHE_DIR / "respec"
REMEASURE_DIP = 0.1  # a point this much slower per step than a bigger batch's is measured once more

# Calibration prompts: free text (drafts rarely accepted) mixed with repetitive text (n-gram friendly), like a
# rollout where some answers repeat structure.
CALIBRATION_PROMPTS: List[str] = [
    "The history of the old harbour town begins with a small settlement near the river, where farmers",
    "Step 1: add 3 and 4 to get 7. Step 2: add 7 and 4 to get 11. Step 3: add 11 and 4 to get",
    "a b c a b c a b c a b c a b c a b c",
    "Question: what is the capital of France? Answer: Paris. Question: what is the capital of Spain? Answer:",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Once upon a time there was a little fox who lived in a forest full of tall trees and",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,",
    "The list of colours is red, green, blue, red, green, blue, red, green,",
]

_KEY = re.compile(r"^(?P<alg>[A-Z0-9_]+):s(?P<s>\d+)t(?P<t>\d+)n(?P<n>\d+)$")


@dataclass(frozen=True)
class SpecConfig:
    """A speculative config: algorithm and (s = num_steps, t = topk / branching, n = num_draft_tokens)."""

    algorithm: str
    num_steps: int
    topk: int
    num_draft_tokens: int

    @property
    def key(self) -> str:
        return f"{self.algorithm}:s{self.num_steps}t{self.topk}n{self.num_draft_tokens}"

    @classmethod
    def parse(cls, key: str) -> "SpecConfig":
        m = _KEY.match(key.strip())
        if not m:
            raise ValueError(f"bad config key {key!r} (expected e.g. NGRAM:s4t1n4)")
        return cls(m["alg"], int(m["s"]), int(m["t"]), int(m["n"]))

    def server_args(self) -> List[str]:
        """SGLang's flags for this config (NGRAM derives s = n // t; its branching flag is the BFS breadth)."""
        args = ["--speculative-algorithm", self.algorithm, "--speculative-num-draft-tokens", str(self.num_draft_tokens)]
        if self.algorithm == "NGRAM":
            return args + ["--speculative-ngram-max-bfs-breadth", str(self.topk)]
        return args + ["--speculative-num-steps", str(self.num_steps), "--speculative-eagle-topk", str(self.topk)]


def ngram(n: int, t: int = 1) -> SpecConfig:
    return SpecConfig("NGRAM", max(1, n // t), t, n)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(text).name or text).strip("_") or "x"


TEMPERATURE_TAG = "__t"  # the name of a profile cached at T > 0 ends in __t<T>


def default_profile_path(model: str, drafter: str, device: str, temperature: float = 0.0) -> Path:
    """Where a profile is cached: one file per (model, drafter, device) and sampling temperature (a T > 0 profile
    accepts less than a greedy one and must not overwrite it; greedy keeps the plain name)."""
    at = f"{TEMPERATURE_TAG}{temperature:g}" if temperature > 0 else ""
    return PROFILE_DIR / f"{_slug(model)}__{_slug(drafter)}__{_slug(device)}{at}.json"


def cached_at_t_above_zero(path: Path) -> bool:
    """``path`` is named as :func:`default_profile_path` names a profile cached at T > 0."""
    return re.search(rf"{TEMPERATURE_TAG}[^_]+$", path.stem) is not None


# --- measurement -------------------------------------------------------------------------------------------


def _generate(url: str, texts: List[str], n: int, temperature: float = 0.0) -> List[dict]:
    params = {"temperature": temperature, "max_new_tokens": n, "ignore_eos": True}
    r = httpx.post(url + "/generate", json={"text": texts, "sampling_params": params}, timeout=900)
    r.raise_for_status()
    return [x["meta_info"] for x in r.json()]


def flush(url: str, wait_s: float = 10.0, poll_s: float = 0.1) -> float:
    """``/flush_cache``: empties the radix cache and SGLang's NGRAM corpus. SGLang refuses while requests are in
    flight (an aborted speculative request may linger), so it is retried for up to ``wait_s``, then RuntimeError.
    Returns the seconds waited."""
    t0 = time.monotonic()
    while True:
        r = httpx.post(url + "/flush_cache", timeout=60)
        if r.status_code == 200:
            return time.monotonic() - t0
        if time.monotonic() - t0 > wait_s:
            raise RuntimeError(f"/flush_cache refused for {wait_s:.0f} s (HTTP {r.status_code}): requests in flight")
        time.sleep(poll_s)


def prompt_set(spec: str, model_path: str, n: int = 16) -> List[str]:
    """``calibration`` (:data:`CALIBRATION_PROMPTS`) or ``task:NAME``: ``n`` held-out questions of a bundled task,
    chat-formatted with the model's template (what a rollout of that task sends)."""
    if spec == "calibration":
        return list(CALIBRATION_PROMPTS)
    if not spec.startswith("task:"):
        raise ValueError(f"prompt set {spec!r}: expected 'calibration' or 'task:NAME'")
    from transformers import AutoTokenizer

    from sglang_spex.tot.tasks import get_task

    tok = AutoTokenizer.from_pretrained(model_path)
    questions = get_task(spec[5:]).questions(n, split="test")
    chat = [[{"role": "user", "content": q.text}] for q in questions]
    return [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chat]


def default_drafter(model: str) -> str:
    """The bootstrap drafter ``scripts/respec_bootstrap.py`` caches for ``model`` (SmolLM2)."""
    from sglang_spex.models import CACHE_DIR

    path = CACHE_DIR / f"{Path(model).name}-eagle3-respec"
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no drafter at {path}: run scripts/respec_bootstrap.py first or pass --drafter")
    return str(path)


def batch_prompts(batch: int, prompts: Sequence[str] = CALIBRATION_PROMPTS) -> List[str]:
    """``batch`` distinct prompts cycling through the calibration set."""
    return [prompts[i % len(prompts)] + ("" if i < len(prompts) else f" ({i // len(prompts)})") for i in range(batch)]


def _representative(tries: List[Tuple[float, List[dict]]], temperature: float) -> Tuple[float, List[dict]]:
    """One run of a few (wall time, its meta_info): greedy, the fastest (the runs decode the same tokens; other
    processes only ever add time); sampled, the median time's (the fastest would favour a run that happened to
    accept more; of two, the slower: a plan errs towards plain decode)."""
    ordered = sorted(tries, key=lambda run: run[0])
    return ordered[0] if temperature == 0 else ordered[len(ordered) // 2]


def measure_point(
    url: str,
    batch: int,
    n_short: int,
    n_long: int,
    prompts: Sequence[str] = CALIBRATION_PROMPTS,
    repeats: int = 2,
    min_sequences: int = 8,
    min_steps: int = 32,
    max_rounds: int = 8,
    temperature: float = 0.0,
) -> Point:
    """Decode numbers of the server at ``url`` for one batch size (two-point difference, see module doc).

    A point covers at least ``min_sequences`` sequences: below that batch size it is measured on
    ``ceil(min_sequences / batch)`` batches of different prompts and summed (acceptance differs a lot from prompt
    to prompt; one prompt at batch 1 made a tree look 2.7x faster than plain decode where it measured 1.0x).
    It also covers at least ``min_steps`` decode (verify) steps, with up to ``max_rounds`` rounds in all: a
    speculative config that accepts much takes few verify steps between ``n_short`` and ``n_long`` tokens, and a
    point from 21 steps read B=16 cheaper than B=4.

    ``temperature``: the requests' sampling temperature. A speculative config accepts less at T=1 than greedy (a
    draft token is accepted with its target probability, not only when it is the argmax): profile at the
    temperature the server will serve (RL rollouts: their own).
    """
    rounds = max(1, -(-min_sequences // max(batch, 1)))
    dt_sum, steps_sum, verify_sum, accepts = 0.0, 0, 0, []
    spec = False
    j = 0
    while j < rounds or (steps_sum < min_steps and j < max(rounds, max_rounds)):
        shift = (j * batch) % max(len(prompts), 1)
        texts = batch_prompts(batch, list(prompts[shift:]) + list(prompts[:shift]))
        runs = []
        for n in (n_short, n_long):
            tries = []
            for _ in range(max(1, repeats)):
                flush(url)  # every run starts cold: same prefill to cancel out, and no n-gram corpus of earlier runs
                t0 = time.perf_counter()
                meta = _generate(url, texts, n, temperature)
                tries.append((time.perf_counter() - t0, meta))
            runs.append(_representative(tries, temperature))
        (t_s, m_s), (t_l, m_l) = runs
        spec = "spec_verify_ct" in m_l[0]
        if spec:
            steps = max(m["spec_verify_ct"] for m in m_l) - max(m["spec_verify_ct"] for m in m_s)
            verify_sum += max(m["spec_verify_ct"] for m in m_l)
            accepts += [m.get("spec_accept_length", 1.0) for m in m_l]
        else:
            steps = n_long - n_short
        dt_sum += max(t_l - t_s, 1e-6)
        steps_sum += max(steps, 1)
        j += 1
    tokens = j * batch * (n_long - n_short)
    return Point(
        batch_size=batch,
        step_s=dt_sum / steps_sum,
        tokens_per_step=tokens / batch / steps_sum,
        throughput=tokens / dt_sum,
        accept_length=sum(accepts) / len(accepts) if spec else None,
        verify_ct=verify_sum if spec else None,
    )


def profile_configs(
    model: str,
    configs: Sequence[Optional[SpecConfig]],
    batch_sizes: Sequence[int],
    n_short: int = 8,
    n_long: int = 40,
    repeats: int = 2,
    server_args: Sequence[str] = (),
    drafter: str = "",
    prompts: Sequence[str] = CALIBRATION_PROMPTS,
    server_factory: Optional[Callable[[List[str]], object]] = None,
    temperature: float = 0.0,
) -> Profile:
    """Start one server per config (``None`` = no speculation), measure every batch size at ``temperature``
    (:func:`measure_point`), return the profile."""
    from sglang_spex.serve import ServerProcess

    factory = server_factory or ServerProcess
    algs = sorted({c.algorithm for c in configs if c is not None})
    prof = Profile(model=model, drafter=drafter or "+".join(algs) or "none", device=device_name())
    prof.meta.update(
        n_short=n_short,
        n_long=n_long,
        repeats=repeats,
        batch_sizes=list(batch_sizes),
        server_args=list(server_args),
        temperature=temperature,
    )
    prof.meta["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    for cfg in configs:
        key = PLAIN if cfg is None else cfg.key
        args = ["--model-path", model, *server_args, *([] if cfg is None else cfg.server_args())]
        if cfg is not None and cfg.algorithm != "NGRAM" and drafter:  # EAGLE / STANDALONE: the draft model
            args += ["--speculative-draft-model-path", drafter]
        with factory(args) as srv:
            _generate(srv.url, batch_prompts(1, prompts), 4)  # warm-up
            points: List[Point] = []
            remeasured: List[int] = []
            for b in batch_sizes:
                points.append(measure_point(srv.url, b, n_short, n_long, prompts, repeats, temperature=temperature))
                logger.info("respec profile %s B=%d: %s", key, b, points[-1])
                for i in out_of_order([p.step_s for p in points], REMEASURE_DIP):  # slower than a bigger batch
                    if points[i].batch_size not in remeasured:  # disturbed: once more, the faster one stays
                        remeasured.append(points[i].batch_size)
                        again = measure_point(
                            srv.url, points[i].batch_size, n_short, n_long, prompts, repeats, temperature=temperature
                        )
                        points[i] = min(points[i], again, key=lambda p: p.step_s)
            for p in points:
                prof.add(key, p)
            prof.meta.setdefault("remeasured", {})[key] = remeasured
            if cfg is not None:
                info = httpx.get(srv.url + "/get_server_info", timeout=60).json()
                states = info.get("internal_states") or [{}]
                prof.meta.setdefault("avg_spec_accept_length", {})[key] = states[0].get("avg_spec_accept_length")
    return prof
