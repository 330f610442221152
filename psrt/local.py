"""Shard servers as child processes on this machine: for the demo, tests and benchmarks.

:class:`LocalShards` starts S ``psrt server`` processes on ephemeral loopback ports, reads each one's endpoint
from its ready line, and stops them all on exit (terminate, then kill after a grace period), so no process is
left behind even when the caller fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Optional, Sequence

from psrt.errors import PsrtTimeoutError

__all__ = ["LocalShards", "READY_LINE"]

#: The line a server prints once it is bound and serving.
READY_LINE = re.compile(r"psrt-server ready endpoint=(\S+)")


class LocalShards:
    """Start ``num_servers`` shard servers on loopback; use as a context manager.

    Parameters
    ----------
    num_servers : int
        How many shards to start.
    num_workers : int
        W, passed to every shard.
    mode : str
        ``"sync"`` or ``"async"``.
    host : str
        Address to bind (ports are ephemeral).
    extra_args : sequence of str
        More ``psrt server`` flags.
    timeout : float
        Seconds to wait for each server's ready line.
    stderr : int or None
        Where the servers' stderr goes (default: inherited).
    """

    def __init__(self, num_servers: int, num_workers: int, mode: str = "sync", host: str = "127.0.0.1",
                 extra_args: Sequence[str] = (), timeout: float = 30.0, stderr: Optional[int] = None) -> None:
        self.procs: list[subprocess.Popen] = []
        self.endpoints: list[str] = []
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            for _ in range(num_servers):
                cmd = [sys.executable, "-m", "psrt.cli", "server", "--bind", f"tcp://{host}:*",
                       "--workers", str(num_workers), "--mode", mode, *extra_args]
                self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env))
            for proc in self.procs:
                self.endpoints.append(self._wait_ready(proc, timeout))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _wait_ready(proc: subprocess.Popen, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        buf = ""
        while time.monotonic() < deadline:
            chunk = proc.stdout.readline()
            if chunk:
                buf += chunk
                match = READY_LINE.search(buf)
                if match:
                    os.set_blocking(proc.stdout.fileno(), True)
                    return match.group(1)
            elif proc.poll() is not None:
                raise RuntimeError(f"psrt server exited with code {proc.returncode} before it was ready: {buf!r}")
            else:
                time.sleep(0.01)
        raise PsrtTimeoutError(f"psrt server did not report ready within {timeout:g}s")

    def alive(self) -> list[bool]:
        """Whether each server process is still running."""
        return [p.poll() is None for p in self.procs]

    def close(self, grace: float = 10.0) -> list[Optional[int]]:
        """Stop every server (SIGTERM, then SIGKILL after ``grace`` seconds); returns their exit codes."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        codes = []
        for p in self.procs:
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(grace)
            if p.stdout is not None:
                p.stdout.close()
            codes.append(p.returncode)
        return codes

    def __enter__(self) -> LocalShards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
