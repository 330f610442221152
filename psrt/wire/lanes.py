"""Shared-memory lanes on the data plane: how a worker and a shard on one host agree to move tensor bytes
through a segment (:mod:`psrt.shm`) while ZeroMQ carries only the headers.

==============  ==========================================================  ===================================
request         fields (besides ``v, op, id``)                              reply
==============  ==========================================================  ===================================
``lane_probe``  (none)                                                      ``beacon {name}``: the shard's
                                                                            beacon file ("" when it serves no
                                                                            shared memory)
``lane_open``   ``worker, session, token, size``: the token read from the   ``lane {name, generation, size}``:
                beacon, the segment's size                                  a new segment for this worker
``lane_close``  ``generation``: the worker is done with that segment        ``closed {}``
``local_open``  ``token``: the token read from the beacon                   ``local {name, secret}``: the
                                                                            shard's local listener and a
                                                                            secret for this worker
==============  ==========================================================  ===================================

A worker that reads a shard's beacon (it shares the host) asks for a local connection (``local_open``,
:mod:`psrt.transport.local`): it connects to the listener ``name`` (an abstract Unix socket) and presents
``secret``, and from its next request on, its requests and their replies take that connection instead of
ZeroMQ, the frames unchanged.

A ``push``, ``push_pull`` or ``pull`` sent over a lane has no buffer frames and one more field, ``lane``:
``[generation, inputs, outputs]``: the segment's generation, the offset of each tensor's bytes (``push`` and
``push_pull``: one per tensor; ``pull``: none), and the offset each tensor's parameters are to be written at
(``push_pull`` and ``pull``: one per tensor or key; ``push``: none). The shard checks every offset against the
segment (aligned, after its header, the whole area inside) and the generation against the lane's current one
before anything changes. Its ``params`` reply then carries ``lane: generation`` and ``places``, and no buffer
frames: per tensor, ``[]`` when its parameters are in the segment at the offset the request gave, or
``[generation, offset, counter]`` when the worker is to copy them from the shard's shared parameters (sync
mode), at that offset of that segment, under the seqlock counter that precedes them (its value when the
reply was sent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from psrt.errors import ProtocolError
from psrt.wire.codec import MAX_U63, MAX_WORKER, check_fields, encode, string, uint

__all__ = ["places", "LaneRef", "LaneProbeRequest", "LaneOpenRequest", "LaneCloseRequest", "BeaconReply",
           "LaneReply", "ClosedReply", "REQUEST_FIELDS", "REPLY_FIELDS", "decode_lane_request", "decode_lane_reply",
           "lane_ref", "encode_lane_probe", "encode_lane_open", "encode_lane_close", "encode_beacon", "encode_closed",
           "encode_lane", "LocalOpenRequest", "LocalReply", "encode_local_open", "encode_local"]

_MAX_NAME = 64

REQUEST_FIELDS: dict[str, frozenset[str]] = {
    "lane_probe": frozenset({"v", "op", "id"}),
    "lane_open": frozenset({"v", "op", "id", "worker", "session", "token", "size"}),
    "lane_close": frozenset({"v", "op", "id", "generation"}),
    "local_open": frozenset({"v", "op", "id", "token"}),
}
REPLY_FIELDS: dict[str, frozenset[str]] = {
    "beacon": frozenset({"v", "op", "id", "name"}),
    "lane": frozenset({"v", "op", "id", "name", "generation", "size"}),
    "closed": frozenset({"v", "op", "id"}),
    "local": frozenset({"v", "op", "id", "name", "secret"}),
}


@dataclass(frozen=True)
class LaneRef:
    """Where a request's tensors lie in its worker's segment: ``inputs`` (gradients) and ``outputs`` (where the
    parameters go), byte offsets in message order."""

    generation: int
    inputs: list[int]
    outputs: list[int]

    def to_wire(self) -> list[Any]:
        """The header value of the ``lane`` field."""
        return [self.generation, self.inputs, self.outputs]


def lane_ref(value: Any, inputs: int, outputs: int) -> LaneRef:
    """Check a request's ``lane`` field: ``[generation, inputs, outputs]`` with the given list lengths.

    Raises
    ------
    ProtocolError
        When it is not so shaped or an offset is not a non-negative integer.
    """
    if type(value) is not list or len(value) != 3:
        raise ProtocolError("field 'lane' must be [generation, inputs, outputs]")
    generation, ins, outs = value
    if type(generation) is not int or not 0 <= generation <= MAX_U63:
        raise ProtocolError("field 'lane': the generation must be a non-negative integer")
    for what, got, want in (("inputs", ins, inputs), ("outputs", outs, outputs)):
        if type(got) is not list or len(got) != want or any(type(o) is not int or not 0 <= o <= MAX_U63
                                                             for o in got):
            raise ProtocolError(f"field 'lane': {what} must be {want} non-negative integer offsets")
    return LaneRef(generation, ins, outs)


def places(value: Any, count: int) -> list[list[int]]:
    """Check a ``params`` reply's ``places``: ``count`` entries, each ``[]`` or three non-negative integers."""
    if type(value) is not list or len(value) != count:
        raise ProtocolError(f"field 'places' must list {count} places")
    for p in value:
        if type(p) is not list or len(p) not in (0, 3) or any(type(x) is not int or not 0 <= x <= MAX_U63
                                                               for x in p):
            raise ProtocolError("field 'places': each place is [] or [generation, offset, counter]")
    return value


