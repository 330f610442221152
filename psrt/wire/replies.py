"""The data plane's replies, from a shard to a worker's client, as typed records.

Each reply has one record type and one encoder; :func:`decode_reply` turns an untrusted header frame into its
record (or raises :class:`~psrt.errors.ProtocolError`), so the client never indexes a raw header. A ``params``
reply's buffers follow as separate frames, received by the caller straight into place.
"""

from __future__ import annotations

import struct
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
    pack_header,
    same_limits,
    string,
    tensor_entry,
    tensor_metas,
    uint,
    uint_list,
    unpack_header,
    with_buffers,
)
from psrt.wire.rows import RowsReply, decode_rows_reply

__all__ = ["JobInfo", "ParamsReply", "AckReply", "StatsReply", "ErrorReply", "SavedReply", "HeldReply", "Reply",
           "decode_reply", "encode_params", "params_tensors", "encode_params_packed", "encode_ack", "encode_stats",
           "encode_error", "encode_saved", "encode_held"]

#: A ``params`` reply's fields; answering ``init`` it adds the job's, over a shared-memory lane the lane's.
_PARAMS = frozenset({"v", "op", "id", "tensors", "versions"})
_PARAMS_JOB = _PARAMS | frozenset({"mode", "num_workers", "conflicts"})
#: ... of a shard with backup workers (only then: a job without them answers as older shards do).
_PARAMS_JOB_BACKUP = _PARAMS_JOB | frozenset({"backup_workers"})
#: ... of a shard whose range has replicas (only then), with or without backup workers.
_PARAMS_JOB_REPLICATED = (_PARAMS_JOB | frozenset({"replicated"}), _PARAMS_JOB_BACKUP | frozenset({"replicated"}))
_PARAMS_LANE = _PARAMS | frozenset({"lane", "places"})
#: ... sent before the replicas hold the round it tells (a replicated job's pipelined copy): ``held`` is false, and
#: a ``held`` notice naming its id follows once they do (a reply without the field is held already).
_PARAMS_EARLY = _PARAMS | frozenset({"held"})
#: ... of a push, with when the shard took it in and how long it held the answer (:class:`AckReply`).
_ACK_TIMED = frozenset({"v", "op", "id", "versions", "duplicate", "taken", "held"})
#: Most request ids one ``held`` notice names (a worker has at most a step's calls per shard in flight).
MAX_HELD_IDS = 1 << 16
_REPLY_FIELDS: dict[str, frozenset[str]] = {
    "params": _PARAMS,
    "ack": frozenset({"v", "op", "id", "versions", "duplicate"}),
    "stats": frozenset({"v", "op", "id", "stats"}),
    "error": frozenset({"v", "op", "id", "code", "message"}),
    "saved": frozenset({"v", "op", "id", "path"}),
    "held": frozenset({"v", "op", "id", "ids"}),
}


@dataclass(frozen=True)
class JobInfo:
    """What a shard says about the job in its answer to ``init``: its mode and W, and the refused tensors."""

    mode: str
    num_workers: int
    #: Indices (into the request's tensors) of keys that exist with a different optimizer.
    conflicts: list[int]
    #: Sync mode: the shard's backup workers b (> 0: its workers' pushes say which version they were computed
    #: from, :mod:`psrt.shard.stragglers`).
    backup_workers: int = 0
    #: The shard's range has replicas: in sync mode a push's ack waits until its round is copied, so until every
    #: worker pushed it (a pipeline then holds no push back there: :class:`psrt.worker.overlap.Pipeline`).
    replicated: bool = False


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
    #: False: sent before the replicas hold what it tells; the call completes on a :class:`HeldReply` naming it.
    held: bool = True
    op: ClassVar[str] = "params"


