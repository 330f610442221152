"""The data plane's requests, from a worker's client to a shard, as typed records (the shard's replies are in
:mod:`psrt.wire.replies`).

Each op has one record type and one encoder; :func:`decode_request` turns untrusted frames into those records
(or raises :class:`~psrt.errors.ProtocolError`), so the server never indexes a raw header. The fields of each op
are listed in :mod:`psrt.wire`'s docstring.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Sequence, Union

import msgpack
import numpy as np

from psrt.config import WireLimits
from psrt.errors import ProtocolError
from psrt.wire import compression, lanes
from psrt.wire.codec import (
    MAX_U63,
    MAX_WORKER,
    PROTOCOL_VERSION,
    Key,
    TensorMeta,
    check_buffers,
    check_version,
    encode,
    op_of,
    pack_header,
    same_limits,
    tensor_metas,
    uint,
    unpack_header,
    with_buffers,
)
from psrt.wire.lanes import LaneRef
from psrt.wire.rows import REQUEST_FIELDS as _ROW_OPS
from psrt.wire.rows import (
    InitTableRequest,
    PullRowsRequest,
    PushRowsRequest,
    decode_row_request,
)

__all__ = [
    "data_request_id",
    "InitRequest", "PushRequest", "PullKey", "PullRequest", "StatsRequest", "CheckpointRequest", "Request",
    "decode_request", "encode_init", "encode_push", "push_prefix", "encode_push_after", "encode_pull",
    "encode_stats_request", "encode_checkpoint_request",
]

_NO_LANE = object()


def _push_fixed(worker: int, session: int, entries: list[list[Any]], pull: bool) -> dict[str, Any]:
    """The fields of a ``push`` (``push_pull``) header that a repeated push of the same tensors repeats, in the
    order they are packed (once per set of tensors, :func:`push_prefix`); over a shared-memory lane, ``lane``
    follows them."""
    return {"v": PROTOCOL_VERSION, "op": "push_pull" if pull else "push", "worker": worker, "session": session,
            "tensors": entries}


#: A push header's fields: those of :func:`_push_fixed`, then those that change with every push, each packed as a
#: uint64, in the order of :func:`encode_push_after`'s arguments.
PUSH_FIXED = tuple(_push_fixed(0, 0, [], False))
PUSH_PER_CALL = ("id", "seq", "clock")
_PUSH = frozenset(PUSH_FIXED + PUSH_PER_CALL)
#: A sync push says the version its gradients were computed from (``base``, one int): a fourth per-call field.
_PUSH_BASED = _PUSH | {"base"}

_REQUEST_FIELDS: dict[str, frozenset[str]] = {
    "init": frozenset({"v", "op", "id", "worker", "session", "optimizer", "tensors"}),
    "push": _PUSH,
    "push_pull": _PUSH,
    "pull": frozenset({"v", "op", "id", "worker", "clock", "keys"}),
    "stats": frozenset({"v", "op", "id"}),
    "checkpoint": frozenset({"v", "op", "id"}),
}


# ---------------------------------------------------------------------------------------------- requests
@dataclass
class _WithTensors:
    """A message carrying tensors: ``buffers[i]`` holds the bytes of ``tensors[i]``."""

    tensors: list[TensorMeta]
    buffers: list[Any]
    #: The arrays made so far, by index, with the buffer each was made of (a lane rebinds the buffers).
    _arrays: Optional[dict[int, tuple[Any, np.ndarray]]] = field(default=None, init=False, repr=False, compare=False)

    def array(self, i: int) -> np.ndarray:
        """The i-th buffer as a flat array of its declared dtype (no copy; read-only if received), made once.

        A compressed gradient is widened to float32 (a new array).
        """
        buf = self.buffers[i]
        arrays = self._arrays
        if arrays is None:
            arrays = self._arrays = {}
        else:
            made = arrays.get(i)
            if made is not None and made[0] is buf:
                return made[1]
        meta = self.tensors[i]
        a = np.frombuffer(buf, meta.dtype) if meta.encoding is None else compression.decode(meta.encoding, buf,
                                                                                            meta.count)
        arrays[i] = (buf, a)
        return a

    def keys(self) -> list[Key]:
        """The ``(name, part)`` key of every tensor, in message order."""
        return [m.key for m in self.tensors]


@dataclass
class InitRequest(_WithTensors):
    """``init``: register tensors with initial values and the optimizer (by name) that updates them.

    ``check``: a question, not a change: would an ``init`` of these parts be taken (no existing key of another size)?
    It carries the parts' names and sizes and no bytes, and the shard answers an ``ack`` or the refusal the
    ``init`` would get, creating nothing (a client choosing how to cut its tensors asks it first).
    """

    id: int
    worker: int
    session: int
    optimizer: dict[str, Any]
    check: bool = False
    op: ClassVar[str] = "init"


@dataclass
class PushRequest(_WithTensors):
    """``push`` or ``push_pull`` (``pull`` true): gradients, with the sequence number that makes them exactly-once.

    ``clock`` is the worker's count of pushes including this one (bounded staleness, ``ssp`` mode). ``base``: the
    version of the parameters the gradients were computed from, one for every tensor (an int) or one per tensor (a
    list); None when the push does not say (an older client, or a shard without rounds: async, ssp). A sync
    shard restored behind what its workers saw keeps their rounds in step by it (:mod:`psrt.shard.realign`); one
    with backup workers drops a push whose base is older than the round it could join
    (:mod:`psrt.shard.stragglers`).
    """

    id: int
    worker: int
    session: int
    seq: int
    pull: bool
    clock: int = 0
    #: Sent over a shared-memory lane (:mod:`psrt.wire.lanes`): the buffers are bound to the segment by the shard.
    lane: Optional[LaneRef] = None
    base: Union[None, int, list[int]] = None

    @property
    def op(self) -> str:
        """``"push_pull"`` or ``"push"``."""
        return "push_pull" if self.pull else "push"


@dataclass(frozen=True)
class PullKey:
    """One key a pull asks for, and the least version the answer must have."""

    name: str
    part: int
    min_version: int

    @property
    def key(self) -> Key:
        """``(name, part)``."""
        return (self.name, self.part)


@dataclass
class PullRequest:
    """``pull``: parameters of ``keys``, each at least at its ``min_version``; ``clock``: the worker's pushes so far."""

    id: int
    worker: int
    keys: list[PullKey]
    clock: int = 0
    lane: Optional[LaneRef] = None  #: where the parameters are to be written, over a shared-memory lane
    #: Sent again to a shard that restarted before answering: answer with any version. ``min_version`` still says
    #: what this worker's pushes targeted, by which a restored shard tells a push it lost (:mod:`psrt.shard.realign`).
    again: bool = False
    op: ClassVar[str] = "pull"


