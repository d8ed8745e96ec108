"""``python -m sglang_spex search ...`` (one search, :mod:`sglang_spex.cli`) or ``demo`` (:mod:`sglang_spex.demo`)."""

from __future__ import annotations

import sys
from typing import Dict, Optional, Sequence

# each subcommand and its one-line summary (its own -h says more)
COMMANDS: Dict[str, str] = {
    "search": 'one server-side search from the shell: search "question" [--policy P] [--url URL] ...',
    "demo": "make demo: one sampled answer vs a REBASE-8 tree search, then that search without and with SPEX",
}


def usage() -> str:
    """The top-level help: the usage line and one line per subcommand."""
    lines = ["usage: python -m sglang_spex COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<8} {what}" for name, what in COMMANDS.items()]
    lines += ["", "python -m sglang_spex COMMAND -h shows a command's options."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the subcommand; ``-h`` prints :func:`usage` (exit 0), a missing or unknown one is refused (exit 2)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["search"]:
        from sglang_spex import cli

        return cli.main(args[1:])
    if args[:1] == ["demo"]:
        from sglang_spex import demo

        demo.main(args[1:])
        return 0
    if args[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    error = f"unknown command {args[0]!r}" if args else "a command is required"
    print(f"{usage()}\n\nerror: {error}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
