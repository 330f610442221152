"""Calls in flight from a client to its shards: one DEALER socket per shard, request ids, and replies.

:class:`ShardCalls` routes: every request a :class:`psrt.worker.sender.ShardSender` sends is tracked under a
fresh id (:meth:`ShardCalls.track`) as a :class:`Request`, which remembers the :class:`Handle` (one user-level
call, possibly many requests) it belongs to; every reply is routed back by that id, a ``params`` reply's buffers
received straight into the handle's output arrays. When a request must go again, the routing gives it back to
the sender that sent it, which knows how:

- the shard refused the request's shared-memory lane: over the socket (:meth:`ShardSender.without_lane`);
- the shard restarted (its socket reconnected, or it came back on another endpoint) before answering: in its
  socket form (:meth:`ShardSender.resend`), unless the shard keeps dropping the connection without answering
  anything, which fails the calls instead;
- the shared parameters a reply named were overwritten while being copied: those chunks are pulled again
  (:meth:`ShardSender.pull_again`), once the reply has been taken in, never from inside the receive path.

:class:`Versions` keeps the versions each key is known to have reached on its shard, which a later pull asks
for. A reply that answers nothing pending (a late one, after a timeout) is dropped.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Protocol, Sequence

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
from psrt.shm.lanes import LANE_CODES, LaneUse, WorkerLanes
from psrt.wire import compression
from psrt.worker.handles import Handle

__all__ = ["Handle", "Request", "Sender", "ShardCalls", "Versions"]

log = logging.getLogger("psrt.client")

Key = tuple[str, int]
#: Makes a request's frames from its id.
Encode = Callable[[int], list[Any]]


class Sender(Protocol):
    """What the routing asks of the sender of a request that must go again
    (:class:`psrt.worker.sender.ShardSender`)."""

    shard: int
    #: Whether embedding rows may take the shard's lane.
    rows_lane: bool

    def resend(self, rid: int, request: Request) -> None:
        """The shard restarted before answering: send ``request`` again in its socket form."""

    def without_lane(self, rid: int, request: Request, why: str) -> None:
        """The shard refused ``request``'s lane: send it again over the socket, under the same id."""

    def pull_again(self, handle: Handle, chunks: list[tuple[Chunk, int]]) -> None:
        """Pull ``(chunk, version)`` pairs again over the socket for ``handle``."""


class Request:
    """A request in flight: the call its reply belongs to, and what sending it again takes.

    Attributes
    ----------
    handle : Handle
        The call.
    sender : Sender
        Who sent it (to ``sender.shard``), and sends it again.
    chunks : sequence of Chunk
        The dense chunks it carries or asks for: a reply's tensors and versions are theirs, in order.
    table : str or None
        An embedding table's name, for its requests: a reply's one version is the table's on this shard.
    resend : callable
        Makes its frames again, over the socket, for a shard that restarted without answering it.
    lane : LaneUse or None
        Over a shared-memory lane: its areas, given back when it is answered.
    plain : callable or None
        Over a lane: its frames over the socket, should the shard refuse the lane.
    refused : callable or None
        Called when the shard refuses it (top-k: its residual changes are taken back).
    early : list or None
        Its parameters came before the shard's replicas held them (a replicated job's early reply): each key's
        version, taken once the ``held`` notice naming it comes (None: no such reply, or it was sent again since).
    """

    __slots__ = ("handle", "sender", "shard", "chunks", "table", "resend", "lane", "plain", "refused", "early")

    def __init__(self, handle: Handle, sender: Sender, chunks: Sequence[Chunk], table: Optional[str],
                 resend: Encode, lane: Optional[LaneUse] = None, plain: Optional[Encode] = None,
                 refused: Optional[Callable[[], None]] = None) -> None:
        self.handle = handle
        self.sender = sender
        self.shard: int = sender.shard
        self.chunks = chunks
        self.table = table
        self.resend = resend
        self.lane = lane
        self.plain = plain
        self.refused = refused
        self.early: Optional[list[tuple[Any, int]]] = None

    def release(self) -> None:
        """It was answered: its lane areas are free."""
        if self.lane is not None:
            self.lane.lane.give_back()
            self.lane = None

    def abandon(self) -> None:
        """Nobody waits for it any more: the shard may still write its lane areas, so that segment is never
        handed out again."""
        if self.lane is not None:
            self.lane.lane.retired = True