@dataclass
class AckReply:
    """``ack``: a push was taken; ``versions`` says which version of each key will include it.

    ``taken`` and ``held`` (a push's ack gives both, from the shard's monotonic clock, in ns): when the shard took
    the push's message in, and how long after that it answered (an early sync push waits for its round to open).
    The spacing of a worker's pushes taken one after another is the rate its pushes reach the shard at, which
    :class:`psrt.worker.overlap.Pipeline` sizes its window by; None from an ack without them: a replicated job's,
    whose sync acks wait for every worker's push of the round, which a worker pacing its pushes by them could hold
    back.
    """

    id: int
    versions: list[int]
    duplicate: bool
    taken: Optional[int] = None
    held: Optional[int] = None
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


@dataclass
class HeldReply:
    """``held``: the replicas hold what the early ``params`` replies ``ids`` (``held`` false) told: those calls are
    answered now. Its own ``id`` is 0 (it answers no request of its own)."""

    id: int
    ids: list[int]
    op: ClassVar[str] = "held"


Reply = Union[ParamsReply, AckReply, StatsReply, ErrorReply, SavedReply, HeldReply, RowsReply, lanes.BeaconReply,
              lanes.LaneReply, lanes.ClosedReply]


def _rows(value: Any) -> bool:
    """Whether a stats value is rows of numbers and strings (a shard's per-worker ``workers`` table)."""
    return type(value) is list and all(type(row) is list and all(type(x) in (int, float, str) for x in row)
                                       for row in value)


def decode_reply(data: Any, limits: WireLimits) -> Reply:
    """Decode a reply's header frame from a shard; a ``params`` reply's buffers follow as separate frames.

    Raises
    ------
    ProtocolError
        When the header is malformed, whatever is wrong with it.
    """
    if type(data) is bytes and data.startswith(_PACKED_HEAD):  # as encode_params_packed makes them: shorter yet
        if (reply := _packed_params(data, limits)) is not None:
            return reply
    h = unpack_header(data, limits)
    if h.keys() == _PARAMS:  # a params reply without job or lane fields, every step's: short path
        if (reply := _plain_params(h, limits)) is not None:
            if type(data) is bytes and data.startswith(_PACKED_HEAD):
                _remember_tensors(data, reply, limits)
            return reply
    check_version(h)
    op = h.get("op")
    if op == "rows":
        return decode_rows_reply(h, limits)
    if type(op) is str and op in lanes.REPLY_FIELDS:
        return lanes.decode_lane_reply(h)
    if type(op) is str and op == "params" and h.keys() in (_PARAMS_JOB, _PARAMS_LANE, _PARAMS_JOB_BACKUP,
                                                           _PARAMS_EARLY, *_PARAMS_JOB_REPLICATED):
        fields = h.keys()
    elif op == "ack" and h.keys() == _ACK_TIMED:
        fields = _ACK_TIMED
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
            if "replicated" in h and h["replicated"] is not True:
                raise ProtocolError("params reply: 'replicated' is true when given (a shard without replicas leaves "
                                    "it out)")
            job = JobInfo(string(h, "mode", allowed=MODES), uint(h, "num_workers", MAX_WORKER, lo=1), conflicts,
                          uint(h, "backup_workers", MAX_WORKER) if "backup_workers" in h else 0, "replicated" in h)
        if "held" in h:
            if h["held"] is not False:
                raise ProtocolError("params reply: 'held' is false when given (a held reply leaves it out)")
            return ParamsReply(rid, metas, versions, held=False)
        if "lane" not in h:
            return ParamsReply(rid, metas, versions, job)
        return ParamsReply(rid, metas, versions, job, uint(h, "lane"), lanes.places(h["places"], len(metas)))
    if op == "ack":
        if type(h["duplicate"]) is not bool:
            raise ProtocolError("ack reply: 'duplicate' must be true or false")
        if "taken" in h:
            return AckReply(rid, uint_list(h, "versions"), h["duplicate"], uint(h, "taken"), uint(h, "held"))
        return AckReply(rid, uint_list(h, "versions"), h["duplicate"])
    if op == "stats":
        stats = h["stats"]
        if type(stats) is not dict or any(type(k) is not str or (type(v) not in (int, float, str) and not _rows(v))
                                          for k, v in stats.items()):
            raise ProtocolError("stats reply: 'stats' must map names to numbers, strings or rows of them")
        return StatsReply(rid, stats)
    if op == "saved":
        return SavedReply(rid, string(h, "path"))
    if op == "held":
        ids = uint_list(h, "ids")
        if not 0 < len(ids) <= MAX_HELD_IDS:
            raise ProtocolError(f"held reply: 'ids' names {len(ids)} requests (1 to {MAX_HELD_IDS})")
        return HeldReply(rid, ids)
    return ErrorReply(rid, string(h, "code", 64), string(h, "message", 1 << 16))


