"""The ``psrt`` command line: it parses arguments and calls the module that does the work.

``psrt scheduler``   the job's control plane
``psrt server``      one shard (standalone with ``--bind``, or joining a job with ``--scheduler``)
``psrt launch``      a whole job on this machine: scheduler, S servers, W copies of a command
``psrt run``         become scheduler, server or worker as the environment says (srun, mpirun, Kubernetes)
``psrt stats``       a live per-shard table of a running job
``psrt checkpoint``  every shard of a running job writes a checkpoint now
``psrt keygen``      write a job's CURVE keys (``--keys DIR`` / ``PSRT_KEYS=DIR`` turn them on)
``psrt worker``      a synthetic load-test worker
``psrt model``       the performance model's predictions, extrapolated to thousands of workers
``psrt demo``        train a classifier on scikit-learn's digits on a local job
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import math
import os
import signal
import sys
import time
from typing import Any, Callable, Optional, Sequence

from psrt import __version__, config
from psrt.checks import MAX_PORT, check_port
from psrt.config import JOB_SETTINGS, MODES, START_TIMEOUT, ClusterConfig, ServerConfig
from psrt.errors import ConfigError, PsrtError

__all__ = ["main", "build_parser"]


def _server(args: argparse.Namespace) -> int:
    from psrt.cluster.daemon import run_server

    if args.scheduler is None:  # with a scheduler, the mode and the bound come from it
        _staleness_needs_ssp(args)

    return run_server(scheduler=args.scheduler, host=args.host, metrics_port=args.metrics_port,
                      metrics_host=args.metrics_host, **_settings(ServerConfig, args))


def _scheduler(args: argparse.Namespace) -> int:
    from psrt.cluster.daemon import run_scheduler

    _staleness_needs_ssp(args)
    given = {name: value for name, value in _settings(ClusterConfig, args).items() if value is not None}
    return run_scheduler(args.bind, dataclasses.replace(ClusterConfig.from_env(), **given))


def _launch(args: argparse.Namespace) -> int:
    from psrt.cluster.launch import launch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return launch(args.servers, args.workers, command, mode=args.mode, host=args.host, start_timeout=args.timeout,
                  transport=args.transport, secure=args.secure, elastic=args.elastic, staleness=args.staleness,
                  clients=args.clients, replicas=args.replicas, backup_workers=args.backup_workers,
                  **{name: getattr(args, name) for name in config.CHECKPOINT_SETTINGS})


def _keygen(args: argparse.Namespace) -> int:
    from psrt.control.security import KEY_FILES, keygen

    keys = keygen(args.directory)
    names = ", ".join(n for pair in KEY_FILES.values() for n in pair)
    print(f"psrt keygen: wrote {names} in {keys.directory}; give every process of the job "
          f"PSRT_KEYS={keys.directory} (or --keys); hosts that run only workers need server.key and the client "
          "pair", flush=True)
    return 0


def _run(args: argparse.Namespace) -> int:
    from psrt.cluster.launch import run_role

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return run_role(command)


def _checkpoint(args: argparse.Namespace) -> int:
    from psrt.cluster.stats import checkpoint_job

    return checkpoint_job(args.scheduler, timeout=args.timeout)


def _stats(args: argparse.Namespace) -> int:
    from psrt.cluster.stats import watch

    return watch(args.scheduler, interval=args.interval, count=args.count)


def _worker(args: argparse.Namespace) -> int:
    from psrt.emulation.loadgen import run_worker

    servers = args.servers.split(",") if args.servers else None
    clients = args.clients if args.clients is not None else ClusterConfig.from_env().clients
    run_worker(args.model, args.compute_ms, args.steps, warmup=args.warmup, compute=args.compute, servers=servers,
               rank=args.rank, num_workers=args.workers, lr=args.lr, clients=clients, overlap=args.overlap,
               layers=args.layers, window=args.window, trace=args.trace)
    return 0


def _model(args: argparse.Namespace) -> int:
    from psrt.emulation import perfmodel
    from psrt.emulation.models import model_bytes, model_tensors
    from psrt.emulation.netns import parse_rate

    cal = perfmodel.calibrate() if args.calibrate else perfmodel.Calibration(
        agg_bytes_per_s=args.agg_rate, msg_overhead_s=args.msg_overhead_us * 1e-6, rtt_s=args.rtt_us * 1e-6)
    if args.reply_tail is not None:
        if not 0 <= args.reply_tail <= 1:
            raise ConfigError(f"--reply-tail must be in [0, 1], got {args.reply_tail}")
        cal = dataclasses.replace(cal, contended_tail=args.reply_tail)
    tensors = model_tensors(args.model, args.partition_bytes)
    link = parse_rate(args.link)
    server_link = parse_rate(args.server_link) if args.server_link else link
    job = dict(tensors=tensors, cal=cal, link_bits=link, compute_s=args.compute_ms / 1000, mode=args.mode,
               partition_bytes=args.partition_bytes, server_link_bits=server_link)
    # Everything that can refuse the arguments runs before the first line is printed.
    plans = None
    if args.target_efficiency is not None:
        plans = [perfmodel.smallest_servers(workers, args.target_efficiency, **job) for workers in args.workers]
    if args.plot:
        perfmodel.plot_efficiency(args.plot, args.workers, args.servers, target=args.target_efficiency, **job,
                                  title=f"{args.model}, links {args.link}/{args.server_link or args.link}, "
                                        f"compute {args.compute_ms:g} ms, {args.mode}")
    print(f"model {args.model}: {model_bytes(tensors) / 1e6:.1f} MB in "
          f"{len(tensors)} tensors; links: worker {args.link}, server {args.server_link or args.link}; compute "
          f"{args.compute_ms:g} ms; {args.mode}")
    what = "calibration (measured here)" if args.calibrate else "assumed costs (--calibrate measures them)"
    print(f"{what}: aggregation {cal.agg_bytes_per_s / 1e9:.2f} GB/s, message overhead "
          f"{cal.msg_overhead_s * 1e6:.0f} us, round trip {cal.rtt_s * 1e6:.0f} us")
    if plans is not None:
        _print_plans(plans, args.server_link or args.link)
    else:
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
                print(f"{workers:>8} {p.step_s * 1000:>10.1f} {p.steps_per_s:>15.1f} "
                      f"{p.steps_per_s / workers:>11.2f}  {p.bottleneck}")
    if args.plot:
        print(f"\nwrote {args.plot}")
    return 0


def _print_plans(plans: list, server_link: str) -> None:
    """The capacity planner's table: per W the smallest S, its efficiency and the shard link it needs."""
    first = plans[0]
    print(f"\ntarget: efficiency >= {first.target:g}, i.e. throughput >= {first.target:g} x W x "
          f"{first.alone_steps_per_s:.2f} worker-steps/s (one worker with one server)")
    print(f"{'W':>8} {'smallest S':>11} {'efficiency':>11} {'shard link':>11} {'S=W*Bw/Bs':>10}  bottleneck at S")
    for plan in plans:
        if plan.reached:
            print(f"{plan.workers:>8} {plan.servers:>11} {plan.efficiency:>11.3f} "
                  f"{_rate(plan.server_link * 8):>11} {plan.matched_servers:>10}  {plan.bottleneck}")
            continue
        if plan.server_link is not None:
            how = (f"limit: shard link; S={plan.link_servers} with {_rate(plan.server_link * 8)} shard links "
                   "reaches it")
        else:
            how = f"limit: {plan.limit}, which no shard link lifts"
        print(f"{plan.workers:>8} {'-':>11} {'-':>11} {'-':>11} {plan.matched_servers:>10}  none of S <= "
              f"{plan.max_servers} reaches it at {server_link} (best {plan.efficiency:.3f} at "
              f"S={plan.servers}); {how}")


