"""``python -m sdnet_trainer.ft.lighthouse``: the lighthouse that keeps the replica groups' quorum.

A thin wrapper around torchft's ``LighthouseServer`` (the same server as torchft's
``torchft_lighthouse`` command): it prints the address the groups pass as
``fault_tolerance.lighthouse`` and serves until SIGINT or SIGTERM. The lighthouse's own times
(docs/fault_tolerance.md): a group that has not sent a heartbeat for ``--heartbeat-timeout-ms``
is dropped from the next quorum; a quorum that lacks a member of the previous one waits up to
``--join-timeout-ms`` for it (all of the previous quorum's live members present: at once).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from sdnet_trainer.ft.checks import require_torchft
from sdnet_trainer.lazy import freeze_imports


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sdnet_trainer.ft.lighthouse", description=__doc__
    )
    parser.add_argument(
        "--bind", default="[::]:29510", help="address:port to listen on (port 0: any free)"
    )
    parser.add_argument("--min-groups", type=int, default=1, help="fewest groups a quorum may hold")
    parser.add_argument("--join-timeout-ms", type=int, default=5000)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
    parser.add_argument("--quorum-tick-ms", type=int, default=100)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_torchft()
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_groups,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    # One write, so that the server's own log lines (its threads write to stderr, often the same
    # file) cannot land between the address and its newline.
    sys.stdout.write(f"lighthouse at {server.address()}\n")
    sys.stdout.flush()
    try:
        while not stop.wait(0.5):  # woken by the signal handlers
            pass
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    freeze_imports()  # a process of its own: see sdnet_trainer/lazy.py
    sys.exit(main())