@dataclass
class StatsRequest:
    """``stats``: the shard's counters."""

    id: int
    op: ClassVar[str] = "stats"


@dataclass
class CheckpointRequest:
    """``checkpoint``: write a checkpoint now (the shard must have a checkpoint directory)."""

    id: int
    op: ClassVar[str] = "checkpoint"


Request = Union[InitRequest, PushRequest, PullRequest, StatsRequest, CheckpointRequest, InitTableRequest,
                PushRowsRequest, PullRowsRequest, lanes.LaneProbeRequest, lanes.LaneOpenRequest,
                lanes.LaneCloseRequest]


def decode_request(frames: Sequence[Any], limits: WireLimits) -> Request:
    """Decode and validate a request ``[header, buffers...]`` (the frames after the ROUTER identity).

    Parameters
    ----------
    frames : sequence of buffer-like
        The message frames (``zmq.Frame``, ``bytes`` or ``memoryview``).
    limits : WireLimits
        Decode limits.

    Raises
    ------
    ProtocolError
        With ``request_id`` set to the request's id when the header got that far, else ``None``.
    """
    # A push whose fixed fields were decoded and checked before (a training loop's every step): only its id, seq
    # and clock are new (the lookup of a header shorter than that misses: nothing that short is remembered).
    head = frames[0] if frames else None
    if type(head) is not bytes and head is not None:
        head = _header_bytes(head, limits)
    seen = based = None
    if type(head) is bytes:
        # (A sync push: its base follows the clock. A lane push's head may be the same byte; its lookup misses.)
        if head[:1] == _BASED_HEAD:
            seen = _SEEN_PUSHES.get(head[:-_BASED_TAIL.size])
            if seen is not None:
                id_key, rid, seq_key, seq, clock_key, clock, base_key, based = _BASED_TAIL.unpack_from(
                    head, -_BASED_TAIL.size)
                if (id_key, seq_key, clock_key, base_key) != _BASED_KEYS or max(rid, seq, clock, based) > MAX_U63:
                    seen = None
        else:
            seen = _SEEN_PUSHES.get(head[:-_TAIL])
            if seen is not None:
                id_key, rid, seq_key, seq, clock_key, clock = _PUSH_TAIL.unpack_from(head, -_TAIL)
                if (id_key, seq_key, clock_key) != _PER_CALL_KEYS or max(rid, seq, clock) > MAX_U63:
                    seen = None
    if seen is not None and (seen.limits is limits or seen.limits is same_limits(limits)):
        buffers = list(frames[1:])
        if seen.sizes is None or tuple(map(len, buffers)) != seen.sizes:
            try:
                check_buffers(seen.tensors, buffers)  # top-k frames (their own rules), or it says what is wrong
            except ProtocolError as exc:
                exc.request_id = rid  # type: ignore[attr-defined]
                raise
        return PushRequest(list(seen.tensors), buffers, rid, seen.worker, seen.session, seq, seen.pull, clock,
                           None, based)
    request_id = None
    try:
        if len(frames) < 1:
            raise ProtocolError("empty message: expected a header frame")
        h = unpack_header(head, limits)
        if type(h.get("id")) is int and 0 <= h["id"] <= MAX_U63:
            request_id = h["id"]
        check_version(h)
        if request_id is not None and (h.keys() == _PUSH or h.keys() == _PUSH_BASED):  # every step's: short path
            if (req := _plain_push(h, frames, limits, request_id)) is not None:
                _remember_push(head, req, limits)
                return req
        if type(h.get("op")) is str and h["op"] in _ROW_OPS:  # embedding tables: psrt.wire.rows
            return decode_row_request(h, list(frames[1:]), limits)
        if type(h.get("op")) is str and h["op"] in lanes.REQUEST_FIELDS:  # shared-memory lanes: psrt.wire.lanes
            return lanes.decode_lane_request(h, list(frames[1:]))
        lane = h.pop("lane", None) if "lane" in h else _NO_LANE
        again = False
        if "again" in h and h.get("op") == "pull":
            again = h.pop("again")
            if again is not True:
                raise ProtocolError(f"field 'again' must be true when given, got {again!r:.40}")
        check = False
        if "check" in h and h.get("op") == "init":
            check = h.pop("check")
            if check is not True:
                raise ProtocolError(f"field 'check' must be true when given, got {check!r:.40}")
        base = _base(h.pop("base")) if "base" in h and h.get("op") in ("push", "push_pull") else None
        op = op_of(h, _REQUEST_FIELDS, "request")
        if lane is not _NO_LANE and op not in ("push", "push_pull", "pull"):
            raise ProtocolError(f"op {op!r} cannot travel over a shared-memory lane")
        rid = uint(h, "id")
        buffers = list(frames[1:])
        if op in ("stats", "pull", "checkpoint"):
            if buffers:
                raise ProtocolError(f"op {op!r} takes no buffer frames, got {len(buffers)}")
            if op == "stats":
                return StatsRequest(rid)
            if op == "checkpoint":
                return CheckpointRequest(rid)
            keys = _pull_keys(h["keys"], limits)
            ref = None if lane is _NO_LANE else lanes.lane_ref(lane, 0, len(keys))
            return PullRequest(rid, uint(h, "worker", MAX_WORKER), keys, uint(h, "clock"), ref, again)
        worker, session = uint(h, "worker", MAX_WORKER), uint(h, "session")
        seq, clock = (uint(h, "seq"), uint(h, "clock")) if op != "init" else (0, 0)
        if op == "init" and type(h["optimizer"]) is not dict:
            raise ProtocolError("field 'optimizer' must be a map")
        metas = tensor_metas(h["tensors"], limits, compressed=op != "init" and lane is _NO_LANE)
        ref = None if lane is _NO_LANE else lanes.lane_ref(lane, len(metas), len(metas) if op == "push_pull" else 0)
        if (ref is not None or check) and buffers:
            raise ProtocolError(f"a {op!r} {'check' if check else 'over a shared-memory lane'} takes no buffer "
                                f"frames, got {len(buffers)}")
        if ref is None and not check:
            check_buffers(metas, buffers)
        _check_distinct(metas)
        if op == "init":
            return InitRequest(metas, buffers, rid, worker, session, h["optimizer"], check)
        if type(base) is list and len(base) != len(metas):
            raise ProtocolError(f"field 'base' lists {len(base)} versions for {len(metas)} tensors")
        return PushRequest(metas, buffers, rid, worker, session, seq, op == "push_pull", clock, ref, base)
    except ProtocolError as exc:
        exc.request_id = request_id  # type: ignore[attr-defined]
        raise


