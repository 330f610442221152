"""Shard checkpoints: everything a shard must keep to resume exactly, written so that a torn file is never loaded.

A checkpoint holds, for every key, the parameters, the optimizer (by name, never a pickle) and its state slots,
the version, and the sync round in progress (its accumulator and who is in it); and the per-worker push sequence
numbers, the mode, W and the elastic members. The sequence numbers travel in the same file as the parameters:
restored together, they keep every push exactly-once across a restart.

File layout: ``MAGIC``, an 8-byte header length, a msgpack header describing every array, the raw arrays one after
the other, and a trailer of ``TRAILER_MAGIC``, the length of everything before it, and its CRC-32. A file is
written to a temporary name in the same directory, flushed and ``fsync``-ed, renamed over its final name with
``os.replace``, and the directory is ``fsync``-ed; a loader accepts a file only when magic, length and checksum
agree, so a crash mid-write leaves at worst a temporary file that no loader reads.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, NamedTuple, Optional

import msgpack
import numpy as np

from psrt import dtypes, optim
from psrt.config import ServerConfig
from psrt.embedding import RowTable
from psrt.errors import ConfigError, PsrtError
from psrt.store import Entry, Store, WorkerLog

__all__ = ["save", "load_latest", "file_prefix", "Checkpointer", "CheckpointError", "Restored", "TableState",
           "check_directory"]

#: Embedding tables as :meth:`psrt.tables.TableService.state` gives them: (record, arrays) per table, and the
#: per-table worker sequence numbers.
TableState = tuple[list[tuple[dict[str, Any], list[np.ndarray]]], list[list[Any]]]

#: Dtypes a checkpoint's table arrays may have.
_TABLE_DTYPES = {*dtypes.BY_WIRE_NAME, np.dtype(np.int64).str}


class Restored(NamedTuple):
    """A checkpoint read back: the dense store, the metadata, the file, and the embedding tables."""

    store: Store
    meta: dict[str, Any]
    path: Path
    tables: list[RowTable]
    table_logs: list[list[Any]]

log = logging.getLogger("psrt.checkpoint")

MAGIC = b"PSRTCKP1"
TRAILER_MAGIC = b"PSRTEND1"
_TRAILER = struct.Struct("<8sQI")  # magic, bytes before the trailer, crc32 of them
_SUFFIX = ".psrtckpt"
#: Checkpoints kept per shard (older ones are removed once a newer one is safely on disk).
KEEP = 2


class CheckpointError(PsrtError, OSError):
    """A checkpoint could not be written, or a checkpoint directory is unusable."""


def file_prefix(endpoint: str) -> str:
    """The file-name prefix of a shard's checkpoints: its endpoint, made safe for a file name."""
    return "shard-" + re.sub(r"[^A-Za-z0-9.]+", "_", endpoint).strip("_")


def _arrays_of(store: Store) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    keys, arrays = [], []
    for (name, part), e in store.entries.items():
        e.settle()  # the round in progress is saved as one sum, whether its gradients were held or summed
        record = {"name": name, "part": part, "dtype": dtypes.wire_name(e.param.dtype), "size": int(e.param.size),
                  "version": e.version, "optimizer": e.optimizer.to_wire(), "slots": sorted(e.slots),
                  "contributors": sorted(e.contributors), "expected": sorted(e.expected),
                  "acc": bool(e.contributors)}
        arrays.append(e.param)
        arrays.extend(e.slots[s] for s in record["slots"])
        if e.contributors:
            assert e.acc is not None
            arrays.append(e.acc)
        keys.append(record)
    return keys, arrays