@dataclass
class LaneProbeRequest:
    """``lane_probe``: where is the shard's beacon?"""

    id: int
    op: ClassVar[str] = "lane_probe"


@dataclass
class LaneOpenRequest:
    """``lane_open``: a worker proves it read the beacon (``token``) and asks for a segment of ``size`` bytes."""

    id: int
    worker: int
    session: int
    token: str
    size: int
    op: ClassVar[str] = "lane_open"


@dataclass
class LaneCloseRequest:
    """``lane_close``: the worker is done with the segment of ``generation`` (its client is closing)."""

    id: int
    generation: int
    op: ClassVar[str] = "lane_close"


@dataclass
class ClosedReply:
    """``closed``: the answer to ``lane_close``."""

    id: int
    op: ClassVar[str] = "closed"


@dataclass
class BeaconReply:
    """``beacon``: the name of the shard's beacon in /dev/shm ("" when it serves no shared memory)."""

    id: int
    name: str
    op: ClassVar[str] = "beacon"


@dataclass(frozen=True)
class LocalOpenRequest:
    """``local_open``: a worker that read the shard's beacon (``token``) asks for a local connection."""

    id: int
    token: str
    op: ClassVar[str] = "local_open"


@dataclass(frozen=True)
class LocalReply:
    """``local``: the shard's local listener (an abstract socket's name) and the secret to present there."""

    id: int
    name: str
    secret: str
    op: ClassVar[str] = "local"


@dataclass
class LaneReply:
    """``lane``: the segment a ``lane_open`` got: its name in /dev/shm, generation and size."""

    id: int
    name: str
    generation: int
    size: int
    op: ClassVar[str] = "lane"


def decode_lane_request(h: dict[str, Any], buffers: list[Any]) -> Any:
    """Decode a ``lane_probe`` or ``lane_open`` header (it passed the version check); neither takes frames."""
    op = h["op"]
    check_fields(op, h, REQUEST_FIELDS[op])
    if buffers:
        raise ProtocolError(f"op {op!r} takes no buffer frames, got {len(buffers)}")
    rid = uint(h, "id")
    if op == "lane_probe":
        return LaneProbeRequest(rid)
    if op == "lane_close":
        return LaneCloseRequest(rid, uint(h, "generation"))
    if op == "local_open":
        return LocalOpenRequest(rid, string(h, "token", 64))
    return LaneOpenRequest(rid, uint(h, "worker", MAX_WORKER), uint(h, "session"), string(h, "token", 64),
                           uint(h, "size", lo=1))


def decode_lane_reply(h: dict[str, Any]) -> Any:
    """Decode a ``beacon`` or ``lane`` reply header (it passed the version check)."""
    op = h["op"]
    check_fields(op, h, REPLY_FIELDS[op])
    rid = uint(h, "id")
    if op == "beacon":
        return BeaconReply(rid, string(h, "name", _MAX_NAME))
    if op == "closed":
        return ClosedReply(rid)
    if op == "local":
        return LocalReply(rid, string(h, "name", _MAX_NAME), string(h, "secret", _MAX_NAME))
    return LaneReply(rid, string(h, "name", _MAX_NAME), uint(h, "generation"), uint(h, "size", lo=1))


def encode_lane_probe(rid: int) -> list[Any]:
    """Frames of a ``lane_probe`` request."""
    return encode({"op": "lane_probe", "id": rid})


def encode_lane_open(rid: int, worker: int, session: int, token: str, size: int) -> list[Any]:
    """Frames of a ``lane_open`` request."""
    return encode({"op": "lane_open", "id": rid, "worker": worker, "session": session, "token": token,
                   "size": size})


def encode_lane_close(rid: int, generation: int) -> list[Any]:
    """Frames of a ``lane_close`` request."""
    return encode({"op": "lane_close", "id": rid, "generation": generation})


def encode_closed(rid: int) -> list[Any]:
    """Frames of a ``closed`` reply."""
    return encode({"op": "closed", "id": rid})


def encode_beacon(rid: int, name: str) -> list[Any]:
    """Frames of a ``beacon`` reply."""
    return encode({"op": "beacon", "id": rid, "name": name})


def encode_lane(rid: int, name: str, generation: int, size: int) -> list[Any]:
    """Frames of a ``lane`` reply."""
    return encode({"op": "lane", "id": rid, "name": name, "generation": generation, "size": size})


def encode_local_open(rid: int, token: str) -> list[Any]:
    """Frames of a ``local_open`` request."""
    return encode({"op": "local_open", "id": rid, "token": token})


def encode_local(rid: int, name: str, secret: str) -> list[Any]:
    """Frames of a ``local`` reply."""
    return encode({"op": "local", "id": rid, "name": name, "secret": secret})