def _base(value: Any) -> Union[int, list[int]]:
    """A push's optional ``base``: a version (uint), or a list of one per tensor."""
    if type(value) is int and 0 <= value <= MAX_U63:
        return value
    if type(value) is list and all(type(v) is int and 0 <= v <= MAX_U63 for v in value):
        return value
    raise ProtocolError(f"field 'base' must be a version (an integer in [0, {MAX_U63}]) or a list of one per tensor, "
                        f"got {value!r:.80}")


def _header_bytes(frame: Any, limits: WireLimits) -> Any:
    """A received header frame's bytes (msgpack and the lookup of a push's fixed part read bytes fastest), or the
    frame itself when it is larger than a header may be (refused unread) or no buffer."""
    if hasattr(type(frame), "bytes"):  # a zmq.Frame: its copy of its bytes (made once, on first use)
        return frame.bytes if len(frame) <= limits.max_header_bytes else frame
    if isinstance(frame, (bytearray, memoryview)) and len(frame) <= limits.max_header_bytes:
        return bytes(frame)
    return frame


def _plain_push(h: dict[str, Any], frames: Sequence[Any], limits: WireLimits, rid: int) -> Optional[PushRequest]:
    """A push(_pull) with in-range integers, in fewer steps (None: the general path says what is wrong)."""
    op, worker, session, seq, clock, base = h["op"], h["worker"], h["session"], h["seq"], h["clock"], h.get("base")
    if not ((op == "push_pull" or op == "push") and type(op) is str and type(worker) is int and type(session) is int
            and type(seq) is int and type(clock) is int and 0 <= worker <= MAX_WORKER
            and 0 <= session <= MAX_U63 and 0 <= seq <= MAX_U63 and 0 <= clock <= MAX_U63
            and (base is None or (type(base) is int and 0 <= base <= MAX_U63))):
        return None
    metas, buffers = tensor_metas(h["tensors"], limits, compressed=True), list(frames[1:])  # as the general path
    check_buffers(metas, buffers)
    _check_distinct(metas)
    return PushRequest(metas, buffers, rid, worker, session, seq, op == "push_pull", clock, None, base)


