"""Embedding-table ops of the data plane: ``init_table``, ``push_rows``, ``pull_rows`` and the ``rows`` reply.

Ids travel as one raw frame of little-endian int64 (``count * 8`` bytes), rows as one raw frame of
``count * dim`` elements of the table's dtype; the header says ``count``, ``dim`` and ``dtype``, and each frame
must hold exactly that many bytes. Everything is checked as hostile input, as the dense ops are
(:mod:`psrt.wire.codec`); the policy caps (rows per message, rows per table) are the shard's, checked by
:mod:`psrt.shard.tables` before any state changes.

==============  ==========================================================  ===================================
request         fields (besides ``v, op, id``) + frames                     reply
==============  ==========================================================  ===================================
``init_table``  ``worker, table, dim, dtype, optimizer, init, a, b, seed,    ``ack`` (``versions``: the table's
                num_rows, count`` + ids, rows when ``count > 0`` (given       version; ``duplicate``: it existed)
                rows, set where missing); optional ``policy``: a map of
                ``admit_after, capacity, ttl, max_pending`` (left out
                when all are the defaults)
``push_rows``   ``worker, session, seq, table, dim, dtype, count`` + ids,    ``ack`` (``versions``: the version
                gradient rows (duplicate ids are summed); ``base`` (the      that will include the push)
                table version they were computed from; a shard with
                backup workers reads it)
``pull_rows``   ``worker, table, min_version, count`` + ids                  ``rows``
``table_stats`` ``table``                                                    ``stats`` (the table's counters)
==============  ==========================================================  ===================================

Reply ``rows {table, dim, dtype, count, version}`` + one frame: the rows of the request's ids, in its order.

Over a shared-memory lane (:mod:`psrt.wire.lanes`, a worker and a shard of one host) a ``push_rows`` or
``pull_rows`` has no buffer frames and one more field, ``lane: [generation, inputs, outputs]``: ``push_rows``
``[ids, rows]`` offsets in and none out, ``pull_rows`` ``[ids]`` in and ``[rows]`` out (where the shard is to
write the answer). Its ``rows`` reply then carries ``lane: generation`` and no frame: the rows are at the
request's output offset. The shard checks every area against the segment before anything changes
(``lane_stale``, ``lane_bounds``), as for dense tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import numpy as np

from psrt import dtypes
from psrt.config import WireLimits
from psrt.errors import ProtocolError
from psrt.kernels.rows import INITIALIZERS
from psrt.wire.codec import MAX_U63, MAX_WORKER, check_fields, encode, string, uint
from psrt.wire.lanes import LaneRef, lane_ref

__all__ = ["InitTableRequest", "PushRowsRequest", "PullRowsRequest", "TableStatsRequest", "RowsReply",
           "REQUEST_FIELDS", "IDS_DTYPE", "encode_table_stats",
           "MAX_ROW_DIM", "decode_row_request", "decode_rows_reply", "encode_init_table", "encode_push_rows",
           "encode_pull_rows", "encode_rows"]

#: The dtype of an ids frame.
IDS_DTYPE = np.dtype("<i8")
#: Longest row on the wire.
MAX_ROW_DIM = 1 << 20
_INITS = tuple(INITIALIZERS)

REQUEST_FIELDS: dict[str, frozenset[str]] = {
    "init_table": frozenset({"v", "op", "id", "worker", "table", "dim", "dtype", "optimizer", "init", "a", "b",
                             "seed", "num_rows", "count"}),
    "push_rows": frozenset({"v", "op", "id", "worker", "session", "seq", "clock", "table", "dim", "dtype", "count"}),
    "pull_rows": frozenset({"v", "op", "id", "worker", "table", "min_version", "clock", "count"}),
    "table_stats": frozenset({"v", "op", "id", "table"}),
}
_ROWS = frozenset({"v", "op", "id", "table", "dim", "dtype", "count", "version"})
_ROWS_LANE = _ROWS | {"lane"}
#: The ops that may travel over a shared-memory lane, with their ``(inputs, outputs)`` areas.
_LANE_AREAS = {"push_rows": (2, 0), "pull_rows": (1, 1)}
#: The fields of the usual row requests over a lane, which :func:`_lane_rows` decodes inline.
_PULL_ROWS_LANE = REQUEST_FIELDS["pull_rows"] | {"lane"}
_PUSH_ROWS_LANE = REQUEST_FIELDS["push_rows"] | {"lane"}
_PUSH_ROWS_LANE_BASED = _PUSH_ROWS_LANE | {"base"}  # (the version its rows came from: every client's now)


@dataclass
class _Rows:
    table: str
    dim: int
    dtype: np.dtype
    ids: np.ndarray

    @property
    def count(self) -> int:
        """How many ids the message carries."""
        return len(self.ids)


@dataclass
class InitTableRequest(_Rows):
    """``init_table``: create a table (first init wins) and set the given rows where missing."""

    id: int
    worker: int
    optimizer: dict[str, Any]
    init: str
    a: float
    b: float
    seed: int
    num_rows: Optional[int]
    rows: Optional[np.ndarray]
    #: The admission and eviction options (``admit_after``, ``capacity``, ``ttl``, ``max_pending``); None when
    #: all are the defaults (the field is then left out, as before it existed).
    policy: Optional[dict[str, Any]] = None
    op: ClassVar[str] = "init_table"


@dataclass
class PushRowsRequest(_Rows):
    """``push_rows``: gradient rows of ids, exactly-once by ``(worker, session, seq)`` (per table)."""

    id: int
    worker: int
    session: int
    seq: int
    grads: np.ndarray
    #: The worker's count of pushes to this table, this one included: ``ssp`` bounds staleness by it, and a sync
    #: shard restored from a checkpoint makes its rounds of pushes of one clock (:mod:`psrt.shard.realign`).
    clock: int = 0
    #: The table's version (on this shard) of the rows the gradients were computed from, by which a shard with
    #: backup workers drops a straggler's; None: not said (an older client).
    base: Optional[int] = None
    #: Over a shared-memory lane: where the ids and rows are (``ids`` and ``grads`` are empty until the shard
    #: binds them to the segment, :meth:`psrt.shm.lanes.ShardLanes.bind_rows`), and their count.
    lane: Optional[LaneRef] = None
    lane_count: int = 0
    op: ClassVar[str] = "push_rows"


@dataclass
class PullRowsRequest(_Rows):
    """``pull_rows``: the rows of ids, once the table has reached ``min_version``."""

    id: int
    worker: int
    min_version: int
    #: ``ssp``: the worker's count of pushes to this table so far.
    clock: int = 0
    #: Over a shared-memory lane: where the ids are and the rows go (``ids`` is empty until the shard binds it,
    #: :meth:`psrt.shm.lanes.ShardLanes.bind_rows`), and their count.
    lane: Optional[LaneRef] = None
    lane_count: int = 0
    #: Over a lane, once bound: the ``(count, dim)`` area of the segment the answer is gathered into.
    out: Optional[np.ndarray] = None
    op: ClassVar[str] = "pull_rows"


@dataclass
class RowsReply:
    """``rows``: the rows a ``pull_rows`` asked for (their frame follows), and the table's version."""

    id: int
    table: str
    dim: int
    dtype: np.dtype
    count: int
    version: int
    #: Over a shared-memory lane: the segment's generation (the rows are at the request's output area; no frame).
    lane: Optional[int] = None
    op: ClassVar[str] = "rows"

    @property
    def nbytes(self) -> int:
        """The byte size of the rows frame."""
        return self.count * self.dim * self.dtype.itemsize


