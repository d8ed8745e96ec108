"""Record the signature of every SGLang target in ``sglang_spex.srt.hooks.TOUCH_POINTS`` for the installed SGLang.

Writes ``python/sglang_spex/srt/hook_signatures.json`` (or ``--out``), which ``test/srt/test_hook_contracts.py`` and
``register_all`` compare the installed SGLang against. Run it only when moving to a new SGLang pin, after checking
every changed hook target by hand:

    .venv/bin/python scripts/record_hook_signatures.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import sglang

from sglang_spex.srt.hooks import SIGNATURES_FILE, TOUCH_POINTS, describe, resolve_target


def record() -> dict:
    """``{"sglang_version", "targets": {target: signature}}`` of the installed SGLang; exits 1 if a target is gone."""
    targets, missing = {}, []
    for tp in TOUCH_POINTS:
        try:
            targets[tp.target] = describe(resolve_target(tp.target))
        except Exception as e:
            missing.append(f"{tp.id} {tp.target}: {type(e).__name__}: {e}")
    if missing:
        sys.exit("targets that do not resolve in sglang %s:\n  %s" % (sglang.__version__, "\n  ".join(missing)))
    return {"sglang_version": sglang.__version__, "targets": dict(sorted(targets.items()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=SIGNATURES_FILE)
    args = ap.parse_args()
    data = record()
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(data['targets'])} targets of sglang {data['sglang_version']} -> {args.out}")


if __name__ == "__main__":
    main()
