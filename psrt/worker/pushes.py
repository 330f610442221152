"""A push's per-shard requests, made from parts cached per set of tensors (a training loop repeats one set).

For each set of tensor names a client pushes, :class:`PushPlans` keeps, per shard, the messages, the bytes a call
takes in a shared-memory lane, and each message's packed header prefix (:func:`psrt.wire.push_prefix`): a step's
request over the socket then packs only its ``id, seq, clock``. Compressed gradients (whose header entries depend
on the values) and calls over a lane take the general path, :func:`payload_of` and
:func:`psrt.wire.encode_push`.

Top-k's residuals (:mod:`psrt.wire.compression`) change as a push is encoded; a push the shard refuses takes its
changes back (:func:`psrt.wire.compression.undo`), and the residuals of a shard that restarted (maybe from a
checkpoint, behind what it was) or of tensors initialized again start from zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np

from psrt import wire
from psrt.partition import MAX_CACHED_PLANS, Chunk
from psrt.shm.lanes import LaneUse, WorkerLanes, call_bytes
from psrt.wire import compression
from psrt.worker.calls import Handle, ShardCalls

__all__ = ["PushPlans", "payload_of"]


def payload_of(chunks: list[Chunk], arrays: Mapping[str, np.ndarray],
               lane: Optional[LaneUse] = None) -> tuple[list[list[Any]], list[np.ndarray]]:
    """The header entries of a message's chunks and their bytes: views of the caller's arrays (no copy), or with
    ``lane``, their copies in its segment (compression: :meth:`PushPlans.send`)."""
    entries, payload = [], []
    for c in chunks:  # one loop, not two comprehensions: this runs for every message a client sends
        entries.append(wire.tensor_entry(c.name, c.part, c.dtype, (c.count,)))
        if lane is None:
            flat = arrays[c.name].reshape(-1)
            payload.append(flat if c.start == 0 and c.count == flat.size else flat[c.start:c.start + c.count])
    return (entries, list(lane.inputs)) if lane is not None else (entries, payload)


@dataclass
class _ShardPush:
    """One shard's part of a push of a set of tensors."""

    shard: int
    messages: list[list[Chunk]]
    #: What the call takes in a lane (:func:`psrt.shm.lanes.call_bytes`).
    lane_bytes: int
    #: Per message, its packed header prefix (None with compression: the general path).
    prefixes: list[Optional[bytes]]


