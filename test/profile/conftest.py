"""Fixtures of the profile tests."""

from __future__ import annotations

import pytest
from fake_engine import Clock

from sglang_spex.profile import cache, measure


@pytest.fixture
def clock(monkeypatch, tmp_path) -> Clock:
    """A virtual clock as the profiler's ``time`` (see ``fake_engine.Engine``); profiles cached under ``tmp_path``."""
    monkeypatch.setattr(cache, "CACHE_DIR", tmp_path)
    c = Clock()
    monkeypatch.setattr(measure, "time", c)
    return c
