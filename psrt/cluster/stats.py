"""Operating a running job found through its scheduler: ``psrt stats`` (a live table of every shard) and
``psrt checkpoint`` (every shard writes a checkpoint now)."""

from __future__ import annotations

import sys
import time
from typing import IO, Any, Optional

from psrt import transport
from psrt.checks import check_seconds
from psrt.config import ClientConfig
from psrt.control.link import SchedulerLink, Table
from psrt.control.metrics import per_worker
from psrt.errors import ConfigError, PsrtError
from psrt.worker.client import Client

__all__ = ["watch", "format_table", "format_ranges", "format_workers", "job_table", "checkpoint_job"]

COLUMNS = ("shard", "keys", "MB", "pushes", "pulls", "rounds", "queued", "deferred", "errors", "MB/s in",
           "MB/s out", "MB in", "kB in/push", "% shm in")


def _in(r: dict[str, Any]) -> int:
    """Bytes received, over the socket and through shared memory (docs/sharedmem.md)."""
    return r["bytes_in"] + r.get("shm_bytes_in", 0)


def _out(r: dict[str, Any]) -> int:
    return r["bytes_out"] + r.get("shm_bytes_out", 0)


def format_table(rows: list[dict[str, Any]], previous: Optional[list[dict[str, Any]]], seconds: float) -> str:
    """Render per-shard stats (and rates against the previous sample) as a fixed-width text table."""
    lines = [" ".join(f"{c:>10}" if i else f"{c:<24}" for i, c in enumerate(COLUMNS))]
    for i, r in enumerate(rows):
        prev = previous[i] if previous and i < len(previous) else None
        rate_in = (_in(r) - _in(prev)) / seconds / 1e6 if prev and seconds > 0 else 0.0
        rate_out = (_out(r) - _out(prev)) / seconds / 1e6 if prev and seconds > 0 else 0.0
        cells = [r["endpoint"], r["keys"], f"{r['param_bytes'] / 1e6:.1f}", r["pushes"], r["pulls"], r["rounds"],
                 r["queued_pulls"], r["deferred_pushes"], r["errors"], f"{rate_in:.1f}", f"{rate_out:.1f}",
                 f"{_in(r) / 1e6:.1f}", f"{_in(r) / max(1, r['pushes']) / 1e3:.1f}",
                 f"{100 * r.get('shm_bytes_in', 0) / max(1, _in(r)):.0f}"]
        lines.append(" ".join(f"{c:>10}" if j else f"{c:<24}" for j, c in enumerate(map(str, cells))))
    return "\n".join(lines)


def format_ranges(table: Table) -> str:
    """A replicated job's key ranges, one line each: the shard serving it (and where), then its replicas; empty for
    a job without replicas."""
    info = table.replication
    if info is None:
        return ""
    lines = [f"replicas R={info.replicas}: key range -> primary (serving at), replicas"]
    for k, holders in enumerate(info.holders):
        where = table.servers[k] if k < len(table.servers) else "?"
        if not holders:
            lines.append(f"  range {k}: lost (no live shard holds it)")
            continue
        rest = ", ".join(f"shard {j}" for j in holders[1:]) or "none left"
        lines.append(f"  range {k}: shard {holders[0]} ({where}), replicas: {rest}")
    return "\n".join(lines)


WORKER_COLUMNS = ("worker", "host", "pushes", "late p50 ms", "late p99 ms", "dropped")


def format_workers(rows: list[dict[str, Any]]) -> str:
    """Who is slow: per worker, over every shard, how late its pushes came after their round's first push (the
    worst shard's median and p99) and how many were dropped as too late (backup workers); "" when no shard
    measured any (no sync rounds)."""
    workers: dict[int, dict[str, Any]] = {}
    for r in rows:
        for rank, w in per_worker(r).items():
            seen = workers.setdefault(rank, {"host": "", "pushes": 0, "dropped": 0, "p50": 0.0, "p99": 0.0})
            seen["host"] = seen["host"] or w.get("host", "")
            seen["pushes"] += w.get("pushes", 0)
            seen["dropped"] += w.get("dropped", 0)
            seen["p50"] = max(seen["p50"], w.get("late_p50_s", 0.0))
            seen["p99"] = max(seen["p99"], w.get("late_p99_s", 0.0))
    if not workers:
        return ""
    lines = [" ".join(f"{c:>12}" for c in WORKER_COLUMNS)]
    for rank in sorted(workers):
        w = workers[rank]
        cells = [rank, w["host"] or "?", w["pushes"], f"{1e3 * w['p50']:.1f}", f"{1e3 * w['p99']:.1f}", w["dropped"]]
        lines.append(" ".join(f"{c:>12}" for c in map(str, cells)))
    return "\n".join(lines)


