"""Helpers the benchmark scripts share: sizes on the command line and in tables, child processes, spawned
worker processes that report through a queue, the machine's memory-copy bandwidth, the psrt rows of the
comparison benches (plain usage and its variants) and the workload of ``bench/peers.py`` (here, so that spawned
processes and Ray actors unpickle it from an importable module).

Each script runs as ``python bench/NAME.py``, so this directory is on ``sys.path`` and ``import _common`` finds
this module. A model's byte count is :func:`psrt.emulation.models.model_bytes`; every child process is a
:class:`psrt.control.process.Child` (its own process group, stopped as a whole, dies with the bench).
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from psrt.control.process import SERVER_READY, Child, psrt_command
from psrt.emulation.models import parse_size as _parse_units
from psrt.errors import ConfigError

__all__ = ["parse_size", "human", "human_bytes", "start_child", "start_server", "Relay", "serving", "BenchError",
           "collect", "spawn", "join_or_kill", "free_port", "environ", "copy_bandwidth",
           "Variant", "VARIANTS", "shards", "Workload"]

_BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str, multiple: int = 1) -> int:
    """A positive count from the command line: ``4096``, ``64K``, ``1M``, ``4KiB``, ``16MiB`` or ``100MB``.

    A bare ``K``, ``M`` or ``G`` and ``KiB``/``MiB``/``GiB`` are binary multiples; ``KB``, ``MB`` and ``GB``
    decimal ones, as in ``psrt worker --model``. Raises :class:`argparse.ArgumentTypeError`, so it serves as an
    argparse ``type``.

    Parameters
    ----------
    text : str
        The size.
    multiple : int
        The value must be a multiple of this (4 for float32 bytes).
    """
    t = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGkmg])", t)
    try:
        value = int(float(m.group(1)) * _BINARY[m.group(2).upper()]) if m else _parse_units(t)
    except ConfigError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4096, 64K, 1M, 16MiB)") from None
    if value < 1 or value % multiple:
        what = f"a positive multiple of {multiple}" if multiple > 1 else "positive"
        raise argparse.ArgumentTypeError(f"size must be {what}, got {text!r}")
    return value


def _shorten(n: int) -> tuple[int, str]:
    for prefix, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return n // mult, prefix
    return n, ""


def human(n: int) -> str:
    """A count as the command line takes it: ``1048576`` -> ``"1M"`` (only exact binary multiples shorten)."""
    value, prefix = _shorten(n)
    return f"{value}{prefix}"


def human_bytes(n: int) -> str:
    """Bytes: ``65536`` -> ``"64 KiB"``, ``100`` -> ``"100 B"``."""
    value, prefix = _shorten(n)
    return f"{value} {prefix}iB" if prefix else f"{value} B"


def start_child(cmd: Sequence[str], ready: re.Pattern, timeout: float, **kwargs: Any) -> Child:
    """Start ``cmd`` and wait up to ``timeout`` seconds for its ready line; stopped again if it never comes.

    ``kwargs`` go to :class:`psrt.control.process.Child`. The endpoint is ``child.endpoint``; stop it with
    ``child.stop()``.
    """
    child = Child(cmd, ready=ready, **kwargs)
    try:
        child.wait_ready(timeout)
    except BaseException:
        child.stop()
        raise
    return child


def start_server(workers: int, timeout: float, bind: str = "tcp://127.0.0.1:*", mode: str = "sync",
                 **kwargs: Any) -> Child:
    """A ready ``psrt server --bind BIND --workers W --mode MODE`` child (output collected)."""
    cmd = psrt_command("server", "--bind", bind, "--workers", str(workers), "--mode", mode)
    return start_child(cmd, SERVER_READY, timeout, **{"label": "psrt server", **kwargs})


class Relay:
    """A TCP forwarder on 127.0.0.1 that records every byte it passes, each direction apart: to show what an
    eavesdropper on the link would read (the chaos bench and the security tests use it). :meth:`cut` closes the
    connections passing through while it keeps listening, so a peer connects again (a dropped link, as the
    failure-detection tests make one)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream[len("tcp://"):].rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.to_server = bytearray()
        self.to_client = bytearray()
        #: Connections accepted so far.
        self.accepted = 0
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            try:
                up = socket.create_connection(self.upstream, timeout=5)
            except OSError:  # the upstream is gone (its job ended): the peer's socket tries again, in vain
                conn.close()
                continue
            with self._lock:
                self._pairs.append((conn, up))
                self.accepted += 1
            for src, dst, record in ((conn, up, self.to_server), (up, conn, self.to_client)):
                t = threading.Thread(target=self._pump, args=(src, dst, record), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, record: bytearray) -> None:
        src.settimeout(0.1)
        while not self._stop.is_set():
            try:
                data = src.recv(1 << 16)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                break
            if not data:
                break
            with self._lock:
                record += data
            try:
                dst.sendall(data)
            except OSError:
                break
        _shut(src, dst)

    def cut(self) -> None:
        """Close every connection passing through (both of its ends): the peers see their connections drop."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            _shut(*pair)

    def close(self) -> None:
        """Stop forwarding."""
        self._stop.set()
        for t in self._threads:
            t.join(5)
        self.listener.close()
        for pair in self._pairs:
            for s in pair:
                s.close()


def _shut(*sockets: socket.socket) -> None:
    for s in sockets:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


@contextmanager
def serving(config: Any) -> Iterator[Any]:
    """An in-process shard (:class:`psrt.shard.server.Server` with ``config``) serving on a thread, so that its counters
    can be read exactly; stopped and closed on exit."""
    from psrt.shard.server import Server

    server = Server(config)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(10)
        server.close()


# ---------------------------------------------------------------------------------------------------- workers
class BenchError(RuntimeError):
    """A system failed to run (start-up, timeout, a worker's exception); the message says which and why."""


def collect(results: Any, procs: Sequence[Any], expected: int, deadline: float, what: str) -> list[dict[str, Any]]:
    """Gather ``expected`` result dicts from the queue ``results`` before ``deadline`` (``time.monotonic()``).

    A dict with an ``"error"`` entry (a worker's traceback), a process that exits with a non-zero code, all of
    them gone with results missing, or the deadline raise :class:`BenchError` naming ``what``.
    """
    got: list[dict[str, Any]] = []
    while len(got) < expected:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BenchError(f"{what}: {len(got)} of {expected} results arrived before the deadline "
                             "(--timeout)")
        try:
            msg = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise BenchError(f"{what}: process {dead[0].name} exited with code {dead[0].exitcode}") from None
            if all(p.exitcode is not None for p in procs):
                try:
                    msg = results.get(timeout=1.0)
                except queue.Empty:
                    raise BenchError(f"{what}: all processes exited but only {len(got)} of {expected} "
                                     "results arrived") from None
            else:
                continue
        if "error" in msg:
            raise BenchError(f"{what}: rank {msg.get('rank')} failed:\n{msg['error']}")
        got.append(msg)
    return got


def join_or_kill(procs: Sequence[Any], grace: float) -> None:
    """Join ``multiprocessing`` processes for up to ``grace`` seconds, then terminate, then kill what is left."""
    deadline = time.monotonic() + grace
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(ctx: Any, target: Callable[..., None], argsets: Sequence[tuple], name: str) -> list[Any]:
    """Start one daemon process of the ``multiprocessing`` context ``ctx`` per argument tuple, named ``name-i``."""
    procs = []
    for i, args in enumerate(argsets):
        p = ctx.Process(target=target, args=args, name=f"{name}-{i}", daemon=True)
        p.start()
        procs.append(p)
    return procs


@contextmanager
def environ(extra: Mapping[str, str] | Sequence[tuple[str, str]]) -> Iterator[None]:
    """Set ``extra`` in ``os.environ`` for the block (processes spawned in it inherit it), then restore."""
    extra = dict(extra)
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """The machine's memory-copy bandwidth in GB/s (1e9 bytes/s): ``np.copyto`` between two ``nbytes`` arrays,
    counted as bytes read plus bytes written (``2 * nbytes`` per copy), the best of ``repeats`` copies after one
    that touches every page."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


# ---------------------------------------------------------------------------------------------------- psrt rows
@dataclass(frozen=True)
class Variant:
    """How a bench runs psrt: the plain usage (the headline) or a variant beside it.

    Parameters
    ----------
    name : str
        The row's name, also what ``--systems``/``--variants`` take.
    ipc : bool
        Shards on Unix-socket endpoints (``ipc://`` in a private directory) instead of ``tcp://127.0.0.1:*``.
    out : bool
        Workers receive into the arrays they already hold (``out=``) instead of the plain call's result.
    tune : bool
        Workers call ``psrt.tune_allocator()`` (``psrt server`` always does it itself).
    env : tuple of (str, str)
        Environment of the shards and the workers on top of the bench's.
    """

    name: str
    ipc: bool = False
    out: bool = False
    tune: bool = False
    env: tuple[tuple[str, str], ...] = ()


#: The psrt rows of the comparison benches: plain usage first (the headline), then the knob-tuned and the
#: sockets-only variants. ``PSRT_SHM=0`` turns off the shared-memory data path between a worker and a shard of
#: one host where psrt has one (a psrt without it ignores the variable).
VARIANTS = {
    "psrt": Variant("psrt"),
    "psrt-tuned": Variant("psrt-tuned", ipc=True, out=True, tune=True),
    "psrt-sockets": Variant("psrt-sockets", env=(("PSRT_SHM", "0"),)),
}


@contextmanager
def shards(count: int, workers: int, mode: str, variant: Variant, deadline: float) -> Iterator[list[Child]]:
    """``count`` ready ``psrt server --workers W --mode MODE`` children for ``variant``, stopped on exit.

    Each binds ``tcp://127.0.0.1:*`` (``ipc://`` in a private temporary directory for ``variant.ipc``) and gets
    ``variant.env``; their endpoints are ``child.endpoint``. A shard that does not start raises
    :class:`BenchError` with its own words.
    """
    import shutil
    import tempfile

    from psrt.control.process import stop_children
    from psrt.errors import PsrtError

    sockdir = tempfile.mkdtemp(prefix="psrt-bench-") if variant.ipc else None
    children: list[Child] = []
    try:
        for i in range(count):
            bind = f"ipc://{sockdir}/server-{i}.sock" if sockdir else "tcp://127.0.0.1:*"
            try:
                children.append(start_server(workers, max(1.0, min(60.0, deadline - time.monotonic())), bind,
                                             mode=mode, label=f"psrt server {i}", env=dict(variant.env) or None))
            except PsrtError as exc:
                raise BenchError(f"{variant.name}: {exc}") from None
        yield children
    finally:
        stop_children(children, grace=10.0)
        if sockdir:
            shutil.rmtree(sockdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- peers.py
@dataclass(frozen=True)
class Workload:
    """The workload of ``bench/peers.py``; picklable, so every process rebuilds the same arrays from the seed.

    Parameters
    ----------
    elements : int
        Number of float32 values of the single tensor.
    workers : int
        W, the number of worker processes.
    servers : int
        S, the number of parameter-server shards.
    steps : int
        Timed steps per worker, after one warm-up step.
    lr : float
        SGD learning rate.
    timeout : float
        Seconds one system may take in all; also the limit of every single wait.
    seed : int
        Seed of the initial values and the gradient.
    """

    elements: int
    workers: int
    servers: int
    steps: int
    lr: float = 0.01
    timeout: float = 600.0
    seed: int = 1234

    def initial(self) -> np.ndarray:
        """The initial weights ``w0``: standard normal float32."""
        return np.random.default_rng(self.seed).standard_normal(self.elements, dtype=np.float32)

    def _base(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed + 1)
        return rng.integers(-64, 65, self.elements).astype(np.float32) / np.float32(64)

    def gradient(self, rank: int) -> np.ndarray:
        """Worker ``rank``'s constant gradient ``(rank + 1) * g`` (exact in float32)."""
        return self._base() * np.float32(rank + 1)

    def bounds(self) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` slice of the tensor each of the S baseline shards holds (near-equal slices)."""
        n, s = self.elements, self.servers
        return [(k * n // s, (k + 1) * n // s) for k in range(s)]

    def check(self, weights: np.ndarray) -> dict[str, Any]:
        """Compare final weights with ``w0 - (steps + 1) * lr * mean gradient``.

        Returns
        -------
        dict
            ``ok`` (bool), ``max_err`` (largest absolute difference) and ``tol`` (the bound it must not exceed).
        """
        w = np.asarray(weights).reshape(-1)
        if w.size != self.elements:
            return {"ok": False, "max_err": float("inf"), "tol": 0.0}
        n = self.steps + 1
        w0 = self.initial().astype(np.float64)
        mean_grad = self._base().astype(np.float64) * ((self.workers + 1) / 2)
        expected = w0 - n * self.lr * mean_grad
        err = float(np.max(np.abs(w.astype(np.float64) - expected))) if w.size else 0.0
        # Each float32 update rounds by at most about one ulp of the largest weight.
        scale = float(np.max(np.abs(w0))) + n * self.lr * float(np.max(np.abs(mean_grad))) + 1.0
        tol = 2.0 * n * float(np.finfo(np.float32).eps) * scale
        return {"ok": bool(np.isfinite(err) and err <= tol), "max_err": err, "tol": tol}
