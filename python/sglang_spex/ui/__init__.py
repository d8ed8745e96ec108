"""The live tree view (``GET /tot/ui``): one static page with its script and style shipped as package data
(``static/``), and the observer that turns a running search into the page's events (``observer.py``)."""

from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).resolve().parent / "static"
ASSETS = {"tree.js": "text/javascript", "tree.css": "text/css"}


def asset_path(name: str) -> Path:
    """The shipped file ``name`` (``index.html`` or one of :data:`ASSETS`); KeyError for anything else."""
    if name != "index.html" and name not in ASSETS:
        raise KeyError(name)
    return STATIC_DIR / name