def watch(scheduler: str, interval: float = 1.0, count: Optional[int] = None, out: IO[str] = sys.stdout) -> int:
    """Print the table every ``interval`` seconds, ``count`` times (None: until interrupted).

    With ``PSRT_KEYS`` set, every connection uses the job's keys (a secured job answers nothing else).

    Raises
    ------
    ConfigError
        When ``interval`` is not a finite number of seconds > 0 or ``count`` is not a whole number >= 1.
    PsrtError
        When the job has no servers yet, or a shard does not answer.
    """
    check_seconds(interval, "interval")
    if interval == float("inf") or (count is not None and (type(count) is not int or count < 1)):
        raise ConfigError(f"need a finite interval > 0 and a count >= 1 (or None), got {interval!r} and {count!r}")
    config = ClientConfig()
    table = _formed(scheduler, job_table(scheduler, config))
    previous, last, shown = None, time.monotonic(), 0
    client = Client(table.servers, rank=0, num_workers=max(1, table.num_workers), config=config)
    try:
        while True:
            rows = client.stats(timeout=max(2.0, interval))
            now = time.monotonic()
            ranges = format_ranges(table)
            backup = f"  b={table.backup_workers}" if table.backup_workers else ""
            slow = format_workers(rows)
            out.write(f"\n{time.strftime('%H:%M:%S')}  {table.mode}  W={table.num_workers}  "
                      f"S={table.num_servers}{backup}\n{format_table(rows, previous, now - last)}\n"
                      + (f"{ranges}\n" if ranges else "") + (f"{slow}\n" if slow else ""))
            out.flush()
            previous, last, shown = rows, now, shown + 1
            if count is not None and shown >= count:
                return 0
            time.sleep(interval)
            if table.replication is not None:  # a range may have moved to a replica meanwhile
                fresh = job_table(scheduler, config)
                if fresh.servers != table.servers:
                    client.close()
                    client = Client(fresh.servers, rank=0, num_workers=max(1, fresh.num_workers), config=config)
                    previous = None
                table = fresh
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def job_table(scheduler: str, config: ClientConfig, timeout: float = 5.0) -> Table:
    """The scheduler's view of its job (shards, W, S, mode), asked with the job's keys when ``config`` has them;
    waits at most ``timeout`` seconds for the answer."""
    ctx = transport.new_context()
    try:
        link = SchedulerLink(ctx, scheduler, keys=config.keys)
        try:
            return link.table(timeout)
        finally:
            link.close()
    finally:
        ctx.term()


def _formed(scheduler: str, table: Table) -> Table:
    """``table`` if servers have joined the job (else there is nobody to ask)."""
    if not table.servers:
        raise PsrtError(f"scheduler {scheduler}: no servers have joined yet (expecting {table.num_servers} servers, "
                        f"{table.num_workers} workers); try again once the job has formed")
    return table


def checkpoint_job(scheduler: str, timeout: float = 60.0, out: IO[str] = sys.stdout) -> int:
    """Ask every shard of the job to write a checkpoint now, waiting at most ``timeout`` seconds for the scheduler
    and again for the shards; prints each file; returns the exit code."""
    check_seconds(timeout, "timeout")
    config = ClientConfig()
    table = _formed(scheduler, job_table(scheduler, config, timeout))
    with Client(table.servers, rank=0, num_workers=max(1, table.num_workers), config=config) as client:
        for endpoint, path in zip(table.servers, client.checkpoint(timeout=timeout)):
            out.write(f"{endpoint}: {path}\n")
    return 0