def _real(h: dict[str, Any], key: str) -> float:
    value = h.get(key)
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ProtocolError(f"field {key!r} must be a finite number, got {value!r}")
    return float(value)


def _shape(h: dict[str, Any], limits: WireLimits, with_dtype: bool = True) -> tuple[str, int, np.dtype, int]:
    table = string(h, "table", limits.max_name_len)
    if not table:
        raise ProtocolError("field 'table' must be a non-empty string")
    count = uint(h, "count", limits.max_tensor_bytes // IDS_DTYPE.itemsize)
    if not with_dtype:
        return table, 0, IDS_DTYPE, count
    dim = uint(h, "dim", MAX_ROW_DIM, lo=1)
    dtype = dtypes.from_wire_name(h.get("dtype"))
    if dtype is None:
        raise ProtocolError(f"dtype {h.get('dtype')!r} is not allowed; use one of {sorted(dtypes.BY_WIRE_NAME)}")
    if count * dim * dtype.itemsize > limits.max_tensor_bytes:
        raise ProtocolError(f"{count} rows of {dim} x {dtype.str} exceed the {limits.max_tensor_bytes}-byte limit")
    return table, dim, dtype, count


def _frame(buf: Any, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    if len(buf) != count * dtype.itemsize:
        raise ProtocolError(f"{what} frame has {len(buf)} bytes; {count} x {dtype.str} needs {count * dtype.itemsize}")
    return np.frombuffer(buf, dtype=dtype) if count else np.empty(0, dtype)


@dataclass
class TableStatsRequest:
    """``table_stats``: one table's counters on this shard (rows, evicted, admitted, pending, ...)."""

    id: int
    table: str
    op: ClassVar[str] = "table_stats"


def decode_row_request(h: dict[str, Any], buffers: Sequence[Any], limits: WireLimits) -> Any:
    """Decode the fields and frames of an embedding request whose header passed the version check.

    Raises
    ------
    ProtocolError
        When a field is missing, extra or out of range, or a frame's size does not match the header.
    """
    op = h["op"]
    if "lane" in h and op in _LANE_AREAS and (req := _lane_rows(h, buffers, limits)) is not None:  # every call's
        return req
    base = uint(h, "base") if op == "push_rows" and "base" in h else None  # (optional: an older client's has none)
    if base is not None:
        del h["base"]
    lane = h.pop("lane") if op in _LANE_AREAS and "lane" in h else None
    check_fields(op, h, REQUEST_FIELDS[op] | ({"policy"} if op == "init_table" and "policy" in h else set()))
    if op == "table_stats":
        if buffers:
            raise ProtocolError(f"op 'table_stats' takes no buffer frames, got {len(buffers)}")
        return TableStatsRequest(uint(h, "id"), string(h, "table", limits.max_name_len))
    rid, worker = uint(h, "id"), uint(h, "worker", MAX_WORKER)
    pull = op == "pull_rows"
    table, dim, dtype, count = _shape(h, limits, with_dtype=not pull)
    if lane is not None:  # the ids and rows are in the worker's segment: the shard binds them
        ref = lane_ref(lane, *_LANE_AREAS[op])
        if buffers:
            raise ProtocolError(f"a {op!r} over a shared-memory lane takes no buffer frames, got {len(buffers)}")
        none = np.empty(0, IDS_DTYPE)
        if pull:
            return PullRowsRequest(table, 0, IDS_DTYPE, none, rid, worker, uint(h, "min_version"), uint(h, "clock"),
                                   ref, count)
        return PushRowsRequest(table, dim, dtype, none, rid, worker, uint(h, "session"), uint(h, "seq"),
                               np.empty((0, dim), dtype), uint(h, "clock"), base, ref, count)
    want = 1 if pull else (0 if op == "init_table" and count == 0 else 2)
    if len(buffers) != want:
        raise ProtocolError(f"op {op!r} with count {count} takes {want} buffer frames, got {len(buffers)}")
    ids = _frame(buffers[0], IDS_DTYPE, count, "ids") if want else np.empty(0, IDS_DTYPE)
    if pull:
        return PullRowsRequest(table, 0, IDS_DTYPE, ids, rid, worker, uint(h, "min_version"), uint(h, "clock"))
    rows = _frame(buffers[1], dtype, count * dim, "rows").reshape(count, dim) if want == 2 else None
    if op == "push_rows":
        assert rows is not None
        return PushRowsRequest(table, dim, dtype, ids, rid, worker, uint(h, "session"), uint(h, "seq"), rows,
                               uint(h, "clock"), base)
    if type(h["optimizer"]) is not dict:
        raise ProtocolError("field 'optimizer' must be a map")
    num_rows = h["num_rows"]
    if num_rows is not None and (type(num_rows) is not int or not 1 <= num_rows <= MAX_U63):
        raise ProtocolError(f"field 'num_rows' must be nil or a positive integer, got {num_rows!r}")
    return InitTableRequest(table, dim, dtype, ids, rid, worker, h["optimizer"], string(h, "init", allowed=_INITS),
                            _real(h, "a"), _real(h, "b"), uint(h, "seed"), num_rows, rows, _policy(h))


def _lane_ok(lane: Any, inputs: int, outputs: int) -> bool:
    """Whether ``lane`` is ``[generation, inputs, outputs]`` as :func:`psrt.wire.lanes.lane_ref` accepts it."""
    if type(lane) is not list or len(lane) != 3:
        return False
    generation, ins, outs = lane
    if type(generation) is not int or not 0 <= generation <= MAX_U63 or type(ins) is not list \
            or type(outs) is not list or len(ins) != inputs or len(outs) != outputs:
        return False
    for offset in ins + outs:
        if type(offset) is not int or not 0 <= offset <= MAX_U63:
            return False
    return True


def _lane_rows(h: dict[str, Any], buffers: Sequence[Any], limits: WireLimits) -> Any:
    """A ``pull_rows`` or ``push_rows`` over a lane, every field checked as the general path checks it, with less
    Python per field (a row call sends a message to every shard); None when anything is unusual, and the general
    path then says what."""
    op = h["op"]
    keys = h.keys()
    if buffers or not (keys == _PULL_ROWS_LANE or keys == _PUSH_ROWS_LANE or keys == _PUSH_ROWS_LANE_BASED):
        return None
    rid, worker, clock, count, table = h["id"], h["worker"], h["clock"], h["count"], h["table"]
    if not (type(rid) is int and type(worker) is int and type(clock) is int and type(count) is int
            and type(table) is str and 0 <= rid <= MAX_U63 and 0 <= worker <= MAX_WORKER and 0 <= clock <= MAX_U63
            and 0 <= count <= limits.max_tensor_bytes // IDS_DTYPE.itemsize
            and 0 < len(table) <= limits.max_name_len):
        return None
    lane = h["lane"]
    if op == "pull_rows" and keys == _PULL_ROWS_LANE:
        version = h["min_version"]
        if type(version) is not int or not 0 <= version <= MAX_U63 or not _lane_ok(lane, 1, 1):
            return None
        return PullRowsRequest(table, 0, IDS_DTYPE, _NO_IDS, rid, worker, version, clock,
                               LaneRef(lane[0], lane[1], lane[2]), count)
    based = keys == _PUSH_ROWS_LANE_BASED
    if op != "push_rows" or not (based or keys == _PUSH_ROWS_LANE):
        return None
    session, seq, dim, base = h["session"], h["seq"], h["dim"], h["base"] if based else None
    dtype = dtypes.from_wire_name(h["dtype"])
    if not (type(session) is int and type(seq) is int and type(dim) is int and 0 <= session <= MAX_U63
            and 0 <= seq <= MAX_U63 and 1 <= dim <= MAX_ROW_DIM and dtype is not None
            and count * dim * dtype.itemsize <= limits.max_tensor_bytes and _lane_ok(lane, 2, 0)
            and (not based or (type(base) is int and 0 <= base <= MAX_U63))):
        return None
    return PushRowsRequest(table, dim, dtype, _NO_IDS, rid, worker, session, seq, np.empty((0, dim), dtype), clock,
                           base, LaneRef(lane[0], lane[1], lane[2]), count)


def _lane_rows_reply(h: dict[str, Any], limits: WireLimits) -> Optional[RowsReply]:
    """A ``rows`` reply over a lane, every field checked as :func:`decode_rows_reply` checks it, inline; None when
    anything is unusual (the general path then says what)."""
    rid, table, dim, count, version, lane = h["id"], h["table"], h["dim"], h["count"], h["version"], h["lane"]
    dtype = dtypes.from_wire_name(h["dtype"])
    if (type(rid) is int and type(table) is str and type(dim) is int and type(count) is int and type(version) is int
            and type(lane) is int and dtype is not None and 0 <= rid <= MAX_U63
            and 0 < len(table) <= limits.max_name_len and 1 <= dim <= MAX_ROW_DIM
            and 0 <= count <= limits.max_tensor_bytes // IDS_DTYPE.itemsize
            and count * dim * dtype.itemsize <= limits.max_tensor_bytes and 0 <= version <= MAX_U63
            and 0 <= lane <= MAX_U63):
        return RowsReply(rid, table, dim, dtype, count, version, lane)
    return None


#: The (empty) ids of a request over a lane until the shard binds them.
_NO_IDS = np.empty(0, IDS_DTYPE)
_NO_IDS.flags.writeable = False

_POLICY = frozenset({"admit_after", "capacity", "ttl", "max_pending"})


def _policy(h: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The ``policy`` map of an ``init_table``, its types checked (the values' sense is the table spec's)."""
    if "policy" not in h:
        return None
    p = h["policy"]
    if type(p) is not dict or p.keys() != _POLICY:
        raise ProtocolError(f"field 'policy' must be a map of exactly {sorted(_POLICY)}")
    for key in ("admit_after", "capacity", "max_pending"):
        if p[key] is not None or key == "admit_after":
            uint(p, key, MAX_U63, 1)
    if p["ttl"] is not None:
        _real(p, "ttl")
    return dict(p)


def decode_rows_reply(h: dict[str, Any], limits: WireLimits) -> RowsReply:
    """Check a ``rows`` reply's header (its frame is received by the caller, straight into place)."""
    if h.keys() == _ROWS_LANE and (reply := _lane_rows_reply(h, limits)) is not None:  # every call's: short path
        return reply
    check_fields("rows", h, _ROWS_LANE if "lane" in h else _ROWS)
    table, dim, dtype, count = _shape(h, limits)
    return RowsReply(uint(h, "id"), table, dim, dtype, count, uint(h, "version"),
                     uint(h, "lane") if "lane" in h else None)


def encode_init_table(rid: int, worker: int, table: str, dim: int, dtype: np.dtype, optimizer: dict[str, Any],
                      init: str, a: float, b: float, seed: int, num_rows: Optional[int], ids: np.ndarray,
                      rows: Optional[np.ndarray], policy: Optional[dict[str, Any]] = None) -> list[Any]:
    """Frames of an ``init_table`` request (``rows`` None or ``(len(ids), dim)``; ids empty without rows;
    ``policy`` as :meth:`psrt.tablespec.TableSpec.policy` gives it)."""
    header = {"op": "init_table", "id": rid, "worker": worker, "table": table, "dim": dim,
              "dtype": dtypes.WIRE_NAMES[np.dtype(dtype)], "optimizer": optimizer, "init": init, "a": a, "b": b,
              "seed": seed, "num_rows": num_rows, "count": len(ids) if rows is not None else 0}
    if policy is not None:
        header["policy"] = policy
    return encode(header, [ids, rows] if rows is not None and len(ids) else [])


def encode_push_rows(rid: int, worker: int, session: int, seq: int, table: str, ids: np.ndarray,
                     grads: np.ndarray, clock: int = 0, base: Optional[int] = None,
                     lane: Optional[LaneRef] = None) -> list[Any]:
    """Frames of a ``push_rows`` request: ids (int64) and ``(len(ids), dim)`` C-contiguous gradient rows; ``base``
    (read by a shard with backup workers): the table version the gradients were computed from; ``lane``: the ids and
    rows are in a shared-memory segment there (copied in by the caller), and no frame carries them."""
    header = {"op": "push_rows", "id": rid, "worker": worker, "session": session, "seq": seq, "clock": clock,
              "table": table, "dim": grads.shape[1], "dtype": dtypes.WIRE_NAMES[grads.dtype], "count": len(ids)}
    if base is not None:
        header["base"] = base
    if lane is not None:
        header["lane"] = lane.to_wire()
        return encode(header)
    return encode(header, [ids, grads])


def encode_table_stats(rid: int, table: str) -> list[Any]:
    """Frames of a ``table_stats`` request."""
    return encode({"op": "table_stats", "id": rid, "table": table})


def encode_pull_rows(rid: int, worker: int, table: str, min_version: int, ids: np.ndarray,
                     clock: int = 0, lane: Optional[LaneRef] = None) -> list[Any]:
    """Frames of a ``pull_rows`` request; ``lane``: the ids are in a shared-memory segment there (copied in by
    the caller) and the rows are to be written at its output offset."""
    header = {"op": "pull_rows", "id": rid, "worker": worker, "table": table, "min_version": min_version,
              "clock": clock, "count": len(ids)}
    if lane is not None:
        header["lane"] = lane.to_wire()
        return encode(header)
    return encode(header, [ids])


def encode_rows(rid: int, table: str, version: int, rows: np.ndarray, lane: Optional[int] = None) -> list[Any]:
    """Frames of a ``rows`` reply: ``rows`` is the ``(count, dim)`` answer; with ``lane`` (the segment's
    generation) it was written into the request's output area, and only the header goes."""
    header = {"op": "rows", "id": rid, "table": table, "dim": rows.shape[1], "dtype": dtypes.WIRE_NAMES[rows.dtype],
              "count": rows.shape[0], "version": version}
    if lane is not None:
        header["lane"] = lane
        return encode(header)
    return encode(header, [rows])
