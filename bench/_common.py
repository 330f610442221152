"""Helpers the benchmark scripts share: sizes on the command line and in tables, and child processes.

Each script runs as ``python bench/NAME.py``, so this directory is on ``sys.path`` and ``import _common`` finds
this module. A model's byte count is :func:`psrt.models.model_bytes`; every child process is a
:class:`psrt.process.Child` (its own process group, stopped as a whole, dies with the bench).
"""

from __future__ import annotations

import argparse
import re
import socket
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from psrt.errors import ConfigError
from psrt.models import parse_size as _parse_units
from psrt.process import SERVER_READY, Child, psrt_command

__all__ = ["parse_size", "human", "human_bytes", "start_child", "start_server", "Relay", "serving"]

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

    ``kwargs`` go to :class:`psrt.process.Child`. The endpoint is ``child.endpoint``; stop it with ``child.stop()``.
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
    eavesdropper on the link would read (the chaos bench and the security tests use it)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream[len("tcp://"):].rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.to_server = bytearray()
        self.to_client = bytearray()
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
            up = socket.create_connection(self.upstream, timeout=5)
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
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Stop forwarding."""
        self._stop.set()
        for t in self._threads:
            t.join(5)
        self.listener.close()


@contextmanager
def serving(config: Any) -> Iterator[Any]:
    """An in-process shard (:class:`psrt.server.Server` with ``config``) serving on a thread, so that its counters
    can be read exactly; stopped and closed on exit."""
    from psrt.server import Server

    server = Server(config)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(10)
        server.close()
