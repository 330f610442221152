"""The data plane's replies, from a shard to a worker's client, as typed records.

Each reply has one record type and one encoder; :func:`decode_reply` turns an untrusted header frame into its
record (or raises :class:`~psrt.errors.ProtocolError`), so the client never indexes a raw header. A ``params``
reply's buffers follow as separate frames, received by the caller straight into place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence, Union

import numpy as np

from psrt.config import MODES, WireLimits
from psrt.errors import ProtocolError
from psrt.wire import compression, lanes
from psrt.wire.codec import (
    MAX_U63,
    MAX_WORKER,
    PROTOCOL_VERSION,
    TensorMeta,
    check_fields,
    check_version,
    encode,
    string,
    tensor_metas,
    uint,
    uint_list,
    unpack_header,
)
from psrt.wire.rows import RowsReply, decode_rows_reply

__all__ = ["JobInfo", "ParamsReply", "AckReply", "StatsReply", "ErrorReply", "SavedReply", "Reply", "decode_reply",
           "encode_params", "encode_ack", "encode_stats", "encode_error", "encode_saved"]

#: A ``params`` reply's fields; answering ``init`` it adds the job's, over a shared-memory lane the lane's.
_PARAMS = frozenset({"v", "op", "id", "tensors", "versions"})
_PARAMS_JOB = _PARAMS | frozenset({"mode", "num_workers", "conflicts"})
_PARAMS_LANE = _PARAMS | frozenset({"lane", "places"})
_REPLY_FIELDS: dict[str, frozenset[str]] = {
    "params": _PARAMS,
    "ack": frozenset({"v", "op", "id", "versions", "duplicate"}),
    "stats": frozenset({"v", "op", "id", "stats"}),
    "error": frozenset({"v", "op", "id", "code", "message"}),
    "saved": frozenset({"v", "op", "id", "path"}),
}


@dataclass(frozen=True)
class JobInfo:
    """What a shard says about the job in its answer to ``init``: its mode and W, and the refused tensors."""

    mode: str
    num_workers: int
    #: Indices (into the request's tensors) of keys that exist with a different optimizer.
    conflicts: list[int]


@dataclass
class ParamsReply:
    """``params``: parameters (their buffers follow the header) and the version of each."""

    id: int
    tensors: list[TensorMeta]
    versions: list[int]
    job: Optional[JobInfo] = None
    #: The generation of the shared-memory lane the parameters were written to (no buffer frames follow), and
    #: per tensor ``[]`` (in the lane) or ``[generation, offset, counter]`` (in the shard's shared parameters).
    lane: Optional[int] = None
    places: Optional[list[list[int]]] = None
    op: ClassVar[str] = "params"


@dataclass
class AckReply:
    """``ack``: a push was taken; ``versions`` says which version of each key will include it."""

    id: int
    versions: list[int]
    duplicate: bool
    op: ClassVar[str] = "ack"


@dataclass
class StatsReply:
    """``stats``: the shard's counters, a flat map of numbers and strings."""

    id: int
    stats: dict[str, Any]
    op: ClassVar[str] = "stats"


@dataclass
class ErrorReply:
    """``error``: the request was refused; ``code`` is machine-readable, ``message`` says what to do."""

    id: int
    code: str
    message: str
    op: ClassVar[str] = "error"


@dataclass
class SavedReply:
    """``saved``: the checkpoint a ``checkpoint`` request wrote, by its path on the shard's host."""

    id: int
    path: str
    op: ClassVar[str] = "saved"


Reply = Union[ParamsReply, AckReply, StatsReply, ErrorReply, SavedReply, RowsReply, lanes.BeaconReply,
              lanes.LaneReply, lanes.ClosedReply]