@dataclass(frozen=True)
class _SeenPush:
    """What the fixed fields of a push header (:data:`PUSH_FIXED`, packed as one byte string) decoded to, under
    ``limits`` (:func:`~psrt.wire.codec.same_limits`): everything but the id, seq and clock, checked."""

    limits: WireLimits
    tensors: tuple[TensorMeta, ...]
    worker: int
    session: int
    pull: bool
    #: Each buffer frame's size, or None when one is top-k's (whose size depends on the push).
    sizes: Optional[tuple[int, ...]]


#: Pushes decoded before, by their header's bytes up to the per-call fields (:func:`_remember_push`).
_SEEN_PUSHES: dict[bytes, _SeenPush] = {}
_SEEN_PUSHES_MAX = 1 << 14


def _remember_push(head: bytes, req: PushRequest, limits: WireLimits) -> None:
    """Keep what the fixed part of a valid push header decoded to, by its bytes, when the header ends with the
    per-call fields as :func:`encode_push_after` packs them (every psrt client's push over a socket).

    msgpack decodes a map's pairs one after the other, each from its own bytes: when the bytes before the tail
    are the map's head and then exactly the fixed fields' pairs (decoded alone, as a map of that many, they
    are complete and nothing is left over), any header of those bytes and such a tail is this header with
    other integers, and decodes and checks as it did. A later push with the same bytes then skips msgpack.
    """
    if req.base is None:
        cut = len(head) - _PUSH_TAIL.size
        if cut <= 1 or head[0] != _MAP_HEADS[len(PUSH_FIXED)][0]:
            return
        id_key, _, seq_key, _, clock_key, _ = _PUSH_TAIL.unpack_from(head, cut)
        if (id_key, seq_key, clock_key) != _PER_CALL_KEYS:
            return
    else:
        cut = len(head) - _BASED_TAIL.size
        if cut <= 1 or head[:1] != _BASED_HEAD:
            return
        if _BASED_TAIL.unpack_from(head, cut)[::2] != _BASED_KEYS:
            return
    try:
        fixed = unpack_header(_FIXED_HEAD + head[1:cut], limits)
    except ProtocolError:
        return
    if fixed.keys() != _FIXED_KEYS:
        return
    if len(_SEEN_PUSHES) >= _SEEN_PUSHES_MAX:
        _SEEN_PUSHES.clear()  # a peer inventing headers must not grow this without bound
    sizes = None if any(m.encoding == compression.TOPK for m in req.tensors) else tuple(m.nbytes for m in req.tensors)
    _SEEN_PUSHES[head[:cut]] = _SeenPush(same_limits(limits), tuple(req.tensors), req.worker, req.session, req.pull,
                                         sizes)


