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

A checkpoint belongs to the shard's rank (its place in the job's shard order, hence its keys), not to its address:
files are named ``rank-R-TIME-vVERSION.psrtckpt``, so a shard restarted on another endpoint finds its own. One
directory may hold the checkpoints of several shards; while a shard runs it holds a lock on its rank's files
(:mod:`psrt.shard.recovery`), so two live shards never write the same rank. Files an older psrt named after the
shard's endpoint (``shard-ENDPOINT-...``) are still read when they are the directory's only shard, and removed
once their state is in a file of the rank.

Incremental checkpoints (``chain``): a *delta* file, ``rank-R-TIME-vVERSION.delta.psrtckpt``, holds the whole dense
state, sequence numbers and table records like a full one, but of each embedding table only the rows changed since
the file before it and the ids evicted since then (:meth:`psrt.shard.embedding.RowTable.state`). Its header names
the full file it builds on (``base``) and the file just before it (``prev``). A restore takes the newest complete
full file and every complete delta after it whose ``prev`` is the one before, in order; a torn or missing link
ends the chain there. Delta files are named so that the full files' listing (:func:`files_of`, :data:`KEEP`) never
sees them; they are removed with the full file they build on.
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
from psrt.errors import ConfigError, PsrtError
from psrt.shard import realign
from psrt.shard.embedding import RowTable
from psrt.shard.store import Entry, Store, WorkerLog

__all__ = ["save", "load_latest", "file_prefix", "endpoint_prefix", "rank_of", "holdings", "choose",
           "files_of", "deltas_of", "CheckpointError", "Restored", "TableState", "KEEP", "check_directory"]

#: Embedding tables as :meth:`psrt.shard.tables.TableService.state` gives them: (record, arrays) per table, and the
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
_DELTA = ".delta" + _SUFFIX
#: Checkpoints kept per shard (older ones are removed once a newer one is safely on disk).
KEEP = 2


class CheckpointError(PsrtError, OSError):
    """A checkpoint could not be written, or a checkpoint directory is unusable."""


def file_prefix(rank: int) -> str:
    """The file-name prefix of the checkpoints of the shard of rank ``rank``."""
    return f"rank-{rank}"


def endpoint_prefix(endpoint: str) -> str:
    """The prefix older psrt versions named a shard's checkpoints with: its endpoint, made safe for a file name."""
    return "shard-" + re.sub(r"[^A-Za-z0-9.]+", "_", endpoint).strip("_")


_FILE = re.compile(r"(.+)-\d{20}-v\d+" + re.escape(_SUFFIX) + "$")
_RANK = re.compile(r"rank-(\d+)$")


def rank_of(prefix: str) -> Optional[int]:
    """The rank a file-name prefix names (None: an older psrt's, named after an endpoint)."""
    m = _RANK.match(prefix)
    return int(m.group(1)) if m else None


def _present(directory: Path) -> bool:
    """Whether the checkpoint directory exists (it need not: nothing was saved yet); a file there is an error."""
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"checkpoint directory {directory} is not a directory")
    return directory.exists()


def holdings(directory: Path) -> dict[str, int]:
    """The shards whose checkpoints ``directory`` holds: file-name prefix -> number of files (none is read).

    Raises
    ------
    ConfigError
        When ``directory`` exists but is not a directory.
    """
    held: dict[str, int] = {}
    for p in directory.glob(f"*{_SUFFIX}") if _present(directory) else ():
        if (m := _FILE.match(p.name)) and not p.name.startswith("."):
            held[m.group(1)] = held.get(m.group(1), 0) + 1
    return held


def _describe(held: dict[str, int]) -> str:
    ranks = sorted(r for r in map(rank_of, held) if r is not None)
    names = [f"rank {r}" for r in ranks]
    names += [f"{p} (an older psrt's, named after its endpoint)" for p in sorted(held) if rank_of(p) is None]
    return "checkpoints of " + ", ".join(names)


def choose(directory: Path, rank: Optional[int]) -> Optional[str]:
    """The prefix of the checkpoints a shard of rank ``rank`` (None: not known) restores from ``directory``.

    Its own rank's, else the directory's only shard (when ``rank`` is None, or that shard's files are named after
    an endpoint, from an older psrt); None when the directory holds no checkpoint at all (a first run).

    Raises
    ------
    ConfigError
        When the directory holds checkpoints, but none this shard can take as its own: it names what it holds.
    """
    held = holdings(directory)
    if not held:
        return None
    if rank is not None and file_prefix(rank) in held:
        return file_prefix(rank)
    if len(held) == 1:
        (only,) = held
        if rank is None or rank_of(only) is None:
            return only
    if rank is None:
        raise ConfigError(f"--restore: {directory} holds {_describe(held)}; say which this shard is with --rank R")
    raise ConfigError(f"--restore: {directory} holds no checkpoint of rank {rank} but {_describe(held)}; give the "
                      "rank of one of those with --rank R, or an empty --checkpoint-dir to start this shard fresh")


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
         tables: Optional[TableState] = None, chain: Optional[tuple[str, str]] = None) -> Path:
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
        The shard's embedding tables (:meth:`psrt.shard.tables.TableService.state`).
    chain : (str, str), optional
        A delta file's ``(base, prev)``: the names of the full file it builds on and of the file before it
        (``tables`` then holds deltas); None: a full checkpoint.

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
        # (A log's replay holes, where it has any, are a fourth element: psrt.shard.replay.)
        "workers": [[w, log_.session, log_.last_seq] + ([log_.hole_runs()] if log_.holes else [])
                    for w, log_ in store.workers.items()],
        "keys": keys, "meta": meta, "tables": records, "table_logs": table_logs,
        **({"chain": list(chain)} if chain is not None else {}),
    }, use_bin_type=True)
    stamp = max((e.version for e in store.entries.values()), default=0)
    final = directory / f"{prefix}-{time.time_ns():020d}-v{stamp}{_DELTA if chain is not None else _SUFFIX}"
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
                    view = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))  # (0, dim) too
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
    for old in files_of(directory, prefix)[:-KEEP]:
        old.unlink(missing_ok=True)
    kept = files_of(directory, prefix)
    for old in deltas_of(directory, prefix):  # the deltas of full files no longer kept
        if not kept or _time_of(old) < _time_of(kept[0]):
            old.unlink(missing_ok=True)
    return final


