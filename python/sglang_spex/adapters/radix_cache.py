"""SGLang radix-cache internals used by live-prefix protection (SGLang 0.5.23, ``UnifiedRadixCache``).

Matching a finished request's tokens, taking and dropping a tree lock (``lock`` / ``unlock``, the same
lock a running request holds on its prefix), and the cache's sizes.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.common import _req_radix_key


def lock_sequence(tree_cache: Any, req: Any) -> Optional[Tuple[Any, int]]:
    """Lock the tree node that ends the cached part of ``req``'s tokens (prompt + output).

    Returns (lock, locked tokens), or None when nothing of it is cached."""
    tokens = req.origin_input_ids + req.output_ids
    match = tree_cache.match_prefix(MatchPrefixParams(key=_req_radix_key(tree_cache, req, tokens)))
    if match.device_prefix_len <= 0 or tree_cache.is_root(match.last_device_node):
        return None
    return tree_cache.lock(match.last_device_node), int(match.device_prefix_len)


def unlock(tree_cache: Any, lock: Any) -> None:
    tree_cache.unlock(lock)


def protected_size(tree_cache: Any) -> int:
    """Tokens the tree holds locked (running requests' prefixes and our protection)."""
    return int(tree_cache.protected_size())


def evictable_size(tree_cache: Any) -> int:
    return int(tree_cache.evictable_size())
