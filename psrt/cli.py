"""The ``psrt`` command line.

``psrt scheduler``   the job's control plane
``psrt server``      one shard (standalone with ``--bind``, or joining a job with ``--scheduler``)
``psrt launch``      a whole job on this machine: scheduler, S servers, W copies of a command
``psrt run``         become scheduler, server or worker as the environment says (srun, mpirun, Kubernetes)
``psrt stats``       a live per-shard table of a running job
``psrt keygen``      write a job's CURVE keys (``--keys DIR`` / ``PSRT_KEYS=DIR`` turn them on)
``psrt worker``      a synthetic load-test worker
``psrt model``       the performance model's predictions, extrapolated to thousands of workers
``psrt demo``        train a classifier on scikit-learn's digits on a local job
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from typing import Optional, Sequence
from urllib.parse import urlsplit

from psrt.config import MODES, ClusterConfig, ServerConfig
from psrt.errors import ConfigError, PsrtError

__all__ = ["main", "build_parser"]


def _host_towards(endpoint: str) -> str:
    """The local address that reaches ``endpoint``'s host (loopback stays loopback); no packet is sent."""
    host = urlsplit(endpoint).hostname or "127.0.0.1"
    try:
        addr = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except OSError:
        raise ConfigError(f"cannot resolve the scheduler host {host!r}") from None
    if ipaddress.ip_address(addr).is_loopback:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))  # UDP connect only picks a route and a source address
        return s.getsockname()[0]


def _on_signals(stop) -> None:
    def handler(signum: int, frame: object) -> None:
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _server(args: argparse.Namespace) -> int:
    from psrt.memory import tune_allocator
    from psrt.scheduler import SchedulerLink
    from psrt.server import Server

    tune_allocator()
    link = None
    if args.scheduler:
        host = args.host or _host_towards(args.scheduler)
        config = ServerConfig(bind=args.bind or f"tcp://{host}:*", nonfinite=args.nonfinite, keys=args.keys)
    else:
        config = ServerConfig(bind=args.bind or "tcp://127.0.0.1:5701", num_workers=args.workers, mode=args.mode,
                              nonfinite=args.nonfinite, keys=args.keys)
    server = Server(config)
    _on_signals(server.stop)
    metrics = None
    try:
        if args.scheduler:
            announce = server.endpoint.replace("0.0.0.0", host) if server.endpoint.startswith("tcp://") \
                else server.endpoint
            cluster = ClusterConfig.from_env()
            link = SchedulerLink(server.context, args.scheduler, heartbeat_interval=cluster.heartbeat_interval,
                                 heartbeat_timeout=cluster.heartbeat_timeout, keys=config.keys)
            timeout = cluster.start_timeout + 10.0
            table = link.register("server", endpoint=announce, host=host, timeout=timeout)
            server.set_job(table.num_workers, table.mode)
        if args.metrics_port is not None:
            from psrt.metrics import serve_metrics

            metrics = serve_metrics(server, args.metrics_port, args.metrics_host)
        # One machine-readable line: launchers and tests read the bound endpoint from it.
        print(f"psrt-server ready endpoint={server.endpoint} mode={server.config.mode} "
              f"workers={server.config.num_workers}" + (f" rank={link.rank}" if link else ""), flush=True)
        server.serve(control=link)
    finally:
        stats = server.stats()
        if metrics is not None:
            metrics.shutdown()
        if link is not None:
            link.close()
        server.close()
        print(f"psrt-server stopped endpoint={stats['endpoint']} pushes={stats['pushes']} pulls={stats['pulls']} "
              f"rounds={stats['rounds']} errors={stats['errors']}", flush=True)
    return 0