def save(store: Store, directory: Path, prefix: str, meta: dict[str, Any],
         tables: Optional[TableState] = None) -> Path:
    """Write a checkpoint of ``store`` atomically; returns its path.

    Parameters
    ----------
    store : Store
        The shard's state.
    directory : Path
        The checkpoint directory (created if missing).
    prefix : str
        The shard's file-name prefix (:func:`file_prefix`).
    meta : dict
        More to record (the endpoint, ...), msgpack-able.
    tables : TableState, optional
        The shard's embedding tables (:meth:`psrt.tables.TableService.state`).

    Raises
    ------
    CheckpointError
        When the file cannot be written; the previous checkpoints are untouched.
    """
    keys, arrays = _arrays_of(store)
    table_records, table_logs = tables if tables is not None else ([], [])
    records = []
    for record, table_arrays in table_records:
        flat = [np.ascontiguousarray(a) for a in table_arrays]
        records.append({**record, "arrays": [[a.dtype.str, int(a.size)] for a in flat]})
        arrays.extend(flat)
    header = msgpack.packb({
        "format": 1, "created": time.time(), "mode": store.mode, "num_workers": store.num_workers,
        "members": None if store.members is None else sorted(store.members),
        "workers": [[w, log_.session, log_.last_seq] for w, log_ in store.workers.items()],
        "keys": keys, "meta": meta, "tables": records, "table_logs": table_logs,
    }, use_bin_type=True)
    stamp = max((e.version for e in store.entries.values()), default=0)
    final = directory / f"{prefix}-{time.time_ns():020d}-v{stamp}{_SUFFIX}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{prefix}-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                crc = 0
                for chunk in (MAGIC, struct.pack("<Q", len(header)), header):
                    f.write(chunk)
                    crc = zlib.crc32(chunk, crc)
                length = len(MAGIC) + 8 + len(header)
                for a in arrays:
                    view = memoryview(np.ascontiguousarray(a)).cast("B")
                    f.write(view)
                    crc = zlib.crc32(view, crc)
                    length += view.nbytes
                f.write(_TRAILER.pack(TRAILER_MAGIC, length, crc))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself must survive a crash
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise CheckpointError(f"cannot write a checkpoint in {directory}: {exc}") from None
    for old in _complete_files(directory, prefix)[:-KEEP]:
        old.unlink(missing_ok=True)
    return final


def _complete_files(directory: Path, prefix: str) -> list[Path]:
    """This shard's checkpoint files, oldest first (by the time in their names)."""
    pattern = re.compile(re.escape(prefix) + r"-(\d{20})-v\d+" + re.escape(_SUFFIX) + "$")
    found = [(m.group(1), p) for p in directory.glob(f"{prefix}-*{_SUFFIX}") if (m := pattern.match(p.name))]
    return [p for _, p in sorted(found)]


def _verify(data: bytes) -> Optional[str]:
    """None when ``data`` is a complete checkpoint, else why not."""
    if len(data) < len(MAGIC) + 8 + _TRAILER.size or not data.startswith(MAGIC):
        return "not a psrt checkpoint"
    magic, length, crc = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
    if magic != TRAILER_MAGIC or length != len(data) - _TRAILER.size:
        return "incomplete (no trailer where the file ends)"
    if zlib.crc32(memoryview(data)[:length]) != crc:
        return "corrupt (checksum mismatch)"
    return None