class Versions:
    """The highest version each key is known to have reached, from acks and replies, by shard.

    ``chunks[shard]`` holds dense keys ``(name, part)``, ``tables[shard]`` embedding tables by name. A shard that
    restarted (maybe from a checkpoint, behind what it was) is forgotten whole (:meth:`forget`). ``held[shard]``:
    per dense key, the version of the parameters last received (what the client holds, which the next gradient
    is computed from: a push to a shard with backup workers says it), kept across a restart.
    """

    def __init__(self, num_shards: int) -> None:
        self.chunks: list[dict[Key, int]] = [{} for _ in range(num_shards)]
        self.tables: list[dict[str, int]] = [{} for _ in range(num_shards)]
        self.held: list[dict[Key, int]] = [{} for _ in range(num_shards)]
        #: Per embedding table, the version of the rows last pulled from the shard (as ``held``).
        self.held_tables: list[dict[str, int]] = [{} for _ in range(num_shards)]

    def forget(self, shard: int) -> None:
        """Nothing learned from ``shard`` holds any more (the dicts are emptied in place: senders hold them)."""
        self.chunks[shard].clear()
        self.tables[shard].clear()

    def drop(self, chunks: Sequence[Chunk]) -> None:
        """Forget the versions of ``chunks`` (tensors whose ``init`` failed)."""
        for c in chunks:
            self.chunks[c.shard].pop(c.key, None)
            self.held[c.shard].pop(c.key, None)


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
    lanes : WorkerLanes
        The client's shared-memory lanes: a reply may name parameters in a shard's shared memory, and a
        restarted shard's lanes are gone.
    check : callable, optional
        Called while waiting; raises to end every wait at once (the job failed:
        :meth:`psrt.control.link.HeartbeatThread.check`).
    moves : dict, optional
        Shards that restarted on another endpoint, or whose range a replica took over, filled by another thread
        (:attr:`psrt.control.link.HeartbeatThread.moves`): every wait takes them in, re-points the shard's socket
        and sends again what it never answered.
    restarted : callable, optional
        Called with a shard that came back (maybe from a checkpoint, behind what it was) before what it never
        answered goes again (top-k compression: the residuals owed to its earlier life are dropped).
    """

    def __init__(self, context: Any, servers: Sequence[str], config: ClientConfig, lanes: WorkerLanes,
                 check: Optional[Callable[[], None]] = None, moves: Optional[dict[int, tuple[str, bool]]] = None,
                 restarted: Optional[Callable[[int], None]] = None) -> None:
        self._check = check
        self._moves = moves
        self._lanes = lanes
        self._restarted = restarted
        self.servers = list(servers)
        self.config = config
        # One object for equal limits in a process (several clients): the decoders' caches compare them by identity.
        self._limits = wire.same_limits(config.limits)
        keys = security.load_keys(config.keys)
        self.channels = [transport.DealerChannel(context, ep, config.hwm, keys=keys,
                                                 max_frame=config.limits.max_frame_bytes) for ep in self.servers]
        self._poller = transport.Poller(self.channels)
        self._next_id = 1
        self._pending: dict[int, Request] = {}
        self.versions = Versions(len(self.channels))
        self._connections = [0] * len(self.channels)  # handshakes seen per shard (see _ride_through)
        #: Shards re-pointed whose new endpoint's first handshake is still to come: ridden through already.
        self._repointed = [False] * len(self.channels)
        self._unanswered = [0] * len(self.channels)  # reconnections since the shard last answered anything
        self._answered = [False] * len(self.channels)  # whether the shard ever answered this client
        #: Chunks to pull again (their shared parameters changed while being copied), once replies are taken in.
        self._again: list[tuple[Request, list[tuple[Chunk, int]]]] = []
        self.closed = False

    def close(self) -> None:
        """Close the sockets; replies in flight are discarded."""
        if not self.closed:
            self.closed = True
            for ch in self.channels:
                ch.close()
            self._pending.clear()

    def track(self, request: Request) -> int:
        """A fresh id for ``request``, about to be sent: its reply will be routed to ``request.handle`` by it."""
        rid = self._next_id
        self._next_id = rid + 1
        self._pending[rid] = request
        request.handle._outstanding.add(rid)
        return rid

    def untrack(self, rid: int) -> None:
        """Request ``rid`` could not be sent (or sent again): no reply is awaited for it."""
        request = self._pending.pop(rid)
        request.handle._outstanding.discard(rid)

    # ------------------------------------------------------------------ receiving
    def wait(self, handle: Handle, timeout: float, wake: Optional[Callable[[], bool]] = None) -> None:
        """Take in replies until every request of ``handle`` is answered or ``timeout`` seconds pass; or, with
        ``wake``, until a reply taken in makes it true (``handle`` still waiting, not failed)."""
        if self.closed:
            raise ConnectionLostError("this client is closed")
        # A pipelined caller's reply has most likely arrived (see _take_arrived): taken without the clock's work.
        # (With a job to watch, every wait checks on it first: the loop below does.) Whatever this finds, what was
        # queued is taken in: the loop's first step polls.
        eager = True
        if self._check is None and handle._outstanding:
            self._take_arrived(handle)
            if not handle._outstanding or (wake is not None and wake()):
                return
            eager = False
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
                if all(self._answered[s] for s in late):
                    hint = ("they answered this client before: busy (a large table being made, a sync round "
                            "waiting for another worker), not unreachable")
                elif all(self._answered[s] or self._reached(s) for s in late):
                    hint = ("they took the connection and have not answered yet: busy (a large table being made, "
                            "a sync round waiting for another worker), not unreachable")
                else:
                    hint = "is a psrt server running there, and is it reachable from this host?"
                log.warning("still waiting for %s to answer %s after %.0fs (timeout %gs); %s",
                            ", ".join(self.servers[s] for s in late), handle.op, now - start, timeout, hint)
            remaining = deadline - now
            if remaining <= 0:
                late = sorted({self._pending[r].shard for r in handle._outstanding})
                names = ", ".join(self.servers[s] for s in late)
                for rid in handle._outstanding:
                    self._pending.pop(rid).abandon()
                handle._outstanding.clear()
                handle._fail(ShardTimeoutError(
                    f"shard {names} did not answer {handle.op} within {timeout:g}s", shard=self.servers[late[0]]
                ))
                return
            wait = remaining if warn_at is None else min(remaining, warn_at - now)
            # With a job to watch, wait in short slices so that news of a dead peer ends the wait promptly.
            try:
                self.progress(handle, wait if self._check is None else min(wait, 0.25), eager)
                eager = False  # (every reply queued was taken in: the next step polls)
                if wake is not None and handle._outstanding and wake():
                    return
            except AuthenticationError as exc:
                # A refused handshake will not heal by waiting: fail this call now, naming the shard.
                self._forget(handle)
                handle._fail(exc)
                return

    def _reached(self, shard: int) -> bool:
        """Whether ``shard``'s socket completed a handshake (a ZeroMQ peer took the connection), as far as its
        monitor says now."""
        ch = self.channels[shard]
        try:
            ch.check_handshake()
        except AuthenticationError:
            return False
        return ch.connections > 0

    def _forget(self, handle: Handle) -> None:
        """Stop waiting for ``handle``'s replies: any that still come are dropped as late, and what it held back
        is never sent."""
        handle._deferred = None
        for rid in handle._outstanding:
            request = self._pending.pop(rid, None)
            if request is not None:
                request.abandon()
        handle._outstanding.clear()

    def outstanding(self, shard: int) -> bool:
        """Whether a request to ``shard`` waits for its answer (a replicated job's early answer included)."""
        return any(p.shard == shard for p in self._pending.values())

    def settle(self, shard: int, timeout: float) -> bool:
        """Take in replies, whichever calls they answer, until no request to ``shard`` is outstanding or ``timeout``
        seconds pass; returns whether none is. With a job to watch, news of a dead peer raises here as in
        :meth:`wait`, within the same quarter of a second."""
        handle = Handle(self, "settle", None)  # (none of its own: each step takes what arrives)
        deadline = time.monotonic() + timeout
        while self.outstanding(shard):
            if self._check is not None:
                self._check()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.progress(handle, left if self._check is None else min(left, 0.25))
        return True

    def progress(self, handle: Handle, timeout: float, eager: bool = True) -> None:
        """Take in the replies that arrive within ``timeout`` seconds, whichever handle each answers (those queued
        behind the last one ``handle`` waits for stay queued for the next call); ``eager``: first try to receive
        one without a poll (:meth:`_take_arrived`)."""
        if self._moves:
            self._follow_moves()
        # (Replies taken without a poll, and the handle still waits: every one queued on that socket is in, so the
        # poll waits for the rest.)
        if not (eager and handle._outstanding and self._take_arrived(handle)) or handle._outstanding:
            for index in self._poller.wait(timeout):
                # The poll says a reply is there.
                self._receive(index, self.channels[index].recv_frame())
                self._take_queued(handle, index)
        if self._again:
            self._pull_again()
        if not self._poller.heard:
            return  # no monitor spoke: no connection count moved
        self._poller.heard = False
        for shard, ch in enumerate(self.channels):
            if ch.connections != self._connections[shard]:
                seen = ch.connections - self._connections[shard]
                if self._repointed[shard]:  # the new endpoint's first handshake: _follow_moves rode it through
                    self._repointed[shard] = False
                    again = seen > 1  # (and the shard went away and came back since)
                else:
                    again = self._connections[shard] > 0
                if again:
                    self._ride_through(shard)
                self._connections[shard] = ch.connections

    def _take_arrived(self, handle: Handle) -> bool:
        """With several requests in flight, take in the replies already queued on the socket of ``handle``'s first
        outstanding request, without a poll; returns whether there was one (False: poll for it).

        A caller keeping calls going while it waits on the oldest finds its reply there most of the time, and a
        receive that finds it costs less than the poll it saves (a system call, and ZeroMQ's work on the socket and
        its handshake monitor, which the next poll reads). With one request in flight (a call at a time) the reply
        is still on its way: the poll waits for it, and no receive is tried first.
        """
        if len(self._pending) < 2:
            return False
        request = self._pending.get(next(iter(handle._outstanding)))
        if request is None:
            return False
        shard = request.shard
        # (A call waiting on several requests, fanned out over shards or chunks, waits on its slowest: its first
        # reply is less often there, and a look at the socket's flags costs less than a receive that fails.)
        head = self.channels[shard].try_recv_frame(look=len(handle._outstanding) > 1)
        if head is None:
            return False
        self._receive(shard, head)
        self._take_queued(handle, shard)
        if self._again:
            self._pull_again()
        return True

    def _take_queued(self, handle: Handle, shard: int) -> None:
        """Take every reply already queued on ``shard``'s socket, whichever handle it belongs to, until ``handle``
        has all of its own: what is left is taken in by a later call."""
        ch = self.channels[shard]
        while handle._outstanding:
            # (A handle that waits on several requests mostly waits on other shards: this socket is likely empty.)
            head = ch.try_recv_frame(look=len(handle._outstanding) > 1)
            if head is None:
                return
            self._receive(shard, head)

    def _pull_again(self) -> None:
        """Chunks whose shared parameters changed while being copied: their senders ask for them over the socket."""
        again, self._again = self._again, []
        for i, (request, chunks) in enumerate(again):
            try:
                request.sender.pull_again(request.handle, chunks)
            except PsrtError as exc:
                for later, _ in again[i + 1:]:  # never sent: their calls must not end without those chunks
                    later.handle._fail(exc)
                raise

    def _follow_moves(self) -> None:
        """Shards that came back on another endpoint: connect there, and ride through at once.

        Re-pointing drops what is still queued for the old endpoint, and what this client sends from now on goes
        to the new one, in order. What the old endpoint never answered goes first: a shard takes a worker's pushes
        exactly once in any order (its replay window, :mod:`psrt.shard.replay`), but a sync round is made of the
        pushes in the order they come, and a push sent again ahead of later ones keeps its rounds as they were
        meant. So it goes again now, ahead of anything sent later; the new endpoint's first handshake then rides
        through no more (which would also forget the versions its first answers taught, read in the same poll).
        """
        while self._moves:
            shard, (endpoint, replica) = self._moves.popitem()
            if shard >= len(self.channels) or endpoint == self.servers[shard]:
                continue
            log.warning("shard %d moved from %s to %s (restarted, or its range taken over by a replica): "
                        "reconnecting", shard, self.servers[shard], endpoint)
            self.channels[shard].repoint(endpoint)
            self.servers[shard] = endpoint
            self._repointed[shard] = True
            self._ride_through(shard, behind=not replica)

    def _fail_requests(self, requests: list[tuple[int, Request]], error: BaseException) -> None:
        """Stop waiting for ``requests`` (``(id, request)`` pairs): each one's handle fails with ``error``."""
        for rid, p in requests:
            del self._pending[rid]
            p.handle._outstanding.discard(rid)
            p.abandon()
            p.handle._fail(error)

    def _ride_through(self, shard: int, behind: bool = True) -> None:
        """A shard came back (restarted, maybe from a checkpoint): its senders send again what it never answered.

        The versions learned from it are forgotten (what it restored may be behind what it was). So is what top-k's
        residuals owed it when it may be behind (``behind``); a replica that took over its range holds all that
        the shard answered, so what the residuals owe is still owed there, and kept. Pushes it already applied
        carry their sequence numbers and are not applied twice.
        """
        unanswered = [(rid, p) for rid, p in self._pending.items() if p.shard == shard]
        # A local connection's set-up goes no further with this connection: its sender asks again from the start
        # (answered again and again, it would also hide a peer that drops everything else).
        self._fail_requests([(rid, p) for rid, p in unanswered if p.handle.setup],
                            ConnectionLostError(f"{self.servers[shard]} reconnected before answering"))
        unanswered = [(rid, p) for rid, p in unanswered if not p.handle.setup]
        self._unanswered[shard] += 1
        if self._unanswered[shard] > 3:  # it drops what is sent: resending would loop until the timeout
            self._fail_requests(unanswered, ConnectionLostError(
                f"{self.servers[shard]} dropped the connection {self._unanswered[shard]} times without answering "
                "anything: it is not a psrt shard (a psrt scheduler drops messages over 64 KiB), or it refuses "
                "this client's messages (larger than its limits allow, e.g. a tensor over its max_tensor_bytes)"))
            return
        log.warning("shard %s reconnected or moved (restarted?): sending again the %d requests it has not answered",
                    self.servers[shard], len(unanswered))
        self.versions.forget(shard)
        self._lanes.reset(shard)  # its lanes died with it; what was sent over one goes again over the socket
        self.channels[shard].reset_local()  # (and its local connection)
        if self._restarted is not None and behind:
            self._restarted(shard)
        for rid, p in unanswered:
            p.early = None  # parameters an early reply brought are not held: the new answer replaces them
            p.sender.resend(rid, p)

    def _receive(self, shard: int, head: bytes) -> None:
        """Take in the reply from ``shard`` whose header frame ``head`` was just received."""
        ch = self.channels[shard]
        try:
            reply = wire.decode_reply(head, self._limits)
        except ProtocolError as exc:
            ch.discard_rest()
            raise ProtocolError(f"shard {self.servers[shard]} sent a malformed reply: {exc}") from None
        self._unanswered[shard] = 0
        if type(reply) is wire.HeldReply:
            ch.discard_rest()
            self._held(shard, reply.ids)
            return
        pending = self._pending.get(reply.id)
        if pending is None or pending.shard != shard:
            ch.discard_rest()  # a late reply to a call that timed out, or one this shard was never asked
            return
        if type(reply) is wire.ParamsReply and not reply.held:
            self._early(ch, reply, pending)
            return
        if isinstance(reply, wire.ErrorReply) and pending.plain is not None and (
                reply.code in LANE_CODES or (reply.code == "protocol" and pending.table is not None)):
            ch.discard_rest()
            if reply.code == "protocol":  # a shard older than embedding rows over lanes: sockets for them
                pending.sender.rows_lane = False
            pending.sender.without_lane(reply.id, pending, reply.message)  # still awaited, under the same id
            return
        del self._pending[reply.id]
        pending.handle._outstanding.discard(reply.id)
        try:
            self._take(ch, reply, pending)
        finally:
            pending.release()
        if pending.handle._deferred:
            self._send_next(pending.handle, shard)

    @staticmethod
    def _send_next(handle: Handle, shard: int) -> None:
        """``shard`` answered one of ``handle``'s requests: send the next one the call holds back for it (a paced
        push's next piece)."""
        queue = handle._deferred.get(shard) if handle._deferred else None
        if not queue:
            return
        try:
            queue.popleft()()
        except PsrtError as exc:  # (not sent: nothing awaits it, and nothing more goes)
            queue.clear()
            handle._fail(exc)

    def _early(self, ch: transport.DealerChannel, reply: wire.ParamsReply, pending: Request) -> None:
        """A params reply sent before the shard's replicas held its round: its parameters are taken into the call's
        outputs now, but the call stays pending until the ``held`` notice (:meth:`_held`). Should the shard die
        first, the request goes again to whoever takes its range over, whose answer replaces them: a call never
        ends with parameters the replicas did not hold."""
        try:
            pending.early = self._receive_params(ch, reply, pending, early=True)
        except ProtocolError as exc:
            ch.discard_rest()
            del self._pending[reply.id]
            pending.handle._outstanding.discard(reply.id)
            pending.release()
            pending.handle._fail(ProtocolError(f"shard {self.servers[pending.shard]}: {exc}"))
        if pending.handle._deferred:  # the round closed: the next piece may go
            self._send_next(pending.handle, pending.shard)

    def _held(self, shard: int, ids: list[int]) -> None:
        """A ``held`` notice: the early replies ``ids`` of ``shard`` are held by its replicas: their calls end."""
        known, held = self.versions.chunks[shard], self.versions.held[shard]
        for rid in ids:
            pending = self._pending.get(rid)
            if pending is None or pending.shard != shard or pending.early is None:
                continue  # a call that timed out, or one sent again since its early reply (its answer is to come)
            del self._pending[rid]
            pending.handle._outstanding.discard(rid)
            self._answered[shard] = True
            for key, version in pending.early:
                known[key] = max(known.get(key, 0), version)
                held[key] = version
            pending.early = None
            pending.release()

    def _take(self, ch: transport.DealerChannel, reply: Any, pending: Request) -> None:
        """Take in one reply to a pending request (already removed from the pending table)."""
        shard = pending.shard
        endpoint = self.servers[shard]
        handle = pending.handle
        self._answered[shard] = True
        if type(reply) is wire.ParamsReply:
            try:
                self._receive_params(ch, reply, pending)
            except ProtocolError as exc:
                ch.discard_rest()
                handle._fail(ProtocolError(f"shard {endpoint}: {exc}"))
            if reply.job is not None:
                handle._conflicts.extend(pending.chunks[i].name for i in reply.job.conflicts
                                         if i < len(pending.chunks))
                handle._answers[shard] = reply.job
            return
        if isinstance(reply, wire.RowsReply):  # embedding rows: psrt.worker.embedding_client.RowsHandle
            try:
                handle._take_rows(ch, reply, shard, pending.lane)  # type: ignore[attr-defined]
            except ProtocolError as exc:
                ch.discard_rest()
                handle._fail(ProtocolError(f"shard {endpoint}: {exc}"))
                return
            known = self.versions.tables[shard]
            known[reply.table] = max(known.get(reply.table, 0), reply.version)
            self.versions.held_tables[shard][reply.table] = reply.version
            return
        ch.discard_rest()
        if isinstance(reply, wire.ErrorReply):
            if pending.refused is not None:
                pending.refused()
            handle._fail(refusal(endpoint, handle.op, reply.code, reply.message))
        elif isinstance(reply, wire.AckReply):
            if reply.taken is not None:
                handle._timed(shard, reply.taken, reply.held or 0)
            table = pending.table
            expected = len(pending.chunks) if table is None else 1
            if len(reply.versions) != expected:
                handle._fail(ProtocolError(f"shard {endpoint}: ack lists {len(reply.versions)} versions for "
                                           f"{expected} tensors"))
                return
            if table is not None:
                tables = self.versions.tables[shard]
                tables[table] = max(tables.get(table, 0), reply.versions[0])
                return
            known = self.versions.chunks[shard]
            for chunk, version in zip(pending.chunks, reply.versions):
                known[chunk.key] = max(known.get(chunk.key, 0), version)
        elif isinstance(reply, wire.SavedReply):
            handle._answers[shard] = reply.path
        elif isinstance(reply, (wire.BeaconReply, wire.LaneReply, wire.ClosedReply, wire.LocalReply)):
            handle._answers[shard] = reply
        else:
            handle._answers[shard] = reply.stats

    def _receive_params(self, ch: transport.DealerChannel, reply: wire.ParamsReply, pending: Request,
                        early: bool = False) -> Optional[list[tuple[Any, int]]]:
        """Take a params reply's parameters into the call's outputs and learn their versions; ``early`` (a reply
        the replicas do not hold yet, over the socket): the versions are returned instead, to learn on its notice."""
        chunks = pending.chunks
        outputs = pending.handle._outputs
        if outputs is None or len(reply.tensors) != len(chunks):
            raise ProtocolError(f"reply carries {len(reply.tensors)} tensors, expected {len(chunks)}")
        for meta, chunk in zip(reply.tensors, chunks):
            if (meta.name != chunk.name or meta.part != chunk.part or meta.count != chunk.count
                    or (meta.dtype is not chunk.dtype and meta.dtype != chunk.dtype)):
                raise ProtocolError(f"reply tensor {meta.name!r} part {meta.part} does not match the request")
        known = self.versions.chunks[pending.shard]
        held = self.versions.held[pending.shard]
        versions: list[tuple[Any, int]] = []
        if reply.lane is not None:  # the parameters are in this request's lane areas, or the shard's memory
            use = pending.lane
            if use is None or reply.lane != use.ref.generation or len(use.ref.outputs) != len(chunks) \
                    or ch.more() or reply.places is None:
                raise ProtocolError("reply names a shared-memory lane this request did not use")
            again = []
            for i, (chunk, version, place) in enumerate(zip(chunks, reply.versions, reply.places)):
                dest = chunk.of(outputs[chunk.name])
                if not place:
                    np.copyto(dest, use.output(i, chunk.dtype, chunk.count))
                elif not self._lanes.copy_shared(pending.shard, place, dest):
                    again.append((chunk, version))  # the next round overwrote it meanwhile: ask again (socket)
                    continue
                known[chunk.key] = max(known.get(chunk.key, 0), version)
                held[chunk.key] = version
            if again:
                self._again.append((pending, again))
            return
        # A frame per tensor, or (a shard's sync round of several tensors) one frame with them all back to back.
        first: Optional[memoryview] = None
        joined: Optional[memoryview] = None
        at = 0  # where the next tensor's bytes start in ``joined``
        if len(chunks) > 1 and ch.more():
            first = ch.recv_buffer()
            if not ch.more() and first.nbytes == sum(m.nbytes for m in reply.tensors):
                joined = first
        for i, (meta, chunk, version) in enumerate(zip(reply.tensors, chunks, reply.versions)):
            dest = outputs[chunk.name]
            if chunk.pieces != 1:  # (a whole tensor is received into as it is: its shape was checked)
                dest = chunk.of(dest)
            if joined is not None:
                got = _take_bytes(joined[at:at + meta.nbytes], meta, dest)
                at += meta.nbytes
            elif i == 0 and first is not None:
                got = _take_bytes(first, meta, dest)
            elif not ch.more():
                raise ProtocolError("reply has fewer buffer frames than tensors")
            elif meta.encoding is None:
                got = ch.recv_into(memoryview(dest).cast("B") if dest.size else bytearray())
            else:
                got = _take_bytes(ch.recv_buffer(), meta, dest)
            if got != meta.nbytes:
                raise ProtocolError(f"tensor {meta.name!r} part {meta.part}: frame has {got} bytes, "
                                    f"expected {meta.nbytes}")
            key = meta.key  # (the chunk's: checked above)
            if early:
                versions.append((key, version))
                continue
            known[key] = max(known.get(key, 0), version)
            held[key] = version
        if ch.more():
            raise ProtocolError("reply has more buffer frames than tensors")
        return versions if early else None


def _take_bytes(data: memoryview, meta: wire.TensorMeta, dest: np.ndarray) -> int:
    """Copy a received tensor's bytes ``data`` into ``dest`` (widening 16-bit parameters, which a worker pushing
    16-bit gradients gets back) when they are as many as ``meta`` says; returns how many there were."""
    got = data.nbytes
    if got == meta.nbytes and got:
        if meta.encoding is None:
            memoryview(dest).cast("B")[:] = data
        else:
            dest.reshape(-1)[:] = compression.decode(meta.encoding, data)
    return got