def _check_distinct(metas: list[TensorMeta]) -> None:
    if len(metas) > 1 and len({m.key for m in metas}) != len(metas):
        raise ProtocolError("a tensor key appears twice in one message")


def _pull_keys(keys: Any, limits: WireLimits) -> list[PullKey]:
    if type(keys) is not list or len(keys) > limits.max_tensors:
        raise ProtocolError(f"field 'keys' must be a list of at most {limits.max_tensors} [name, part, min_version]")
    out = []
    for i, entry in enumerate(keys):
        if (type(entry) is not list or len(entry) != 3 or type(entry[0]) is not str
                or not 0 < len(entry[0]) <= limits.max_name_len
                or type(entry[1]) is not int or not 0 <= entry[1] <= MAX_U63
                or type(entry[2]) is not int or not 0 <= entry[2] <= MAX_U63):
            raise ProtocolError(f"pull key {i} must be [name, part, min_version] with a non-empty name "
                                "and non-negative integers")
        out.append(PullKey(entry[0], entry[1], entry[2]))
    return out


def encode_init(rid: int, worker: int, session: int, optimizer: dict[str, Any], entries: list[list[Any]],
                payload: Sequence[np.ndarray], check: bool = False) -> list[Any]:
    """Frames of an ``init`` request; ``entries`` are :func:`~psrt.wire.codec.tensor_entry` lists. ``check``: only
    ask whether it would be taken (:class:`InitRequest`), with no ``payload``."""
    header = {"op": "init", "id": rid, "worker": worker, "session": session, "optimizer": optimizer,
              "tensors": entries}
    if check:
        if payload:
            raise ValueError("an init check carries no tensor bytes")
        header["check"] = True
    return encode(header, payload)


