"""Starting a job's processes: the local launcher (``psrt launch``) and the role dispatcher (``psrt run``).

``psrt launch -s S -w W -- CMD ARGS`` starts a scheduler, S servers and W copies of CMD on this machine, with
the environment each needs, and prefixes every line they print with their role and rank. It exits with the
first failing exit code (128 + N for a process killed by signal N), and tears everything down on Ctrl-C or when
any process dies; when the workers finish, the scheduler tells the servers to stop and everything exits. Every
child runs in its own process group, which the launcher kills as a whole, and gets SIGTERM if the launcher itself
dies (Linux), so no process outlives it (:class:`psrt.control.process.Child`).

``psrt run -- CMD`` is the one command line every process of a multi-host job can share (as with ps-lite): it
reads its role from the environment (see :class:`psrt.config.ClusterConfig`) and becomes the scheduler, a
server, or a worker that runs CMD.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Mapping, Optional, Sequence

from psrt.cluster.daemon import run_scheduler, run_server
from psrt.config import CHECKPOINT_SETTINGS, ClusterConfig, ServerConfig, check_backup_workers
from psrt.config import flags as config_flags
from psrt.control.placement import check_job_replicas
from psrt.control.process import (
    SCHEDULER_READY,
    SERVER_READY,
    Child,
    describe_exit,
    exit_status,
    psrt_command,
    stop_children,
)
from psrt.errors import ConfigError, PsrtTimeoutError
from psrt.shard.checkpoint import check_directory

__all__ = ["launch", "run_role", "scheduler_bind", "exit_status", "worker_copies", "compute_threads",
           "THREAD_VARIABLES", "SCHEDULER_READY"]

log = logging.getLogger("psrt.launch")

#: Hosts in a scheduler's URI that ask for every interface.
_EVERYWHERE = ("0.0.0.0", "*", "::", "[::]")


def launch(num_servers: int, num_workers: int, command: Sequence[str], mode: str = "sync",
           host: str = "127.0.0.1", start_timeout: Optional[float] = None, out: IO[str] = sys.stdout,
           extra_env: Optional[dict[str, str]] = None, transport: str = "auto", secure: bool = False,
           elastic: bool = False, staleness: Optional[int] = None, clients: int = 1, replicas: int = 0,
           backup_workers: Optional[int | str] = None, checkpoint_dir: Optional[str] = None,
           checkpoint_every: int = 0, checkpoint_secs: float = 0.0, checkpoint_full_every: int = 10,
           restore: bool = False) -> int:
    """Run a whole job on this machine; returns the exit code (the first failure's, else 0).

    Parameters
    ----------
    num_servers, num_workers : int
        S and W.
    command : sequence of str
        The worker program and its arguments; each copy gets ``PSRT_SCHEDULER``, ``PSRT_ROLE=worker``,
        ``PSRT_WORKER_ID``, ``PSRT_NUM_WORKERS``, ``PSRT_NUM_SERVERS`` and ``PSRT_MODE``.
    mode : str
        ``"sync"``, ``"async"`` or ``"ssp"`` (with ``staleness``).
    host : str
        Address the scheduler and servers bind on.
    start_timeout : float, optional
        Seconds for the job to form and for each barrier (default: ``PSRT_START_TIMEOUT`` or 120, as the
        scheduler's).
    out : text stream
        Where the prefixed output goes.
    extra_env : dict, optional
        More environment for every process.
    transport : str
        How workers reach the shards: ``"tcp"``, ``"ipc"`` (Unix sockets in a private temporary directory:
        no TCP stack between processes of one machine), or ``"auto"``: ipc when ``host`` is loopback.
    secure : bool
        Generate a key pair set for this job in a private (0700) temporary directory, give it to every process
        as ``PSRT_KEYS`` (CURVE on every socket), and delete it when the job ends.
    staleness : int, optional
        ``ssp`` mode: pushes a worker may run ahead of the slowest (default: ``PSRT_STALENESS`` or 0).
    elastic : bool
        An elastic job (docs/elastic.md): a worker that dies leaves the job instead of ending it, and the
        launcher goes on with the others; the job ends when every worker has exited.
    backup_workers : int or "auto", optional
        Sync mode: backup workers b, ``0 <= b < num_workers``: a round closes on the first W - b pushes; ``"auto"``:
        the shards pick b (default: ``PSRT_BACKUP_WORKERS`` or 0).
    clients : int
        Workers per copy of ``command``: ceil(W / clients) copies, copy k told to host the workers of ranks
        ``k * clients`` on (``PSRT_WORKER_ID``), ``clients`` of them, the last copy the rest (``PSRT_CLIENTS``).
        ``psrt worker`` understands it (``--clients``); another program must run that many clients itself.
    replicas : int
        Copies of each shard's key range on the next R shards (``psrt scheduler --replicas``).
    checkpoint_dir, checkpoint_every, checkpoint_secs, checkpoint_full_every, restore
        Every shard's checkpoints, as ``psrt server`` takes them (:class:`psrt.config.ServerConfig`): each shard
        writes its rank's files in ``checkpoint_dir`` and, with ``restore``, starts from its rank's newest.
    """
    if transport not in ("auto", "tcp", "ipc"):
        raise ConfigError(f"transport must be auto, tcp or ipc, got {transport!r}")
    if transport == "auto":
        transport = "ipc" if host in ("127.0.0.1", "localhost") and os.name == "posix" else "tcp"
    if num_servers < 1 or num_workers < 1:
        raise ConfigError(f"need -s >= 1 and -w >= 1, got -s {num_servers} -w {num_workers}")
    if isinstance(clients, bool) or not isinstance(clients, int) or not 1 <= clients:
        raise ConfigError(f"--clients must be a whole number of workers >= 1, got {clients!r}")
    if not command:
        raise ConfigError("no worker command: use psrt launch -s S -w W -- CMD ARGS")
    if staleness is not None and mode != "ssp":
        raise ConfigError(f"--staleness is the bound of --mode ssp; this is --mode {mode}: leave --staleness out or "
                          "use --mode ssp")
    if backup_workers is not None:
        check_backup_workers(backup_workers, num_workers, mode)
    check_job_replicas(replicas, num_servers, mode, elastic, backup_workers or 0)
    if shutil.which(command[0]) is None:  # say so before starting a job that could not run
        raise ConfigError(f"cannot start the workers: {command[0]}: no such program (or not executable)")
    if start_timeout is None:
        start_timeout = ClusterConfig.from_env().start_timeout
    checkpoints = _checkpoint_flags(checkpoint_dir, checkpoint_every, checkpoint_secs, checkpoint_full_every,
                                    restore)
    lock = threading.Lock()
    env = dict(extra_env or {})  # on top of this process's environment (Child adds it)
    copies = worker_copies(num_workers, clients)
    threads = compute_threads(len(copies), {**os.environ, **env})
    if threading.current_thread() is threading.main_thread():
        # SIGTERM to the launcher tears the job down like Ctrl-C does, and exits 128 + 15 as supervisors expect.
        signal.signal(signal.SIGTERM, _terminated)
    procs: list[Child] = []
    sockdir = tempfile.mkdtemp(prefix="psrt-") if transport == "ipc" else None
    keydir = tempfile.mkdtemp(prefix="psrt-keys-") if secure else None  # mkdtemp: 0700, only this user

    def start(label: str, cmd: Sequence[str], env: dict[str, str], **kwargs: object) -> Child:
        procs.append(Child(cmd, label=label, env=env, out=out, lock=lock, **kwargs))
        return procs[-1]

    try:
        if keydir:
            from psrt.control.security import keygen

            keygen(keydir)
            env["PSRT_KEYS"] = keydir
        if threads:
            out.write(f"psrt launch: {len(copies)} worker processes share this machine's {_cores()} cores: "
                      f"{'='.join(THREAD_VARIABLES)}={threads[THREAD_VARIABLES[0]]} for each (set one of them to "
                      "choose otherwise)\n")
        sched = start("scheduler", psrt_command("scheduler", "--bind", f"tcp://{host}:*", "--servers",
                                                str(num_servers), "--workers", str(num_workers), "--mode", mode,
                                                "--timeout", str(start_timeout),
                                                *(["--staleness", str(staleness)] if staleness is not None else []),
                                                *(["--backup-workers", str(backup_workers)]
                                                  if backup_workers is not None else []),
                                                *(["--elastic"] if elastic else []),
                                                *(["--replicas", str(replicas)] if replicas else [])),
                      env, ready=SCHEDULER_READY)
        endpoint = sched.wait_ready(30.0).group(1)
        job_env = {**env, "PSRT_SCHEDULER": endpoint, "PSRT_NUM_SERVERS": str(num_servers),
                   "PSRT_NUM_WORKERS": str(num_workers), "PSRT_MODE": mode, "PSRT_START_TIMEOUT": str(start_timeout)}

        def bind(i: int) -> list[str]:
            return ["--bind", f"ipc://{sockdir}/server-{i}.sock"] if sockdir else []

        # The scheduler ranks servers in the order they register: each takes its label from its ready line's rank.
        servers = [start("server", psrt_command("server", "--scheduler", endpoint, "--host", host, *bind(i),
                                                *checkpoints),
                         {**job_env, "PSRT_ROLE": "server"}, ready=SERVER_READY, relabel=_server_label)
                   for i in range(num_servers)]
        workers = [start(_workers_label(first, count), command,
                         {**job_env, **threads, "PSRT_ROLE": "worker", "PSRT_WORKER_ID": str(first),
                          "PSRT_CLIENTS": str(count)})
                   for first, count in copies]
        return _supervise(sched, servers, workers, procs, out, lock, elastic, replicated=replicas > 0)
    except KeyboardInterrupt as exc:
        by = signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT
        with lock:
            out.write(f"psrt launch: {'terminated' if by == signal.SIGTERM else 'interrupted'}; stopping every "
                      "process\n")
        return 128 + by
    finally:
        stop_children(procs)
        if sockdir:
            shutil.rmtree(sockdir, ignore_errors=True)
        if keydir:
            shutil.rmtree(keydir, ignore_errors=True)


def _checkpoint_flags(checkpoint_dir: Optional[str], every: int, secs: float, full_every: int,
                      restore: bool) -> list[str]:
    """The ``psrt server`` flags of a job's checkpoint settings, checked now (as a shard would refuse them) so that
    a wrong one stops the launch before anything starts.

    Raises
    ------
    ConfigError
        When a setting is out of range, needs ``checkpoint_dir``, or the directory cannot be written.
    """
    settings = ServerConfig(checkpoint_dir=checkpoint_dir, checkpoint_every=every, checkpoint_secs=secs,
                            checkpoint_full_every=full_every, restore=restore, backup_workers=0)
    if checkpoint_dir is None:
        return []
    check_directory(checkpoint_dir)
    defaults = ServerConfig(backup_workers=0)
    args: list[str] = []
    for f, flag in config_flags(ServerConfig):
        if f.name not in CHECKPOINT_SETTINGS or getattr(settings, f.name) == getattr(defaults, f.name):
            continue
        value = getattr(settings, f.name)
        if f.name == "checkpoint_dir":
            value = os.path.abspath(value)  # the shards' working directory is this one, but say it once and for all
        args += [flag.name] if isinstance(value, bool) else [flag.name, str(value)]
    return args


#: The variables that size a process's compute thread pools: OpenMP's (PyTorch's intra-op threads, MKL and
#: OpenBLAS built with OpenMP), OpenBLAS's own (NumPy's wheels) and MKL's. OpenBLAS falls back to OpenMP's.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _cores() -> int:
    """The cores this process may run on (its affinity mask: a container's CPU set), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def compute_threads(processes: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The thread-pool sizes (:data:`THREAD_VARIABLES`) for each of ``processes`` worker processes sharing this
    machine: its cores shared out, at least one each; nothing when the user set any of the variables (their
    choice stands) or one process has every core anyway.

    Left alone, every process's pools take every core: W workers on C cores run W x C threads, which spin and
    preempt each other (and the shards) between the short matrix products of a training step, as torchrun found
    (it sets ``OMP_NUM_THREADS=1`` for more than one process a node). On 2 cores, README's main job (2 workers,
    NumPy) trains in 0.5 s with one thread each against 0.8 s with the libraries' default.
    """
    if any(environ.get(name) for name in THREAD_VARIABLES):
        return {}
    cores = _cores()
    each = max(1, cores // max(1, processes))
    if each >= cores:
        return {}
    return dict.fromkeys(THREAD_VARIABLES, str(each))


def worker_copies(num_workers: int, clients: int) -> list[tuple[int, int]]:
    """The copies of the worker command a job of W workers takes at ``clients`` a copy: ``(first rank, count)``."""
    return [(first, min(clients, num_workers - first)) for first in range(0, num_workers, clients)]


def _workers_label(first: int, count: int) -> str:
    return f"worker {first}" if count == 1 else f"workers {first}-{first + count - 1}"


def _server_label(ready: re.Match) -> str:
    rank = re.search(r" rank=(\d+)", ready.string)
    return f"server {rank.group(1)}" if rank else "server"


class _Terminated(KeyboardInterrupt):
    """SIGTERM to the launcher: unwinds like Ctrl-C, but the exit code says SIGTERM."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated


def _supervise(sched: Child, servers: list[Child], workers: list[Child], procs: list[Child], out: IO[str],
               lock: threading.Lock, elastic: bool = False, replicated: bool = False) -> int:
    def say(line: str) -> None:
        with lock:
            out.write(f"psrt launch: {line}\n")

    def report(p: Child) -> int:
        code = p.poll()
        assert code is not None
        say(f"{p.label} {describe_exit(code)}; stopping every process")
        return exit_status(code)

    left: list[Child] = []  # elastic: workers that failed and left the job, in the order seen
    failed_over: list[Child] = []  # replicated: servers that died, whose ranges their replicas serve
    while True:
        for p in procs:
            code = p.poll()
            if code is None or code == 0 or p in left or p in failed_over:
                continue
            if replicated and p in servers:  # the scheduler promotes its replicas, or fails the job if it cannot
                failed_over.append(p)
                say(f"{p.label} {describe_exit(code)}; its key ranges are served by their replicas")
                continue
            if elastic and p in workers:
                left.append(p)
                say(f"{p.label} {describe_exit(code)}; it leaves the elastic job, which goes on")
                continue
            return report(_culprit(p, procs, workers))
        if all(w.poll() is not None for w in workers) if elastic else all(w.poll() == 0 for w in workers):
            break
        # A daemon exits 0 only once the workers have said they are done, so a clean exit is not a failure.
        time.sleep(0.02)
    if left and len(left) == len(workers):  # nobody finished: the elastic job failed
        return report(left[0])
    # Workers are done: the scheduler tells the servers to stop; give them a moment to exit on their own.
    deadline = time.monotonic() + 10.0
    for p in (sched, *[s for s in servers if s not in failed_over]):
        try:
            code = p.wait(max(0.0, deadline - time.monotonic()))
        except PsrtTimeoutError:
            say(f"{p.label} did not exit after the workers finished; stopping it")
            continue
        if code != 0:
            return report(p)
    if left:  # the policy: an elastic job that completed exits 0, and says who left it on the way
        say("the elastic job completed; " + ", ".join(f"{p.label} ({describe_exit(p.poll() or 0)})" for p in left)
            + " left it")
    return 0


def _culprit(first: Child, procs: list[Child], workers: list[Child]) -> Child:
    """The process whose failure ends the job. When a worker's program fails, the scheduler names it to everyone
    and exits, and the others follow: so when a daemon is seen failing first, wait a moment (1 s at most) and
    blame the first worker seen failing, whose exit code is the user's, rather than a daemon that relayed it."""
    if first in workers:
        return first
    order = [first]
    deadline = time.monotonic() + 1.0
    while True:
        order += [p for p in procs if p not in order and p.poll() not in (None, 0)]
        if time.monotonic() > deadline or all(w.poll() is not None for w in workers):
            break
        time.sleep(0.02)
    return next((p for p in order if p in workers), first)
def scheduler_bind(endpoint: str) -> str:
    """Where ``psrt run``'s scheduler binds, given the job's scheduler endpoint ``tcp://HOST:PORT``.

    A scheduler listens on every interface only when asked (HOST ``0.0.0.0`` or ``*``). Otherwise it binds the
    address HOST names on this host: an address of this host as given, a name resolved (a local non-loopback
    address first). A name that resolves to loopback here binds loopback (with a warning: other hosts cannot
    reach it). An address that is not this host's (a Kubernetes Service name resolves to a virtual IP) is an
    error saying to set the URI to 0.0.0.0 on the scheduler.

    Raises
    ------
    ConfigError
        When HOST cannot be resolved, or is not an address of this host.
    """
    host, _, port = endpoint[len("tcp://"):].rpartition(":") if endpoint.startswith("tcp://") else ("", "", "")
    if not host:
        raise ConfigError(f"psrt run: the scheduler binds a TCP endpoint tcp://HOST:PORT, got {endpoint!r}")
    if host in _EVERYWHERE:
        return f"tcp://*:{port}"
    if host.startswith("["):  # an IPv6 literal: bound as given
        return endpoint
    try:
        found = [info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)]
    except OSError:
        raise ConfigError(f"psrt run: cannot resolve the scheduler's host {host!r} (DMLC_PS_ROOT_URI or "
                          "PSRT_SCHEDULER)") from None
    local = [a for a in dict.fromkeys(found) if _is_local(a)]
    if not local:
        shown = ", ".join(dict.fromkeys(found))
        raise ConfigError(f"psrt run: the scheduler's host {host!r}{f' ({shown})' if shown != host else ''} is not "
                          "an address of this host, so the scheduler cannot listen there; on the scheduler, set "
                          f"DMLC_PS_ROOT_URI=0.0.0.0 (or PSRT_SCHEDULER=tcp://0.0.0.0:{port}) to listen on every "
                          "interface, or give this host's own address")
    outside = [a for a in local if not ipaddress.ip_address(a).is_loopback]
    if not outside and _is_name(host) and host != "localhost":  # e.g. /etc/hosts maps this host's name so
        log.warning("the scheduler's host %r is loopback (%s) on this host: only processes of this host can reach "
                    "it; give the address other hosts reach it at, or 0.0.0.0 to listen on every interface",
                    host, local[0])
    return f"tcp://{(outside or local)[0]}:{port}"


def _is_name(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


def _is_local(address: str) -> bool:
    """Whether ``address`` is one of this host's (a socket can bind it); no packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def run_role(command: Sequence[str], cluster: Optional[ClusterConfig] = None) -> int:
    """Become the scheduler, a server, or a worker running ``command``, as the environment says."""
    cluster = cluster if cluster is not None else ClusterConfig.from_env()
    if cluster.role is None:
        raise ConfigError("psrt run: no role: set PSRT_ROLE (or DMLC_ROLE) to scheduler, server or worker, or start "
                          "under srun/mpirun with PSRT_NUM_SERVERS set")
    if cluster.scheduler is None:
        raise ConfigError("psrt run: set PSRT_SCHEDULER=tcp://HOST:PORT (or DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT)")
    if cluster.role == "scheduler":
        if cluster.num_servers is None or cluster.num_workers is None:
            raise ConfigError("psrt run: the scheduler needs PSRT_NUM_SERVERS and PSRT_NUM_WORKERS "
                              "(or DMLC_NUM_SERVER and DMLC_NUM_WORKER)")
        return run_scheduler(scheduler_bind(cluster.scheduler), cluster)
    if cluster.role == "server":
        return run_server(scheduler=cluster.scheduler, host=cluster.node_host or None)
    if not command:
        raise ConfigError("psrt run: a worker needs a command: psrt run -- python train.py")
    env = {**os.environ, "PSRT_ROLE": "worker", "PSRT_SCHEDULER": cluster.scheduler}
    if cluster.worker_id is not None:
        env["PSRT_WORKER_ID"] = str(cluster.worker_id)
    if cluster.num_workers is not None:
        env["PSRT_NUM_WORKERS"] = str(cluster.num_workers)
    try:
        return exit_status(subprocess.call(list(command), env=env))
    except OSError as exc:
        raise ConfigError(f"psrt run: cannot start {command[0]}: {exc.strerror or exc}") from None
