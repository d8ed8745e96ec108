"""Live-prefix protection in SGLang's radix cache (hook logic; registered in hooks.py).

When a request of a live ToT search finishes normally, SGLang inserts its tokens into the radix cache. We
then take a tree lock (``UnifiedRadixCache.lock``) on the node that ends that node's sequence, so the
prefix a search may still expand survives eviction. Locks are keyed ``(search_id, node_path)`` and all
of a search's locks go when the search ends: ``/spex/release`` or ``/spex/cancel``, an abort of one of
its primary requests (cancel or client disconnect), or a lease of ``ttl_s`` without any of its
requests in the scheduler (a client-side search whose client vanished).

Protected tokens are capped at ``max_fraction`` of the KV pool so protection can never starve admission.
Speculative-only KV is evicted first by SGLang itself: speculative requests carry the lowest priority,
which ``--radix-eviction-policy priority`` stores on the nodes they insert.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from sglang_spex.srt.hook_guard import HookGuard

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 300.0
DEFAULT_MAX_FRACTION = 0.5
ENDED_TTL_S = 120.0  # a late finish of an ended search is not protected again
SWEEP_EVERY_S = 1.0


@dataclass
class _Lock:
    lock: Any
    tokens: int


@dataclass
class PrefixGuard:
    ttl_s: float = DEFAULT_TTL_S
    max_fraction: float = DEFAULT_MAX_FRACTION
    locks: Dict[str, Dict[str, _Lock]] = field(default_factory=dict)
    last_seen: Dict[str, float] = field(default_factory=dict)
    ended: Dict[str, float] = field(default_factory=dict)
    pending: List[Tuple[str, str, Any]] = field(default_factory=list)
    counters: Dict[str, int] = field(default_factory=dict)
    _last_sweep: float = 0.0

    def bump(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    @property
    def num_locks(self) -> int:
        return sum(len(v) for v in self.locks.values())

    @property
    def locked_tokens(self) -> int:
        return sum(x.tokens for v in self.locks.values() for x in v.values())

    def report(self) -> Dict[str, Any]:
        return {
            "searches": len(self.locks),
            "locks": self.num_locks,
            "locked_tokens": self.locked_tokens,
            "pending": len(self.pending),
            "ttl_s": self.ttl_s,
            "max_fraction": self.max_fraction,
            "counters": dict(self.counters),
        }

    # ------------------------------------------------------------ commands
    def start_search(self, search_id: str) -> None:
        """Register a live search (or renew its lease); protection of its finished nodes starts or resumes."""
        self.ended.pop(search_id, None)
        self.last_seen[search_id] = time.monotonic()
        self.locks.setdefault(search_id, {})

    def end_search(self, tree_cache, search_id: str, node_prefix: str = "") -> int:
        """Drop the search's locks (only nodes under ``node_prefix`` if given); returns how many."""
        held = self.locks.get(search_id, {})
        paths = [p for p in held if not node_prefix or p == node_prefix or p.startswith(node_prefix + ".")]
        for p in paths:
            tree_cache.unlock(held.pop(p).lock)
        if not node_prefix:
            self.locks.pop(search_id, None)
            self.last_seen.pop(search_id, None)
            self.ended[search_id] = time.monotonic() + ENDED_TTL_S
            self.pending = [x for x in self.pending if x[0] != search_id]
        self.bump("released", len(paths))
        return len(paths)

    def release_all(self, tree_cache) -> int:
        return sum(self.end_search(tree_cache, s) for s in list(self.locks))

    # ------------------------------------------------------------ hook bodies
    def note_finished(self, req, search_id: str, node_path: str) -> None:
        if search_id in self.ended:
            return
        self.pending.append((search_id, node_path, req))

    def _protect(self, scheduler, search_id: str, node_path: str, req) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.common import _req_radix_key

        tree_cache = scheduler.tree_cache
        if tree_cache.protected_size() >= self.max_fraction * scheduler.max_total_num_tokens:
            self.bump("skipped_cap")
            return
        tokens = req.origin_input_ids + req.output_ids
        match = tree_cache.match_prefix(MatchPrefixParams(key=_req_radix_key(tree_cache, req, tokens)))
        if match.device_prefix_len <= 0 or tree_cache.is_root(match.last_device_node):
            self.bump("skipped_uncached")
            return
        held = self.locks.setdefault(search_id, {})
        old = held.pop(node_path, None)
        held[node_path] = _Lock(tree_cache.lock(match.last_device_node), int(match.device_prefix_len))
        if old is not None:
            tree_cache.unlock(old.lock)
        self.last_seen[search_id] = time.monotonic()
        self.bump("protected")

    def pre_step(self, scheduler) -> None:
        tree_cache = scheduler.tree_cache
        while self.pending:
            search_id, node_path, req = self.pending.pop(0)
            if search_id not in self.ended:
                self._protect(scheduler, search_id, node_path, req)
        now = time.monotonic()
        if now - self._last_sweep < SWEEP_EVERY_S:
            return
        self._last_sweep = now
        for s, t in list(self.ended.items()):
            if t < now:
                del self.ended[s]
        if not self.locks:
            return
        from sglang_spex.srt.scheduling import classify

        active = {classify(r)[1] for r in scheduler.waiting_queue}
        for batch in (scheduler.running_batch, scheduler.last_batch):
            if batch is not None:
                active.update(classify(r)[1] for r in batch.reqs)
        for s in list(self.locks):
            if s in active:
                self.last_seen[s] = now
            elif now - self.last_seen.get(s, now) > self.ttl_s:
                self.bump("expired")
                self.end_search(tree_cache, s)


GUARD = PrefixGuard()
G_PROTECT = HookGuard("prefix_protect")


def h_on_release(result, tree_cache, req, *args, checkpointed: bool = False, **kwargs):
    """AFTER UnifiedRadixCache.on_release: queue a normally finished node of a live search for protection."""

    def note():
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        if not checkpointed or not req.finished() or isinstance(req.finished_reason, FINISH_ABORT):
            return
        from sglang_spex.srt.scheduling import classify

        _, search, node = classify(req)
        if search:
            GUARD.note_finished(req, search, node)

    G_PROTECT.run(note)
    return result


def h_pre_step(scheduler, *args, **kwargs):
    """BEFORE Scheduler.get_next_batch_to_run: lock queued prefixes (before any allocation can evict them)
    and expire the leases of searches that have gone quiet."""
    G_PROTECT.run(GUARD.pre_step, scheduler)
    return None


def protect_report(scheduler: Optional[Any] = None) -> Dict[str, Any]:
    out = GUARD.report()
    out["enabled"] = G_PROTECT.enabled
    return out