def _scheduler(args: argparse.Namespace) -> int:
    from psrt.scheduler import Scheduler

    sched = Scheduler(args.bind, args.servers, args.workers, args.mode, start_timeout=args.timeout,
                      heartbeat_timeout=ClusterConfig.from_env().heartbeat_timeout, keys=args.keys)
    _on_signals(sched.stop)
    print(f"psrt-scheduler ready endpoint={sched.endpoint} servers={args.servers} workers={args.workers} "
          f"mode={args.mode}", flush=True)
    code = sched.serve()
    print(f"psrt-scheduler stopped code={code}", flush=True)
    return code


def _launch(args: argparse.Namespace) -> int:
    from psrt.launch import launch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return launch(args.servers, args.workers, command, mode=args.mode, host=args.host, start_timeout=args.timeout,
                  transport=args.transport, secure=args.secure)


def _keygen(args: argparse.Namespace) -> int:
    from psrt.security import KEY_FILES, keygen

    keys = keygen(args.directory)
    names = ", ".join(n for pair in KEY_FILES.values() for n in pair)
    print(f"psrt keygen: wrote {names} in {keys.directory}; give every process of the job "
          f"PSRT_KEYS={keys.directory} (or --keys); hosts that run only workers need server.key and the client "
          "pair", flush=True)
    return 0


def _run(args: argparse.Namespace) -> int:
    from psrt.launch import run_role

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return run_role(command)


def _stats(args: argparse.Namespace) -> int:
    from psrt.stats import watch

    return watch(args.scheduler, interval=args.interval, count=args.count)


def _worker(args: argparse.Namespace) -> int:
    from psrt.worker import run_worker

    servers = args.servers.split(",") if args.servers else None
    run_worker(args.model, args.compute_ms, args.steps, warmup=args.warmup, compute=args.compute, servers=servers,
               rank=args.rank, num_workers=args.workers, lr=args.lr)
    return 0


