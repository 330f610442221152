"""A shard's checkpoints over its life: the rank that names them, the restore at start, and when it writes them.

A checkpoint belongs to the shard's rank, not its address (:mod:`psrt.shard.checkpoint` names the files). By hand, the
rank is ``--rank R``, else the one of the checkpoint restored (the directory's only shard), else 0. Under a
scheduler the scheduler gives the rank: a shard asks for the one its checkpoint belongs to when it registers
(:meth:`Checkpointer.claim`), and restores once the table has come (:meth:`Recovery.join`), so the mode and W it
compares the checkpoint with are the job's. A directory holding checkpoints, none of them this shard's, is an
error that names what it holds; an empty one is a first run, and said so in the log.

Checkpoints are written every ``checkpoint_every`` rounds, every ``checkpoint_secs`` seconds, on request, and at
a clean shutdown (:meth:`Recovery.checkpoint_at_exit`), so a job that finished resumes exactly where it ended.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from psrt import wire
from psrt.config import ServerConfig
from psrt.errors import ConfigError, RequestRefused
from psrt.shard.checkpoint import (
    CheckpointError,
    Restored,
    TableState,
    choose,
    file_prefix,
    files_of,
    holdings,
    load_latest,
    rank_of,
    save,
)
from psrt.shard.store import Store

if TYPE_CHECKING:
    from psrt.shard.counters import Counters
    from psrt.shard.tables import TableService
    from psrt.shm.lanes import ShardLanes

__all__ = ["Checkpointer", "Recovery"]

log = logging.getLogger("psrt.checkpoint")


class Checkpointer:
    """When a shard writes its checkpoints, and where; its rank, and its restore at start.

    Parameters
    ----------
    config : ServerConfig
        ``checkpoint_dir``, ``checkpoint_every``, ``checkpoint_secs``, ``restore``, ``rank`` and the mode.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.directory = Path(config.checkpoint_dir) if config.checkpoint_dir else None
        self.restoring, self.rank = config.restore, config.rank
        self.prefix = ""  # file_prefix(rank), once start() has taken the rank
        self.every, self.secs, self.mode = config.checkpoint_every, config.checkpoint_secs, config.mode
        self._next = self.every  # sync: the version every key must reach for the next checkpoint
        self._pushes = 0  # async: pushes at the last checkpoint
        self._time = time.monotonic()
        self._dirty = False
        self._lock: Optional[int] = None
        self._legacy: Optional[str] = None  # restored from an older psrt's endpoint-named files: removed once saved
        self.full_every = config.checkpoint_full_every
        self._chain: Optional[tuple[str, str]] = None  # (full file, last file) the next delta builds on
        self._deltas = 0  # deltas written since the last full checkpoint

    @property
    def enabled(self) -> bool:
        """Whether the shard has a checkpoint directory."""
        return self.directory is not None

    def claim(self) -> tuple[int, bool]:
        """Before registering with a scheduler: the rank to ask for (-1: any) and whether this shard resumes
        from a checkpoint (and so may take back the slot of a shard that died).

        Raises
        ------
        ConfigError
            With ``restore``, when the directory holds checkpoints but none of this shard's (see :func:`choose`).
        """
        asked = -1 if self.rank is None else self.rank
        if not self.restoring or self.directory is None or not (held := holdings(self.directory)):
            return asked, False
        if self.rank is None and len(held) > 1:
            return -1, True  # the scheduler knows which slot waits for a restart; start() checks its files are here
        rank = rank_of(choose(self.directory, self.rank) or "")
        return (asked if rank is None else rank), True

    def start(self, rank: Optional[int] = None) -> Optional[Restored]:
        """Take this shard's rank, lock its files, and with ``restore`` read its newest complete checkpoint.

        ``rank`` is the scheduler's; by hand, ``config.rank``, else the restored shard's, else 0. Returns None
        when there is nothing to restore (no ``restore``, or no checkpoint at all: a first run, said in the log).

        Raises
        ------
        ConfigError
            When the directory holds checkpoints but none of this rank's (see :func:`choose`).
        CheckpointError
            When another running shard holds this rank's files, or none of them can be read.
        """
        assert self.directory is not None
        rank = self.rank if rank is None else rank
        source = choose(self.directory, rank) if self.restoring else None
        self.rank = (rank_of(source or "") if rank is None else rank) or 0
        self.prefix = file_prefix(self.rank)
        self._take_lock()
        if not self.restoring:
            return None
        if source is None:
            log.warning("--restore: no checkpoint in %s yet: rank %d starts fresh (the first run of this shard)",
                        self.directory, self.rank)
            return None
        found = load_latest(self.directory, source)
        if found is None:
            raise CheckpointError(f"--restore: no checkpoint of {source} in {self.directory} can be read (see the "
                                  "warnings above); move them away to start this shard fresh")
        self._legacy = source if source != self.prefix else None
        versions = [e.version for e in found.store.entries.values()]
        self.mode = found.store.mode
        if self.every:
            self._next = (min(versions, default=0) // self.every + 1) * self.every
        log.warning("rank %d restored %d keys (versions %d..%d) and %d tables from %s", self.rank, len(versions),
                    min(versions, default=0), max(versions, default=0), len(found.tables), found.path)
        return found

    def align(self, version: int) -> None:
        """Count the rounds to the next checkpoint from ``version`` (a range taken over at that version)."""
        if self.every:
            self._next = (version // self.every + 1) * self.every

    def _take_lock(self) -> None:
        assert self.directory is not None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.directory / f".{self.prefix}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise CheckpointError(f"cannot use the checkpoint directory {self.directory}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the kernel lets go when this process ends, however
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointError(f"another running shard (pid {holder}) writes the checkpoints of rank {self.rank} "
                                  f"in {self.directory}; give each shard of a job its own --rank R (its place in "
                                  "the workers' list of servers), or its own --checkpoint-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock = fd

    def close(self) -> None:
        """Let go of this rank's files (another shard may take the rank)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def next_is_delta(self) -> bool:
        """Whether the next checkpoint may be a delta: a full one of this run is on disk, and fewer than
        ``full_every - 1`` deltas follow it (after a restore, the first is full)."""
        return self._chain is not None and self._deltas + 1 < self.full_every

    def save(self, store: Store, pushes: int, tables: Optional[TableState] = None, delta: bool = False) -> Path:
        """Write a checkpoint now (:func:`psrt.shard.checkpoint.save`); ``delta``: ``tables`` holds deltas
        (:meth:`next_is_delta` said so)."""
        assert self.directory is not None and self.prefix
        started = time.monotonic()
        chain = self._chain if delta else None
        path = save(store, self.directory, self.prefix, {"prefix": self.prefix, "rank": self.rank}, tables, chain)
        self._chain, self._deltas = (chain[0], path.name) if chain else (path.name, path.name), \
            self._deltas + 1 if chain else 0
        self._time, self._pushes, self._dirty = time.monotonic(), pushes, False
        if self._legacy is not None:  # their state is in this rank's own file now
            for old in files_of(self.directory, self._legacy):
                old.unlink(missing_ok=True)
            log.warning("removed the older checkpoints %s* restored from: rank %d's files carry them on",
                        self._legacy, self.rank)
            self._legacy = None
        log.info("checkpoint %s written in %.3fs", path, time.monotonic() - started)
        return path

    def due_after_rounds(self, store: Store, pushes: int) -> bool:
        """After rounds completed: whether they reach the next multiple of ``every`` (sync) or ``every`` more
        pushes were applied (async)."""
        self._dirty = True
        if not self.every or self.directory is None:
            return False
        if self.mode == "async":
            return pushes - self._pushes >= self.every
        if min((e.version for e in store.entries.values()), default=0) < self._next:
            return False
        self._next += self.every
        return True

    def due_by_time(self) -> bool:
        """Whether ``secs`` have passed since the last checkpoint and something changed."""
        if not self.secs or not self._dirty or self.directory is None:
            return False
        if time.monotonic() - self._time < self.secs:
            return False
        self._time = time.monotonic()  # a failed write is retried one period later, not on every poll
        return True


class Recovery:
    """The checkpoint half of :class:`psrt.shard.server.Server`: restore at start, and writing checkpoints."""

    config: ServerConfig
    store: Store
    tables: TableService
    lanes: ShardLanes
    counters: Counters
    restored_from: Optional[Path]
    _ckpt: Checkpointer
    #: Under a scheduler: the rank taken before registering, and what it restored then.
    _early: Optional[tuple[int, Optional[Restored]]] = None

    def checkpoint_claim(self) -> tuple[int, bool]:
        """Before registering: the rank to ask the scheduler for (-1: any) and whether this shard resumes from a
        checkpoint (:meth:`Checkpointer.claim`). A rank it knows is taken, and its checkpoint read, now: the
        scheduler hears from a restarted shard once it serves, and reading a large one takes time."""
        if not self._ckpt.enabled:
            return -1 if self.config.rank is None else self.config.rank, False
        rank, resuming = self._ckpt.claim()
        if rank >= 0:
            self._early = (rank, self._ckpt.start(rank))
        return rank, resuming

    def join(self, table: wire.Table) -> None:
        """Adopt the rank, W, mode and staleness of the scheduler's table and, with ``restore``, resume from the
        checkpoint of that rank (before serving)."""
        asked = self.config.rank if self._early is None else self._early[0]
        if asked is not None and table.rank != asked:
            raise ConfigError(f"asked the scheduler for rank {asked} but got {table.rank}")
        self.set_job(table.num_workers, table.mode, table.staleness, table.backup_workers)
        self._restore(table)

    def set_job(self, num_workers: int, mode: str, staleness: int = 0, backup_workers: int | str = 0) -> None:
        """Adopt W, the mode, the staleness bound and the backup workers the scheduler's table gives (before
        serving)."""
        # (An elastic job's W is its members when the table was sent, maybe fewer than b + 1: its rounds count
        # the members, and the config only keeps b below that W.)
        self.config = dataclasses.replace(self.config, num_workers=num_workers, mode=mode, staleness=staleness,
                                          backup_workers=backup_workers if backup_workers == "auto"
                                          else min(backup_workers, num_workers - 1))
        self.store.set_job(mode, num_workers, backup_workers)
        self.tables.staleness = staleness
        self._ckpt.mode = mode

    def _restore(self, table: Optional[wire.Table] = None) -> None:
        """Take the rank (the table's, or by hand) and restore its checkpoint, if any."""
        if not self._ckpt.enabled:
            return
        early = self._early
        found = early[1] if early is not None else self._ckpt.start(None if table is None else table.rank)
        if found is None:
            return
        store, path = found.store, found.path
        self.tables.store = store
        self.tables.restore(found.tables, found.table_logs)
        mode, workers = self.config.mode, self.config.num_workers
        # An elastic job's W is the number of members when the table was sent: it may differ and that is fine.
        if store.mode != mode or (store.num_workers != workers and not (table is not None and table.elastic)):
            source = "the job (from the scheduler)" if table is not None else "this shard's command line"
            log.warning("checkpoint %s was taken in %s mode with W=%d; %s says %s mode with W=%d; resuming in %s",
                        path, store.mode, store.num_workers, source, mode, workers,
                        "the job's" if table is not None else "the checkpoint's")
        if table is None:  # by hand, the checkpoint knows best what the shard was
            self.config = dataclasses.replace(self.config, mode=store.mode, num_workers=store.num_workers)
            store.set_job(store.mode, store.num_workers, self.config.backup_workers)
        else:  # under a scheduler, the job's table does
            store.set_job(mode, workers, self.config.backup_workers)
            self._ckpt.mode = mode
        store.use_shared_memory(self.lanes.arena)
        self.store, self.restored_from = store, path

    def checkpoint(self) -> Path:
        """Write a checkpoint now; returns its path.

        Raises
        ------
        RequestRefused
            When the shard has no checkpoint directory.
        CheckpointError
            When the file cannot be written.
        """
        if not self._ckpt.enabled:
            raise RequestRefused("no_checkpoint_dir", "this shard was started without --checkpoint-dir")
        delta = bool(self.tables.tables) and self._ckpt.next_is_delta()  # dense keys alone: always full
        path = self._ckpt.save(self.store, self.counters.pushes, self.tables.state(delta), delta)
        self.tables.saved()  # the next delta holds what changes from now
        self.counters.checkpoints += 1
        return path

    def checkpoint_at_exit(self) -> Optional[Path]:
        """At a clean shutdown: write a checkpoint (with a checkpoint directory), so the job resumes exactly."""
        if not self._ckpt.enabled or not self._ckpt.prefix:
            return None
        try:
            path = self.checkpoint()
        except CheckpointError as exc:
            log.error("%s; the shard stops without a final checkpoint", exc)
            return None
        log.warning("final checkpoint %s written", path)
        return path

    def _after_rounds(self) -> None:
        if self._ckpt.due_after_rounds(self.store, self.counters.pushes):
            self._checkpoint_quietly()

    def _checkpoint_quietly(self) -> None:
        try:
            self.checkpoint()
        except CheckpointError as exc:
            log.error("%s; training goes on", exc)
