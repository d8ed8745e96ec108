"""SimPort: a simulated continuous-batching engine behind the same :class:`EnginePort` as the real ones.

One engine task plays SGLang's scheduler loop on the event loop's clock (virtual under
:func:`sglang_spex.sim.clock.run_virtual`):

- **prefill first**: waiting requests are admitted (highest ``priority`` first, then arrival; at most
  ``max_running`` running and ``kv_capacity`` KV tokens) and prefilled together in one pass costing
  ``cost.prefill_time`` of their *uncached* prompt tokens; the pass also yields each one's first token;
- otherwise **one decode step** for every running request, costing ``cost.decode_time(batch, context)``.
  Runs of steps with no arrival/abort in between are taken in one sleep (exact per-step sums), so a long
  simulation costs one event per request completion, not per token;
- an arrival, abort or promote during a decode step takes effect at the next step boundary (as in SGLang, where
  an aborted running request finishes after one more step); an aborted request returns
  ``finish_reason="abort"`` with the tokens it had;
- a prefix cache at ``block``-token granularity (SGLang's radix cache, without eviction unless
  ``cache_capacity`` is set): prompts reuse the longest cached prefix of earlier prompts + outputs;
- priorities: larger = more urgent; a request without one gets ``default_priority`` (0, as our launcher
  sets ``--default-priority-value 0`` under ``--tot-speculation``, so primaries outrank speculative work);
- ``preempt``: a waiting request of higher priority than a running one retracts it when full (SGLang's
  ``--enable-priority-scheduling`` retraction); the retracted request later re-prefills its prompt and the
  tokens it had (mostly from the cache) and continues to the same output;
- ``cache_on_prefill``: a prompt enters the prefix cache once prefilled (SGLang's ``cache_unfinished_req``),
  not only when its request finishes; off by default (the GPU figures were made without it);
- ``spec_knee``: the product's speculative gate (:mod:`sglang_spex.srt.scheduling`): speculative requests (priority
  below ``default_priority``) run only in the room the primary work (running + waiting primaries) leaves below
  this batch size; running ones above it are retracted at a step boundary (lowest ranked, least advanced first),
  and a prefill of speculative requests alone never replaces a step in which primaries decode (they wait for a
  prefill that runs anyway, or for the primaries to finish). None (default): no gate;
- ``mixed_chunk``: SGLang's ``--enable-mixed-chunk``: a prefill pass also runs the running requests' decode step
  (one forward over the new prompt tokens plus one token per running request), and the gate then admits
  speculative requests within the room while primaries decode;
- client overhead: ``cost.client`` (:mod:`sglang_spex.sim.client`) passes each request through the serial
  request path (``request_s`` each), delays its result by ``response_s``, then queues ``cpu_s`` on the one
  client thread.

An exception inside the engine loop (a cost model's, say) is raised to every caller waiting on it, at once; later
calls raise a RuntimeError caused by it.

Tokens are the simulated text's whitespace-separated words (:mod:`sglang_spex.sim.workload`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import numbers
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import numpy as np

from sglang_spex.sim.client import SerialResource
from sglang_spex.sim.cost import CostModel, default_attn_pairs
from sglang_spex.sim.workload import MixedWorkload, SimOutput, Workload
from sglang_spex.tot.engine import EnginePort, GenRequest, GenResult


@dataclass(eq=False)
class _Req:
    req: GenRequest
    fut: "asyncio.Future[GenResult]"
    out: SimOutput
    prompt_words: List[str]
    arrival: float
    seq: int
    priority: int
    done: int = 0  # tokens generated so far
    cached: int = 0
    aborted: bool = False

    @property
    def target(self) -> int:
        return self.out.completion_tokens

    @property
    def ctx(self) -> int:
        return len(self.prompt_words) + self.done

    @property
    def prefill_words(self) -> List[str]:
        """What a (re-)prefill must cover: the prompt, plus the tokens so far for a retracted request."""
        return self.prompt_words + self.out.text.split()[: self.done] if self.done else self.prompt_words


@dataclass
class EngineMetrics:
    decode_steps: int = 0
    decode_time: float = 0.0
    prefill_passes: int = 0
    prefill_time: float = 0.0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    batch_time_integral: float = 0.0  # Σ batch · step time (mean batch = this / decode_time)
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    aborted_tokens: int = 0
    preempted: int = 0
    client_cpu_time: float = 0.0  # seconds the client thread was busy (ClientOverhead.cpu_s per request)
    batch_hist: Dict[int, float] = field(default_factory=dict)  # batch size → seconds spent decoding at it

    @property
    def mean_batch(self) -> float:
        return self.batch_time_integral / self.decode_time if self.decode_time else 0.0

    def to_dict(self) -> Dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "batch_hist"}
        d["mean_batch"] = self.mean_batch
        d["busy_time"] = self.decode_time + self.prefill_time
        return d


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an int >= ``minimum`` (or None when ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{' or None' if optional else ''}, got {value!r}")


class PrefixCache:
    """Block-granular prefix cache over word tokens (chained block hashes, optional LRU capacity)."""

    def __init__(self, block: int = 16, capacity_tokens: Optional[int] = None):
        _check_int("PrefixCache.block", block, 1)
        _check_int("PrefixCache.capacity_tokens", capacity_tokens, 0, optional=True)
        self.block = block
        self.capacity_blocks = None if capacity_tokens is None else max(capacity_tokens // block, 1)
        self._blocks: "OrderedDict[int, None]" = OrderedDict()

    def _hashes(self, words: List[str]) -> List[int]:
        out, h, b = [], 0, self.block
        for i in range(0, len(words) - b + 1, b):
            h = hash((h, tuple(words[i : i + b])))
            out.append(h)
        return out

    def match(self, words: List[str]) -> int:
        n = 0
        for h in self._hashes(words):
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            n += 1
        return n * self.block

    def insert(self, words: List[str]) -> None:
        for h in self._hashes(words):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        if self.capacity_blocks is not None:
            while len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)


class SimPort(EnginePort):
    """A simulated SGLang engine (see the module docstring). Create it inside the loop that will use it."""

    def __init__(
        self,
        cost: CostModel,
        workload: Union[Workload, MixedWorkload],
        *,
        max_running: int = 256,
        kv_capacity: Optional[int] = None,
        prefill_chunk: int = 8192,
        cache_block: int = 16,
        cache_capacity: Optional[int] = None,
        preempt: bool = True,
        default_priority: int = 0,
        cache_on_prefill: bool = False,
        spec_knee: Optional[int] = None,
        mixed_chunk: bool = False,
    ):
        for name, value, minimum, optional in (
            ("max_running", max_running, 1, False),
            ("kv_capacity", kv_capacity, 1, True),
            ("prefill_chunk", prefill_chunk, 1, False),
            ("cache_block", cache_block, 1, False),
            ("cache_capacity", cache_capacity, 0, True),
            ("spec_knee", spec_knee, 1, True),
        ):
            _check_int(f"SimPort.{name}", value, minimum, optional)
        self.cost, self.workload = cost, workload
        self.max_running, self.kv_capacity, self.prefill_chunk = max_running, kv_capacity, prefill_chunk
        self.preempt, self.default_priority, self.cache_on_prefill = preempt, default_priority, cache_on_prefill
        self.spec_knee, self.mixed_chunk = spec_knee, mixed_chunk
        self.cache = PrefixCache(cache_block, cache_capacity)
        self.waiting: List[_Req] = []
        self.running: List[_Req] = []
        self.prefilling: List[_Req] = []  # the batch of the prefill pass in progress (in neither list above)
        self.metrics = EngineMetrics()
        self.frontend = SerialResource()  # the request path (HTTP server + tokenizer)
        self.client = SerialResource()  # the client's Python thread
        self.last_step_time = 0.0
        self._seq = itertools.count()
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._closed = False
        self._error: Optional[BaseException] = None  # what killed the engine loop (then every call raises)

    # ---- EnginePort --------------------------------------------------------------------------------

    async def generate(self, req: GenRequest) -> GenResult:
        overhead = self.cost.client
        await self.frontend.run(overhead.request_s)
        res = await self._submit(req)
        if overhead.response_s > 0:
            await asyncio.sleep(overhead.response_s)
        await self.client.run(overhead.cpu_s)
        self.metrics.client_cpu_time = self.client.busy_s
        return res

    async def _submit(self, req: GenRequest) -> GenResult:
        loop = asyncio.get_running_loop()
        self._ensure_started()
        r = _Req(
            req=req,
            fut=loop.create_future(),
            out=self.workload.generate(req),
            prompt_words=req.prompt.split(),
            arrival=loop.time(),
            seq=next(self._seq),
            priority=req.priority if req.priority is not None else self.default_priority,
        )
        self.metrics.requests += 1
        self.waiting.append(r)
        self._wake.set()
        try:
            return await r.fut
        except asyncio.CancelledError:  # the caller went away: like a client disconnect, abort it
            r.aborted = True
            self._wake.set()
            raise

    def _live(self) -> List[_Req]:
        """Every request the engine holds: waiting, running, and in the prefill pass in progress."""
        return self.waiting + self.running + self.prefilling

    async def abort(self, rid_or_prefix: str) -> None:
        hit = False
        for r in self._live():
            if r.req.rid.startswith(rid_or_prefix) and not r.aborted:
                r.aborted, hit = True, True
        if hit and self._wake is not None:
            self._wake.set()

    async def promote(self, rid: str) -> None:
        changed = False
        for r in self._live():
            if r.req.rid == rid and r.priority < self.default_priority:
                r.priority, changed = self.default_priority, True
        if changed and self._wake is not None:  # takes effect at the next step boundary, like an arrival
            self._wake.set()

    async def stats(self) -> Dict[str, Any]:
        return {
            "inflight": len(self._live()),
            "running": len(self.running),
            "waiting": len(self.waiting),
            "last_step_time": self.last_step_time,
            "time": asyncio.get_running_loop().time(),
            **self.metrics.to_dict(),
        }

    async def close(self) -> None:
        """Stop the engine loop (an error that killed it and reached no caller is raised here)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            finally:
                self._task = None

    # ---- the scheduler loop ------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"SimPort: the engine loop failed earlier: {self._error!r}") from self._error
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="simport-engine")

    async def _loop(self) -> None:
        """Run the scheduler; an exception in it is set on every waiting caller's future (re-raised if none)."""
        try:
            await self._schedule()
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._error = e
            waiting = [r.fut for r in self._live() if not r.fut.done()]
            for fut in waiting:
                fut.set_exception(e)
            if not waiting or not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: also stop the loop
                raise

    async def _schedule(self) -> None:
        while not self._closed:
            self._reap_aborted()
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._admit()
            if batch:
                await self._prefill(batch)
            elif self.running:
                await self._decode()
            else:  # waiting but nothing admissible and nothing running: wait for a change
                self._wake.clear()
                await self._wake.wait()

    def _finish(self, r: _Req, reason: Optional[str] = None) -> None:
        now = asyncio.get_running_loop().time()
        out = r.out
        if reason == "abort":
            text = " ".join(out.text.split()[: r.done])
            res = GenResult(r.req.rid, text, [0] * r.done, "abort", None, [], len(r.prompt_words), r.done, r.cached)
            self.metrics.aborted += 1
            self.metrics.aborted_tokens += r.done
        else:
            lps = [math.log(max(out.reward, 1e-12))] * out.completion_tokens if r.req.return_logprob else []
            res = GenResult(
                r.req.rid,
                out.text,
                [0] * out.completion_tokens,
                out.finish_reason,
                out.matched_stop,
                lps,
                len(r.prompt_words),
                out.completion_tokens,
                r.cached,
            )
            self.cache.insert(r.prompt_words + out.text.split())
            self.metrics.finished += 1
        res.latency = now - r.arrival
        if not r.fut.done():
            r.fut.set_result(res)

    def _reap_aborted(self) -> None:
        for queue in (self.waiting, self.running):
            for r in [r for r in queue if r.aborted]:
                queue.remove(r)
                self._finish(r, "abort")

    def _kv_used(self) -> int:
        return sum(r.ctx - r.cached for r in self.running)

    def _is_spec(self, r: _Req) -> bool:
        return r.priority < self.default_priority

    def _spec_room(self) -> Optional[int]:
        """Speculative requests the gate allows in the running batch now (None: no gate)."""
        if self.spec_knee is None:
            return None
        primary = sum(1 for r in self.running + self.waiting if not self._is_spec(r))
        return max(self.spec_knee - primary, 0)

    def _trim_spec(self) -> None:
        """Retract the running speculative requests above the gate's room (they re-prefill from the cache later)."""
        room = self._spec_room()
        if room is None:
            return
        spec = [r for r in self.running if self._is_spec(r)]
        if len(spec) <= room:
            return
        spec.sort(key=lambda r: (r.priority, r.done))
        for victim in spec[: len(spec) - room]:
            self._retract(victim)

    def _spec_allowed(self) -> Optional[int]:
        """Speculative requests this prefill may admit (None: any)."""
        room = self._spec_room()
        if room is None:
            return None
        primaries_decode = any(not self._is_spec(r) for r in self.running)
        if primaries_decode and not self.mixed_chunk and all(self._is_spec(r) for r in self.waiting):
            return 0  # a speculative-only prefill would replace the primaries' decode step
        return max(room - sum(1 for r in self.running if self._is_spec(r)), 0)

    def _admit(self) -> List[_Req]:
        if not self.waiting:
            return []
        self.waiting.sort(key=lambda r: (-r.priority, r.seq))
        batch: List[_Req] = []
        budget = self.prefill_chunk
        kv = self._kv_used()
        spec_left = self._spec_allowed()
        for r in list(self.waiting):
            if spec_left is not None and self._is_spec(r):
                if spec_left <= 0:
                    break  # primaries come first in the queue: nothing after this may be admitted
                spec_left -= 1
            if len(self.running) + len(batch) >= self.max_running and not self._preempt_for(r):
                break
            words = r.prefill_words
            r.cached = min(self.cache.match(words), max(len(words) - 1, 0))
            need = r.ctx - r.cached
            if self.kv_capacity is not None and kv + need > self.kv_capacity and (self.running or batch):
                break
            new = len(words) - r.cached
            if batch and new > budget:
                break
            batch.append(r)
            self.waiting.remove(r)
            budget -= new
            kv += need
        return batch

    def _preempt_for(self, r: _Req) -> bool:
        if not self.preempt or not self.running:
            return False
        victim = min(self.running, key=lambda x: (x.priority, -x.seq))
        if victim.priority >= r.priority:
            return False
        self._retract(victim)
        return True

    def _retract(self, victim: _Req) -> None:
        self.running.remove(victim)  # retracted: re-prefills its prompt + tokens so far from the cache later
        self.cache.insert(victim.prefill_words)
        self.waiting.append(victim)
        self.metrics.preempted += 1

    async def _prefill(self, batch: List[_Req]) -> None:
        self.prefilling = batch  # an abort or promote during the pass must still find these
        try:
            await self._prefill_pass(batch)
        except asyncio.CancelledError:
            self.prefilling = []
            raise
        self.prefilling = []  # after an error they stay here, so _loop reaches their callers

    async def _prefill_pass(self, batch: List[_Req]) -> None:
        lens = [len(r.prompt_words) + r.done for r in batch]
        new = sum(n - r.cached for n, r in zip(lens, batch))
        cached = sum(r.cached for r in batch)
        pairs = sum(default_attn_pairs(n - r.cached, r.cached) for n, r in zip(lens, batch))
        decoding = list(self.running) if self.mixed_chunk else []
        ctx = sum(r.ctx for r in decoding)  # a mixed pass: one more token per running request, reading its context
        dt = self.cost.prefill_time(new + len(decoding), cached + ctx, pairs + ctx)
        await asyncio.sleep(dt)
        m = self.metrics
        m.prefill_passes += 1
        m.prefill_time += dt
        decoded = [r for r in decoding if r in self.running]  # not retracted or finished while the pass ran
        m.generated_tokens += len(decoded)
        self._advance(decoded, 1)
        m.prefill_tokens += new
        m.cached_tokens += cached
        for r in batch:
            if self.cache_on_prefill:
                self.cache.insert(r.prefill_words)
            if r.aborted:
                self._finish(r, "abort")
                continue
            step = 1 if r.target > r.done else 0  # the prefill pass samples the next token
            r.done += step
            m.generated_tokens += step
            if r.done >= r.target:
                self._finish(r)
            else:
                self.running.append(r)

    async def _decode(self) -> None:
        loop = asyncio.get_running_loop()
        self._trim_spec()
        if not self.running:
            return
        batch = len(self.running)
        n = min(r.target - r.done for r in self.running)
        ctx0 = sum(r.ctx for r in self.running)
        steps = self.cost.decode_time(batch, ctx0 + batch * np.arange(n, dtype=float))
        cum = np.cumsum(np.atleast_1d(steps))
        t0 = loop.time()
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), float(cum[-1]))
        except asyncio.TimeoutError:
            pass
        elapsed = loop.time() - t0
        k = int(np.searchsorted(cum, elapsed * (1 + 1e-12), side="right"))  # steps fully done
        if k < n:  # interrupted mid-step: that step still completes
            await asyncio.sleep(max(float(cum[k]) - (loop.time() - t0), 0.0))
            k += 1
        self._account(batch, cum[:k])
        self._advance(list(self.running), k)

    def _advance(self, reqs: List[_Req], k: int) -> None:
        """``k`` more tokens for each running request of ``reqs``; those done leave the batch."""
        for r in reqs:
            r.done += k
            if r.done >= r.target:
                self.running.remove(r)
                self._finish(r)

    def _account(self, batch: int, cum: np.ndarray) -> None:
        if cum.size == 0:
            return
        dt = float(cum[-1])
        m = self.metrics
        m.decode_steps += int(cum.size)
        m.decode_time += dt
        m.batch_time_integral += batch * dt
        m.generated_tokens += batch * int(cum.size)
        m.batch_hist[batch] = m.batch_hist.get(batch, 0.0) + dt
        self.last_step_time = dt / cum.size