def _model(args: argparse.Namespace) -> int:
    from psrt import perfmodel
    from psrt.models import model_tensors
    from psrt.netns import parse_rate

    cal = perfmodel.calibrate() if args.calibrate else perfmodel.Calibration(
        agg_bytes_per_s=args.agg_rate, msg_overhead_s=args.msg_overhead_us * 1e-6, rtt_s=args.rtt_us * 1e-6)
    if args.reply_tail is not None:
        if not 0 <= args.reply_tail <= 1:
            raise ConfigError(f"--reply-tail must be in [0, 1], got {args.reply_tail}")
        cal = dataclasses.replace(cal, contended_tail=args.reply_tail)
    tensors = model_tensors(args.model, args.partition_bytes)
    link = parse_rate(args.link)
    server_link = parse_rate(args.server_link) if args.server_link else link
    print(f"model {args.model}: {4 * sum(__import__('math').prod(s) for _, s in tensors) / 1e6:.1f} MB in "
          f"{len(tensors)} tensors; links: worker {args.link}, server {args.server_link or args.link}; compute "
          f"{args.compute_ms:g} ms; {args.mode}")
    print(f"calibration: aggregation {cal.agg_bytes_per_s / 1e9:.2f} GB/s, message overhead "
          f"{cal.msg_overhead_s * 1e6:.0f} us, round trip {cal.rtt_s * 1e6:.0f} us")
    for servers in args.servers:
        base = perfmodel.scenario_for(1, servers, tensors, link, args.compute_ms / 1000, args.mode,
                                      args.partition_bytes, server_link)
        knee, plateau = perfmodel.saturation_point(base, cal)
        print(f"\nS={servers}: busiest shard holds {base.shard_bytes / 1e6:.2f} MB; the shards' links saturate "
              f"at W ~ {knee:.1f}; throughput plateau {plateau:.1f} worker-steps/s")
        print(f"{'W':>8} {'step ms':>10} {'worker-steps/s':>15} {'per worker':>11}  bottleneck")
        for workers in args.workers:
            sc = perfmodel.scenario_for(workers, servers, tensors, link, args.compute_ms / 1000, args.mode,
                                        args.partition_bytes, server_link)
            p = perfmodel.predict(sc, cal)
            print(f"{workers:>8} {p.step_s * 1000:>10.1f} {p.steps_per_s:>15.1f} {p.steps_per_s / workers:>11.2f}"
                  f"  {p.bottleneck}")
    return 0


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("values must be positive integers")
    return values


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
    defaults = ServerConfig()

    s = sub.add_parser("server", help="run one shard server")
    s.add_argument("--bind", default=None,
                   help="ZeroMQ endpoint to bind; tcp://HOST:* picks a free port (default tcp://127.0.0.1:5701, "
                        "or an ephemeral port on --host with --scheduler)")
    s.add_argument("--scheduler", default=None, help="join the job of the scheduler at tcp://HOST:PORT")
    s.add_argument("--host", default=None,
                   help="with --scheduler: the address to bind and announce (default: $PSRT_NODE_HOST, or the "
                        "local address that reaches the scheduler)")
    s.add_argument("--workers", type=int, default=defaults.num_workers,
                   help="W: pushes that complete a sync round (default: $PSRT_NUM_WORKERS or 1; from the "
                        "scheduler with --scheduler)")
    s.add_argument("--mode", choices=MODES, default=defaults.mode,
                   help="sync (BSP) or async (default: $PSRT_MODE or sync; from the scheduler with --scheduler)")
    s.add_argument("--nonfinite", choices=("reject", "allow"), default=defaults.nonfinite,
                   help="what to do with NaN/Inf gradients (default: reject)")
    s.add_argument("--keys", default=defaults.keys, metavar="DIR",
                   help="the job's key directory (psrt keygen): CURVE on every socket, only the job's client key "
                        "accepted (default: $PSRT_KEYS; empty: off)")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (needs prometheus_client)")
    s.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    s.set_defaults(func=_server)

    c = sub.add_parser("scheduler", help="run the job's scheduler")
    env = ClusterConfig.from_env()
    c.add_argument("--bind", default="tcp://127.0.0.1:5700", help="endpoint to bind (default %(default)s)")
    c.add_argument("--servers", type=int, default=env.num_servers or 1, help="S (default: $PSRT_NUM_SERVERS or 1)")
    c.add_argument("--workers", type=int, default=env.num_workers or 1, help="W (default: $PSRT_NUM_WORKERS or 1)")
    c.add_argument("--mode", choices=MODES, default=env.mode, help="sync or async (default: $PSRT_MODE or sync)")
    c.add_argument("--timeout", type=float, default=env.start_timeout,
                   help="seconds for everyone to register and for each barrier (default: $PSRT_START_TIMEOUT or 120)")
    c.add_argument("--keys", default=env.keys, metavar="DIR",
                   help="the job's key directory (psrt keygen): CURVE, only the job's client key accepted "
                        "(default: $PSRT_KEYS; empty: off)")
    c.set_defaults(func=_scheduler)

    la = sub.add_parser("launch", help="run a scheduler, S servers and W copies of CMD on this machine")
    la.add_argument("-s", "--servers", type=int, required=True, help="number of servers S")
    la.add_argument("-w", "--workers", type=int, required=True, help="number of workers W")
    la.add_argument("--mode", choices=MODES, default="sync", help="sync or async (default %(default)s)")
    la.add_argument("--host", default="127.0.0.1", help="address to bind on (default %(default)s)")
    la.add_argument("--timeout", type=float, default=60.0, help="seconds for the job to form (default %(default)s)")
    la.add_argument("--transport", choices=("auto", "tcp", "ipc"), default="auto",
                    help="worker-to-shard transport: ipc (Unix sockets) or tcp; auto: ipc on loopback "
                         "(default %(default)s)")
    la.add_argument("--secure", action="store_true",
                    help="make a private key directory for this job, hand it to every process by PSRT_KEYS "
                         "(CURVE on every socket), and remove it at the end")
    la.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS: the worker program")
    la.set_defaults(func=_launch)

    r = sub.add_parser("run", help="become scheduler, server or worker (running CMD) as the environment says")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS: the worker program")
    r.set_defaults(func=_run)

    st = sub.add_parser("stats", help="print a live per-shard table of a running job")
    st.add_argument("scheduler", help="the scheduler's endpoint, tcp://HOST:PORT")
    st.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default %(default)s)")
    st.add_argument("--count", type=int, default=0, help="stop after this many tables (default: until Ctrl-C)")
    st.set_defaults(func=_stats)

    kg = sub.add_parser("keygen", help="write a job's CURVE keys: a server pair and a client pair")
    kg.add_argument("directory", help="where to write them (created 0700; must not hold keys already)")
    kg.set_defaults(func=_keygen)

    wk = sub.add_parser("worker", help="a synthetic load-test worker reporting its steps/s")
    wk.add_argument("--model", required=True,
                    help="model size (e.g. 4MB, 100MiB) or a shipped network: resnet50, vgg16, bert-base")
    wk.add_argument("--compute-ms", type=float, default=0.0, help="emulated compute per step (default 0)")
    wk.add_argument("--steps", type=int, default=20, help="timed steps (default %(default)s)")
    wk.add_argument("--warmup", type=int, default=2, help="untimed steps first (default %(default)s)")
    wk.add_argument("--compute", choices=("sleep", "numpy"), default="sleep",
                    help="emulate compute by sleeping or with real NumPy work (default %(default)s)")
    wk.add_argument("--servers", default=None,
                    help="comma-separated shard endpoints (default: find them through the scheduler)")
    wk.add_argument("--rank", type=int, default=None, help="worker rank (with --servers, or requested)")
    wk.add_argument("--workers", type=int, default=None, help="W (with --servers)")
    wk.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate (default %(default)s)")
    wk.set_defaults(func=_worker)

    mo = sub.add_parser("model", help="predict step time and throughput with the performance model")
    mo.add_argument("--model", default="resnet50", help="size (100MB) or network (resnet50, vgg16, bert-base)")
    mo.add_argument("--workers", type=_ints, default=[1, 2, 4, 8, 16, 64, 256, 1024, 4096],
                    help="comma-separated W values (default 1,2,4,...,4096)")
    mo.add_argument("--servers", type=_ints, default=[1, 4, 16, 64, 256], help="comma-separated S values")
    mo.add_argument("--link", default="10gbit", help="worker link bandwidth, e.g. 10gbit (default %(default)s)")
    mo.add_argument("--server-link", default=None, help="server link bandwidth (default: as --link)")
    mo.add_argument("--compute-ms", type=float, default=100.0, help="compute per step (default %(default)s)")
    mo.add_argument("--mode", choices=MODES, default="sync")
    mo.add_argument("--partition-bytes", type=int, default=4 << 20, help="partition size (default 4 MiB)")
    mo.add_argument("--calibrate", action="store_true", help="measure this machine's aggregation rate and "
                    "message overhead first (starts a local shard)")
    mo.add_argument("--agg-rate", type=float, default=2e9, help="shard aggregation bytes/s if not calibrating")
    mo.add_argument("--msg-overhead-us", type=float, default=100.0, help="per-message cost if not calibrating")
    mo.add_argument("--rtt-us", type=float, default=300.0, help="small round trip if not calibrating")
    mo.add_argument("--reply-tail", type=float, default=None,
                    help="fraction of a round's replies sent after its last push on a shared shard link "
                         "(default: ideal pipelining; bench/scaling.py measures it, docs/perfmodel.md explains)")
    mo.set_defaults(func=_model)

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
    started = time.monotonic()
    try:
        args = build_parser().parse_args(argv)
    except PsrtError as exc:  # a bad PSRT_* environment variable feeding a default
        print(f"psrt: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except PsrtError as exc:
        print(f"psrt: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        logging.getLogger("psrt.cli").info("%s finished in %.2fs", args.command, time.monotonic() - started)


if __name__ == "__main__":
    sys.exit(main())
