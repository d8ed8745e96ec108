"""The vote key of an answer: one rule for the final vote (:func:`~sglang_spex.tot.answers.aggregate`), T3's
tally (:mod:`sglang_spex.speculation.early_stop`) and the tree view's answers table (``vote_key`` of a node)."""

from __future__ import annotations

import re


def normalize(ans: str) -> str:
    """Vote key: numbers by value (``"1,000.0"`` → ``"1000"``), other strings lower-cased without spaces."""
    s = ans.strip().replace(",", "")
    try:
        v = float(s)
        return str(int(v)) if v.is_integer() else repr(v)
    except ValueError:
        return re.sub(r"\s+", "", ans).lower()
