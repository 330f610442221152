"""What a client sends one shard, and how: :class:`ShardSender`.

A client has one sender per shard, and every request it makes of that shard goes through it: ``init``, pushes,
pulls, embedding rows, counters, checkpoints, lane set-up. A call moving enough bytes to a shard on this host goes
through the shard's shared-memory lane (:mod:`psrt.shm.lanes`: the tensor bytes in a segment, the socket carrying
the header), anything else over the shard's DEALER socket; and to a shard on this host, every message takes a
local connection once one is set up (:meth:`ShardSender._local_first`, :mod:`psrt.transport.local`). Each
request is tracked by :class:`~psrt.worker.calls.ShardCalls`, which routes its reply, with the forms it may have
to go again in; the routing gives a request back to its sender when it must:

- :meth:`ShardSender.without_lane`: the shard refused the lane (it restarted, or dropped the segment), so the
  request goes again over the socket, under the same id;
- :meth:`ShardSender.resend`: the shard restarted before answering, so the request goes again in its socket form
  (a pull then asks for any version: a shard restored from a checkpoint may be behind what it was; a push keeps
  its sequence number and is not applied twice);
- :meth:`ShardSender.pull_again`: the shared parameters a reply named were overwritten while being copied.

A push's requests come from a plan cached per set of tensors (:class:`psrt.worker.plans.ShardPlan`): over the
socket and uncompressed, a step packs only ``id, seq, clock`` (to a sync shard, ``base`` too) after the header
prefix packed once. Compressed gradients, whose header entries depend on the values, and calls over a lane take
the general path (:func:`psrt.wire.encode_push`); :class:`psrt.worker.compress.Compressor` encodes the former.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from psrt import wire
from psrt.errors import ConnectionLostError, PsrtError
from psrt.partition import Chunk
from psrt.shm.lanes import LaneUse, WorkerLanes, rows_bytes
from psrt.transport import ZERO_COPY_BYTES
from psrt.worker.calls import Encode, Request, ShardCalls
from psrt.worker.compress import Compressor
from psrt.worker.handles import Handle
from psrt.worker.pacing import GROUPED, PACED
from psrt.worker.plans import ShardPlan

__all__ = ["ShardSender", "payload_of"]

log = logging.getLogger("psrt.client")

#: Seconds a client waits for a shard's local listener to take its connection and greeting.
LOCAL_CONNECT_S = 10.0
#: At most how long a call waits, once, for the requests in flight to take the local connection
#: (:meth:`ShardSender._settle`).
SETTLE_S = 1.0


def payload_of(chunks: Sequence[Chunk], arrays: Mapping[str, np.ndarray],
               lane: Optional[LaneUse] = None) -> tuple[list[list[Any]], list[np.ndarray]]:
    """The header entries of a message's chunks and their bytes: views of the caller's arrays (no copy), or with
    ``lane``, their copies in its segment."""
    entries = [wire.tensor_entry(c.name, c.part, c.dtype, (c.count,)) for c in chunks]
    return entries, (list(lane.inputs) if lane is not None else [c.of(arrays[c.name]) for c in chunks])


class ShardSender:
    """Sends one shard the client's requests, and sends them again when they must go again.

    Parameters
    ----------
    shard : int
        The shard's index (its socket is ``calls.channels[shard]``).
    calls : ShardCalls
        The client's requests in flight: each request sent here is tracked there, which routes its reply.
    lanes : WorkerLanes
        The client's shared-memory lanes.
    rank, session : int
        The worker's rank and session, in every request that names the worker.
    compressor : Compressor, optional
        The gradient compression of pushes (none: pushes go at full precision).
    pipeline : str
        :attr:`psrt.config.ClientConfig.pipeline`: whether a split tensor's pieces go a piece a message over the
        socket (``"on"``), never (``"off"``), or when the shard is reached over a network (``"auto"``).
    """

    def __init__(self, shard: int, calls: ShardCalls, lanes: WorkerLanes, rank: int, session: int,
                 compressor: Optional[Compressor] = None, pipeline: str = "auto") -> None:
        self.shard = shard
        self._calls = calls
        self._channel = calls.channels[shard]  # re-pointed in place when the shard moves
        self._lanes = lanes
        self._rank, self._session = rank, session
        self._compressor = compressor
        self._pipeline = pipeline
        self._timeout = calls.config.timeout
        self._known = calls.versions.chunks[shard]  # the versions a pull asks for
        self._held = calls.versions.held[shard]  # the versions of the parameters this client holds
        #: The shard's backup workers (its answer to ``init`` says): > 0, each push says the version it was
        #: computed from (its ``base``; so does every push to a sync shard, :mod:`psrt.shard.realign`).
        self.backup_workers = 0
        #: The sequence number of this client's next push to the shard (the shard applies each once).
        self.seq = 0
        #: The request of :meth:`_local_first` in flight: ``("probe" | "open", its handle)``.
        self._opening: Optional[tuple[str, Handle]] = None
        #: Whether embedding rows may take the shard's lane (False once a shard too old for it refused one).
        self.rows_lane = True
        #: Whether the shard runs sync rounds (its answer to ``init`` says): a blocking call's pieces are paced.
        self.sync = False
        #: Whether its range has replicas (its answer to ``init`` says): a sync push's ack then waits for its round.
        self.replicated = False
        #: Whether requests in flight were waited for once, to move onto the attached local connection
        #: (:meth:`_settle`); False again with each new local connection.
        self._settled = False
        #: :attr:`psrt.config.ClientConfig.in_flight`.
        self.in_flight = calls.config.in_flight

    # ------------------------------------------------------------------ sending
    def send(self, handle: Handle, encode: Encode, resend: Optional[Encode] = None,
             chunks: Sequence[Chunk] = (), table: Optional[str] = None) -> None:
        """Send one request over the socket, its frames made by ``encode(request_id)``; the reply goes to ``handle``.

        ``resend`` makes the frames to send again should the shard restart before answering (default:
        ``encode``). ``chunks`` (dense tensors) or ``table`` (an embedding table) say what the reply's versions
        and tensors are of.
        """
        self._send(Request(handle, self, chunks, table, encode if resend is None else resend), encode)

    def _send(self, request: Request, encode: Encode) -> None:
        if self._channel.local_ready and not self._calls.outstanding(self.shard):
            self._channel.switch_local()  # (nothing of this client's to the shard in flight: nothing can cross)
        rid = self._calls.track(request)
        try:
            self._channel.send(encode(rid), self._timeout)
        except PsrtError:
            self._calls.untrack(rid)
            raise

    def _begin(self) -> None:
        """A call's start (``push``/``push_pull``, ``pull``, ``pull_rows``, ``push_rows``): the next step of the local
        connection's set-up (:meth:`_local_first`), or, the connection ready, its requests moved onto it
        (:meth:`_settle`)."""
        channel = self._channel
        if not channel.local_tried:
            self._local_first()
        elif not self._settled and channel.local_ready and self._calls.outstanding(self.shard):
            self._settle()

    def _settle(self) -> None:
        """Wait, once, for this client's requests to the shard in flight (at most :data:`SETTLE_S`), so that the
        call's requests take the local connection (:meth:`_send` switches when none is in flight).

        A request goes over the local connection only when none sent over ZeroMQ is unanswered (the two could
        cross, and a shard takes a worker's requests in the order they come). A client that always keeps one in
        flight, a pipelined training loop, would never find that moment and stay on ZeroMQ, at under half the
        calls a second. Its next call waits instead, a round trip, once. What it has in flight is answered
        without anything more from it in an async job, and in a sync one as soon as the other workers push the
        round; but in ssp a pull's answer may wait for another worker's clock, which may wait for this client's
        next push, and a sync worker's peers may wait for this very call before pushing what its requests wait
        for: there the wait ends at the bound, and the requests stay on ZeroMQ until a moment with nothing in
        flight.
        """
        self._settled = True
        self._calls.settle(self.shard, min(self._timeout, SETTLE_S))

    def ask(self, encode: Encode) -> Any:
        """One request no tensor rides on (a lane set-up), waited for: the reply record.

        Raises
        ------
        ServerError
            When the shard answers with an error (e.g. an older shard that does not know the op).
        """
        handle = Handle(self._calls, "lane set-up", None)
        self.send(handle, encode)
        handle.wait(self._timeout)
        return handle._answers[self.shard]

    def init(self, handle: Handle, messages: list[list[Chunk]], arrays: Mapping[str, np.ndarray],
             optimizer: dict[str, Any], check: bool = False) -> None:
        """Send the ``init`` requests of ``messages`` (chunks of ``arrays``), with the optimizer's wire spec;
        ``check``: only ask whether they would be taken (no bytes; answered by an ``ack`` or the refusal)."""
        rank, session = self._rank, self._session
        for msg in messages:
            entries, payload = payload_of(msg, arrays)
            if check:
                payload = []
            self.send(handle, lambda rid, e=entries, p=payload: wire.encode_init(rid, rank, session, optimizer, e, p,
                                                                                 check), chunks=msg)

    def _grouped(self) -> bool:
        """Whether a call's pieces share messages over this shard's socket (else each piece is one)."""
        pipeline = self._pipeline
        return pipeline == "off" or (pipeline == "auto" and self._channel.local)

    def pull(self, handle: Handle, plan: ShardPlan, clock: int) -> None:
        """Send the pull requests of ``plan``: each asks for the versions this client's pushes target."""
        self._begin()
        rank, known = self._rank, self._known
        lane = self._lane_for(plan.lane_bytes)
        for msg in (plan.grouped if lane is not None or self._grouped() else plan.joined):
            keys = [[c.name, c.part, known.get(c.key, 0)] for c in msg]
            plain = lambda rid, k=keys: wire.encode_pull(rid, rank, k, clock)  # noqa: E731
            # Sent again after a restart, any version will do (a restored shard may be behind what this worker saw);
            # the versions still say what this worker's pushes targeted, by which a restored sync shard tells that
            # it lost one of them (psrt.shard.realign).
            resend = lambda rid, k=keys: wire.encode_pull(rid, rank, k, clock, again=True)  # noqa: E731
            if lane is None:
                self._send(Request(handle, self, msg, None, resend), plain)
                continue
            use = WorkerLanes.carry(lane, msg, None, True)
            self._send(Request(handle, self, msg, None, resend, use, plain),
                       lambda rid, k=keys, u=use: wire.encode_pull(rid, rank, k, clock, u.ref))

    def push(self, handle: Handle, plan: ShardPlan, arrays: dict[str, np.ndarray], pull: bool, clock: int,
             way: Optional[int] = None) -> None:
        """Send the push (``pull``: push_pull) requests of ``plan``, the gradients ``arrays`` checked by the caller.

        Over a network a split tensor's pieces go joined (:attr:`ShardPlan.joined`), all at once, unless ``way``
        (a blocking call to a sync shard, whose caller waits for it at once: :mod:`psrt.worker.pacing`) says
        :data:`~psrt.worker.pacing.PACED` (a piece a message, at most :attr:`in_flight` ahead of the shard's
        answers: :meth:`_paced`) or :data:`~psrt.worker.pacing.GROUPED` (as few messages as can be).
        """
        self._begin()
        # (A call moving less than a lane's threshold never takes one: the usual small push asks nothing more.)
        lane = None if plan.lane_bytes < ZERO_COPY_BYTES else self._lane_for(plan.lane_bytes)
        if lane is not None:  # the bytes are all there at once: as few messages as can be
            messages, prefixes = plan.grouped, [None] * len(plan.grouped)
        elif self._grouped() or way == GROUPED:  # no link to keep busy both ways (or pipelining is off): the same
            messages, prefixes = plan.grouped, plan.grouped_prefixes
        elif way == PACED and self.sync and 0 < self.in_flight < len(plan.messages):
            self._paced(handle, plan.messages, plan.prefixes, arrays, pull, clock)
            return
        else:  # over a network: small pieces, so the shard answers each while the next arrives
            messages, prefixes = plan.joined, plan.joined_prefixes
        backup = self.backup_workers or self.sync
        for msg, prefix in zip(messages, prefixes):
            self._push_one(handle, msg, prefix, lane, arrays, pull, clock, self._base(msg) if backup else None)

    def _paced(self, handle: Handle, messages: list[list[Chunk]], prefixes: list[Optional[bytes]],
               arrays: dict[str, np.ndarray], pull: bool, clock: int) -> None:
        """Send a sync call's pieces of split tensors :attr:`in_flight` at a time: the first ones now, each of the
        rest once the shard answers one (:meth:`psrt.worker.calls.ShardCalls` sends it from ``handle``'s
        queue); every other message goes now.

        A round closes when every worker's piece is in, so pieces sent all at once race each other over the
        shard's link, and rounds close late and in bursts. Held in step, the workers' pieces arrive side by side
        and each round's answers flow out while the next pieces arrive. The pieces go in the order of their keys,
        the same for every worker whatever order its call named the tensors in: a worker holds back a piece only
        behind pieces before it, whose rounds can close, so no two workers ever wait on each other.
        """
        backup = self.backup_workers or self.sync
        pieces = []
        for msg, prefix in zip(messages, prefixes):
            if len(msg) == 1 and msg[0].pieces > 1:
                pieces.append((msg[0].key, msg, prefix))
            else:  # small tensors sharing a message: their grouping is the call's, not every worker's
                self._push_one(handle, msg, prefix, None, arrays, pull, clock, self._base(msg) if backup else None)
        pieces.sort(key=lambda p: p[0])
        queue = None
        for i, (_, msg, prefix) in enumerate(pieces):
            # A piece's base is the version its gradient came from: read now, not when it goes.
            base = self._base(msg) if backup else None
            if i < self.in_flight:
                self._push_one(handle, msg, prefix, None, arrays, pull, clock, base)
                continue
            if queue is None:
                queue = handle._queue(self.shard)
            queue.append(lambda m=msg, h=prefix, b=base: self._push_one(handle, m, h, None, arrays, pull, clock, b))

    def _push_one(self, handle: Handle, msg: list[Chunk], prefix: Optional[bytes], lane: Any,
                  arrays: dict[str, np.ndarray], pull: bool, clock: int, base: Any) -> None:
        """Send the push request of one message (its sequence number taken now)."""
        rank, session = self._rank, self._session
        seq = self.seq
        self.seq = seq + 1
        if lane is None and prefix is not None and type(base) is not list:  # the usual small push: socket, plain
            payload = []
            for c in msg:
                a = arrays[c.name]
                # A whole tensor's bytes are its own (encoding takes any C-contiguous shape): no flat view.
                payload.append(a if c.pieces == 1 else c.of(a))
            encode = lambda rid, h=prefix, q=seq, p=payload: wire.encode_push_after(  # noqa: E731
                h, rid, q, clock, p, base)
            self._send(Request(handle, self, msg, None, encode), encode)
            return
        # Over a lane the gradients are copied into the segment; the socket form stays at hand.
        use = None if lane is None else WorkerLanes.carry(lane, msg, arrays, pull)
        entries, payload = payload_of(msg, arrays, use)
        refused = None
        if self._compressor is not None:
            refused = self._compressor.compress(self.shard, msg, entries, payload)
        plain = lambda rid, q=seq, e=entries, p=payload, b=base: wire.encode_push(  # noqa: E731
            rid, rank, session, q, e, p, pull, clock, None, b)
        if use is None:
            self._send(Request(handle, self, msg, None, plain, None, None, refused), plain)
            return
        self._send(Request(handle, self, msg, None, plain, use, plain, refused),
                   lambda rid, q=seq, e=entries, u=use, b=base: wire.encode_push(
                       rid, rank, session, q, e, [], pull, clock, u.ref, b))

    def pull_rows(self, handle: Handle, rank: int, table: str, version: int, ids: np.ndarray, clock: int,
                  row_bytes: int) -> None:
        """Send one ``pull_rows`` of ``ids`` (int64, C-contiguous; its answer takes ``row_bytes``): through the
        shard's lane when it moves enough bytes and the shard has one, else over the socket."""
        self._begin()
        plain = lambda rid: wire.encode_pull_rows(rid, rank, table, version, ids, clock)  # noqa: E731
        resend = lambda rid: wire.encode_pull_rows(rid, rank, table, 0, ids, clock)  # noqa: E731
        lane = self._rows_lane(rows_bytes(ids.nbytes, row_bytes))
        if lane is None:
            self._send(Request(handle, self, (), table, resend), plain)
            return
        use = WorkerLanes.carry_rows(lane, ids, None, row_bytes)
        self._send(Request(handle, self, (), table, resend, use, plain),
                   lambda rid: wire.encode_pull_rows(rid, rank, table, version, ids, clock, use.ref))

    def push_rows(self, handle: Handle, table: str, seq: int, ids: np.ndarray, grads: np.ndarray, clock: int,
                  base: Optional[int], select: Optional[np.ndarray] = None) -> None:
        """Send one ``push_rows`` of ``ids`` and their gradient rows (C-contiguous; with ``select``, of
        ``ids[select]`` and ``grads[select]``, gathered once, straight into the lane when it takes one): through
        the shard's lane when it moves enough bytes and the shard has one, else over the socket."""
        self._begin()
        rank, session = self._rank, self._session
        count = len(ids) if select is None else len(select)
        lane = self._rows_lane(rows_bytes(count * ids.itemsize, count * grads.shape[1] * grads.itemsize))
        if lane is None:
            if select is not None:
                ids, grads = ids[select], grads[select]
            plain = lambda rid: wire.encode_push_rows(rid, rank, session, seq, table, ids, grads,  # noqa: E731
                                                      clock, base)
            self._send(Request(handle, self, (), table, plain), plain)
            return
        use = WorkerLanes.carry_rows(lane, ids, grads, 0, select)
        # Sent again over the socket (a refused lane, a restarted shard), it is the copy in the lane that goes: the
        # caller may change its gradients once this returns, as over a lane for dense tensors.
        lids, lgrads = use.inputs
        plain = lambda rid: wire.encode_push_rows(rid, rank, session, seq, table, lids, lgrads, clock,  # noqa: E731
                                                  base)
        self._send(Request(handle, self, (), table, plain, use, plain),
                   lambda rid: wire.encode_push_rows(rid, rank, session, seq, table, lids, lgrads, clock, base,
                                                     use.ref))

    def _rows_lane(self, nbytes: int) -> Any:
        """The lane an embedding request moving ``nbytes`` (aligned areas) takes, or None: sockets."""
        if nbytes < ZERO_COPY_BYTES or not self.rows_lane:
            return None
        return self._lane_for(nbytes)

    def _lane_for(self, nbytes: int) -> Any:
        """The lane a call moving ``nbytes`` (aligned areas) takes, or None: sockets."""
        return self._lanes.lane_for(self.shard, nbytes, self.ask)

    def _local_first(self) -> None:
        """Ask, without waiting, for a local connection to the shard, so that small calls, which never take a
        lane, leave ZeroMQ too when the shard shares this host (whatever address it is reached at: the beacon
        proves it, or that it runs elsewhere).

        Each call's start takes the next step once the last one is answered (its answer comes in while a call
        waits): ``lane_probe`` (unless a lane read the beacon already), the beacon's token read on this host,
        ``local_open`` with it, then the connection. Nothing waits on these answers, so a call never waits
        longer for them (a shard that answers nothing costs its caller one timeout, as before; a shard elsewhere,
        one small request), and the requests go over the connection from the first send at which no request to
        the shard is outstanding.
        """
        channel = self._channel
        if not self._lanes.local:
            channel.local_tried, self._opening = True, None
            return
        token = self._lanes.known_token(self.shard)
        if self._opening is not None:
            step, handle = self._opening
            if handle._outstanding:
                return
            self._opening = None
            reply = handle._answers.get(self.shard)
            try:
                if handle._error is not None:
                    raise handle._error
                if step == "open":
                    channel.local_tried = True
                    channel.attach_local(reply.name, reply.secret, min(self._timeout, LOCAL_CONNECT_S))
                    self._settled = False
                    return
                token = self._lanes.take_beacon(self.shard, reply)
            except (PsrtError, OSError) as exc:
                # The shard reconnected or restarted since (the restart forgot the token, and a new shard's beacon
                # holds another): read its beacon again. Else it stays on the socket.
                if not isinstance(exc, ConnectionLostError) and not (
                        step == "open" and token is None and isinstance(exc, PsrtError)):
                    channel.local_tried = True
                    log.info("shard %s: no local connection (%s); its requests stay on the socket",
                             channel.endpoint, exc)
                    return
                token = None
            else:
                if token is None:  # (another host after all, or no shared memory there)
                    channel.local_tried = True
                    return
        handle = Handle(self._calls, "local set-up", None)
        handle.setup = True
        if token is None:
            self.send(handle, wire.encode_lane_probe)
            self._opening = ("probe", handle)
        else:
            self.send(handle, lambda rid, t=token: wire.encode_local_open(rid, t))
            self._opening = ("open", handle)

    def _base(self, msg: Sequence[Chunk]) -> Any:
        """The version(s) of the parameters a push of ``msg``'s gradients was computed from: those last received
        (one int when the chunks agree, the usual case, else one per chunk)."""
        get = self._held.get  # (every sync push asks: one pass that builds no list while the chunks agree)
        first = get(msg[0].key, 0) if msg else 0
        for c in msg:
            if get(c.key, 0) != first:
                return [get(c.key, 0) for c in msg]
        return first

    # ------------------------------------------------------------------ sending again
    def resend(self, rid: int, request: Request) -> None:
        """The shard restarted without answering ``request``: send it again, in its socket form."""
        self._channel.send(request.resend(rid), self._timeout)

    def without_lane(self, rid: int, request: Request, why: str) -> None:
        """The shard refused ``request``'s lane (and changed nothing): send it again over the socket, under the
        same id. Its areas stay taken until this answer comes, since a socket send may still be reading them."""
        log.info("shard %s refused a shared-memory lane (%s); sending over the socket",
                 self._calls.servers[self.shard], why)
        self._lanes.reset(self.shard)
        assert request.plain is not None
        frames, request.plain = request.plain(rid), None  # refused once: the socket from now on
        try:
            self._channel.send(frames, self._timeout)
        except PsrtError as exc:
            self._calls.untrack(rid)
            request.release()
            request.handle._fail(exc)

    def pull_again(self, handle: Handle, chunks: list[tuple[Chunk, int]]) -> None:
        """Pull ``(chunk, version)`` pairs again over the socket for ``handle``: their parameters in the shard's
        shared memory were overwritten by a later round while being copied."""
        keys = [[c.name, c.part, v] for c, v in chunks]
        rank = self._rank
        self.send(handle, lambda rid: wire.encode_pull(rid, rank, keys, 0), chunks=[c for c, _ in chunks])
