"""Adapters: the only places that touch SGLang internals, one small module per SGLang subsystem.

A version bump of SGLang should only need changes here: ``scheduler`` (requests, batches, finishing,
retraction, the in-flight batch under overlap scheduling), ``radix_cache`` (match, lock, unlock, sizes) and
``spec_workers`` (speculative-decoding workers).
"""
