"""``python -m sglang_spex search ...`` (one search, :mod:`sglang_spex.cli`) or ``demo`` (:mod:`sglang_spex.demo`)."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = 'usage: python -m sglang_spex {search "question" [--policy P] [--url URL] ... | demo [...]} (-h for help)'


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["search"]:
        from sglang_spex import cli

        return cli.main(args[1:])
    if args[:1] == ["demo"]:
        from sglang_spex import demo

        demo.main(args[1:])
        return 0
    print(USAGE, file=sys.stderr)
    return 0 if args[:1] in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