def _plain_params(h: dict[str, Any], limits: WireLimits) -> Optional[ParamsReply]:
    """A plain ``params`` reply (no job or lane fields), in fewer steps: None when its version, op or id is not
    right, for the general path to say so; then the tensors and versions, checked as the general path does."""
    v, op, rid = h["v"], h["op"], h["id"]
    if not (type(v) is int and v == PROTOCOL_VERSION and type(op) is str and op == "params" and type(rid) is int
            and 0 <= rid <= MAX_U63):
        return None
    return ParamsReply(rid, *_params_of(h, limits))


# A params reply as encode_params_packed packs it: the map's head, ``v``, ``op``, the ``id`` key and the uint64 marker
# (_PACKED_HEAD), the id's 8 bytes, the ``versions`` key, an array head and a uint64 per version, then the ``tensors``
# key and its list. The constant bytes are msgpack's own (checked at import against its packing of the map).
_PACKED_HEAD = (pack_header(dict.fromkeys(_PARAMS))[:1]  # a map of the five fields
                + pack_header({"v": PROTOCOL_VERSION, "op": "params", "id": 1 << 63})[1:-8])
_VERSIONS_KEY = pack_header("versions")
_TENSORS_KEY = pack_header("tensors")
_AT_ID = len(_PACKED_HEAD)
_AT_VERSIONS = _AT_ID + 8 + len(_VERSIONS_KEY)  # where the versions' array head is
_U64 = struct.Struct(">Q")
_U16 = struct.Struct(">H")
_UINT64 = 0xCF
_ARRAY16 = 0xDC
_ONE_PAIR = pack_header({"": 0})[:1]  # the head of a map of one pair


def _array_head(n: int) -> bytes:
    """msgpack's head of a list of ``n`` items (a fixarray below 16, else array 16; a reply never holds more)."""
    return pack_header([None] * n)[:-n] if n else pack_header([])


def _versions_struct(n: int) -> struct.Struct:
    """The layout of ``n`` versions as uint64s: each its marker byte and 8 bytes."""
    st = _VERSIONS.get(n)
    if st is None:
        st = struct.Struct(">" + "BQ" * n)
        if len(_VERSIONS) < 64:
            _VERSIONS[n] = st
    return st


_VERSIONS: dict[int, struct.Struct] = {}
#: A one-tensor reply's header up to its tensors: the head, the id, the versions' key, head and uint64 marker, the
#: version (then the tensors part).
_ONE_VERSION_HEAD = _VERSIONS_KEY + _array_head(1) + bytes((_UINT64,))
_ONE_HEAD = struct.Struct(f">{len(_PACKED_HEAD)}sQ{len(_ONE_VERSION_HEAD)}sQ")


@dataclass(frozen=True)
class _SeenTensors:
    """The tensors a packed params reply's ``tensors`` part (its bytes from the key on) decoded to, under
    ``limits`` (:func:`~psrt.wire.codec.same_limits`)."""

    limits: WireLimits
    tensors: tuple[TensorMeta, ...]


#: Packed params replies' ``tensors`` parts decoded before, by their bytes (:func:`_remember_tensors`).
_SEEN_TENSORS: dict[bytes, _SeenTensors] = {}
_SEEN_TENSORS_MAX = 1 << 14