def encode_push(rid: int, worker: int, session: int, seq: int, entries: list[list[Any]],
                payload: Sequence[np.ndarray], pull: bool, clock: int = 0, lane: Optional[LaneRef] = None,
                base: Union[None, int, Sequence[int]] = None) -> list[Any]:
    """Frames of a ``push`` (or, with ``pull``, a ``push_pull``) request; with ``lane``, no payload.

    Without ``lane`` (and with ``base`` one int or None), the bytes of :func:`encode_push_after` from the
    :func:`push_prefix` of the same fields. ``base`` (every sync push's, :mod:`psrt.shard.realign`; backup workers
    drop a late one): the version the gradients were computed from, one int or one per tensor; it follows the
    per-call fields.
    """
    if base is not None and type(base) is not int:  # one per tensor: the general packing
        header = _push_fixed(worker, session, entries, pull)
        del header["v"]  # (encode puts it first)
        if lane is not None:
            header["lane"] = lane.to_wire()
        header.update(id=rid, seq=seq, clock=clock, base=list(base))
        return encode(header, payload)
    return encode_push_after(_push_prefix(worker, session, entries, pull, lane), rid, seq, clock, payload, base)


def push_prefix(worker: int, session: int, entries: list[list[Any]], pull: bool) -> bytes:
    """The part of a ``push`` (``push_pull``) header that a repeated push of the same tensors repeats, packed once.

    :func:`encode_push_after` completes it with the fields that change from push to push (``id, seq, clock``), so
    a training loop's step packs three integers instead of the whole header; the result is the bytes
    :func:`encode_push` makes of the same fields.
    """
    return _push_prefix(worker, session, entries, pull, None)


def _push_prefix(worker: int, session: int, entries: list[list[Any]], pull: bool, lane: Optional[LaneRef]) -> bytes:
    fixed = _push_fixed(worker, session, entries, pull)
    if lane is not None:
        fixed["lane"] = lane.to_wire()
    # The fixed fields packed as a map of their own, under the head of the whole header's map (_push_template).
    return _MAP_HEADS[len(fixed)] + pack_header(fixed)[1:]


def _push_template(per_call: tuple[str, ...]) -> tuple[dict[int, bytes], struct.Struct, tuple[bytes, ...]]:
    """The constant parts of a push header whose fields after the fixed ones are ``per_call``, derived once, at
    import, from its field tables and msgpack.

    A map of fewer than 16 entries packs as one head byte that counts them (a fixmap), then each key and value
    in order. So a push header is the whole map's head, the fixed fields packed as a map without its head, and
    the per-call fields: each its packed key, the uint64 marker and 8 bytes (every integer a client sends fits).
    Returns the heads by the number of fixed fields (without and with ``lane``), the per-call part's format and
    the constant bytes before each of its integers; checked against msgpack's packing of a whole header.
    """
    big = (1 << 64) - 1  # msgpack packs it as a uint64
    keys = tuple(msgpack.packb(k) + msgpack.packb(big)[:1] for k in per_call)
    tail = struct.Struct(">" + "".join(f"{len(k)}sQ" for k in keys))
    heads = {}
    for fixed in (PUSH_FIXED, (*PUSH_FIXED, "lane")):
        whole = pack_header({**dict.fromkeys(fixed), **dict.fromkeys(per_call, big)})
        heads[len(fixed)] = whole[:1]
        cut = whole[:1] + pack_header(dict.fromkeys(fixed))[1:] + tail.pack(*(x for k in keys for x in (k, big)))
        if cut != whole:
            raise AssertionError(f"a push header of {len(whole)} bytes does not pack as its parts")
    return heads, tail, keys


