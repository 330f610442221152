"""Starting a job's processes: the local launcher (``psrt launch``) and the role dispatcher (``psrt run``).

``psrt launch -s S -w W -- CMD ARGS`` starts a scheduler, S servers and W copies of CMD on this machine, with
the environment each needs, and prefixes every line they print with their role and rank. It exits with the
first failing exit code, and tears everything down on Ctrl-C or when any process dies; when the workers finish,
the scheduler tells the servers to stop and everything exits. Every child runs in its own process group, which
the launcher kills as a whole, and gets SIGTERM if the launcher itself dies (Linux), so no process outlives it.

``psrt run -- CMD`` is the one command line every process of a multi-host job can share (as with ps-lite): it
reads its role from the environment (see :class:`psrt.config.ClusterConfig`) and becomes the scheduler, a
server, or a worker that runs CMD.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Optional, Sequence

from psrt.config import ClusterConfig
from psrt.errors import ConfigError, PsrtTimeoutError

__all__ = ["launch", "run_role", "SCHEDULER_READY"]

SCHEDULER_READY = re.compile(r"psrt-scheduler ready endpoint=(\S+)")
_PR_SET_PDEATHSIG = 1


def _resolve_prctl():  # looked up once in the parent: the child must do as little as possible after fork
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _resolve_prctl()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


class _Proc:
    """A child process whose output is forwarded line by line with a prefix."""

    def __init__(self, label: str, cmd: Sequence[str], env: dict[str, str], out: IO[str], lock: threading.Lock,
                 watch: Optional[re.Pattern] = None) -> None:
        self.label = label
        self.proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     text=True, bufsize=1, start_new_session=True, preexec_fn=_die_with_parent)
        self.match: Optional[re.Match] = None
        self._seen = threading.Event()
        self._watch = watch
        self._thread = threading.Thread(target=self._pump, args=(out, lock), daemon=True)
        self._thread.start()

    def _pump(self, out: IO[str], lock: threading.Lock) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if self._watch is not None and self.match is None:
                self.match = self._watch.search(line)
                if self.match:
                    self._seen.set()
            with lock:
                out.write(f"[{self.label}] {line}")
                out.flush()
        self._seen.set()

    def wait_for_match(self, timeout: float) -> re.Match:
        if not self._seen.wait(timeout) or self.match is None:
            raise PsrtTimeoutError(f"{self.label} did not report ready within {timeout:g}s "
                                   f"(exit code {self.proc.poll()})")
        return self.match

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def finish(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)


def _teardown(procs: list[_Proc], grace: float = 5.0) -> None:
    for p in procs:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        p.signal(signal.SIGKILL)  # the whole group: children a worker started go too
        p.proc.wait()
        p.finish()


def launch(num_servers: int, num_workers: int, command: Sequence[str], mode: str = "sync",
           host: str = "127.0.0.1", start_timeout: float = 60.0, out: IO[str] = sys.stdout,
           extra_env: Optional[dict[str, str]] = None, transport: str = "auto", secure: bool = False) -> int:
    """Run a whole job on this machine; returns the exit code (the first failure's, else 0).

    Parameters
    ----------
    num_servers, num_workers : int
        S and W.
    command : sequence of str
        The worker program and its arguments; each copy gets ``PSRT_SCHEDULER``, ``PSRT_ROLE=worker``,
        ``PSRT_WORKER_ID``, ``PSRT_NUM_WORKERS``, ``PSRT_NUM_SERVERS`` and ``PSRT_MODE``.
    mode : str
        ``"sync"`` or ``"async"``.
    host : str
        Address the scheduler and servers bind on.
    start_timeout : float
        Seconds for the job to form.
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
    """
    if transport not in ("auto", "tcp", "ipc"):
        raise ConfigError(f"transport must be auto, tcp or ipc, got {transport!r}")
    if transport == "auto":
        transport = "ipc" if host in ("127.0.0.1", "localhost") and os.name == "posix" else "tcp"
    if num_servers < 1 or num_workers < 1:
        raise ConfigError(f"need -s >= 1 and -w >= 1, got -s {num_servers} -w {num_workers}")
    if not command:
        raise ConfigError("no worker command: use psrt launch -s S -w W -- CMD ARGS")
    lock = threading.Lock()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    if threading.current_thread() is threading.main_thread():
        # SIGTERM to the launcher tears the job down like Ctrl-C does.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    me = [sys.executable, "-m", "psrt.cli"]
    procs: list[_Proc] = []
    sockdir = tempfile.mkdtemp(prefix="psrt-") if transport == "ipc" else None
    keydir = tempfile.mkdtemp(prefix="psrt-keys-") if secure else None  # mkdtemp: 0700, only this user
    try:
        if keydir:
            from psrt.security import keygen

            keygen(keydir)
            env["PSRT_KEYS"] = keydir
        sched = _Proc("scheduler", [*me, "scheduler", "--bind", f"tcp://{host}:*", "--servers", str(num_servers),
                                    "--workers", str(num_workers), "--mode", mode, "--timeout", str(start_timeout)],
                      env, out, lock, watch=SCHEDULER_READY)
        procs.append(sched)
        endpoint = sched.wait_for_match(30.0).group(1)
        job_env = {**env, "PSRT_SCHEDULER": endpoint, "PSRT_NUM_SERVERS": str(num_servers),
                   "PSRT_NUM_WORKERS": str(num_workers), "PSRT_MODE": mode, "PSRT_START_TIMEOUT": str(start_timeout)}
        def bind(i: int) -> list[str]:
            return ["--bind", f"ipc://{sockdir}/server-{i}.sock"] if sockdir else []

        servers = [_Proc(f"server {i}", [*me, "server", "--scheduler", endpoint, "--host", host, *bind(i)],
                         {**job_env, "PSRT_ROLE": "server"}, out, lock) for i in range(num_servers)]
        procs.extend(servers)
        workers = [_Proc(f"worker {i}", command, {**job_env, "PSRT_ROLE": "worker", "PSRT_WORKER_ID": str(i)},
                         out, lock) for i in range(num_workers)]
        procs.extend(workers)
        return _supervise(sched, servers, workers, procs, out, lock)
    except KeyboardInterrupt:
        with lock:
            out.write("psrt launch: interrupted; stopping every process\n")
        return 130
    finally:
        _teardown(procs)
        if sockdir:
            shutil.rmtree(sockdir, ignore_errors=True)
        if keydir:
            shutil.rmtree(keydir, ignore_errors=True)


def _supervise(sched: _Proc, servers: list[_Proc], workers: list[_Proc], procs: list[_Proc], out: IO[str],
               lock: threading.Lock) -> int:
    def report(p: _Proc, code: int) -> int:
        with lock:
            out.write(f"psrt launch: {p.label} exited with code {code}; stopping every process\n")
        return code

    while True:
        for p in procs:
            code = p.proc.poll()
            if code is not None and code != 0:
                return report(p, code)
        if all(w.proc.poll() == 0 for w in workers):
            break
        # A daemon exits 0 only once the workers have said they are done, so a clean exit is not a failure.
        time.sleep(0.02)
    # Workers are done: the scheduler tells the servers to stop; give them a moment to exit on their own.
    deadline = time.monotonic() + 10.0
    for p in (sched, *servers):
        try:
            code = p.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with lock:
                out.write(f"psrt launch: {p.label} did not exit after the workers finished; stopping it\n")
            continue
        if code != 0:
            return report(p, code)
    return 0


def run_role(command: Sequence[str], cluster: Optional[ClusterConfig] = None) -> int:
    """Become the scheduler, a server, or a worker running ``command``, as the environment says."""
    cluster = cluster if cluster is not None else ClusterConfig.from_env()
    if cluster.role is None:
        raise ConfigError("psrt run: no role: set PSRT_ROLE (or DMLC_ROLE) to scheduler, server or worker, or start "
                          "under srun/mpirun with PSRT_NUM_SERVERS set")
    if cluster.scheduler is None:
        raise ConfigError("psrt run: set PSRT_SCHEDULER=tcp://HOST:PORT (or DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT)")
    from psrt import cli

    if cluster.role == "scheduler":
        if cluster.num_servers is None or cluster.num_workers is None:
            raise ConfigError("psrt run: the scheduler needs PSRT_NUM_SERVERS and PSRT_NUM_WORKERS "
                              "(or DMLC_NUM_SERVER and DMLC_NUM_WORKER)")
        port = cluster.scheduler.rsplit(":", 1)[-1]
        return cli.main(["scheduler", "--bind", f"tcp://*:{port}", "--servers", str(cluster.num_servers),
                         "--workers", str(cluster.num_workers), "--mode", cluster.mode,
                         "--timeout", str(cluster.start_timeout)])
    if cluster.role == "server":
        args = ["server", "--scheduler", cluster.scheduler]
        if cluster.node_host:
            args += ["--host", cluster.node_host]
        return cli.main(args)
    if not command:
        raise ConfigError("psrt run: a worker needs a command: psrt run -- python train.py")
    env = {**os.environ, "PSRT_ROLE": "worker", "PSRT_SCHEDULER": cluster.scheduler}
    if cluster.worker_id is not None:
        env["PSRT_WORKER_ID"] = str(cluster.worker_id)
    if cluster.num_workers is not None:
        env["PSRT_NUM_WORKERS"] = str(cluster.num_workers)
    return subprocess.call(list(command), env=env)