def decode_reply(data: Any, limits: WireLimits) -> Reply:
    """Decode a reply's header frame from a shard; a ``params`` reply's buffers follow as separate frames.

    Raises
    ------
    ProtocolError
        When the header is malformed, whatever is wrong with it.
    """
    h = unpack_header(data, limits)
    if h.keys() == _PARAMS:  # a params reply without job or lane fields, every step's: short path
        if (reply := _plain_params(h, limits)) is not None:
            return reply
    check_version(h)
    op = h.get("op")
    if op == "rows":
        return decode_rows_reply(h, limits)
    if type(op) is str and op in lanes.REPLY_FIELDS:
        return lanes.decode_lane_reply(h)
    if type(op) is str and op == "params" and h.keys() in (_PARAMS_JOB, _PARAMS_LANE):
        fields = h.keys()
    else:
        fields = _REPLY_FIELDS.get(op) if type(op) is str else None
        if fields is None:
            raise ProtocolError(f"unknown op {op!r} in a reply; known: {sorted(_REPLY_FIELDS)}")
    check_fields(op, h, fields)
    rid = uint(h, "id")
    if op == "params":
        metas, versions = _params_of(h, limits)
        job = None
        if "mode" in h:
            conflicts = uint_list(h, "conflicts")
            if any(i >= len(metas) for i in conflicts):
                raise ProtocolError("params reply: 'conflicts' must index the reply's tensors")
            job = JobInfo(string(h, "mode", allowed=MODES), uint(h, "num_workers", MAX_WORKER, lo=1), conflicts)
        if "lane" not in h:
            return ParamsReply(rid, metas, versions, job)
        return ParamsReply(rid, metas, versions, job, uint(h, "lane"), lanes.places(h["places"], len(metas)))
    if op == "ack":
        if type(h["duplicate"]) is not bool:
            raise ProtocolError("ack reply: 'duplicate' must be true or false")
        return AckReply(rid, uint_list(h, "versions"), h["duplicate"])
    if op == "stats":
        stats = h["stats"]
        if type(stats) is not dict or any(type(k) is not str or type(v) not in (int, float, str)
                                          for k, v in stats.items()):
            raise ProtocolError("stats reply: 'stats' must map names to numbers or strings")
        return StatsReply(rid, stats)
    if op == "saved":
        return SavedReply(rid, string(h, "path"))
    return ErrorReply(rid, string(h, "code", 64), string(h, "message", 1 << 16))


def _plain_params(h: dict[str, Any], limits: WireLimits) -> Optional[ParamsReply]:
    """A plain ``params`` reply (no job or lane fields), in fewer steps: None when its version, op or id is not
    right, for the general path to say so; then the tensors and versions, checked as the general path does."""
    v, op, rid = h["v"], h["op"], h["id"]
    if not (type(v) is int and v == PROTOCOL_VERSION and type(op) is str and op == "params" and type(rid) is int
            and 0 <= rid <= MAX_U63):
        return None
    return ParamsReply(rid, *_params_of(h, limits))


def _params_of(h: dict[str, Any], limits: WireLimits) -> tuple[list[TensorMeta], list[int]]:
    """A ``params`` reply's tensors and their versions, checked in this order."""
    # Parameters may come back in the 16-bit form the worker pushed in; never as top-k.
    metas = tensor_metas(h["tensors"], limits, compressed=True)
    for m in metas:
        if m.encoding == compression.TOPK:
            raise ProtocolError("params reply: parameters never travel as top-k")
    return metas, uint_list(h, "versions", len(metas))


def encode_params(rid: int, entries: list[list[Any]], versions: list[int], payload: Sequence[np.ndarray],
                  job: Optional[JobInfo] = None, lane: Optional[int] = None,
                  places: Optional[list[list[int]]] = None) -> list[Any]:
    """Frames of a ``params`` reply (with the job's mode, W and conflicts when answering ``init``; with ``lane``,
    the parameters are in that lane's segment and ``payload`` is empty)."""
    header: dict[str, Any] = {"op": "params", "id": rid, "tensors": entries, "versions": versions}
    if job is not None:
        header.update(mode=job.mode, num_workers=job.num_workers, conflicts=job.conflicts)
    if lane is not None:
        header.update(lane=lane, places=places)
    return encode(header, payload)


def encode_ack(rid: int, versions: list[int], duplicate: bool) -> list[Any]:
    """Frames of an ``ack`` reply."""
    return encode({"op": "ack", "id": rid, "versions": versions, "duplicate": duplicate})


def encode_stats(rid: int, stats: dict[str, Any]) -> list[Any]:
    """Frames of a ``stats`` reply."""
    return encode({"op": "stats", "id": rid, "stats": stats})


def encode_error(rid: int, code: str, message: str) -> list[Any]:
    """Frames of an ``error`` reply."""
    return encode({"op": "error", "id": rid, "code": code, "message": message})


def encode_saved(rid: int, path: str) -> list[Any]:
    """Frames of a ``saved`` reply."""
    return encode({"op": "saved", "id": rid, "path": path})
