"""H6's preemption for a primary (``adapters.scheduler.preempt_for``) on SGLang's own radix tree and ``Req``.

A primary short of KV had its prefix matched before H6 preempted speculative requests for it. Releasing them can
change the tree: here the primary's matched node is evicted. SGLang's retry of ``add_one_req`` then locks
``req.last_node``; a stale node id raised ``KeyError`` in ``inc_lock_ref`` and killed the scheduler (CI, session
24). ``preempt_for`` matches the prefix again after a preemption (P22), as SGLang's admission loop does.

The tree, its allocator and the request are SGLang's; only the adder stands in: its ``preempt_to_schedule`` evicts
what the primary matched, as releasing KV under pressure can.
"""

from __future__ import annotations

from array import array
from typing import Any, List

import pytest
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_spex.adapters.scheduler import preempt_for

PREFIX = list(range(1, 11))


class _Adder:
    """The two members of SGLang's ``PrefillAdder`` that ``preempt_for`` uses."""

    def __init__(self, tree_cache: Any, frees: bool):
        self.tree_cache, self.frees = tree_cache, frees
        self.calls: List[Any] = []

    def preempt_to_schedule(self, req: Any) -> bool:
        self.calls.append(req)
        if self.frees:
            self.tree_cache.evict(EvictParams(num_tokens=len(PREFIX)))
        return self.frees


def _tree_and_primary():
    alloc = TokenToKVPoolAllocator(64, torch.float32, "cpu", None, False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=alloc,
        page_size=1,
        tree_components=(ComponentType.FULL,),
    )
    tree = UnifiedRadixCache(params)
    tree.insert(InsertParams(key=RadixKey(array("q", PREFIX)), value=alloc.alloc(len(PREFIX))))
    req = Req("spex:q0:r:", "", array("q", PREFIX + [11, 12]), SamplingParams(max_new_tokens=4))
    req.init_next_round_input(tree)  # SGLang's admission: the prefix match before add_one_req
    assert req.prefix_len == len(PREFIX)
    return tree, req


def test_a_preemption_that_evicts_the_matched_prefix_leaves_a_lockable_node():
    tree, req = _tree_and_primary()
    stale = req.last_node
    adder = _Adder(tree, frees=True)
    assert preempt_for(adder, req) and adder.calls == [req]
    with pytest.raises(KeyError):  # what SGLang's retry locked before P22: the node is gone
        tree.inc_lock_ref(stale)
    assert req.last_node != stale and req.prefix_len == 0  # matched again, on the tree as it is now
    tree.dec_lock_ref(req.last_node, tree.inc_lock_ref(req.last_node).to_dec_params())  # the retry's lock holds


def test_no_preemption_keeps_the_match():
    tree, req = _tree_and_primary()
    node = req.last_node
    assert not preempt_for(_Adder(tree, frees=False), req)
    assert req.last_node == node and req.prefix_len == len(PREFIX)
    tree.dec_lock_ref(node, tree.inc_lock_ref(node).to_dec_params())
