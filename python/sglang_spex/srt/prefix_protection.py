"""Live-prefix protection in SGLang's radix cache (hook logic; registered in hooks.py).

When a request of a live ToT search finishes normally, SGLang inserts its tokens into the radix cache. We
then take a tree lock on the node that ends that node's sequence, so the prefix a search may still expand
survives eviction. Locks are keyed ``(search_id, node_path)`` and all of a search's locks go when the search
ends: ``/spex/release`` or ``/spex/cancel``, an abort of one of its primary requests (cancel or client
disconnect), or a lease of ``ttl_s`` without any of its requests in the scheduler (a client-side search whose
client vanished).

Protected tokens are capped at ``max_fraction`` of the KV pool (checked after each lock is taken, so one sequence
cannot overshoot it), and protection never keeps a request out: when a waiting request cannot fit in the KV that
is free or evictable and no running request will free any, the searches protected longest ago lose their locks
until it fits (``yielded``; the need is SGLang's admission charge, prompt and reserved output, see
:func:`sglang_spex.adapters.scheduler.admission_shortfall`). Should that estimate miss a case, a scheduler that has
admitted nothing for :data:`STALL_YIELD_S` while a primary request waits and locks are held releases every search's
locks anyway (``yielded_stall``): protection never holds the scheduler idle longer than that. A search is known by
its rids (``spex:<search>:<path>:``), so any client may have its prefixes protected this way, within the cap; ids
kept for ended searches are bounded in number (:data:`MAX_TRACKED`).
Speculative-only KV is evicted first by SGLang itself: speculative requests carry the lowest priority,
which ``--radix-eviction-policy priority`` stores on the nodes they insert.

One :class:`PrefixProtection` per scheduler, held by its plugin state (``scheduling.state_of``). Under overlap
scheduling a request finishes while the next batch is already launched (its allocation is done); the lock is
taken at the next scheduling point, before that step allocates, as without overlap.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from sglang_spex.adapters import radix_cache as rc
from sglang_spex.adapters import scheduler as sa
from sglang_spex.srt.hook_guard import HookGuard

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 300.0
DEFAULT_MAX_FRACTION = 0.5
ENDED_TTL_S = 120.0  # a late finish of an ended search is not protected again
SWEEP_EVERY_S = 1.0
YIELD_AFTER_S = 1.0  # a waiting request held out this long (past batch boundaries) makes protection give way
STALL_YIELD_S = 5.0  # nothing admitted this long while a primary waits: every search yields, whatever the need
MAX_TRACKED = 4096  # searches kept in ``last_seen`` / ``ended`` at most (the oldest go first)
G_PROTECT = HookGuard("prefix_protect")


@dataclass
class _Lock:
    lock: Any
    tokens: int


@dataclass
class PrefixProtection:
    """Tree locks on the finished nodes of live searches, per search, with leases."""

    ttl_s: float = DEFAULT_TTL_S
    max_fraction: float = DEFAULT_MAX_FRACTION
    locks: Dict[str, Dict[str, _Lock]] = field(default_factory=dict)
    last_seen: Dict[str, float] = field(default_factory=dict)
    ended: Dict[str, float] = field(default_factory=dict)
    pending: List[Tuple[str, str, Any]] = field(default_factory=list)
    counters: Dict[str, int] = field(default_factory=dict)
    last_sweep: float = 0.0
    _stalled_since: Optional[float] = None  # since when requests have waited with nothing admitted (``_stalled``)
    _num_locks: int = 0  # kept with ``locks`` (read by every published step: no walk over all locks)
    _locked_tokens: int = 0

    def bump(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    @property
    def num_locks(self) -> int:
        return self._num_locks

    @property
    def locked_tokens(self) -> int:
        return self._locked_tokens

    def _drop(self, tree_cache: Any, held: _Lock) -> None:
        rc.unlock(tree_cache, held.lock)
        self._num_locks -= 1
        self._locked_tokens -= held.tokens

    def report(self) -> Dict[str, Any]:
        return {
            "searches": len(self.locks),
            "locks": self.num_locks,
            "locked_tokens": self.locked_tokens,
            "pending": len(self.pending),
            "ttl_s": self.ttl_s,
            "max_fraction": self.max_fraction,
            "counters": dict(self.counters),
            "enabled": G_PROTECT.enabled,
        }

    # ------------------------------------------------------------ commands
    def start_search(self, search_id: str) -> None:
        """Register a live search (or renew its lease); protection of its finished nodes starts or resumes."""
        self.ended.pop(search_id, None)
        self._seen(search_id)
        self.locks.setdefault(search_id, {})

    def end_search(self, tree_cache: Any, search_id: str, node_prefix: str = "") -> int:
        """Drop the search's locks (only nodes under ``node_prefix`` if given); returns how many."""
        held = self.locks.get(search_id, {})
        paths = [p for p in held if not node_prefix or p == node_prefix or p.startswith(node_prefix + ".")]
        for p in paths:
            self._drop(tree_cache, held.pop(p))
        if not node_prefix:
            self.locks.pop(search_id, None)
            self.last_seen.pop(search_id, None)
            self.ended[search_id] = time.monotonic() + ENDED_TTL_S
            _bound(self.ended)
            self.pending = [x for x in self.pending if x[0] != search_id]
        self.bump("released", len(paths))
        return len(paths)

    def release_all(self, tree_cache: Any) -> int:
        return sum(self.end_search(tree_cache, s) for s in list(self.locks))

    # ------------------------------------------------------------ hook bodies
    def note_finished(self, req: Any) -> None:
        """A request finished normally and its tokens are in the tree: lock them at the next scheduling point."""
        _, search, node = sa.classify(req)
        if search and search not in self.ended:
            self.pending.append((search, node, req))

    def _protect(self, scheduler: Any, search_id: str, node_path: str, req: Any) -> None:
        tree_cache = scheduler.tree_cache
        cap = self.max_fraction * sa.kv_total(scheduler)
        if rc.protected_size(tree_cache) >= cap:
            self.bump("skipped_cap")
            return
        taken = rc.lock_sequence(tree_cache, req)
        if taken is None:
            self.bump("skipped_uncached")
            return
        if rc.protected_size(tree_cache) > cap:  # this sequence would take protection past the cap
            rc.unlock(tree_cache, taken[0])
            self.bump("skipped_cap")
            return
        held = self.locks.setdefault(search_id, {})
        old = held.pop(node_path, None)
        held[node_path] = new = _Lock(*taken)
        self._num_locks += 1
        self._locked_tokens += new.tokens
        if old is not None:
            self._drop(tree_cache, old)
        self._seen(search_id)
        self.bump("protected")

    def _seen(self, search_id: str) -> None:
        """Renew ``search_id``'s lease. Past :data:`MAX_TRACKED` searches, registered ones that hold no lock are
        forgotten, seen longest ago first (those with locks are bounded by the KV cap)."""
        self.last_seen.pop(search_id, None)  # re-inserted last: the dict stays in order of last sight
        self.last_seen[search_id] = time.monotonic()
        excess = len(self.last_seen) - MAX_TRACKED
        if excess > 0:
            idle = [s for s in self.last_seen if not self.locks.get(s)][:excess]
            for s in idle:
                del self.last_seen[s]
                self.locks.pop(s, None)

    def _stalled(self, scheduler: Any) -> bool:
        """We hold locks, requests wait, and nothing runs, is mid-prefill, or was prefilled last step: a scheduling
        step that admits nothing (only protection or a waiting request's own size can be why)."""
        if not self._num_locks or sa.reqs_view(sa.running_batch(scheduler)) or sa.chunked_req(scheduler) is not None:
            return False
        return bool(sa.waiting(scheduler)) and not sa.scheduled_reqs(None, sa.last_batch(scheduler))

    def _held_out(self, scheduler: Any) -> int:
        """KV tokens the head of the waiting queue (the request SGLang's adder tried first and stopped at) lacks
        for admission while the scheduler is :meth:`_stalled` (0: it fits, or something runs)."""
        if not self._stalled(scheduler):
            return 0
        head = sa.waiting(scheduler)[0]
        return 0 if sa.is_spec(head) else sa.admission_shortfall(scheduler, head)  # never for a speculative one

    def _yield_to_waiting(self, scheduler: Any) -> None:
        """Once the scheduler has been :meth:`_stalled` for :data:`YIELD_AFTER_S`, unlock the searches protected
        longest ago until the waiting request fits (:meth:`_held_out`): protection would hold it until a lease ran
        out. Stalled for :data:`STALL_YIELD_S` with a primary waiting that seems to fit (an admission charge the
        estimate does not model, e.g. the pin SGLang puts on the request's own cached prefix while it checks it), unlock
        every search."""
        if not self._stalled(scheduler):
            self._stalled_since = None
            return
        now = time.monotonic()
        if self._stalled_since is None:
            self._stalled_since = now
        stalled_for = now - self._stalled_since
        if stalled_for < YIELD_AFTER_S:
            return
        if self._held_out(scheduler):
            while self._held_out(scheduler):  # (0 once no lock is left)
                self._end_oldest(scheduler, "yielded")
            self._stalled_since = now
        elif stalled_for >= STALL_YIELD_S and any(not sa.is_spec(r) for r in sa.waiting(scheduler)):
            for search_id in [s for s, held in self.locks.items() if held]:  # the estimate missed why: all yield
                self._end(scheduler, search_id, "yielded_stall")
            self._stalled_since = now

    def _end_oldest(self, scheduler: Any, counter: str) -> None:
        self._end(scheduler, min(self.locks, key=lambda s: self.last_seen.get(s, 0.0)), counter)

    def _end(self, scheduler: Any, search_id: str, counter: str) -> None:
        logger.info("prefix protection yields search %s to a waiting request (%s)", search_id, counter)
        self.end_search(scheduler.tree_cache, search_id)
        self.bump(counter)

    def pre_step(self, scheduler: Any) -> None:
        """Lock queued prefixes; yield protection to a waiting request that could not run otherwise; once a
        second, expire the leases of searches with no request in the scheduler."""
        while self.pending:
            search_id, node_path, req = self.pending.pop(0)
            if search_id not in self.ended:
                self._protect(scheduler, search_id, node_path, req)
        self._yield_to_waiting(scheduler)
        now = time.monotonic()
        if now - self.last_sweep < SWEEP_EVERY_S:
            return
        self.last_sweep = now
        for s, t in list(self.ended.items()):
            if t < now:
                del self.ended[s]
        if not self.locks:
            return
        reqs = sa.waiting(scheduler) + sa.scheduled_reqs(sa.running_batch(scheduler), sa.last_batch(scheduler))
        active = {sa.classify(r)[1] for r in reqs}
        for s in list(self.locks):
            if s in active:
                self._seen(s)
            elif now - self.last_seen.get(s, now) > self.ttl_s:
                self.bump("expired")
                self.end_search(scheduler.tree_cache, s)