def _restore(data: bytes) -> tuple[Store, dict[str, Any], list[RowTable], list[list[Any]]]:
    (hlen,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    h = msgpack.unpackb(data[start:start + hlen], raw=False, strict_map_key=False)
    offset = start + hlen
    store = Store(h["mode"], h["num_workers"])
    if h["members"] is not None:
        store.members = frozenset(h["members"])
    for worker, session, last_seq in h["workers"]:
        store.workers[worker] = WorkerLog(session, last_seq)

    def take(dtype: np.dtype, size: int) -> np.ndarray:
        nonlocal offset
        a = np.frombuffer(data, dtype, size, offset).copy()  # writable, owned
        offset += a.nbytes
        return a

    for k in h["keys"]:
        dtype = dtypes.from_wire_name(k["dtype"])
        if dtype is None:
            raise ValueError(f"unknown dtype {k['dtype']!r}")
        opt = optim.from_wire(k["optimizer"])
        param = take(dtype, k["size"])
        slots = {s: take(dtype, k["size"]) for s in k["slots"]}
        entry = Entry(param=param, optimizer=opt, slots=slots, version=k["version"],
                      contributors=set(k["contributors"]), expected=frozenset(k["expected"]))
        if k["acc"]:
            entry.acc = take(dtype, k["size"])
            entry.acc_filled = True
        store.entries[(k["name"], k["part"])] = entry
    tables = []
    for record in h.get("tables", []):
        arrays = []
        for dname, size in record.pop("arrays"):
            if dname not in _TABLE_DTYPES:
                raise ValueError(f"table array dtype {dname!r}")
            arrays.append(take(np.dtype(dname), size))
        tables.append(RowTable.from_state(record, arrays))
    if offset != len(data) - _TRAILER.size:
        raise ValueError("arrays do not fill the file")
    return store, h["meta"], tables, h.get("table_logs", [])


def load_latest(directory: Path, prefix: str) -> Optional[Restored]:
    """The newest complete checkpoint of this shard in ``directory``, or None.

    Files that are torn, corrupt or unreadable are skipped with a warning (an older complete one is used).

    Raises
    ------
    ConfigError
        When ``directory`` exists but is not a directory.
    """
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"checkpoint directory {directory} is not a directory")
    if not directory.exists():
        return None
    for path in reversed(_complete_files(directory, prefix)):
        try:
            data = path.read_bytes()
        except OSError as exc:
            log.warning("skipping checkpoint %s: %s", path, exc)
            continue
        problem = _verify(data)
        if problem is None:
            try:
                store, meta, tables, table_logs = _restore(data)
                return Restored(store, meta, path, tables, table_logs)
            except (ValueError, KeyError, TypeError, PsrtError, msgpack.UnpackException) as exc:
                problem = f"unreadable ({exc})"
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


class Checkpointer:
    """When a shard writes its checkpoints, and where; and its restore at start.

    Parameters
    ----------
    config : ServerConfig
        ``checkpoint_dir``, ``checkpoint_every``, ``checkpoint_secs`` and the mode.
    endpoint : str
        The shard's endpoint, which names its files (a restarted shard binds the same one).
    """

    def __init__(self, config: ServerConfig, endpoint: str) -> None:
        self.directory = Path(config.checkpoint_dir) if config.checkpoint_dir else None
        self.prefix = file_prefix(endpoint)
        self.every, self.secs, self.mode = config.checkpoint_every, config.checkpoint_secs, config.mode
        self._next = self.every  # sync: the version every key must reach for the next checkpoint
        self._pushes = 0  # async: pushes at the last checkpoint
        self._time = time.monotonic()
        self._dirty = False

    @property
    def enabled(self) -> bool:
        """Whether the shard has a checkpoint directory."""
        return self.directory is not None

    def restore(self) -> Optional[Restored]:
        """The newest complete checkpoint of this shard, or None (said in the log: the shard starts fresh)."""
        assert self.directory is not None
        found = load_latest(self.directory, self.prefix)
        if found is None:
            log.warning("no checkpoint of this shard (%s*) in %s: starting fresh", self.prefix, self.directory)
            return None
        store, path = found.store, found.path
        versions = [e.version for e in store.entries.values()]
        self.mode = store.mode
        if self.every:
            self._next = (min(versions, default=0) // self.every + 1) * self.every
        log.warning("restored %d keys (versions %d..%d) and %d tables from %s", len(versions),
                    min(versions, default=0), max(versions, default=0), len(found.tables), path)
        return found

    def save(self, store: Store, pushes: int, tables: Optional[TableState] = None) -> Path:
        """Write a checkpoint now (:func:`save`)."""
        assert self.directory is not None
        started = time.monotonic()
        path = save(store, self.directory, self.prefix, {"prefix": self.prefix}, tables)
        self._time, self._pushes, self._dirty = time.monotonic(), pushes, False
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


def check_directory(directory: Optional[str | os.PathLike]) -> None:
    """Make sure a shard can write checkpoints in ``directory`` (created if missing), at start rather than at
    every checkpoint; None: no checkpoints, nothing to check.

    Raises
    ------
    ConfigError
        Naming the directory and why it cannot be written.
    """
    if directory is None:
        return
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # the only portable test: root passes any os.access check
            pass
    except OSError as exc:
        raise ConfigError(f"--checkpoint-dir {path}: cannot write checkpoints there: {exc.strerror or exc}; give "
                          "a directory this process can write") from None
