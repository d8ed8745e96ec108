"""Live roofline profile: decode step time vs running batch size, measured through an :class:`EnginePort`.

Method (client-side timing, no SGLang internals needed): for each batch size B send B concurrent requests
with tiny unique prompts and ``ignore_eos``, once with ``short`` and once with ``long`` new tokens; the
wall-time difference divided by ``long − short`` is the decode step time at B (prefill, tokenisation and
HTTP overheads cancel). Interference only slows a wall down, but a slowed *short* wall makes the difference read too
fast, so each wall's fastest repeat counts on its own (:class:`_Walls`) before the two are subtracted. SGLang 0.5.23
reports per-request latencies in ``meta_info`` only with ``--enable-metrics`` and no per-step times in
``get_internal_state``, so this is the portable way.
After the given batch sizes the sweep goes on doubling the batch while throughput still grows (roofline
``next_batch``), bounded by ``max_batch`` and the server's ``max_running_requests`` and ``max_queued_requests``
(:func:`sweep_limit`; with such a cap no batch past it is measured, the given sizes and ``ctx_batch`` included: SGLang
would queue the extra requests, and the wall time would measure queueing, not a decode step, or refuse them); past
the KV pool's room SGLang queues the extra requests too, so throughput flattens there and the sweep stops.
Two extra probes: a long shared prefix at a fixed batch (context slope) and one long prompt (prefill rate).

A profile is measured for an idle engine. Other requests in flight when any of the sweep's batches starts or ends (the
port's ``rids``, else its ``stats()["inflight"]``; SGLang's health checks aside), or a step-time curve that still
falls by more than ``max_dip`` with the batch after its out-of-order points were measured again, mark it
``meta["load"]["under_load"]``: it serves this run but never enters the cache, and a re-profile becomes due
(:class:`~sglang_spex.profile.manager.ProfileManager`) when requests were in flight. An impossible step time (not
finite and positive: every short wall was slowed more than the long ones) that stays so after ``BAD_TIME_RETRIES``
re-measurements also keeps the profile out of the cache (it makes no re-profile due); that batch is left out of the
curve. A re-measurement adds its walls to the batch's earlier ones. The knee is fitted to the curve's monotone
envelope (a bigger batch never decodes a step faster); the points keep what was measured.

The same code runs in the server process (:class:`~sglang_spex.srt.engine_port.TokenizerManagerPort`,
for ``POST /spex/profile`` and ``--tot-k-total auto``) and from a client (:class:`~sglang_spex.tot.http_port.HttpPort`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
import zlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from sglang_spex.profile import cache
from sglang_spex.profile.cache import Profile
from sglang_spex.profile.roofline import (
    find_knee,
    k_total_from_knee,
    monotone_envelope,
    next_batch,
    out_of_order,
    worst_dip,
)
from sglang_spex.profile.server_key import (  # noqa: F401  (the key's names, kept importable from here)
    KEY_FLAGS,
    QUEUE_CAP_FLAG,
    SWEEP_CEILING,
    profile_key,
    server_args_dict,
)
from sglang_spex.tot.engine import EnginePort, GenRequest
from sglang_spex.tot.validation import FieldError

PROFILE_RID_PREFIX = "spexprof:"
BAD_TIME_RETRIES = 2  # re-measurements of a batch whose step time came out impossible (e.g. negative)
STOP_POLL_S = 0.5  # how often a running batch checks whether the server is shutting down
IDLE_RID_PREFIXES = (PROFILE_RID_PREFIX, "HEALTH_CHECK")  # ours, and sglang.srt.constants.HEALTH_CHECK_RID_PREFIX
logger = logging.getLogger(__name__)
_WORDS = "alpha beta gamma delta omega sigma kappa lambda theta zeta".split()
_PROMPT_TOKENS = 32  # a profile prompt's tokens besides its filler words (nonce and index), with room to spare


@dataclass
class ProfileSpec:
    """What to measure. Defaults take ~20 s with SmolLM2-135M on a 2-core CPU."""

    batch_sizes: Tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    short_tokens: int = 4
    long_tokens: int = 20
    ctx_prefix_words: int = 160  # long shared prefix for the context probe (0 = skip)
    ctx_batch: int = 4
    prefill_words: int = 160  # one long prompt for the prefill rate (0 = skip)
    repeats: int = 2  # short/long pairs per batch size; each wall's fastest counts (:class:`_Walls`)
    max_batch: int = SWEEP_CEILING  # the sweep extends past batch_sizes until throughput flattens, up to this batch
    flat_gain: float = 0.1  # "flattened": the last doubling raised throughput by less than this fraction
    remeasure_dip: float = 0.1  # a point this much slower than a bigger batch's is measured once more
    max_dip: float = 0.25  # still this much slower after that: the sweep was disturbed (not cached; 1: never)

    def within(self, limit: int) -> "ProfileSpec":
        """This spec with its batch sizes and ``ctx_batch`` kept to at most ``limit`` (:func:`sweep_limit`)."""
        sizes = tuple(b for b in self.batch_sizes if b <= limit)
        return replace(self, batch_sizes=sizes or (int(limit),), ctx_batch=min(self.ctx_batch, int(limit)))

    def check(self, max_batch: int, context_len: int, tokens_per_word: int = 2) -> None:
        """Raise :class:`FieldError` (naming the field) unless this spec fits an engine that runs at most
        ``max_batch`` requests at once with a ``context_len``-token context, where a filler word of the prompts is
        at most ``tokens_per_word`` tokens (:func:`filler_tokens_per_word`)."""
        self.check_order()
        for i, b in enumerate(self.batch_sizes):
            if not 1 <= b <= max_batch:
                raise FieldError(f"batch_sizes[{i}]", f"{b} is outside 1..{max_batch} (the sweep's ceiling)")
        if not 1 <= self.ctx_batch <= max_batch:
            raise FieldError("ctx_batch", f"{self.ctx_batch} is outside 1..{max_batch} (the sweep's ceiling)")
        if not 1 <= self.short_tokens:
            raise FieldError("short_tokens", f"{self.short_tokens}: must be at least 1")
        room = context_len - self.long_tokens - _PROMPT_TOKENS
        if room < 0:
            raise FieldError("long_tokens", f"{self.long_tokens} does not fit the {context_len}-token context")
        for name in ("ctx_prefix_words", "prefill_words"):
            words = getattr(self, name)
            if not 0 <= tokens_per_word * words <= room:
                top = room // tokens_per_word
                raise FieldError(name, f"{words} is outside 0..{top} (the prompt must fit the context)")

    def check_order(self) -> None:
        """Raise :class:`FieldError` unless ``batch_sizes`` strictly increase (the sweep's order checks read them so)
        and ``long_tokens`` exceeds ``short_tokens`` (a step time is the difference of their walls)."""
        for i in range(1, len(self.batch_sizes)):
            prev, b = self.batch_sizes[i - 1], self.batch_sizes[i]
            if b <= prev:
                raise FieldError(f"batch_sizes[{i}]", f"{b} after {prev}: batch sizes must strictly increase")
        if self.short_tokens >= self.long_tokens:
            raise FieldError("long_tokens", f"{self.long_tokens}: must exceed short_tokens ({self.short_tokens})")


def filler_tokens_per_word(tokenizer: Any, default: int = 2) -> int:
    """The most tokens ``tokenizer`` spends on one filler word of the profile's prompts (``default`` without one)."""
    try:
        return max(len(tokenizer.encode(" " + w, add_special_tokens=False)) for w in _WORDS)
    except Exception:  # no tokenizer (--skip-tokenizer-init) or an unusual one
        return default


class ProfileYielded(RuntimeError):
    """A sweep that yields to traffic (a background re-profile) saw other requests in flight: it stopped, its batch
    aborted, and the profile in use stays."""


class _LoadWatch:
    """Counts the engine's other requests in flight at each check (the profile's own and health checks aside);
    ``yields``: the first one seen stops the sweep (:class:`ProfileYielded`), between batches or, where the port
    lists its requests, during one (its requests are then aborted)."""

    def __init__(self, port: EnginePort, yields: bool = False):
        self.port = port
        self.yields = yields
        self.checks = 0
        self.most: Optional[int] = None  # most other requests seen in flight at one check (None: the port can't tell)
        self.seen = 0  # other requests seen by a yielding sweep

    async def check(self) -> None:
        n = await others_in_flight(self.port)
        self.checks += 1
        if n is not None:
            self.most = max(self.most or 0, n)
            self.seen = self.seen or (n if self.yields else 0)
        self.raise_if_yielded()

    def raise_if_yielded(self) -> None:
        if self.seen:
            raise ProfileYielded(f"{self.seen} other request(s) in flight: the sweep yields to them")


async def others_in_flight(port: EnginePort) -> Optional[int]:
    """Requests in flight on the engine besides the profiler's own (call between its batches), None if unknown."""
    rids = getattr(port, "rids", None)
    if callable(rids):  # the in-process port sees every request SGLang's TokenizerManager tracks
        try:
            return sum(1 for r in rids("") if not r.startswith(IDLE_RID_PREFIXES))
        except Exception:
            pass
    try:
        n = (await port.stats()).get("inflight")
    except Exception:
        return None
    return None if n is None else int(n)


class _ProfileRequest(GenRequest):
    """A request that never stops early (``ignore_eos``), so its length is exactly ``max_new_tokens``."""

    def sampling_params(self) -> Dict[str, Any]:
        sp = super().sampling_params()
        sp["ignore_eos"] = True
        sp.pop("custom_params", None)
        return sp


def _prompt(nonce: str, i: int, words: int = 0, prefix: str = "") -> str:
    rng = np.random.default_rng(zlib.crc32(f"{nonce}:{i}".encode()))
    filler = " ".join(rng.choice(_WORDS, size=words)) if words else ""
    return f"{prefix}{filler} {nonce}{i}:".strip()


class ProfileStopped(RuntimeError):
    """The server began to shut down during a measurement: the sweep stops (SGLang waits for no request of ours)."""


async def _abort_on_stop(port: EnginePort, prefix: str, watch: Optional[_LoadWatch] = None) -> None:
    """Abort a batch's requests once the server is shutting down (SGLang's SIGTERM drain waits for every request,
    and a sweep at batch 512 would hold it for minutes), or once another request arrives at a sweep that yields
    (``watch.yields``; seen where the port lists its requests: the in-process port)."""
    listed = watch is not None and watch.yields and callable(getattr(port, "rids", None))
    while not port.stopping():
        others = await others_in_flight(port) if listed else 0
        if others:
            watch.seen = others  # type: ignore[union-attr]
            break
        await asyncio.sleep(STOP_POLL_S)
    await port.abort(prefix)


async def _batch_wall(
    port: EnginePort, prompts: Sequence[str], new_tokens: int, watch: Optional[_LoadWatch] = None
) -> Tuple[float, List[int]]:
    if watch is not None:
        await watch.check()
    tag = uuid.uuid4().hex[:8]
    reqs = [
        _ProfileRequest(prompt=p, rid=f"{PROFILE_RID_PREFIX}{tag}:{i}", max_new_tokens=new_tokens, temperature=0.0)
        for i, p in enumerate(prompts)
    ]
    if port.stopping():
        raise ProfileStopped("the server is shutting down")
    guard = asyncio.ensure_future(_abort_on_stop(port, f"{PROFILE_RID_PREFIX}{tag}:", watch))
    t0 = time.perf_counter()
    try:
        results = await asyncio.gather(*(port.generate(r) for r in reqs))
    finally:
        guard.cancel()
    wall = time.perf_counter() - t0
    if port.stopping():
        raise ProfileStopped("the server is shutting down")
    if watch is not None:
        watch.raise_if_yielded()
    bad = [r for r in results if r.completion_tokens and r.completion_tokens != new_tokens]
    if bad:
        raise RuntimeError(f"profile request stopped early ({bad[0].completion_tokens} != {new_tokens} tokens)")
    if watch is not None:
        await watch.check()
    return wall, [r.prompt_tokens for r in results]


@dataclass
class _Walls:
    """The fastest short and long wall measured at one batch so far, and the prompt tokens seen. Interference only
    slows a wall down, so each wall's minimum is its best reading; their difference is the step time."""

    short: float = math.inf
    long: float = math.inf
    prompt_tokens: List[int] = field(default_factory=list)

    def step(self, spec: ProfileSpec) -> float:
        """Seconds per decode step: (fastest long − fastest short) / (long − short tokens); NaN before a pair."""
        if math.isinf(self.short) or math.isinf(self.long):
            return math.nan
        return (self.long - self.short) / (spec.long_tokens - spec.short_tokens)


async def _step_time(
    port: EnginePort,
    spec: ProfileSpec,
    batch: int,
    prefix: str = "",
    watch: Optional[_LoadWatch] = None,
    walls: Optional[_Walls] = None,
) -> Tuple[float, float]:
    """(seconds per decode step, mean prompt tokens) at ``batch``: ``spec.repeats`` short/long pairs measured and
    added to ``walls`` (the batch's earlier walls, if any), then :meth:`_Walls.step`."""
    walls = walls if walls is not None else _Walls()
    for _ in range(spec.repeats):
        nonce = uuid.uuid4().hex[:6]
        short, pt = await _batch_wall(
            port, [_prompt(nonce + "s", i, prefix=prefix) for i in range(batch)], spec.short_tokens, watch
        )
        long, _ = await _batch_wall(
            port, [_prompt(nonce + "l", i, prefix=prefix) for i in range(batch)], spec.long_tokens, watch
        )
        walls.short, walls.long = min(walls.short, short), min(walls.long, long)
        walls.prompt_tokens.extend(pt)
    ptoks = walls.prompt_tokens
    return walls.step(spec), float(np.mean(ptoks)) if ptoks else 0.0


def possible_step(t: float) -> bool:
    """Whether ``t`` can be a decode step time: finite and positive."""
    return math.isfinite(t) and t > 0


async def _possible_step_time(
    port: EnginePort, spec: ProfileSpec, batch: int, watch: _LoadWatch, walls: _Walls
) -> Tuple[Optional[float], float]:
    """:func:`_step_time` at ``batch``, measured again (up to ``BAD_TIME_RETRIES`` times, every wall kept in
    ``walls``) while the step time is impossible; (None, tokens) if it stays so."""
    for _ in range(1 + BAD_TIME_RETRIES):
        t, p = await _step_time(port, spec, batch, watch=watch, walls=walls)
        if possible_step(t):
            return t, p
        logger.info("spex: profile B=%d: impossible step time %.3g s, measuring again", batch, t)
    return None, p


async def measure_profile(
    port: EnginePort, key: Dict[str, Any], spec: Optional[ProfileSpec] = None, progress: bool = True, yields=False
) -> Profile:
    """Measure a :class:`Profile` on a live engine (nothing else should be running on it; see the module
    docstring for what marks it as measured under load). ``yields``: stop at the first other request seen
    (:class:`ProfileYielded`) instead of measuring under load."""
    spec = spec or ProfileSpec()
    spec.check_order()
    total = len(spec.batch_sizes) + bool(spec.ctx_prefix_words) + bool(spec.prefill_words)
    bar = _bar(total, progress)
    t_start = time.perf_counter()
    watch = _LoadWatch(port, yields)
    await _batch_wall(port, [_prompt("warm", 0)], 2, watch)  # first request pays one-off costs
    limit = sweep_limit(spec, key)
    todo: List[int] = [int(b) for b in spec.within(limit).batch_sizes]
    bar.total -= len(spec.batch_sizes) - len(todo)
    sizes: List[int] = []  # batches with a possible step time, and those times
    times: List[float] = []
    ptok: List[float] = []
    remeasured: List[int] = []
    impossible: List[int] = []  # batches whose step time stayed impossible: left out of the curve
    walls: Dict[int, _Walls] = {}  # every wall measured per batch (a re-measurement adds to them)
    while todo:
        b = todo.pop(0)
        t, p = await _possible_step_time(port, spec, b, watch, walls.setdefault(b, _Walls()))
        if t is None:
            impossible.append(b)
        else:
            sizes.append(b)
            times.append(t)
            ptok.append(p)
        bar.set_postfix_str(f"B={b}: " + (f"{t * 1e3:.1f} ms/step" if t is not None else "impossible step time"))
        bar.update(1)
        for j in out_of_order(times, spec.remeasure_dip):  # slower than a bigger batch: disturbed, once more
            if sizes[j] not in remeasured:
                remeasured.append(sizes[j])
                t, _ = await _step_time(port, spec, sizes[j], watch=watch, walls=walls[sizes[j]])
                if possible_step(t):
                    times[j] = t  # from the fastest of every short and long wall at that batch
        nb = None if todo else next_batch(sizes, times, limit, spec.flat_gain)
        if nb is not None and nb not in sizes + impossible:
            todo.append(nb)
            bar.total += 1
    if len(sizes) < 2:
        raise RuntimeError(
            f"profile: fewer than two batch sizes up to the sweep's limit {limit} gave a step time "
            f"(measured {sizes}, impossible {impossible})"
        )
    smooth = monotone_envelope(times)
    ctx_len = float(np.mean(ptok)) + (spec.short_tokens + spec.long_tokens) / 2.0
    meta: Dict[str, Any] = {"spec": asdict(spec), "prompt_tokens": ptok, "sweep_limit": limit}
    ctx_batch = min(spec.ctx_batch, limit)
    kw: Dict[str, Any] = {}
    if spec.ctx_prefix_words:
        prefix = _prompt("ctx" + uuid.uuid4().hex[:6], 0, words=spec.ctx_prefix_words) + " "
        await _batch_wall(port, [prefix], 1, watch)  # prime the radix cache with the shared prefix
        t_ctx, p_ctx = await _step_time(port, spec, ctx_batch, prefix=prefix, watch=watch)
        base = float(np.interp(ctx_batch, sizes, smooth))
        extra_ctx = ctx_batch * max(p_ctx - float(np.mean(ptok)), 1.0)
        kw["ctx_coef"] = max((t_ctx - base) / extra_ctx, 0.0)
        meta["ctx_probe"] = {"batch": ctx_batch, "prompt_tokens": p_ctx, "step_time": t_ctx, "base": base}
        bar.update(1)
    if spec.prefill_words:
        nonce = uuid.uuid4().hex[:6]
        t_small, (p_small,) = await _batch_wall(port, [_prompt(nonce + "a", 0)], 1, watch)
        t_big, (p_big,) = await _batch_wall(port, [_prompt(nonce + "b", 0, words=spec.prefill_words)], 1, watch)
        if t_big > t_small and p_big > p_small:
            rate = (p_big - p_small) / (t_big - t_small)
            kw["prefill_tok_s"] = rate
            kw["prefill_overhead_s"] = max(t_small - p_small / rate, 0.0)
        meta["prefill_probe"] = {"small": [p_small, t_small], "big": [p_big, t_big]}
        bar.update(1)
    bar.close()
    dip = worst_dip(times)
    why = (["requests in flight"] if watch.most else []) + (["non-monotone"] if dip > spec.max_dip else [])
    why += ["impossible step time"] if impossible else []
    meta["load"] = {
        "under_load": bool(why),
        "why": why,
        "others_in_flight": watch.most,  # most other requests seen in flight at one check (None: unknown)
        "checks": watch.checks,
        "remeasured": remeasured,
        "impossible": impossible,  # batches left out: their step time stayed impossible
        "worst_dip": dip,
    }
    prof = Profile.from_points(
        key, sizes, times, int(round(ctx_len)), duration_s=time.perf_counter() - t_start, meta=meta, **kw
    )
    if smooth != times:  # the knee of the monotone envelope; the points keep what was measured
        prof.fit = find_knee(sizes, smooth)
        prof.k_total = k_total_from_knee(prof.fit)
    return prof


def sweep_limit(spec: ProfileSpec, key: Dict[str, Any]) -> int:
    """The largest batch the sweep may measure: ``spec.max_batch`` (never below the given batch sizes), capped by
    the server's ``max_running_requests`` and ``max_queued_requests`` (``key["flags"]``) where it has them."""
    limit = max(int(spec.max_batch), max(spec.batch_sizes, default=1))
    flags = key.get("flags") or {}
    caps = [int(c) for c in (flags.get("max_running_requests"), flags.get(QUEUE_CAP_FLAG)) if c]
    return max(min([limit, *caps]), 1)


def _bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="spex roofline profile", disable=not enabled, leave=True)


async def ensure_profile(
    port: EnginePort,
    key: Dict[str, Any],
    spec: Optional[ProfileSpec] = None,
    force: bool = False,
    max_age_s: Optional[float] = None,
    progress: bool = True,
    save: bool = True,
    yields: bool = False,
) -> Profile:
    """The cached profile for ``key`` if fresh, else a new measurement (saved to the cache when ``save`` and not
    measured under load; ``yields``: see :func:`measure_profile`)."""
    if not force:
        prof = cache.load(key, max_age_s=max_age_s)
        if prof is not None:
            return prof
    prof = await measure_profile(port, key, spec, progress, yields)
    if save and cache.save(prof) is None:
        logger.warning("spex: roofline profile measured under load (%s): used now, not cached", prof.load_why)
    return prof