_MAP_HEADS, _PUSH_TAIL, (_ID, _SEQ, _CLOCK) = _push_template(PUSH_PER_CALL)
#: A sync push's header (:func:`encode_push_after` with ``base``): the same fixed fields under the head of a map of
#: one more field, and a tail of four integers.
_BASED_HEADS, _BASED_TAIL, _BASED_KEYS = _push_template((*PUSH_PER_CALL, "base"))
_BASED_HEAD = _BASED_HEADS[len(PUSH_FIXED)]
#: A prefix's head (with a lane or without) -> the head of the same header with ``base``.
_WITH_BASE = {head[0]: _BASED_HEADS[n] for n, head in _MAP_HEADS.items()}
#: The head of a map of the fixed fields alone, and their names (:func:`_remember_push`).
_FIXED_HEAD = pack_header(dict.fromkeys(PUSH_FIXED))[:1]
_FIXED_KEYS = frozenset(PUSH_FIXED)
_TAIL = _PUSH_TAIL.size
_PER_CALL_KEYS = (_ID, _SEQ, _CLOCK)


def encode_push_after(prefix: bytes, rid: int, seq: int, clock: int, payload: Sequence[np.ndarray],
                      base: Optional[int] = None) -> list[Any]:
    """Frames of a ``push`` (``push_pull``) request from its :func:`push_prefix`: as :func:`encode_push` with the
    fields the prefix was packed with. ``base`` (a sync push): the version its gradients were computed from, one
    int for every tensor."""
    if base is None:
        return with_buffers(prefix + _PUSH_TAIL.pack(_ID, rid, _SEQ, seq, _CLOCK, clock), payload)
    k = _BASED_KEYS
    return with_buffers(_WITH_BASE[prefix[0]] + prefix[1:] + _BASED_TAIL.pack(
        k[0], rid, k[1], seq, k[2], clock, k[3], base), payload)


def encode_pull(rid: int, worker: int, keys: list[list[Any]], clock: int = 0,
                lane: Optional[LaneRef] = None, again: bool = False) -> list[Any]:
    """Frames of a ``pull`` request; ``keys`` are ``[name, part, min_version]`` lists; ``again``: sent again to a
    shard that restarted before answering (any version will do; see :attr:`PullRequest.again`)."""
    header = {"op": "pull", "id": rid, "worker": worker, "clock": clock, "keys": keys}
    if lane is not None:
        header["lane"] = lane.to_wire()
    if again:
        header["again"] = True
    return encode(header)


def encode_stats_request(rid: int) -> list[Any]:
    """Frames of a ``stats`` request."""
    return encode({"op": "stats", "id": rid})


def encode_checkpoint_request(rid: int) -> list[Any]:
    """Frames of a ``checkpoint`` request."""
    return encode({"op": "checkpoint", "id": rid})


def data_request_id(frames: Sequence[Any], limits: WireLimits) -> Optional[int]:
    """The id of a message meant for a shard (its header names a data-plane op), or None.

    Lets a process that serves no tensors (the scheduler) answer such a message with an error saying what it is,
    instead of dropping it and leaving the sender to time out.
    """
    try:
        h = unpack_header(frames[0], limits) if frames else None
    except ProtocolError:
        return None
    op, rid = (h.get("op"), h.get("id")) if h is not None else (None, None)
    if type(op) is str and (op in _REQUEST_FIELDS or op in _ROW_OPS or op in lanes.REQUEST_FIELDS) \
            and type(rid) is int and 0 <= rid <= MAX_U63:
        return rid
    return None