class PushPlans:
    """Sends pushes to the shards, from per-set parts computed once.

    Parameters
    ----------
    calls : ShardCalls
        The client's requests in flight.
    lanes : WorkerLanes
        The client's shared-memory lanes.
    rank, session : int
        The worker's rank and session, in every push header.
    seq : list of int
        The next sequence number per shard (shared with the client, updated here).
    compress : str, optional
        The gradient compression (:mod:`psrt.wire.compression`).
    residuals : dict
        Top-k's error feedback by chunk key.
    """

    def __init__(self, calls: ShardCalls, lanes: WorkerLanes, rank: int, session: int, seq: list[int],
                 compress: Optional[str], residuals: compression.Residuals) -> None:
        self._calls, self._lanes = calls, lanes
        self._rank, self._session, self._seq = rank, session, seq
        self._compress, self._residuals = compress, residuals
        self._plans: dict[tuple[tuple[str, ...], bool], list[_ShardPush]] = {}
        self._residual_shard: dict[tuple[str, int], int] = {}  # top-k: the shard each residual's chunk is on
        calls.restarted = self._restarted

    def _restarted(self, shard: int) -> None:
        """A shard came back: what its residuals owed it is relative to a state it may no longer have."""
        for key in [k for k, s in self._residual_shard.items() if s == shard]:
            self._residuals.pop(key, None)

    def forget(self, names: Iterable[str]) -> None:
        """Tensors ``names`` are (re)initialized: their residuals start from zero."""
        names = set(names)
        for key in [k for k in self._residuals if k[0] in names]:
            del self._residuals[key]

    def clear(self) -> None:
        """Forget every cached set (the tensors were partitioned again)."""
        self._plans.clear()

    def _plan(self, names: tuple[str, ...], pull: bool,
              messages: Callable[[tuple[str, ...]], dict[int, list[list[Chunk]]]]) -> list[_ShardPush]:
        plan = self._plans.get((names, pull))
        if plan is None:
            plan = []
            for shard, msgs in messages(names).items():
                prefixes: list[Optional[bytes]] = [None] * len(msgs)
                if self._compress is None:
                    prefixes = [self._prefix(msg, pull) for msg in msgs]
                plan.append(_ShardPush(shard, msgs, call_bytes(msgs, True, pull), prefixes))
            if len(self._plans) < MAX_CACHED_PLANS:
                self._plans[(names, pull)] = plan
        return plan

    def _prefix(self, msg: list[Chunk], pull: bool) -> bytes:
        entries = [wire.tensor_entry(c.name, c.part, c.dtype, (c.count,)) for c in msg]
        return wire.push_prefix(self._rank, self._session, entries, pull)

    def send(self, handle: Handle, arrays: dict[str, np.ndarray], pull: bool, clock: int,
             messages: Callable[[tuple[str, ...]], dict[int, list[list[Chunk]]]]) -> None:
        """Send the requests of one push of ``arrays`` (checked by the caller) to their shards, for ``handle``.

        ``messages`` gives the per-shard messages of a set of tensor names (the client's partition plan).
        """
        calls, seqs = self._calls, self._seq
        for part in self._plan(tuple(arrays), pull, messages):
            shard = part.shard
            lane = self._lanes.lane_for(shard, part.lane_bytes)
            for msg, prefix in zip(part.messages, part.prefixes):
                seq = seqs[shard]
                seqs[shard] += 1
                if lane is None and prefix is not None:  # the usual small push: over the socket, uncompressed
                    payload = _views(msg, arrays)
                    calls.send(handle, shard, msg, lambda rid, h=prefix, q=seq, p=payload: wire.encode_push_after(
                        h, rid, q, clock, p))
                    continue
                # Over a lane the gradients are copied into the segment; the socket form stays at hand.
                use = None if lane is None else WorkerLanes.carry(lane, msg, arrays, pull)
                entries, payload = payload_of(msg, arrays, use)
                refused = self._compressed(shard, msg, entries, payload) if self._compress is not None else None
                plain = lambda rid, q=seq, e=entries, p=payload: wire.encode_push(  # noqa: E731
                    rid, self._rank, self._session, q, e, p, pull, clock)
                encode = plain if use is None else lambda rid, q=seq, e=entries, u=use: wire.encode_push(
                    rid, self._rank, self._session, q, e, [], pull, clock, u.ref)
                calls.send(handle, shard, msg, encode, plain, use, plain if use is not None else None, refused)

    def _compressed(self, shard: int, msg: list[Chunk], entries: list[list[Any]],
                    payload: list[np.ndarray]) -> Optional[Callable[[], None]]:
        """Compress a message's float32 gradients in place of ``entries``/``payload``; returns what takes its
        residual changes back should the shard refuse it (None: nothing changed)."""
        assert self._compress is not None
        changes: compression.Changes = []
        limit = self._calls.config.limits.max_tensor_bytes
        for i, chunk in enumerate(payload):
            key = (msg[i].name, msg[i].part)
            packed = compression.encode(self._compress, chunk, self._residuals, key, changes, limit)
            if packed is not None:  # else the chunk goes at full precision (float64, or out of fp16's range)
                entries[i][2], payload[i] = packed
        for key, _, _ in changes:
            self._residual_shard[key] = shard
        return (lambda: compression.undo(self._residuals, changes)) if changes else None


def _views(msg: list[Chunk], arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The bytes of a message's chunks: views of the caller's arrays (no copy)."""
    payload = []
    for c in msg:
        flat = arrays[c.name].reshape(-1)
        payload.append(flat if c.start == 0 and c.count == flat.size else flat[c.start:c.start + c.count])
    return payload
