"""The bodies of the daemon processes: a shard server and the scheduler, as ``psrt server``/``psrt scheduler``
(and ``psrt run``) run them.

Each installs SIGTERM/SIGINT handlers that stop its loop cleanly, prints its ready line once bound (the format is
:func:`psrt.control.process.ready_line`'s) and a stopped line when it exits, and returns the process's exit code.
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import sys
from typing import IO, Any, Callable, Optional
from urllib.parse import urlsplit

from psrt.config import ClusterConfig, ServerConfig
from psrt.control.process import ready_line, stopped_line
from psrt.errors import ConfigError

__all__ = ["run_server", "run_scheduler", "host_towards"]


def host_towards(endpoint: str) -> str:
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


def _stop_on_signals(stop: Callable[[], None]) -> None:
    # The loops poll with short timeouts, so stopping from a handler is enough to end them between messages.
    def handler(signum: int, frame: object) -> None:
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def run_server(bind: Optional[str] = None, scheduler: Optional[str] = None, host: Optional[str] = None,
               num_workers: Optional[int] = None, mode: Optional[str] = None, nonfinite: str = "reject",
               metrics_port: Optional[int] = None, metrics_host: str = "127.0.0.1",
               checkpoint_dir: Optional[str] = None, checkpoint_every: int = 0, checkpoint_secs: float = 0.0,
               restore: bool = False, keys: Optional[str] = None, staleness: Optional[int] = None,
               rank: Optional[int] = None, out: IO[str] = sys.stdout) -> int:
    """Run one shard server until it is told to stop; returns the exit code.

    Parameters
    ----------
    bind : str, optional
        Endpoint to bind (default ``tcp://127.0.0.1:5701``, or an ephemeral port on ``host`` with a scheduler).
    scheduler : str, optional
        Join the job of the scheduler at this endpoint: register, take W and the mode from it, stop when it says.
    host : str, optional
        With ``scheduler``: the address to bind and announce (default: the one that routes to the scheduler).
    num_workers, mode : optional
        W and ``"sync"``/``"async"``/``"ssp"`` of a standalone server (default: :class:`~psrt.config.ServerConfig`'s).
    nonfinite : str
        ``"reject"`` or ``"allow"`` NaN/Inf gradients.
    metrics_port, metrics_host : optional
        Serve Prometheus metrics there (needs prometheus_client).
    checkpoint_dir, checkpoint_every, checkpoint_secs, restore : optional
        Checkpoints: where, every how many rounds and seconds, and whether to start from the newest of this
        shard's (:class:`~psrt.config.ServerConfig`). A clean shutdown writes one too.
    keys : str, optional
        The job's key directory (CURVE on every socket); default ``PSRT_KEYS``, empty: off.
    staleness : int, optional
        A standalone ``ssp`` server's staleness bound (default ``PSRT_STALENESS`` or 0).
    rank : int, optional
        The shard's rank, which names its checkpoints; with ``scheduler``, the slot it asks for.
    out : text stream
        Where the ready and stopped lines go.
    """
    from psrt.control.link import SchedulerLink
    from psrt.memory import tune_allocator
    from psrt.shard.server import Server

    tune_allocator()
    link = None
    ckpt: dict[str, Any] = dict(checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                                checkpoint_secs=checkpoint_secs, restore=restore, rank=rank)
    if keys is not None:
        ckpt["keys"] = keys
    if scheduler:
        host = host or host_towards(scheduler)
        config = ServerConfig(bind=bind or f"tcp://{host}:*", nonfinite=nonfinite, **ckpt)
    else:
        defaults = ServerConfig()
        config = ServerConfig(bind=bind or "tcp://127.0.0.1:5701", nonfinite=nonfinite,
                              num_workers=defaults.num_workers if num_workers is None else num_workers,
                              mode=mode or defaults.mode,
                              staleness=defaults.staleness if staleness is None else staleness, **ckpt)
    server = Server(config, scheduled=bool(scheduler))
    _stop_on_signals(server.stop)
    metrics = None
    ready = False  # the stopped line pairs with a ready line: a server that never served says only its error
    try:
        if scheduler:
            announce = server.endpoint.replace("0.0.0.0", host) if server.endpoint.startswith("tcp://") \
                else server.endpoint
            cluster = ClusterConfig.from_env()
            link = SchedulerLink(server.context, scheduler, keys=config.keys,
                                 heartbeat_interval=cluster.heartbeat_interval,
                                 heartbeat_timeout=cluster.heartbeat_timeout)
            timeout = cluster.start_timeout + 10.0
            # The rank this shard's checkpoint belongs to goes with the registration: restarted on any endpoint,
            # it takes that slot back. A rank it knows, it restores now; else once the table gives it one.
            asked, resuming = server.checkpoint_claim()
            table = link.register("server", endpoint=announce, host=host, rank=asked, timeout=timeout,
                                  restorable=config.checkpoint_dir is not None, restore=resuming)
            server.join(table)
        if metrics_port is not None:
            from psrt.control.metrics import serve_metrics

            try:
                metrics = serve_metrics(server, metrics_port, metrics_host)
            except OSError as exc:  # the port is taken or the address is not ours
                raise ConfigError(f"--metrics-port: cannot listen on {metrics_host}:{metrics_port}: "
                                  f"{exc.strerror or exc}") from None
        rank = {"rank": link.rank} if link else {}
        print(ready_line("server", server.endpoint, mode=server.config.mode, workers=server.config.num_workers,
                         **rank), file=out, flush=True)
        ready = True
        server.serve(control=link)
        server.checkpoint_at_exit()  # stopped cleanly (a signal, or the job's end): a restart resumes exactly
    finally:
        stats = server.stats()
        if metrics is not None:
            metrics.shutdown()
        if link is not None:
            link.close()
        server.close()
        if ready:
            print(stopped_line("server", endpoint=stats["endpoint"], pushes=stats["pushes"], pulls=stats["pulls"],
                               rounds=stats["rounds"], errors=stats["errors"]), file=out, flush=True)
    return 0


def run_scheduler(bind: str, num_servers: int, num_workers: int, mode: str = "sync",
                  start_timeout: Optional[float] = None, elastic: Optional[bool] = None,
                  keys: Optional[str] = None, staleness: Optional[int] = None, out: IO[str] = sys.stdout) -> int:
    """Run a job's scheduler until the job ends; returns its exit code (nonzero if the job failed to form).

    Parameters
    ----------
    bind : str
        Endpoint to bind.
    num_servers, num_workers : int
        S and W.
    mode : str
        ``"sync"``, ``"async"`` or ``"ssp"``.
    start_timeout : float, optional
        Seconds for everyone to register and for each barrier (default: ``PSRT_START_TIMEOUT`` or 120).
    elastic : bool, optional
        Workers may leave and join while the job runs (default: ``PSRT_ELASTIC``); see docs/elastic.md.
    keys : str, optional
        The job's key directory (CURVE, only the job's client key accepted); default ``PSRT_KEYS``.
    staleness : int, optional
        ``ssp`` mode: pushes a worker may run ahead of the slowest (default ``PSRT_STALENESS`` or 0).
    out : text stream
        Where the ready and stopped lines go.
    """
    from psrt.control.scheduler import Scheduler

    cluster = ClusterConfig.from_env()
    if start_timeout is None:
        start_timeout = cluster.start_timeout
    if elastic is None:
        elastic = cluster.elastic
    sched = Scheduler(bind, num_servers, num_workers, mode, start_timeout=start_timeout,
                      heartbeat_timeout=cluster.heartbeat_timeout, elastic=elastic, restart_grace=cluster.restart_grace,
                      keys=cluster.keys if keys is None else keys,
                      staleness=cluster.staleness if staleness is None else staleness)
    _stop_on_signals(sched.stop)
    print(ready_line("scheduler", sched.endpoint, servers=num_servers, workers=num_workers, mode=mode), file=out,
          flush=True)
    code = sched.serve()
    print(stopped_line("scheduler", code=code), file=out, flush=True)
    return code
