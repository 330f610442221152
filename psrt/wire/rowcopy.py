"""The replication channel's copy of an embedding table's rows, primary shard to replica (:mod:`psrt.shard.tablecopy`).

==================  =====================================================  ==================================
request             fields (besides ``v, op, id``)                          reply
==================  =====================================================  ==================================
``replicate_rows``  ``token, sender, range, table, record, logs, clocks,    ``replicated {}`` once applied, or
                    full`` + one frame per array of ``record``'s layout     ``error {code, message}`` (nothing
                                                                            applied)
==================  =====================================================  ==================================

``record`` is a table's checkpoint record (:meth:`psrt.shard.embedding.RowTable.state`: its definition, version,
push clock, counters, the round in progress, ``rows`` rows given and whether a ``pending`` map of admission counts
follows); a ``delta`` record carries the rows a round or push touched and the ids evicted since the last copy, a
whole one every row. Its arrays come in the checkpoint's order, each a frame whose dtype and length the record
fixes (:func:`layout`): the rows, each optimizer slot's rows, the rows' ids, push clocks and push times, the ids
evicted; then the round in progress (its ids and summed rows) and the pending map (ids, counts, push clocks, push
times, ids that left). ``logs`` is ``[[worker, session, settled], ...]``: every ``push_rows`` of that session to
the table up to sequence number ``settled - 1`` is in the state the message leaves (``settled`` 0: none), but for
its replay holes where it has any (a fourth element, as a ``replicate``'s ``workers`` carry them);
``clocks`` ``[[worker, clock], ...]`` the workers' ssp clocks of the table. ``full``: the record is the whole
table, which replaces the replica's. ``token`` and ``sender`` are checked as a ``replicate``'s are
(:mod:`psrt.wire.replication`) before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Sequence

import numpy as np

from psrt import dtypes
from psrt.config import WireLimits
from psrt.errors import ProtocolError
from psrt.wire.codec import (
    MAX_U63,
    MAX_WORKER,
    check_version,
    encode,
    hole_runs,
    op_of,
    string,
    uint,
    unpack_header,
)

__all__ = ["RowsCopy", "encode_replicate_rows", "decode_replicate_rows", "is_rows_copy", "layout"]

OP = "replicate_rows"
_FIELDS = {OP: frozenset({"v", "op", "id", "token", "sender", "range", "table", "record", "logs", "clocks", "full"})}
#: A record's fields and the types each may have (a table's checkpoint record).
_RECORD: dict[str, tuple[type, ...]] = {
    "name": (str,), "dim": (int,), "dtype": (str,), "optimizer": (dict,), "init": (str,), "a": (float, int),
    "b": (float, int), "seed": (int,), "num_rows": (int, type(None)), "max_rows": (int,), "used": (int,),
    "version": (int,), "contributors": (list,), "expected": (list,), "slots": (list,), "layout": (int,),
    "delta": (bool,), "policy": (dict, type(None)), "tick": (int,), "evicted": (int,), "admitted": (int,),
    "rows": (int,), "round": (bool,), "pending": (dict, type(None))}
_INTS = ("dim", "seed", "max_rows", "used", "version", "tick", "evicted", "admitted", "rows")
_MAX_DIM = 1 << 20
_MAX_SLOTS = 8


@dataclass(frozen=True)
class RowsCopy:
    """A decoded ``replicate_rows`` message (its record's fields typed, its frames matched to :func:`layout`)."""

    id: int
    token: str
    sender: int
    range: int
    table: str
    record: dict[str, Any]
    #: The record's arrays, in :func:`layout`'s order (writable copies of the frames).
    arrays: list[np.ndarray]
    #: ``(worker, session, last applied seq)``; -1: none of that session.
    logs: list[tuple[int, int, int]]
    clocks: dict[int, int]
    full: bool
    #: Per worker with holes: its replay window's holes (:mod:`psrt.shard.replay`); a worker left out has none.
    holes: dict[int, list[list[int]]] = field(default_factory=dict)
    op: ClassVar[str] = OP


def layout(record: dict[str, Any]) -> list[tuple[np.dtype, int]]:
    """The dtype and element count of each array a (type-checked) record says follows it.

    Raises
    ------
    ProtocolError
        When the record's dtype is not one psrt carries.
    """
    rows_dtype = dtypes.from_wire_name(record["dtype"])
    if rows_dtype is None:
        raise ProtocolError(f"record field 'dtype': {record['dtype']!r} is not {dtypes.describe()}")
    i8, f8 = np.dtype(np.int64), np.dtype(np.float64)
    n, dim = record["rows"], record["dim"]
    out = [(rows_dtype, n * dim)] * (1 + len(record["slots"])) + [(i8, n), (i8, n), (f8, n),
                                                                     (i8, record["removed"])]
    if record["round"]:
        out += [(i8, record["round_rows"]), (rows_dtype, record["round_rows"] * dim)]
    if record["pending"] is not None:
        p = record["pending"]["rows"]
        out += [(i8, p), (i8, p), (i8, p), (f8, p), (i8, record["pending"]["removed"])]
    return out


def encode_replicate_rows(rid: int, token: str, sender: int, rng: int, table: str, record: dict[str, Any],
                          arrays: Sequence[np.ndarray], logs: Sequence[tuple[int, int, int]],
                          clocks: dict[int, int], full: bool,
                          holes: Optional[dict[int, list[list[int]]]] = None) -> list[Any]:
    """Frames of a ``replicate_rows`` message: ``record`` and ``arrays`` as a table's checkpoint state has them
    (:meth:`psrt.shard.embedding.RowTable.state`, or a copy's delta of it), ``logs`` ``(worker, session, last
    applied seq)`` of the table's pushes, ``holes`` per worker its replay holes (none when left out or empty)."""
    holes = holes or {}
    record = dict(record)
    n_fixed = 1 + len(record["slots"]) + 3  # rows, slots, ids, clocks, times: then the ids evicted
    record["removed"] = len(arrays[n_fixed])
    at = n_fixed + 1
    if record["round"]:
        record["round_rows"] = len(arrays[at])
        at += 2
    if record["pending"] is not None:
        record["pending"] = {**record["pending"], "rows": len(arrays[at]), "removed": len(arrays[at + 4])}
    flat = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
    return encode({"op": OP, "id": rid, "token": token, "sender": sender, "range": rng, "table": table,
                   "record": record, "logs": [[w, s, q + 1] + ([holes[w]] if holes.get(w) else []) for w, s, q in logs],
                   "clocks": [[w, c] for w, c in sorted(clocks.items())], "full": full}, flat)


def is_rows_copy(frames: Sequence[Any], limits: WireLimits) -> bool:
    """Whether a replication message is a ``replicate_rows`` (anything else goes to the ``replicate`` decoder)."""
    try:
        return unpack_header(frames[0], limits).get("op") == OP
    except (ProtocolError, IndexError):
        return False


def _uint_pairs(value: Any, width: int, what: str) -> list[list[int]]:
    if type(value) is not list or len(value) > 1 << 20 or any(
            type(p) is not list or len(p) != width or any(type(x) is not int or not 0 <= x <= MAX_U63 for x in p)
            for p in value):
        raise ProtocolError(f"field {what!r} must be a list of {width}-element lists of unsigned integers")
    return value


def _check_record(record: Any) -> dict[str, Any]:
    extra = {"removed", "round_rows", "round_clock"}  # (round_clock: the open round's, or nil; a newer psrt's)
    if type(record) is not dict or not set(_RECORD) <= set(record) <= set(_RECORD) | extra:
        raise ProtocolError(f"field 'record' must be a table record with the fields {sorted(_RECORD)}")
    clock = record.get("round_clock")
    if clock is not None and (type(clock) is not int or not 0 <= clock <= MAX_U63):
        raise ProtocolError("record field 'round_clock' must be an unsigned integer or nil")
    for key, types in _RECORD.items():
        if type(record[key]) not in types:
            raise ProtocolError(f"record field {key!r} has the wrong type ({type(record[key]).__name__})")
    for key in (*_INTS, "removed", *(("round_rows",) if record["round"] else ())):
        if type(record.get(key)) is not int or not 0 <= record[key] <= MAX_U63:
            raise ProtocolError(f"record field {key!r} must be an unsigned integer")
    if not 1 <= record["dim"] <= _MAX_DIM:
        raise ProtocolError(f"record field 'dim' must be in [1, {_MAX_DIM}]")
    if record["num_rows"] is not None and not 0 <= record["num_rows"] <= MAX_U63:
        raise ProtocolError("record field 'num_rows' must be an unsigned integer or nil")
    if len(record["slots"]) > _MAX_SLOTS or any(type(s) is not str or len(s) > 64 for s in record["slots"]):
        raise ProtocolError("record field 'slots' must list the optimizer's slot names")
    for key in ("contributors", "expected"):
        if len(record[key]) > MAX_WORKER or any(type(w) is not int or not 0 <= w < MAX_WORKER for w in record[key]):
            raise ProtocolError(f"record field {key!r} must list worker ranks")
    pending = record["pending"]
    if pending is not None and (set(pending) != {"used", "forgotten", "rows", "removed"} or any(
            type(v) is not int or not 0 <= v <= MAX_U63 for v in pending.values())):
        raise ProtocolError("record field 'pending' must hold the unsigned integers used, forgotten, rows, removed")
    if record["layout"] != 2:
        raise ProtocolError("record field 'layout' must be 2")
    return record


def decode_replicate_rows(frames: Sequence[Any], limits: WireLimits) -> RowsCopy:
    """Decode a ``replicate_rows`` message as untrusted input.

    Raises
    ------
    ProtocolError
        When anything in it is malformed (``request_id`` set when the header got that far).
    """
    request_id = None
    try:
        h = unpack_header(frames[0], limits)
        if type(h.get("id")) is int and 0 <= h["id"] <= MAX_U63:
            request_id = h["id"]
        check_version(h)
        op_of(h, _FIELDS, "replication message")
        record = _check_record(h["record"])
        logs = h["logs"]
        if type(logs) is not list or len(logs) > 1 << 20 or any(
                type(w) is not list or len(w) not in (3, 4)
                or any(type(x) is not int or not 0 <= x <= MAX_U63 for x in w[:3])
                or (len(w) == 4 and not hole_runs(w[3])) for w in logs):
            raise ProtocolError("field 'logs' must be a list of [worker, session, settled] or "
                                "[worker, session, settled, holes] (holes: [[first, count], ...])")
        clocks = _uint_pairs(h["clocks"], 2, "clocks")
        if type(h["full"]) is not bool:
            raise ProtocolError("field 'full' must be true or false")
        shapes = layout(record)
        buffers = list(frames[1:])
        if len(buffers) != len(shapes):
            raise ProtocolError(f"{len(buffers)} buffer frames; the record says {len(shapes)} arrays follow")
        arrays = []
        for i, (buf, (dtype, count)) in enumerate(zip(buffers, shapes)):
            if count > limits.max_frame_bytes // dtype.itemsize or len(buf) != count * dtype.itemsize:
                raise ProtocolError(f"array {i}: a frame of {len(buf)} bytes, expected {count} x {dtype}")
            arrays.append(np.frombuffer(buf, dtype).copy() if count else np.empty(0, dtype))
        return RowsCopy(uint(h, "id"), string(h, "token", 128), uint(h, "sender", 1 << 31), uint(h, "range", 1 << 31),
                        string(h, "table", 256), record, arrays, [(w[0], w[1], w[2] - 1) for w in logs],
                        {w: c for w, c in clocks}, h["full"], {w[0]: w[3] for w in logs if len(w) == 4})
    except ProtocolError as exc:
        exc.request_id = request_id  # type: ignore[attr-defined]
        raise
