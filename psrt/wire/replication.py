"""The replication channel's messages, primary shard to replica shard and back (:mod:`psrt.shard.replication`).

==============  =========================================================  ==================================
request         fields (besides ``v, op, id``)                             reply
==============  =========================================================  ==================================
``replicate``   ``token, sender, range, workers, optimizers, tensors,      ``replicated {}`` once applied, or
                versions, opt, slots, included, full, clocks`` + buffers:  ``error {code, message}`` (nothing
                per tensor its parameters, then each of its optimizer      applied)
                slots
==============  =========================================================  ==================================

``tensors`` are the keys whose values the message sets, as everywhere (``[name, part, dtype, [count]]``);
``versions`` their versions, ``opt`` the index in ``optimizers`` (wire specs, :func:`psrt.optim.from_wire`) of
each one's optimizer, ``slots`` the names of each one's optimizer slots, whose buffers (of the parameters'
dtype and size) follow its parameters in that order. ``workers`` is ``[[worker, session, settled], ...]``:
every push of that session up to sequence number ``settled - 1`` is in the state the replica holds once it
applied the message (``settled`` 0: none), and where some of those are not (a push lost and sent again arrives
after later ones: :mod:`psrt.shard.replay`), a fourth element, ``holes``: ``[[first, count], ...]``, the runs
of sequence numbers below ``settled`` not in the state (left out, as an older psrt sends it: every one is).
``included`` lists per tensor ``[[worker, seq], ...]`` for the workers of its
rounds (as of the last one each joined; the session: ``workers``'): its state includes every push of that
worker's session up to ``seq`` that touches it (a push whose
other keys' rounds were still open is not settled, but its part in this key is in), except, where a third element
``holes``, ``[[first, count], ...]``, is given, the runs of sequence numbers listed there (pushes overtaken by
later ones: :mod:`psrt.shard.replay`; left out, as an older psrt sends it and as in-order pushes leave it: none).
``full``: the message holds every key of the range (a replica that
joined a running job holds the range once it took one). ``clocks`` lists per tensor ``[[worker, clock], ...]``, its
workers' ssp clocks (empty in the other modes). ``token`` is the job's replication token and ``sender``
the rank of the shard sending (:mod:`psrt.control.placement`): a replica checks both before it changes anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Optional, Sequence

import numpy as np

from psrt.config import WireLimits
from psrt.errors import ProtocolError
from psrt.wire.codec import (
    MAX_U63,
    TensorMeta,
    check_version,
    encode,
    hole_runs,
    op_of,
    string,
    tensor_entry,
    tensor_metas,
    uint,
    uint_list,
    unpack_header,
)

__all__ = ["ReplicateRequest", "Replicated", "ReplicationError", "encode_replicate", "decode_replicate",
           "encode_replicated", "encode_replication_error", "decode_replication_reply"]

_FIELDS = {"replicate": frozenset({"v", "op", "id", "token", "sender", "range", "workers", "optimizers", "tensors",
                                   "versions", "opt", "slots", "included", "full", "clocks"})}
_REPLY_FIELDS = {"replicated": frozenset({"v", "op", "id"}),
                 "error": frozenset({"v", "op", "id", "code", "message"})}
_MAX_SLOTS = 8
_MAX_OPTIMIZERS = 64


@dataclass(frozen=True)
class ReplicateRequest:
    """A decoded ``replicate`` message (every field checked; the buffers matched to their tensors and slots)."""

    id: int
    token: str
    sender: int
    range: int
    #: ``(worker, session, last applied seq)``; -1: none of that session.
    workers: list[tuple[int, int, int]]
    #: The optimizers' wire specs (maps), for :func:`psrt.optim.from_wire` to check on the shard.
    optimizers: list[dict[str, Any]]
    tensors: list[TensorMeta]
    versions: list[int]
    opt: list[int]
    slots: list[tuple[str, ...]]
    #: Per tensor: its parameters, then its slots, as arrays of its dtype (read-only views of the frames).
    arrays: list[list[np.ndarray]]
    #: Per tensor: ``{worker: seq}`` of the workers of its rounds: its state holds every push of the worker's
    #: session (:attr:`workers`') up to ``seq`` that touches it (settled or not), but the holes in
    #: :attr:`included_holes`.
    included: list[dict[int, int]]
    #: The message holds every key of the range.
    full: bool = False
    #: Per tensor: ``{worker: clock}`` (ssp).
    clocks: list[dict[int, int]] = field(default_factory=list)
    #: Per worker with holes: its replay window's holes below the settled seq (:mod:`psrt.shard.replay`); a worker
    #: left out has none.
    holes: dict[int, list[list[int]]] = field(default_factory=dict)
    #: Per tensor (or none, an older psrt's): ``{worker: [[first, count], ...]}`` of the workers in
    #: :attr:`included` whose pushes up to their ``seq`` are not all in its state; a worker left out has none.
    included_holes: list[dict[int, list[list[int]]]] = field(default_factory=list)
    op: ClassVar[str] = "replicate"


@dataclass(frozen=True)
class Replicated:
    """``replicated``: the replica applied the message."""

    id: int
    op: ClassVar[str] = "replicated"


@dataclass(frozen=True)
class ReplicationError:
    """``error``: the replica refused the message and changed nothing."""

    id: int
    code: str
    message: str
    op: ClassVar[str] = "error"


def encode_replicate(rid: int, token: str, sender: int, rng: int, workers: Sequence[tuple[int, int, int]],
                     entries: Sequence[tuple[tuple[str, int], Any]],
                     included: Sequence[Mapping[int, Any]] = (), full: bool = False,
                     holes: Optional[Mapping[int, list[list[int]]]] = None) -> list[Any]:
    """Frames of a ``replicate`` message: ``entries`` are ``(key, store entry)`` pairs (parameters, slots, version,
    optimizer), ``workers`` ``(worker, session, last applied seq)``, ``included`` per entry the workers of its rounds,
    each ``seq`` or ``(seq, holes)`` (its state holds the worker's pushes up to ``seq`` that touch it, but
    the runs ``holes``, :meth:`psrt.shard.replay.WorkerLog.hole_runs`; none when left out or empty); ``full``:
    ``entries`` are every key of the range; ``holes``: per worker the replay holes at and below its last applied
    seq (none when left out or empty)."""
    holes = holes or {}
    specs: list[dict[str, Any]] = []
    seen: dict[int, int] = {}  # by identity: the keys of one init share one optimizer object
    tensors, versions, opt, slots, arrays, clocks = [], [], [], [], [], []
    for (name, part), entry in entries:
        index = seen.get(id(entry.optimizer))
        if index is None:
            index = seen[id(entry.optimizer)] = len(specs)
            specs.append(entry.optimizer.to_wire())
        names = sorted(entry.slots)
        tensors.append(tensor_entry(name, part, entry.param.dtype, (entry.param.size,)))
        versions.append(entry.version)
        clocks.append([[w, c] for w, c in sorted(entry.clocks.items())])
        opt.append(index)
        slots.append(names)
        arrays.append(entry.param.reshape(-1))
        arrays.extend(entry.slots[s].reshape(-1) for s in names)
    return encode({"op": "replicate", "id": rid, "token": token, "sender": sender, "range": rng,
                   "workers": [[w, session, seq + 1] + ([holes[w]] if holes.get(w) else [])
                               for w, session, seq in workers], "optimizers": specs,
                   "tensors": tensors, "versions": versions, "opt": opt, "slots": slots,
                   "included": [[_included_pair(w, q) for w, q in sorted(d.items())] for d in included]
                   or [[] for _ in tensors],
                   "full": full, "clocks": clocks},
                  arrays)


def _included_pair(worker: int, pushes: Any) -> list[Any]:
    """``[worker, seq]``, or ``[worker, seq, holes]`` where ``pushes`` is ``(seq, holes)`` with holes."""
    if type(pushes) is int:
        return [worker, pushes]
    seq, runs = pushes
    return [worker, seq, runs] if runs else [worker, seq]


def decode_replicate(frames: Sequence[Any], limits: WireLimits) -> ReplicateRequest:
    """Decode a ``replicate`` message as untrusted input.

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
        metas = tensor_metas(h["tensors"], limits)
        n = len(metas)
        versions, opt = uint_list(h, "versions", n), uint_list(h, "opt", n)
        specs = h["optimizers"]
        if type(specs) is not list or len(specs) > _MAX_OPTIMIZERS:
            raise ProtocolError(f"field 'optimizers' must be a list of at most {_MAX_OPTIMIZERS} optimizers")
        if any(type(spec) is not dict for spec in specs):
            raise ProtocolError("field 'optimizers' must be a list of optimizer specs (maps)")
        optimizers = list(specs)
        slots = h["slots"]
        if type(slots) is not list or len(slots) != n or any(
                type(s) is not list or len(s) > _MAX_SLOTS or any(type(x) is not str or len(x) > 64 for x in s)
                for s in slots):
            raise ProtocolError("field 'slots' must list each tensor's optimizer slot names")
        workers = h["workers"]
        if type(workers) is not list or len(workers) > 1 << 20 or any(
                type(w) is not list or len(w) not in (3, 4)
                or any(type(x) is not int or not 0 <= x <= MAX_U63 for x in w[:3])
                or (len(w) == 4 and not hole_runs(w[3])) for w in workers):
            raise ProtocolError("field 'workers' must be a list of [worker, session, settled] or "
                                "[worker, session, settled, holes] (holes: [[first, count], ...])")
        included = h["included"]
        if type(included) is not list or len(included) != n or any(
                type(pairs) is not list or len(pairs) > 1 << 20 or any(
                    type(p) is not list or len(p) not in (2, 3)
                    or any(type(x) is not int or not 0 <= x <= MAX_U63 for x in p[:2])
                    or (len(p) == 3 and not hole_runs(p[2])) for p in pairs) for pairs in included):
            raise ProtocolError("field 'included' must list each tensor's [worker, seq] or [worker, seq, holes] "
                                "(holes: [[first, count], ...])")
        clocks = h["clocks"]
        if type(clocks) is not list or len(clocks) != n or any(
                type(pairs) is not list or len(pairs) > 1 << 20 or any(
                    type(p) is not list or len(p) != 2 or any(type(x) is not int or not 0 <= x <= MAX_U63 for x in p)
                    for p in pairs) for pairs in clocks):
            raise ProtocolError("field 'clocks' must list each tensor's [worker, clock] pairs")
        if type(h["full"]) is not bool:
            raise ProtocolError("field 'full' must be true or false")
        if any(i >= len(optimizers) for i in opt):
            raise ProtocolError("field 'opt' names an optimizer the message does not carry")
        buffers = list(frames[1:])
        if len(buffers) != sum(1 + len(s) for s in slots):
            raise ProtocolError(f"{len(buffers)} buffer frames for {n} tensors and their slots")
        arrays, at = [], 0
        for meta, names in zip(metas, slots):
            these = []
            for _ in range(1 + len(names)):
                buf = buffers[at]
                at += 1
                if len(buf) != meta.nbytes:
                    raise ProtocolError(f"tensor {meta.name!r} part {meta.part}: a frame of {len(buf)} bytes, "
                                        f"expected {meta.nbytes}")
                these.append(np.frombuffer(buf, meta.dtype) if meta.nbytes else np.empty(0, meta.dtype))
            arrays.append(these)
        return ReplicateRequest(uint(h, "id"), string(h, "token", 128), uint(h, "sender", 1 << 31),
                                uint(h, "range", 1 << 31), [(w[0], w[1], w[2] - 1) for w in workers], optimizers,
                                metas, versions, opt, [tuple(s) for s in slots], arrays,
                                [{p[0]: p[1] for p in pairs} for pairs in included], h["full"],
                                [{w: c for w, c in pairs} for pairs in clocks],
                                {w[0]: w[3] for w in workers if len(w) == 4},
                                [{p[0]: p[2] for p in pairs if len(p) == 3} for pairs in included])
    except ProtocolError as exc:
        exc.request_id = request_id  # type: ignore[attr-defined]
        raise


def encode_replicated(rid: int) -> list[Any]:
    """Frames of a ``replicated`` reply."""
    return encode({"op": "replicated", "id": rid})


def encode_replication_error(rid: int, code: str, message: str) -> list[Any]:
    """Frames of a replica's ``error`` reply."""
    return encode({"op": "error", "id": rid, "code": code, "message": message})


def decode_replication_reply(frames: Sequence[Any], limits: WireLimits) -> Replicated | ReplicationError:
    """Decode a replica's reply.

    Raises
    ------
    ProtocolError
        When it is malformed.
    """
    if len(frames) != 1:
        raise ProtocolError(f"a replica's reply is one frame, got {len(frames)}")
    h = unpack_header(frames[0], limits)
    check_version(h)
    op = op_of(h, _REPLY_FIELDS, "replica's reply")
    if op == "replicated":
        return Replicated(uint(h, "id"))
    return ReplicationError(uint(h, "id"), string(h, "code", 64), string(h, "message", 1 << 12))
