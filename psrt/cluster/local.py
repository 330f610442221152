"""Shard servers as child processes on this machine: for the demo, tests and benchmarks.

:class:`LocalShards` starts S ``psrt server`` processes on ephemeral loopback ports, reads each one's endpoint
from its ready line, and stops them all on exit (terminate, then kill after a grace period), so no process is
left behind even when the caller fails.
"""

from __future__ import annotations

import subprocess
from typing import Optional, Sequence

from psrt.control.process import SERVER_READY, Child, psrt_command, stop_children

__all__ = ["LocalShards", "READY_LINE"]

#: The line a server prints once it is bound and serving (defined in :mod:`psrt.control.process`).
READY_LINE = SERVER_READY


class LocalShards:
    """Start ``num_servers`` shard servers on loopback; use as a context manager.

    Parameters
    ----------
    num_servers : int
        How many shards to start.
    num_workers : int
        W, passed to every shard.
    mode : str
        ``"sync"``, ``"async"`` or ``"ssp"``.
    host : str
        Address to bind (ports are ephemeral).
    extra_args : sequence of str
        More ``psrt server`` flags.
    timeout : float
        Seconds to wait for each server's ready line.
    stderr : int or None
        Where the servers' stderr goes (default: inherited).

    Attributes
    ----------
    endpoints : list of str
        The servers' endpoints, in start order.
    children : list of Child
        The server processes; ``procs`` are their :class:`subprocess.Popen` objects.
    """

    def __init__(self, num_servers: int, num_workers: int, mode: str = "sync", host: str = "127.0.0.1",
                 extra_args: Sequence[str] = (), timeout: float = 30.0, stderr: Optional[int] = None) -> None:
        self.children: list[Child] = []
        self.endpoints: list[str] = []
        try:
            for i in range(num_servers):
                cmd = psrt_command("server", "--bind", f"tcp://{host}:*", "--workers", str(num_workers),
                                   "--mode", mode, "--rank", str(i), *extra_args)
                self.children.append(Child(cmd, label=f"psrt server {i}", ready=SERVER_READY, stderr=stderr))
            for child in self.children:
                self.endpoints.append(child.wait_ready(timeout).group(1))
        except BaseException:
            self.close()
            raise

    @property
    def procs(self) -> list[subprocess.Popen]:
        """The server processes."""
        return [c.proc for c in self.children]

    def alive(self) -> list[bool]:
        """Whether each server process is still running."""
        return [c.poll() is None for c in self.children]

    def close(self, grace: float = 10.0) -> list[Optional[int]]:
        """Stop every server (SIGTERM, then SIGKILL after ``grace`` seconds); returns their exit codes."""
        return list(stop_children(self.children, grace))

    def __enter__(self) -> LocalShards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
