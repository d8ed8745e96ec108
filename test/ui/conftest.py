"""The /tot/ui browser tests' headless browser: Debian's Chromium (``scripts/setup.sh`` installs it) driven by
Playwright (``third_party/project-requirements.txt``). A missing browser fails these tests, never skips them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"{CHROMIUM} is missing: the /tot/ui browser tests need Debian's chromium "
            "(bash scripts/setup.sh installs it as root: apt-get install -y --no-install-recommends chromium)"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()