def _rate(bits: float) -> str:
    """A link rate as tc writes one (``psrt model --server-link`` takes it back), rounded up."""
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{math.ceil(bits / scale * 100) / 100:g}{unit}"
    return f"{math.ceil(bits):g}bit"


def _argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse type: its ConfigError becomes the usage error ``argument --FLAG: MESSAGE``."""

    @functools.wraps(parse)  # argparse names the type in its own messages (a plain ValueError: "invalid int value")
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


_nonnegative = _argument(config.parse_whole)
_positive_int = _argument(config.parse_count)
_seconds = _argument(config.parse_seconds)
_interval = _argument(config.parse_interval)
_endpoint = _argument(config.parse_endpoint)


def _parse_size(text: str) -> int:
    from psrt.emulation.models import parse_size  # only when the flag is given: the CLI's import stays light

    size = parse_size(text)
    if size < 1:
        raise ConfigError(f"size {text!r} must be at least one byte")
    return size


_size = _argument(_parse_size)
_bind_endpoint = _argument(config.parse_bind)


def _add_flags(parser: argparse.ArgumentParser, kind: type, defaults: Any, joined: Sequence[str] = (),
               only: Optional[Sequence[str]] = None) -> None:
    """Add the flags of config dataclass ``kind`` (:func:`psrt.config.flags`), defaulting to ``defaults``' values
    (``only``: the flags of those fields alone).

    The help text says each default, and for the ``joined`` fields that a job's scheduler gives them instead.
    """
    for f, flag in config.flags(kind):
        if only is not None and f.name not in only:
            continue
        default = None if flag.unset else getattr(defaults, f.name)
        says = _default_text(f, flag) + ("; from the scheduler with --scheduler" if f.name in joined else "")
        kwargs: dict[str, Any] = dict(default=flag.fallback if default is None else default,
                                      help=f"{flag.help} (default: {says})" if says else flag.help)
        if isinstance(config.field_default(f), bool):
            kwargs["action"] = "store_true"
        else:
            kwargs.update(metavar=flag.metavar, choices=flag.choices)
            if flag.parse is not None:
                kwargs["type"] = _argument(flag.parse)
        parser.add_argument(flag.name, **kwargs)


def _default_text(f: dataclasses.Field, flag: config.Flag) -> str:
    """A flag's default in its help text: the field's variable and default value, or the flag's own words."""
    value = config.field_default(f)
    value = flag.fallback if value is None else value
    if flag.default_help is not None:
        return flag.default_help.format(default=value)
    env = f.metadata.get("env")
    if not env:
        return ""
    if isinstance(value, bool):
        return f"${env[0]}"
    if value is None:
        return f"${env[0]}; empty: off"
    return f"${env[0]} or {value:g}" if isinstance(value, float) else f"${env[0]} or {value}"