def _versions_at(data: bytes) -> Optional[tuple[int, int]]:
    """``(n, where the versions' values start)`` of a reply in :func:`encode_params_packed`'s layout, else None."""
    if len(data) <= _AT_VERSIONS + 2 or data[_AT_ID + 8:_AT_VERSIONS] != _VERSIONS_KEY:
        return None
    head = data[_AT_VERSIONS]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F, _AT_VERSIONS + 1
    if head == _ARRAY16:
        return _U16.unpack_from(data, _AT_VERSIONS + 1)[0], _AT_VERSIONS + 3
    return None


def _packed_params(data: bytes, limits: WireLimits) -> Optional[ParamsReply]:
    """A params reply in :func:`encode_params_packed`'s layout whose tensors were seen before: the id and the versions
    read at their places, the tensors looked up by their bytes. None: anything else (the general path decides).

    (Its length needs no check against ``limits``: a reply of that layout and those tensors has the length of the
    one that was checked under them.)
    """
    if len(data) > _ONE_HEAD.size:  # one tensor, the usual reply: its id and version in one read
        _, rid, versions_head, version = _ONE_HEAD.unpack_from(data)
        if versions_head == _ONE_VERSION_HEAD:
            seen = _SEEN_TENSORS.get(data[_ONE_HEAD.size:])
            if (seen is None or len(seen.tensors) != 1 or rid > MAX_U63 or version > MAX_U63
                    or (seen.limits is not limits and seen.limits is not same_limits(limits))):
                return None
            return ParamsReply(rid, list(seen.tensors), [version])
    where = _versions_at(data)
    if where is None:
        return None
    n, at = where
    layout = _versions_struct(n)
    seen = _SEEN_TENSORS.get(data[at + layout.size:])
    if seen is None or len(seen.tensors) != n or (seen.limits is not limits and seen.limits is not same_limits(limits)):
        return None
    (rid,) = _U64.unpack_from(data, _AT_ID)
    fields = layout.unpack_from(data, at)
    versions = list(fields[1::2])
    if rid > MAX_U63 or fields[0::2].count(_UINT64) != n or (n and max(versions) > MAX_U63):
        return None
    return ParamsReply(rid, list(seen.tensors), versions)


def _remember_tensors(data: bytes, reply: ParamsReply, limits: WireLimits) -> None:
    """Keep the tensors of a valid params reply that starts as :func:`encode_params_packed` packs one, by the bytes
    of its ``tensors`` part, for :func:`_packed_params`.

    Before that part the bytes are exactly the map's head and four pairs (v, op, id, versions) of known layout;
    when the rest, read alone as a map of one pair, is the ``tensors`` key and its list, nothing left over, then
    any reply of that layout ending in those bytes decodes to these tensors (msgpack reads a map's pairs one
    after the other), and is checked as this one was.
    """
    where = _versions_at(data)
    if where is None or where[0] != len(reply.tensors):
        return
    end = where[1] + _versions_struct(where[0]).size
    try:
        rest = unpack_header(_ONE_PAIR + data[end:], limits)
    except ProtocolError:
        return
    if rest.keys() != {"tensors"}:
        return
    if len(_SEEN_TENSORS) >= _SEEN_TENSORS_MAX:
        _SEEN_TENSORS.clear()  # a peer inventing replies must not grow this without bound
    _SEEN_TENSORS[data[end:]] = _SeenTensors(same_limits(limits), tuple(reply.tensors))


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
                  places: Optional[list[list[int]]] = None, held: bool = True) -> list[Any]:
    """Frames of a ``params`` reply (with the job's mode, W and conflicts when answering ``init``; with ``lane``,
    the parameters are in that lane's segment and ``payload`` is empty; ``held`` False: sent before the replicas
    hold it, a ``held`` notice follows, :func:`encode_held`)."""
    header: dict[str, Any] = {"op": "params", "id": rid, "tensors": entries, "versions": versions}
    if not held:
        if job is not None or lane is not None:
            raise ValueError("an early params reply carries neither the job's fields nor a lane")
        header["held"] = False
    if job is not None:
        header.update(mode=job.mode, num_workers=job.num_workers, conflicts=job.conflicts)
        if job.backup_workers:
            header["backup_workers"] = job.backup_workers
        if job.replicated:
            header["replicated"] = True
    if lane is not None:
        header.update(lane=lane, places=places)
    return encode(header, payload)


