"""Calls in flight from a client to its shards: one DEALER socket per shard, request ids, and replies.

:class:`ShardCalls` sends each request with a fresh id, remembers which :class:`Handle` (one user-level call,
possibly many requests) it belongs to, and routes every reply back by that id, receiving a ``params`` reply's
buffers straight into the handle's output arrays. It also keeps the versions each key is known to have reached,
which a later pull asks for. A reply that answers nothing pending (a late one, after a timeout) is dropped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from psrt import transport, wire
from psrt.config import ClientConfig
from psrt.control import security
from psrt.errors import (
    AuthenticationError,
    ConnectionLostError,
    ProtocolError,
    PsrtError,
    ShardTimeoutError,
    refusal,
)
from psrt.partition import Chunk
from psrt.shm.lanes import LANE_CODES, LaneUse
from psrt.wire import compression
from psrt.worker.handles import Handle

__all__ = ["Handle", "ShardCalls"]

log = logging.getLogger("psrt.client")

Key = tuple[str, int]


@dataclass
class _Pending:
    handle: Handle
    shard: int
    chunks: list[Chunk]
    #: Makes the request's frames again, for a shard that restarted without answering it.
    resend: Callable[[int], list[Any]]
    #: Over a shared-memory lane: the request's areas (given back when it is answered), and the frames that
    #: send it over the socket instead, should the shard refuse the lane.
    lane: Optional[LaneUse] = None
    plain: Optional[Callable[[int], list[Any]]] = None
    #: Called when the shard refuses the request (top-k: its residual changes are taken back).
    refused: Optional[Callable[[], None]] = None


class ShardCalls:
    """Requests in flight to the shards ``servers``, over one DEALER socket each.

    Parameters
    ----------
    context : zmq.Context
        From :func:`psrt.transport.new_context`.
    servers : sequence of str
        Shard endpoints, in shard order.
    config : ClientConfig
        Timeouts, high-water marks, decode limits and keys.
    check : callable, optional
        Called while waiting; raises to end every wait at once (the job failed:
        :meth:`psrt.control.link.HeartbeatThread.check`).
    moves : dict, optional
        Shards that restarted on another endpoint, filled by another thread
        (:attr:`psrt.control.link.HeartbeatThread.moves`):
        every wait takes them in, re-points the shard's socket and sends again what it never answered.
    """

    def __init__(self, context: Any, servers: Sequence[str], config: ClientConfig,
                 check: Optional[Callable[[], None]] = None, moves: Optional[dict[int, str]] = None) -> None:
        self._check = check
        self._moves = moves
        self.servers = list(servers)
        self.config = config
        keys = security.load_keys(config.keys)
        self.channels = [transport.DealerChannel(context, ep, config.hwm, keys=keys,
                                                 max_frame=config.limits.max_frame_bytes) for ep in self.servers]
        self._poller = transport.Poller(self.channels)
        self._next_id = 1
        self._pending: dict[int, _Pending] = {}
        #: The highest version each key is known to have reached (from acks and params replies).
        self.versions: dict[Key, int] = {}
        self._key_shard: dict[Key, int] = {}
        self._connections = [0] * len(self.channels)  # handshakes seen per shard (see _ride_through)
        self._unanswered = [0] * len(self.channels)  # reconnections since the shard last answered anything
        #: Called with a shard whose shared-memory lane is gone (it restarted, or refused the lane); and with one
        #: that restarted (maybe from a checkpoint, behind what it was).
        self.lane_lost: Callable[[int], None] = lambda shard: None
        self.restarted: Callable[[int], None] = lambda shard: None
        #: The client's lanes (:class:`psrt.shm.lanes.WorkerLanes`), which copy parameters a shard shares; its rank.
        self.lanes: Any = None
        self.rank = 0
        self.closed = False

    def close(self) -> None:
        """Close the sockets; replies in flight are discarded."""
        if not self.closed:
            self.closed = True
            for ch in self.channels:
                ch.close()
            self._pending.clear()

    def send(self, handle: Handle, shard: int, chunks: list[Chunk], encode: Callable[[int], list[Any]],
             resend: Optional[Callable[[int], list[Any]]] = None, lane: Optional[LaneUse] = None,
             plain: Optional[Callable[[int], list[Any]]] = None, refused: Optional[Callable[[], None]] = None) -> None:
        """Send one request to ``shard``, its frames made by ``encode(request_id)``; the reply goes to ``handle``.

        ``resend`` makes the frames to send again if the shard restarts before answering (default: ``encode``;
        a pull passes one that asks for any version, since a restored shard may be behind what it was). A request
        over a shared-memory lane passes its ``lane`` areas, and ``plain``: its frames over the socket (``resend``
        must make socket frames too, as a restarted shard has no lanes).
        """
        rid = self._next_id
        self._next_id += 1
        for c in chunks:
            self._key_shard[c.key] = shard
        self._pending[rid] = _Pending(handle, shard, chunks, encode if resend is None else resend, lane, plain, refused)
        handle._outstanding.add(rid)
        try:
            self.channels[shard].send(encode(rid), self.config.timeout)
        except PsrtError:
            del self._pending[rid]
            handle._outstanding.discard(rid)
            raise

    def ask(self, shard: int, encode: Callable[[int], list[Any]]) -> Any:
        """One request to ``shard`` that no tensor rides on (a lane set-up), waited for: the reply record.

        Raises
        ------
        ServerError
            When the shard answers with an error (e.g. an older shard that does not know the op).
        """
        handle = Handle(self, "lane set-up", None)
        self.send(handle, shard, [], encode)
        handle.wait(self.config.timeout)
        return handle._answers[shard]

    def close_lanes(self, generations: dict[int, int], timeout: float) -> None:
        """Tell shards this client is done with its lanes (``{shard: generation}``); best effort, at most
        ``timeout`` seconds: a shard that does not hear it drops the lane when it needs the room."""
        handle = Handle(self, "lane_close", None)
        try:
            for shard, generation in generations.items():
                self.send(handle, shard, [], lambda rid, g=generation: wire.encode_lane_close(rid, g))
            handle.wait(timeout)
        except PsrtError:
            pass

    # ------------------------------------------------------------------ receiving
    def wait(self, handle: Handle, timeout: float) -> None:
        """Take in replies until every request of ``handle`` is answered or ``timeout`` seconds pass."""
        if self.closed:
            raise ConnectionLostError("this client is closed")
        start = time.monotonic()
        deadline = start + timeout
        warn_at = start + self.config.warn_after if self.config.warn_after < timeout else None
        while handle._outstanding:
            if self._check is not None:
                try:
                    self._check()
                except PsrtError:
                    self._forget(handle)
                    raise
            now = time.monotonic()
            if warn_at is not None and now >= warn_at:
                warn_at = None  # once per call: a slow shard is worth one line, not one per poll
                late = sorted({self._pending[r].shard for r in handle._outstanding})
                log.warning("still waiting for %s to answer %s after %.0fs (timeout %gs); is a psrt server "
                            "running there, and is it reachable from this host?",
                            ", ".join(self.servers[s] for s in late), handle.op, now - start, timeout)
            remaining = deadline - now
            if remaining <= 0:
                late = sorted({self._pending[r].shard for r in handle._outstanding})
                names = ", ".join(self.servers[s] for s in late)
                for rid in handle._outstanding:
                    self._abandon(self._pending.pop(rid))
                handle._outstanding.clear()
                handle._fail(ShardTimeoutError(
                    f"shard {names} did not answer {handle.op} within {timeout:g}s", shard=self.servers[late[0]]
                ))
                return
            wait = remaining if warn_at is None else min(remaining, warn_at - now)
            # With a job to watch, wait in short slices so that news of a dead peer ends the wait promptly.
            try:
                self.progress(handle, wait if self._check is None else min(wait, 0.25))
            except AuthenticationError as exc:
                # A refused handshake will not heal by waiting: fail this call now, naming the shard.
                self._forget(handle)
                handle._fail(exc)
                return

    def _forget(self, handle: Handle) -> None:
        """Stop waiting for ``handle``'s replies: any that still come are dropped as late."""
        for rid in handle._outstanding:
            self._abandon(self._pending.pop(rid, None))
        handle._outstanding.clear()

    @staticmethod
    def _abandon(pending: Optional[_Pending]) -> None:
        """A request nobody waits for any more: the shard may still write its lane areas, so that segment is
        never handed out again."""
        if pending is not None and pending.lane is not None:
            pending.lane.lane.retired = True

    @staticmethod
    def _release(pending: _Pending) -> None:
        if pending.lane is not None:
            pending.lane.lane.give_back()
            pending.lane = None

    def progress(self, handle: Handle, timeout: float) -> None:
        """Take in the replies that arrive within ``timeout`` seconds, whichever handle each answers (those queued
        behind the last one ``handle`` waits for stay queued for the next call)."""
        if self._moves:
            self._follow_moves()
        for index in self._poller.wait(timeout):
            ch = self.channels[index]
            # The poll says a reply is there. Take every reply already queued on this socket, whichever handle it
            # belongs to, until this handle has all of its own: what is left is taken in by a later poll.
            self._receive(index)
            while handle._outstanding and ch.readable():
                self._receive(index)
        for shard, ch in enumerate(self.channels):
            if ch.connections != self._connections[shard]:
                if self._connections[shard]:
                    self._ride_through(shard)
                self._connections[shard] = ch.connections

    def _follow_moves(self) -> None:
        """Shards that came back on another endpoint: connect there; the new handshake rides through as any."""
        while self._moves:
            shard, endpoint = self._moves.popitem()
            if shard >= len(self.channels) or endpoint == self.servers[shard]:
                continue
            log.warning("shard %d moved from %s to %s (restarted from its checkpoint): reconnecting", shard,
                        self.servers[shard], endpoint)
            self.channels[shard].repoint(endpoint)
            self.servers[shard] = endpoint
            if not self._connections[shard]:
                self._connections[shard] = -1  # never connected before: its first handshake must ride through too

    def _ride_through(self, shard: int) -> None:
        """A shard came back (restarted, maybe from a checkpoint): send again what it never answered.

        What it restored may be behind what it was, so the versions learned from it are forgotten; pushes it
        already applied carry their sequence numbers and are not applied twice.
        """
        pending = [(rid, p) for rid, p in self._pending.items() if p.shard == shard]
        self._unanswered[shard] += 1
        if self._unanswered[shard] > 3:  # it drops what is sent: resending would loop until the timeout
            error = ConnectionLostError(
                f"{self.servers[shard]} dropped the connection {self._unanswered[shard]} times without answering "
                "anything: it is not a psrt shard (a psrt scheduler drops messages over 64 KiB), or it refuses "
                "this client's messages (larger than its limits allow, e.g. a tensor over its max_tensor_bytes)")
            for rid, p in pending:
                del self._pending[rid]
                p.handle._outstanding.discard(rid)
                self._abandon(p)
                p.handle._fail(error)
            return
        log.warning("shard %s reconnected (restarted?): sending again the %d requests it has not answered",
                    self.servers[shard], len(pending))
        self.versions = {k: v for k, v in self.versions.items() if self._key_shard.get(k) != shard}
        self.lane_lost(shard)  # its lanes died with it; what was sent over one goes again over the socket
        self.restarted(shard)
        for rid, p in pending:
            self.channels[shard].send(p.resend(rid), self.config.timeout)

    def _receive(self, shard: int) -> None:
        ch = self.channels[shard]
        endpoint = self.servers[shard]
        head = ch.recv_frame()
        try:
            reply = wire.decode_reply(head, self.config.limits)
        except ProtocolError as exc:
            ch.discard_rest()
            raise ProtocolError(f"shard {endpoint} sent a malformed reply: {exc}") from None
        self._unanswered[shard] = 0
        pending = self._pending.get(reply.id)
        if pending is None or pending.shard != shard:
            ch.discard_rest()  # a late reply to a call that timed out, or one this shard was never asked
            return
        del self._pending[reply.id]
        handle = pending.handle
        if (isinstance(reply, wire.ErrorReply) and reply.code in LANE_CODES and pending.plain is not None):
            ch.discard_rest()
            self._without_lane(reply.id, pending, reply.message)
            return
        handle._outstanding.discard(reply.id)
        try:
            self._take(ch, reply, pending)
        finally:
            self._release(pending)

    def _without_lane(self, rid: int, pending: _Pending, why: str) -> None:
        """The shard refused a request's lane (and changed nothing): send it again over the socket. Its areas
        stay taken until this answer comes, since a socket send may still be reading them."""
        endpoint = self.servers[pending.shard]
        log.info("shard %s refused a shared-memory lane (%s); sending over the socket", endpoint, why)
        self.lane_lost(pending.shard)
        assert pending.plain is not None
        frames, pending.plain = pending.plain(rid), None  # refused once: the socket from now on
        self._pending[rid] = pending
        try:
            self.channels[pending.shard].send(frames, self.config.timeout)
        except PsrtError as exc:
            del self._pending[rid]
            pending.handle._outstanding.discard(rid)
            self._release(pending)
            pending.handle._fail(exc)

    def _take(self, ch: transport.DealerChannel, reply: Any, pending: _Pending) -> None:
        """Take in one reply to a pending request (already removed from the pending table)."""
        shard = pending.shard
        endpoint = self.servers[shard]
        handle = pending.handle
        if type(reply) is wire.ParamsReply:
            try:
                self._receive_params(ch, reply, pending)
            except ProtocolError as exc:
                ch.discard_rest()
                handle._fail(ProtocolError(f"shard {endpoint}: {exc}"))
            if reply.job is not None:
                handle._conflicts.extend(pending.chunks[i].name for i in reply.job.conflicts
                                         if i < len(pending.chunks))
                handle._jobs[shard] = reply.job
            return
        if isinstance(reply, wire.RowsReply):  # embedding rows: psrt.worker.embedding_client.RowsHandle
            try:
                handle._take_rows(ch, reply, pending.chunks)  # type: ignore[attr-defined]
            except ProtocolError as exc:
                ch.discard_rest()
                handle._fail(ProtocolError(f"shard {endpoint}: {exc}"))
            return
        ch.discard_rest()
        if isinstance(reply, wire.ErrorReply):
            if pending.refused is not None:
                pending.refused()
            handle._fail(refusal(endpoint, handle.op, reply.code, reply.message))
        elif isinstance(reply, wire.AckReply):
            if len(reply.versions) != len(pending.chunks):
                handle._fail(ProtocolError(f"shard {endpoint}: ack lists {len(reply.versions)} versions for "
                                           f"{len(pending.chunks)} tensors"))
                return
            for chunk, version in zip(pending.chunks, reply.versions):
                self.versions[chunk.key] = max(self.versions.get(chunk.key, 0), version)
        elif isinstance(reply, wire.SavedReply):
            handle._saved[shard] = reply.path
        elif isinstance(reply, (wire.BeaconReply, wire.LaneReply, wire.ClosedReply)):
            handle._answers[shard] = reply
        else:
            handle._stats[shard] = reply.stats

    def _receive_params(self, ch: transport.DealerChannel, reply: wire.ParamsReply, pending: _Pending) -> None:
        chunks = pending.chunks
        outputs = pending.handle._outputs
        if outputs is None or len(reply.tensors) != len(chunks):
            raise ProtocolError(f"reply carries {len(reply.tensors)} tensors, expected {len(chunks)}")
        for meta, chunk in zip(reply.tensors, chunks):
            if (meta.name != chunk.name or meta.part != chunk.part or meta.dtype != chunk.dtype
                    or meta.count != chunk.count):
                raise ProtocolError(f"reply tensor {meta.name!r} part {meta.part} does not match the request")
        if reply.lane is not None:  # the parameters are in this request's lane areas, or the shard's memory
            use = pending.lane
            if use is None or reply.lane != use.ref.generation or len(use.ref.outputs) != len(chunks) \
                    or ch.more() or reply.places is None or self.lanes is None:
                raise ProtocolError("reply names a shared-memory lane this request did not use")
            again = []
            for i, (chunk, version, place) in enumerate(zip(chunks, reply.versions, reply.places)):
                dest = outputs[chunk.name].reshape(-1)[chunk.start:chunk.start + chunk.count]
                if not place:
                    np.copyto(dest, use.output(i, chunk.dtype, chunk.count))
                elif not self.lanes.copy_shared(pending.shard, place, dest):
                    again.append(chunk)  # the next round overwrote it meanwhile: ask again, over the socket
                    continue
                self.versions[chunk.key] = max(self.versions.get(chunk.key, 0), version)
            if again:
                keys = [[c.name, c.part, v] for c, v in zip(chunks, reply.versions) if c in again]
                self.send(pending.handle, pending.shard, again,
                          lambda rid, k=keys: wire.encode_pull(rid, self.rank, k, 0))
            return
        for meta, chunk, version in zip(reply.tensors, chunks, reply.versions):
            if not ch.more():
                raise ProtocolError("reply has fewer buffer frames than tensors")
            dest = outputs[chunk.name].reshape(-1)
            if chunk.start or chunk.count != dest.size:  # a part of the tensor (a whole one needs no slice)
                dest = dest[chunk.start:chunk.start + chunk.count]
            if meta.encoding is None:
                got = ch.recv_into(memoryview(dest).cast("B") if dest.size else bytearray())
            else:  # 16-bit parameters (this worker pushes 16-bit gradients): widen into the destination
                packed = bytearray(meta.nbytes)
                got = ch.recv_into(packed) if meta.nbytes else 0
                if got == meta.nbytes:
                    dest[:] = compression.decode(meta.encoding, packed)
            if got != meta.nbytes:
                raise ProtocolError(f"tensor {meta.name!r} part {meta.part}: frame has {got} bytes, "
                                    f"expected {meta.nbytes}")
            key = chunk.key
            self.versions[key] = max(self.versions.get(key, 0), version)
        if ch.more():
            raise ProtocolError("reply has more buffer frames than tensors")