def _settings(kind: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of config dataclass ``kind``'s flags, by field name (None: not given, the config's default)."""
    return {f.name: getattr(args, flag.dest) for f, flag in config.flags(kind)}


def _staleness_needs_ssp(args: argparse.Namespace) -> None:
    if args.staleness is not None and args.mode != "ssp":
        raise ConfigError(f"--staleness is the bound of --mode ssp; this is --mode {args.mode}: leave --staleness out "
                          "or use --mode ssp")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("values must be positive integers")
    return values


def _port(text: str) -> int:
    """A TCP port in 1..65535 (a larger number would wrap around, a smaller one fail deep inside a server)."""
    try:
        return check_port(int(text))
    except (ValueError, ConfigError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1..{MAX_PORT})") from None


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
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    env = ClusterConfig.from_env()

    s = sub.add_parser("server", help="run one shard server", description=(
        "Run one shard server: it holds the keys the shard map assigns to it, sums the workers' gradients and "
        "applies the optimizer. With --scheduler it joins a job (binding an ephemeral port and announcing it); "
        "with --bind alone it serves standalone."))
    s.add_argument("--scheduler", default=None, type=_endpoint, help="join the job of the scheduler at tcp://HOST:PORT")
    s.add_argument("--host", default=None,
                   help="with --scheduler: the address to bind and announce (default: $PSRT_NODE_HOST, or the "
                        "local address that reaches the scheduler)")
    # (b's default, PSRT_BACKUP_WORKERS, is checked against W when the config is made, not here)
    _add_flags(s, ServerConfig, ServerConfig(backup_workers=0), joined=JOB_SETTINGS)
    s.add_argument("--metrics-port", type=_port, default=None,
                   help="serve Prometheus metrics on this port (needs prometheus_client)")
    s.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    s.set_defaults(func=_server)

    c = sub.add_parser("scheduler", help="run the job's scheduler", description=(
        "Run a job's scheduler: servers and workers register in any order; once all S and W are in, it hands "
        "out the node table, runs barriers, and ends the job when every worker is done. Past the start deadline "
        "everyone still waiting is told who is missing. No tensor bytes pass through it."))
    c.add_argument("--bind", default="tcp://127.0.0.1:5700", type=_bind_endpoint,
                   help="endpoint to bind (default %(default)s)")
    _add_flags(c, ClusterConfig, env)
    c.set_defaults(func=_scheduler)

    la = sub.add_parser("launch", help="run a scheduler, S servers and W copies of CMD on this machine", description=(
        "Run a whole job on this machine: a scheduler, S shard servers and W copies of CMD, every line they print "
        "prefixed with its role and rank. Exits with the first failing exit code (128 + N for a process killed "
        "by signal N), and tears everything down on Ctrl-C or when any process dies."))
    la.add_argument("-s", "--servers", type=int, required=True, help="number of servers S")
    la.add_argument("-w", "--workers", type=int, required=True, help="number of workers W")
    la.add_argument("--mode", choices=MODES, default="sync",
                    help="sync (BSP), async or ssp (bounded staleness) (default %(default)s)")
    la.add_argument("--staleness", type=_nonnegative, default=None, metavar="S",
                    help="ssp: pushes a worker may run ahead of the slowest (default: $PSRT_STALENESS or 0)")
    la.add_argument("--replicas", type=_nonnegative, default=env.replicas, metavar="R",
                    help="copies of each shard's key range on the next R shards (at most S - 1); a dead "
                         "shard's range is taken over by its first replica (default: $PSRT_REPLICAS or 0)")
    la.add_argument("--backup-workers", type=_argument(config.parse_backup), default=None, metavar="B",
                    help="sync: backup workers (0 <= B < W): a round closes on the first W - B pushes, a later "
                         "push for it is dropped; auto: the shards pick B from how late the pushes come "
                         "(default: $PSRT_BACKUP_WORKERS or 0)")
    la.add_argument("--host", default="127.0.0.1", help="address to bind on (default %(default)s)")
    la.add_argument("--timeout", type=_seconds, default=env.start_timeout,
                    help=f"seconds for the job to form and for each barrier (default: $PSRT_START_TIMEOUT or "
                         f"{START_TIMEOUT:g})")
    la.add_argument("--transport", choices=("auto", "tcp", "ipc"), default="auto",
                    help="worker-to-shard transport: ipc (Unix sockets) or tcp; auto: ipc on loopback "
                         "(default %(default)s)")
    la.add_argument("--elastic", action="store_true", default=env.elastic,
                    help="an elastic job: a worker that dies leaves the job instead of ending it "
                         "(default: $PSRT_ELASTIC); see docs/elastic.md")
    la.add_argument("--secure", action="store_true",
                    help="make a private key directory for this job, hand it to every process by PSRT_KEYS "
                         "(CURVE on every socket), and remove it at the end")
    la.add_argument("--clients", type=_positive_int, default=1, metavar="N",
                    help="workers per copy of CMD: start ceil(W/N) copies, each told by PSRT_CLIENTS and "
                         "PSRT_WORKER_ID to host N of them (psrt worker does; default %(default)s)")
    _add_flags(la, ServerConfig, ServerConfig(backup_workers=0), only=config.CHECKPOINT_SETTINGS)  # every shard's
    la.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS: the worker program")
    la.set_defaults(func=_launch)

    r = sub.add_parser("run", help="become scheduler, server or worker (running CMD) as the environment says",
                       description=(
        "Become the scheduler, a server, or a worker running CMD, as PSRT_*/DMLC_* variables or the srun/mpirun "
        "rank say: one command line for every process of a multi-host job."))
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS: the worker program")
    r.set_defaults(func=_run)

    st = sub.add_parser("stats", help="print a live per-shard table of a running job", description=(
        "Print a live table per shard of a running job: keys, MB held, pushes, pulls, rounds, queued pulls, "
        "deferred pushes, errors, MB/s in and out; and, in a sync job, per worker (rank, host) how late its pushes "
        "come after their round's first push (median, p99) and how many were dropped (--backup-workers)."))
    st.add_argument("scheduler", type=_endpoint, help="the scheduler's endpoint, tcp://HOST:PORT")
    st.add_argument("--interval", type=_interval, default=1.0, help="seconds between refreshes (default %(default)s)")
    st.add_argument("--count", type=_positive_int, default=None,
                    help="stop after this many tables (default: until Ctrl-C)")
    st.set_defaults(func=_stats)

    ck = sub.add_parser("checkpoint", help="ask every shard of a running job to write a checkpoint now",
                        description="Ask every shard of the job whose scheduler is at SCHEDULER to write a "
                                    "checkpoint now (the shards need --checkpoint-dir); prints each file.")
    ck.add_argument("scheduler", type=_endpoint, help="the scheduler's endpoint, tcp://HOST:PORT")
    ck.add_argument("--timeout", type=_seconds, default=60.0, help="seconds to wait (default %(default)s)")
    ck.set_defaults(func=_checkpoint)

    kg = sub.add_parser("keygen", help="write a job's CURVE keys: a server pair and a client pair", description=(
        "Write a job's CURVE keys (ZeroMQ certificate format): a server pair and a client pair. Give every process "
        "of the job the directory with --keys DIR or PSRT_KEYS=DIR."))
    kg.add_argument("directory", help="where to write them (created 0700; must not hold keys already)")
    kg.set_defaults(func=_keygen)

    wk = sub.add_parser("worker", help="a synthetic load-test worker reporting its steps/s", description=(
        "A synthetic load-test worker: each step it computes for --compute-ms, then push_pulls a gradient of the "
        "model's shape (with --overlap: each tensor pushed from an emulated backward, its parameters awaited in the "
        "next forward). It prints one psrt-worker-result JSON line with its steps/s."))
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
    wk.add_argument("--clients", type=_positive_int, default=None, metavar="N",
                    help="workers to run in this process, each a full peer with its own rank and result line "
                         "(default: $PSRT_CLIENTS or 1)")
    wk.add_argument("--overlap", action="store_true",
                    help="overlap communication with compute as a framework does: an emulated backward (2/3 of "
                         "--compute-ms) pushes the tensors one by one, last layer first, and the next forward "
                         "(1/3) waits for each one's parameters, first layer first")
    wk.add_argument("--layers", type=_positive_int, default=None, metavar="N",
                    help="split a sized model into N equal tensors, the layers --overlap pushes one by one "
                         "(default: one tensor per 4 MiB)")
    wk.add_argument("--window", type=_size, default=None, metavar="BYTES",
                    help="with --overlap: gradient bytes in flight at a time, e.g. 64KB (at least one tensor; "
                         "default 4MiB); a window smaller than the model lets the first layers' gradients, needed "
                         "first, overtake the queued later ones")
    wk.add_argument("--trace", default=None, metavar="FILE",
                    help="with --overlap: write each worker's pipeline events (each tensor queued, sent, acknowledged, "
                         "awaited and in; each step's start) to this JSON file at the end, or to trace-PID.json in "
                         "it if it is a folder (python -m psrt.emulation.trace FILE... summarizes them)")
    wk.set_defaults(func=_worker)

    mo = sub.add_parser("model", help="predict step time and throughput with the performance model", description=(
        "Predict step time, throughput and the bottleneck of a job with the performance model "
        "(docs/perfmodel.md), for any number of workers and servers."))
    mo.add_argument("--model", default="resnet50", help="size (100MB) or network (resnet50, vgg16, bert-base)")
    mo.add_argument("--workers", type=_ints, default=[1, 2, 4, 8, 16, 64, 256, 1024, 4096],
                    help="comma-separated W values (default 1,2,4,...,4096)")
    mo.add_argument("--servers", type=_ints, default=[1, 4, 16, 64, 256], help="comma-separated S values")
    mo.add_argument("--link", default="10gbit", help="worker link bandwidth, e.g. 10gbit (default %(default)s)")
    mo.add_argument("--server-link", default=None, help="server link bandwidth (default: as --link)")
    mo.add_argument("--compute-ms", type=float, default=100.0, help="compute per step (default %(default)s)")
    mo.add_argument("--mode", choices=("sync", "async"), default="sync", help="sync or async (the model has no ssp)")
    mo.add_argument("--partition-bytes", type=int, default=4 << 20, help="partition size (default 4 MiB)")
    mo.add_argument("--calibrate", action="store_true", help="measure this machine's aggregation rate and "
                    "message overhead first (starts a local shard)")
    mo.add_argument("--agg-rate", type=float, default=2e9, help="shard aggregation bytes/s if not calibrating")
    mo.add_argument("--msg-overhead-us", type=float, default=100.0, help="per-message cost if not calibrating")
    mo.add_argument("--rtt-us", type=float, default=300.0, help="small round trip if not calibrating")
    mo.add_argument("--reply-tail", type=float, default=None,
                    help="fraction of a round's replies sent after its last push on a shared shard link "
                         "(default: ideal pipelining; bench/scaling.py measures it, docs/perfmodel.md explains)")
    mo.add_argument("--target-efficiency", type=float, default=None, metavar="E",
                    help="capacity planning: for each W (1 to 10,000), the smallest S (1 to 1,000) that keeps the job "
                         "at E (0 < E <= 1) of linear scaling (W x one worker's throughput), and the shard link that "
                         "needs (docs/perfmodel.md, 'The capacity planner')")
    mo.add_argument("--plot", default=None, metavar="FILE",
                    help="draw efficiency against W for each --servers S (and the target), e.g. eff.png; needs "
                         "matplotlib: pip install 'psrt[plot]'")
    mo.set_defaults(func=_model)

    d = sub.add_parser("demo", help="train a classifier on scikit-learn's digits with local shards and workers",
                       description=(
        "Train an MLP on scikit-learn's digits with a job on this machine (psrt launch of psrt.examples.digits). "
        "Needs scikit-learn: pip install 'psrt[examples]'."))
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
    except KeyboardInterrupt:  # Ctrl-C is how a user stops a command: no traceback
        return 128 + signal.SIGINT
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        logging.getLogger("psrt.cli").info("%s finished in %.2fs", args.command, time.monotonic() - started)


if __name__ == "__main__":
    sys.exit(main())