def _time_of(path: Path) -> str:
    return path.name.rsplit("-", 2)[-2]


def deltas_of(directory: Path, prefix: str) -> list[Path]:
    """The delta checkpoint files of the shard ``prefix``, oldest first."""
    pattern = re.compile(re.escape(prefix) + r"-(\d{20})-v\d+" + re.escape(_DELTA) + "$")
    found = [(m.group(1), p) for p in directory.glob(f"{prefix}-*{_DELTA}") if (m := pattern.match(p.name))]
    return [p for _, p in sorted(found)]


def files_of(directory: Path, prefix: str) -> list[Path]:
    """The checkpoint files of the shard ``prefix``, oldest first (by the time in their names)."""
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


def _restore(data: bytes, onto: Optional[dict[str, RowTable]] = None
             ) -> tuple[Store, dict[str, Any], list[RowTable], list[list[Any]]]:
    """Read a complete file; a delta's tables are applied to ``onto`` (the chain's tables so far)."""
    (hlen,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    h = msgpack.unpackb(data[start:start + hlen], raw=False, strict_map_key=False)
    offset = start + hlen
    store = Store(h["mode"], h["num_workers"])
    if h["members"] is not None:
        store.members = frozenset(h["members"])
    for worker, session, last_seq, *holes in h["workers"]:  # (no holes: a checkpoint of an older psrt, or none)
        store.workers[worker] = WorkerLog.restored(session, last_seq, holes[0] if holes else None)

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
    if ("chain" in h) != (onto is not None):
        raise ValueError("a delta file read as a full one, or the reverse")
    for record in h.get("tables", []):
        arrays = []
        for dname, size in record.pop("arrays"):
            if dname not in _TABLE_DTYPES:
                raise ValueError(f"table array dtype {dname!r}")
            arrays.append(take(np.dtype(dname), size))
        if onto is None:
            tables.append(RowTable.from_state(record, arrays))
            continue
        table = onto.get(record["name"])  # a table made since the full file: all its rows are in the deltas
        if table is None:
            table = RowTable(RowTable.spec_of(record), record["max_rows"], record["name"])
        table.apply_delta(record, arrays)
        tables.append(table)
    if offset != len(data) - _TRAILER.size:
        raise ValueError("arrays do not fill the file")
    realign.restored(store)  # (its workers may have seen versions its checkpoint does not hold)
    return store, h["meta"], tables, h.get("table_logs", [])


def load_latest(directory: Path, prefix: str) -> Optional[Restored]:
    """The newest complete checkpoint of this shard in ``directory``, or None.

    Files that are torn, corrupt or unreadable are skipped with a warning (an older complete one is used).

    Raises
    ------
    ConfigError
        When ``directory`` exists but is not a directory.
    """
    if not _present(directory):
        return None
    for path in reversed(files_of(directory, prefix)):
        data, problem = _read(path)
        if problem is None:
            try:
                store, meta, tables, table_logs = _restore(data)
                restored = Restored(store, meta, path, tables, table_logs)
            except (ValueError, KeyError, TypeError, PsrtError, msgpack.UnpackException) as exc:
                problem = f"unreadable ({exc})"
        if problem is not None:
            log.warning("skipping checkpoint %s: %s", path, problem)
            continue
        return _follow(restored, [d for d in deltas_of(directory, prefix) if _time_of(d) > _time_of(path)])
    return None


def _read(path: Path) -> tuple[bytes, Optional[str]]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        return b"", str(exc)
    return data, _verify(data)


def _follow(restored: Restored, deltas: list[Path]) -> Restored:
    """Apply the deltas that extend ``restored``'s file, in order, up to the first that does not (torn, or of
    another chain: it is skipped with a warning, and so is every later one)."""
    base = prev = restored.path.name
    for path in deltas:
        data, problem = _read(path)
        if problem is None:
            try:
                h = _header(data)
                if h.get("chain") != [base, prev]:
                    problem = f"builds on {h.get('chain')}, not on {[base, prev]}"
                else:
                    onto = {t.name: t for t in restored.tables}
                    store, meta, tables, table_logs = _restore(data, onto)
                    restored = Restored(store, meta, path, list({**onto, **{t.name: t for t in tables}}.values()),
                                        table_logs)
                    prev = path.name
                    continue
            except (ValueError, KeyError, TypeError, PsrtError, msgpack.UnpackException) as exc:
                problem = f"unreadable ({exc}); the tables may be half applied"
                raise CheckpointError(f"delta checkpoint {path}: {problem}") from None
        log.warning("ignoring delta checkpoint %s and those after it: %s", path, problem)
        break
    return restored


def _header(data: bytes) -> dict[str, Any]:
    (hlen,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    return msgpack.unpackb(data[start:start + hlen], raw=False, strict_map_key=False)


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
