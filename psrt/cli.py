"""The ``psrt`` command line: ``psrt server`` runs a shard; ``psrt demo`` trains a model on a local cluster."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Optional, Sequence

from psrt.config import MODES, ServerConfig
from psrt.errors import PsrtError

__all__ = ["main"]


def _server(args: argparse.Namespace) -> int:
    from psrt.server import Server

    config = ServerConfig(bind=args.bind, num_workers=args.workers, mode=args.mode, nonfinite=args.nonfinite)
    server = Server(config)

    def _stop(signum: int, frame: object) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # One machine-readable line: launchers and tests read the bound endpoint from it.
    print(f"psrt-server ready endpoint={server.endpoint} mode={config.mode} workers={config.num_workers}",
          flush=True)
    try:
        server.serve()
    finally:
        stats = server.stats()
        server.close()
        print(f"psrt-server stopped endpoint={stats['endpoint']} pushes={stats['pushes']} pulls={stats['pulls']} "
              f"rounds={stats['rounds']} errors={stats['errors']}", flush=True)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from psrt.examples import digits

    return digits.run_local(
        servers=args.servers, workers=args.workers, mode=args.mode, epochs=args.epochs, lr=args.lr,
        batch=args.batch, seed=args.seed,
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``psrt`` command."""
    parser = argparse.ArgumentParser(prog="psrt", description="psrt: a parameter-server runtime on ZeroMQ")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("server", help="run one shard server")
    s.add_argument("--bind", default="tcp://127.0.0.1:5701",
                   help="ZeroMQ endpoint to bind; tcp://HOST:* picks a free port (default %(default)s)")
    s.add_argument("--workers", type=int, default=ServerConfig().num_workers,
                   help="W: pushes that complete a sync round (default: $PSRT_NUM_WORKERS or 1)")
    s.add_argument("--mode", choices=MODES, default=ServerConfig().mode,
                   help="sync (BSP) or async (default: $PSRT_MODE or sync)")
    s.add_argument("--nonfinite", choices=("reject", "allow"), default=ServerConfig().nonfinite,
                   help="what to do with NaN/Inf gradients (default: reject)")
    s.set_defaults(func=_server)

    d = sub.add_parser("demo", help="train a classifier on scikit-learn's digits with local shards and workers")
    d.add_argument("-s", "--servers", type=int, default=2, help="number of shard servers (default %(default)s)")
    d.add_argument("-w", "--workers", type=int, default=2, help="number of worker processes (default %(default)s)")
    d.add_argument("--mode", choices=MODES, default="sync", help="update mode (default %(default)s)")
    d.add_argument("--epochs", type=int, default=30, help="training epochs (default %(default)s)")
    d.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default %(default)s)")
    d.add_argument("--batch", type=int, default=32, help="per-worker batch size (default %(default)s)")
    d.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    d.set_defaults(func=_demo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``psrt`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except PsrtError as exc:
        print(f"psrt: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
