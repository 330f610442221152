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

from psrt.config import JOB_SETTINGS, ClusterConfig, ServerConfig
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


def run_server(scheduler: Optional[str] = None, host: Optional[str] = None, metrics_port: Optional[int] = None,
               metrics_host: str = "127.0.0.1", out: IO[str] = sys.stdout, **settings: Any) -> int:
    """Run one shard server until it is told to stop; returns the exit code.

    Parameters
    ----------
    scheduler : str, optional
        Join the job of the scheduler at this endpoint: register, take W, the mode and the staleness bound from
        it (:data:`~psrt.config.JOB_SETTINGS`), stop when it says.
    host : str, optional
        With ``scheduler``: the address to bind and announce (default: the one that routes to the scheduler).
    metrics_port, metrics_host : optional
        Serve Prometheus metrics there (needs prometheus_client).
    out : text stream
        Where the ready and stopped lines go.
    **settings
        :class:`~psrt.config.ServerConfig` fields (``bind``, ``num_workers``, ``checkpoint_dir``...); one that is
        None or left out takes the config's default, and ``bind`` with ``scheduler`` an ephemeral port on
        ``host``. A clean shutdown of a shard with ``checkpoint_dir`` writes a checkpoint.
    """
    from psrt.control.link import SchedulerLink
    from psrt.memory import tune_allocator
    from psrt.shard.server import Server

    tune_allocator()
    link = None
    settings = {name: value for name, value in settings.items() if value is not None}
    if scheduler:
        host = host or host_towards(scheduler)
        for name in JOB_SETTINGS:  # the scheduler's table gives them
            settings.pop(name, None)
        settings["backup_workers"] = 0  # (until the table says: PSRT_BACKUP_WORKERS is not checked against W=1)
        settings.setdefault("bind", f"tcp://{host}:*")
    config = ServerConfig(**settings)
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
            # A replicated job: the scheduler says R first, and the shard announces where its copies go.
            job = link.table(timeout=timeout).replication
            replication = server.prepare_replication(job.replicas) if job is not None and job.replicas else ()
            table = link.register("server", endpoint=announce, host=host, rank=asked, timeout=timeout,
                                  restorable=config.checkpoint_dir is not None, restore=resuming,
                                  replication=[e.replace("0.0.0.0", host) for e in replication])
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
        server.report_slow()  # who was slow, once more at the job's end
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


def run_scheduler(bind: str, cluster: ClusterConfig, out: IO[str] = sys.stdout) -> int:
    """Run a job's scheduler until the job ends; returns its exit code (nonzero if the job failed to form).

    Parameters
    ----------
    bind : str
        Endpoint to bind.
    cluster : ClusterConfig
        The job: S and W (both needed), the mode and staleness bound, the start deadline, heartbeats, whether it
        is elastic, the restart grace and the key directory.
    out : text stream
        Where the ready and stopped lines go.
    """
    from psrt.control.scheduler import Scheduler

    if cluster.num_servers is None or cluster.num_workers is None:
        raise ConfigError("the scheduler needs S and W: --servers and --workers, or PSRT_NUM_SERVERS and "
                          "PSRT_NUM_WORKERS (or DMLC_NUM_SERVER and DMLC_NUM_WORKER)")
    sched = Scheduler(bind, cluster.num_servers, cluster.num_workers, cluster.mode,
                      start_timeout=cluster.start_timeout, heartbeat_timeout=cluster.heartbeat_timeout,
                      heartbeat_interval=cluster.heartbeat_interval,
                      elastic=cluster.elastic, restart_grace=cluster.restart_grace, keys=cluster.keys,
                      staleness=cluster.staleness, replicas=cluster.replicas,
                      backup_workers=cluster.backup_workers, slow_every=cluster.slow_every)
    _stop_on_signals(sched.stop)
    print(ready_line("scheduler", sched.endpoint, servers=cluster.num_servers, workers=cluster.num_workers,
                     mode=cluster.mode), file=out, flush=True)
    code = sched.serve()
    print(stopped_line("scheduler", code=code), file=out, flush=True)
    return code
