"""N sglang-spex servers behind sglang-router, one command (CPU or GPU); Ctrl-C stops everything.

On GPUs each server gets its own GPUs (``CUDA_VISIBLE_DEVICES``: tp x pp x dp of them, read from the server args;
more with ``--base-gpu-id`` / ``--gpu-id-step``); on CPU its own core range. The servers and the router listen on
127.0.0.1 only. Refused in one line (exit 2) before any server starts, each naming the flag at fault: a missing
sglang-router, a bad or taken ``--port``, after ``--`` a ``--host`` or ``--port`` (each server gets a free port) or
a bad tp/pp/dp size, ``--base-gpu-id`` or ``--gpu-id-step``, and too few GPUs or cores (``--servers``). Ctrl-C,
SIGTERM, SIGHUP and SIGQUIT stop every server and the router (a second one does not cut that short); the children
also get SIGTERM if this process is killed outright. When the router or a server exits on its own, the rest is
stopped too and this exits 1 (naming what died and its log).

    .venv/bin/python scripts/launch_cluster.py                          # 2 × SmolLM2 (CPU: one core range each)
    .venv/bin/python scripts/launch_cluster.py --servers 2 --policy manual --port 30000 -- \
        --model-path M --tot-speculation                                # what follows -- goes to every server

Searches then run client-side against the router URL it prints (``HttpPort(url)``, ``tot.Endpoint(url,
server_side=False)``, ``python examples/rebase_search.py --url URL --client-side``): each search's requests carry
``X-SMG-Routing-Key: <search id>`` and the ``manual`` policy keeps them on one worker. See docs/scale.md.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import List, NoReturn, Optional, Sequence

from sglang_spex.config import ConfigError
from sglang_spex.flags import count_flag
from sglang_spex.scale.cluster import Cluster, check_server_args
from sglang_spex.scale.router import ASSIGNMENT_MODES, POLICIES, check_router, check_router_installed
from sglang_spex.serve import STOP_SIGNALS


def _port(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port number (1-65535)") from None
    if not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n}: expected a port number (1-65535)")
    return n


def _positive_seconds(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds > 0") from None
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: expected a number of seconds > 0")
    return x


def parse(argv: Sequence[str]) -> argparse.Namespace:
    ours, server_args = (list(argv), [])
    if "--" in ours:
        i = ours.index("--")
        ours, server_args = ours[:i], ours[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", type=count_flag, default=2, help="how many servers (default 2)")
    p.add_argument("--policy", choices=POLICIES, default="manual", help="router policy (default manual: affinity)")
    p.add_argument(
        "--assignment-mode",
        choices=ASSIGNMENT_MODES,
        default="min_load",
        help="manual policy: which worker a new routing key goes to",
    )
    p.add_argument("--port", type=_port, default=30000, help="the router's port (default 30000)")
    p.add_argument("--no-bind", action="store_true", help="do not give each CPU server its own core range")
    p.add_argument(
        "--startup-timeout",
        type=_positive_seconds,
        default=600.0,
        help="seconds each server may take to load and answer /health_generate (default 600; large models need more)",
    )
    args = p.parse_args(ours)
    args.server_args = server_args
    return args


def _interrupt(*_: object) -> None:
    for sig in STOP_SIGNALS:  # the first one stops the cluster; later ones must not cut that short
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def _refuse(message: str) -> NoReturn:
    print(f"launch_cluster.py: error: {message}", file=sys.stderr)
    sys.exit(2)  # as argparse's errors


def main(argv: Optional[List[str]] = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    cluster = Cluster(
        args.server_args,
        n=args.servers,
        policy=args.policy,
        assignment_mode=args.assignment_mode,
        bind=not args.no_bind,
        router_port=args.port,
        startup_timeout=args.startup_timeout,
    )
    # before any server starts (they take minutes to load on GPUs), each refusal naming what is wrong
    try:
        check_router_installed()
    except ConfigError as e:
        _refuse(str(e))
    try:
        check_router(args.port)
    except ConfigError as e:
        _refuse(f"--port {args.port}: {e}")
    try:
        check_server_args(args.server_args)
    except ConfigError as e:  # it names the server's flag
        _refuse(f"after --: {e}")
    try:
        cluster.plan()
    except ConfigError as e:
        _refuse(f"--servers {args.servers}: {e}")
    # from here on each is as Ctrl-C (set explicitly: a launcher started in the background inherits SIGINT
    # ignored): a start under way stops what it started, a running cluster stops
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupt)
    print(f"starting {args.servers} servers and the router ...", flush=True)
    try:
        with cluster:
            for srv in cluster.servers:
                print(f"worker {srv.url}  (log {srv.log_path})")
            print(f"router {cluster.url}  policy {args.policy}  (log {cluster.router.log_path})", flush=True)
            gone = cluster.exited()
            while not gone:
                time.sleep(1.0)
                gone = cluster.exited()
            # a dead router or worker: the cluster would serve errors; stop it all
            print(f"launch_cluster.py: {', '.join(gone)} exited on its own: stopping the cluster", file=sys.stderr)
            status = 1
    except KeyboardInterrupt:
        status = 0
    except (RuntimeError, TimeoutError) as e:  # a server exited or was not ready in time: its log tail, no traceback
        print(f"launch_cluster.py: {e}", file=sys.stderr)
        status = 1
    print("stopped")  # Cluster.stop returned: every server and the router have exited
    sys.exit(status)


if __name__ == "__main__":
    main()