def params_tensors(keys: Sequence[tuple[str, int]], dtypes: Sequence[np.dtype], counts: Sequence[int]) -> bytes:
    """The ``tensors`` part of a params reply (the key and the list of entries), packed once for the replies of one
    set of keys (:func:`encode_params_packed`).

    Raises
    ------
    ProtocolError
        When a dtype is not one psrt moves.
    """
    entries = [pack_header(tensor_entry(k[0], k[1], d, (c,))) for k, d, c in zip(keys, dtypes, counts)]
    count = _array_head(len(entries))
    return b"".join([_TENSORS_KEY, count, *entries])


def encode_params_packed(rid: int, tensors: bytes, versions: Sequence[int], payload: Sequence[np.ndarray]) -> list[Any]:
    """Frames of a plain ``params`` reply (no job, no lane) with the ``tensors`` part :func:`params_tensors` packed:
    the map :func:`encode_params` makes of the same fields, the id and every version as a uint64, the tensors
    last, so that a client reads the id and the versions at their places and looks the tensors up by their bytes
    (fewer than 65,536 tensors)."""
    n = len(versions)
    if n == 1:
        header = _ONE_HEAD.pack(_PACKED_HEAD, rid, _ONE_VERSION_HEAD, versions[0]) + tensors
    else:
        marks = _versions_struct(n).pack(*[x for v in versions for x in (_UINT64, v)])
        header = b"".join([_PACKED_HEAD, _U64.pack(rid), _VERSIONS_KEY, _array_head(n), marks, tensors])
    return with_buffers(header, payload)




def _check_packed_layout() -> None:
    """The packed layout is msgpack's map of the same fields (a reply of 1, 2 and 20 tensors)."""
    for n in (0, 1, 2, 20):
        keys = [(f"t{i}", i) for i in range(n)]
        tensors = [tensor_entry(k[0], k[1], np.dtype(np.float32), (i + 1,)) for i, k in enumerate(keys)]
        versions = [(1 << 63) - 1 - i for i in range(n)]
        frames = encode_params_packed(5, params_tensors(keys, [np.dtype(np.float32)] * n, range(1, n + 1)), versions,
                                      [])
        want = {"v": PROTOCOL_VERSION, "op": "params", "id": 5, "versions": versions, "tensors": tensors}
        got = unpack_header(frames[0], WireLimits())
        if got != want or list(got) != list(want):
            raise AssertionError(f"a packed params reply of {n} tensors is not msgpack's map of its fields")


_check_packed_layout()


def encode_ack(rid: int, versions: list[int], duplicate: bool, taken: Optional[int] = None,
               held: int = 0) -> list[Any]:
    """Frames of an ``ack`` reply; a push's says when its message was ``taken`` in and how long it was ``held``
    before this answer (ns of the shard's monotonic clock; see :class:`AckReply`)."""
    if taken is None:
        return encode({"op": "ack", "id": rid, "versions": versions, "duplicate": duplicate})
    return encode({"op": "ack", "id": rid, "versions": versions, "duplicate": duplicate, "taken": taken,
                   "held": held})


def encode_stats(rid: int, stats: dict[str, Any]) -> list[Any]:
    """Frames of a ``stats`` reply."""
    return encode({"op": "stats", "id": rid, "stats": stats})


def encode_error(rid: int, code: str, message: str) -> list[Any]:
    """Frames of an ``error`` reply."""
    return encode({"op": "error", "id": rid, "code": code, "message": message})


def encode_held(ids: Sequence[int]) -> list[Any]:
    """Frames of a ``held`` notice: the early params replies ``ids`` tell what the replicas hold now."""
    return encode({"op": "held", "id": 0, "ids": list(ids)})


def encode_saved(rid: int, path: str) -> list[Any]:
    """Frames of a ``saved`` reply."""
    return encode({"op": "saved", "id": rid, "path": path})
