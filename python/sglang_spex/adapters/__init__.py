"""Adapters: readers and small operations on SGLang's objects that the scheduler hooks share, one module per
SGLang subsystem: ``scheduler`` (requests, batches, finishing, retraction, the in-flight batch under overlap
scheduling), ``radix_cache`` (match, lock, unlock, sizes) and ``spec_workers`` (speculative-decoding workers).

They are not the only code that reaches SGLang: the hooks and routes under ``srt/`` (and ``respec/hotswap.py``)
import SGLang types and patch its methods, each touch point listed in ``srt/hooks.py`` and ``docs/upstream.md``
and checked against the installed SGLang by ``test/srt/test_hook_contracts.py``.
"""