def _bound(by_search: Dict[str, float]) -> None:
    """Drop the oldest entries (insertion order) past :data:`MAX_TRACKED`."""
    while len(by_search) > MAX_TRACKED:
        del by_search[next(iter(by_search))]


def _on_release(tree_cache: Any, args: tuple, kwargs: dict) -> None:
    state = sa.attached_state(tree_cache)
    if state is None:
        return  # no scheduling step has run yet, so no search can be live
    method = type(tree_cache).on_release
    req = sa.hook_arg(method, "req", args, kwargs)
    if sa.hook_arg(method, "checkpointed", args, kwargs, None) and req.finished() and not sa.finished_by_abort(req):
        state.protection.note_finished(req)


def h_on_release(result: Any, tree_cache: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER UnifiedRadixCache.on_release: queue a normally finished node of a live search for protection."""
    t0 = time.perf_counter()
    G_PROTECT.run(_on_release, tree_cache, args, kwargs)
    sa.charge_hook_time(tree_cache, t0, "protect_on_release")
    return result


def _pre_step(scheduler: Any) -> None:
    state = sa.attached_state(scheduler)
    if state is not None:
        state.protection.pre_step(scheduler)


def h_pre_step(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Scheduler.get_next_batch_to_run: lock queued prefixes (before any allocation can evict them)
    and expire the leases of searches that have gone quiet."""
    t0 = time.perf_counter()
    G_PROTECT.run(_pre_step, scheduler)
    sa.charge_hook_time(scheduler, t0, "protect_pre_step")
    return None
