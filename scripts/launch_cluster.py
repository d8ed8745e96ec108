"""N sglang-spex servers behind sglang-router, one command (CPU or GPU); Ctrl-C stops everything.

    .venv/bin/python scripts/launch_cluster.py                          # 2 × SmolLM2 (CPU: one core range each)
    .venv/bin/python scripts/launch_cluster.py --servers 2 --policy manual --port 30000 -- \
        --model-path M --tot-speculation                                # anything after -- goes to every server

Searches then run client-side against the router URL it prints (``HttpPort(url)``, ``tot.Endpoint(url,
server_side=False)``, ``python examples/rebase_search.py --url URL --client-side``): each search's requests carry
``X-SMG-Routing-Key: <search id>`` and the ``manual`` policy keeps them on one worker. See docs/scale.md.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import List, Optional, Sequence

from sglang_spex.config import ConfigError
from sglang_spex.scale.cluster import Cluster
from sglang_spex.scale.router import ASSIGNMENT_MODES, POLICIES


def _at_least_one(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: expected an integer >= 1")
    return n


def parse(argv: Sequence[str]) -> argparse.Namespace:
    ours, server_args = (list(argv), [])
    if "--" in ours:
        i = ours.index("--")
        ours, server_args = ours[:i], ours[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", type=_at_least_one, default=2, help="how many servers (default 2)")
    p.add_argument("--policy", choices=POLICIES, default="manual", help="router policy (default manual: affinity)")
    p.add_argument(
        "--assignment-mode",
        choices=ASSIGNMENT_MODES,
        default="min_load",
        help="manual policy: which worker a new routing key goes to",
    )
    p.add_argument("--port", type=int, default=30000, help="the router's port (default 30000)")
    p.add_argument("--no-bind", action="store_true", help="do not give each CPU server its own core range")
    args = p.parse_args(ours)
    args.server_args = server_args
    return args


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: Optional[List[str]] = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    cluster = Cluster(
        args.server_args,
        n=args.servers,
        policy=args.policy,
        assignment_mode=args.assignment_mode,
        bind=not args.no_bind,
        router_port=args.port,
    )
    signal.signal(signal.SIGTERM, _interrupt)  # from here on, as Ctrl-C: a start under way stops what it started
    print(f"starting {args.servers} servers and the router ...", flush=True)
    try:
        with cluster:
            for srv in cluster.servers:
                print(f"worker {srv.url}  (log {srv.log_path})")
            print(f"router {cluster.url}  policy {args.policy}  (log {cluster.router.log_path})", flush=True)
            while True:
                time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    except ConfigError as e:
        print(f"launch_cluster.py: error: --servers {args.servers}: {e}", file=sys.stderr)
        sys.exit(2)  # as argparse's errors
    print("stopped")


if __name__ == "__main__":
    main()
