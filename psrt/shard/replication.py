"""A shard's part in a replicated job (``--replicas R``): copying its rounds to its replicas, holding the copies
of the ranges it backs, and taking one of them over when the scheduler promotes it.

Shard k's key range is also held by the next R shards of the ring (:func:`psrt.partition.replica_ring`). Two
channels, both DEALER/ROUTER in a ZeroMQ context of their own (with keys: CURVE, whose ZAP handler admits the job's
*server* key alone, so no worker can speak on them):

- **Primary side** (a :class:`Copier` per range served, on the thread serving it): once a sync round completes
  (in async and ssp modes: once a push is applied; ssp copies carry the keys' clocks too), its
  result — the new parameters and optimizer slots of the keys it stepped, their versions, and each worker's
  *settled* sequence number (every push up to it is in that state, none after it) — goes once to every live
  replica, and the shard waits for each one's ``replicated`` before it answers anything that round made true (the
  push_pulls' parameters, the pulls' waits, and in a replicated job even a plain push's ack). A new key's ``init``
  is copied the same way. While it waits it keeps heartbeating and reads the scheduler's notices, so a replica
  the scheduler declares dead (a ``ranges`` notice without it) is no longer waited for.
- **Replica side** (a thread of its own, :meth:`Replication._serve_copies`): the copies land in one standby
  :class:`~psrt.shard.server.Server` per backed range, bound before the shard registered (its endpoint is in the
  registration) and not yet serving. A copy is taken only from the job (its token) and only from the range's
  current primary; anything else is refused with an error and changes nothing.
- **Promotion**: a ``ranges`` notice naming this shard first for a range it backs (only the scheduler promotes,
  and only the first live holder) makes the replication thread apply every copy already queued, stop taking
  copies for that range, and start the standby serving it on its own thread. The scheduler has told the workers
  the standby's endpoint (``moved``); they send again what the dead primary never answered, and the sequence
  numbers the copies carry make that exactly-once.

A promoted standby copies its whole range to the range's other live holders before it serves
(:meth:`Copier.catch_up`), then each round as its primary did, so a range survives R successive deaths.

A range's embedding tables ride the same channel (:mod:`psrt.shard.tablecopy`, :meth:`Copier.deliver`): the rows a
round or push touched, copied before it is answered, and every table whole wherever the dense keys go whole.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Optional, Protocol, Sequence, Union

import numpy as np

from psrt import optim, transport, wire
from psrt.config import ServerConfig
from psrt.control import security
from psrt.errors import ConfigError, ProtocolError, PsrtError
from psrt.partition import backed_ranges
from psrt.shard import tablecopy
from psrt.shard.replay import REPLAY_WINDOW, WorkerLog
from psrt.shard.store import Key, Store
from psrt.wire import replication as messages
from psrt.wire import rowcopy

#: What a key's state holds of one worker's pushes, beyond its settled ones: every push of the worker up to ``seq``
#: that touches the key, as an int ``seq``; or, where some of those are not in it (pushes overtaken by later ones:
#: :mod:`psrt.shard.replay`), ``(seq, holes)``: all but the holes (on a replica, runs ``[[first, count], ...]``; on
#: the primary, before its copy, the replay window's bitmap). In-order pushes leave it an int.
Held = Union[int, tuple[int, Any]]


class ShardLike(Protocol):
    """What replication uses of a :class:`psrt.shard.server.Server` (not imported: the server imports this)."""

    config: ServerConfig
    store: Store
    tables: Any
    endpoint: str
    replies: Any

    def set_job(self, num_workers: int, mode: str, staleness: int = 0) -> None: ...  # noqa: D102
    def take_rank(self, rank: int) -> None: ...  # noqa: D102
    def adopt_copier(self, copier: Copier,  # noqa: D102
                     included: dict[Key, tuple[dict[int, int], dict[int, Held]]]) -> None: ...
    def checkpoint_at_exit(self) -> Any: ...  # noqa: D102
    def serve(self, control: Any = None) -> None: ...  # noqa: D102
    def stop(self) -> None: ...  # noqa: D102
    def close(self) -> None: ...  # noqa: D102

__all__ = ["COPY_POLL", "Replication", "Copier", "ShardLike", "Held", "sibling_endpoint", "frames_nbytes", "peer_keys",
           "holds", "replayed", "apply_except"]

log = logging.getLogger("psrt.replication")

_FULL = (1 << REPLAY_WINDOW) - 1

#: Seconds between the replication thread's looks for a stop or a promotion while no copy arrives.
_POLL = 0.05
#: Most seconds a serving loop waits between reads of the scheduler's notices while a pipelined copy is awaited:
#: as often as an awaited copy reads them (:meth:`Copier._await`), so a replica named dead is not waited for
#: longer than there.
COPY_POLL = _POLL


def sibling_endpoint(bind: str, suffix: str) -> str:
    """Where to bind a socket beside the shard's own ``bind``: the same host on a free port (tcp), or a path
    next to its socket file (ipc)."""
    if bind.startswith("tcp://"):
        host = bind[len("tcp://"):].rpartition(":")[0]
        return f"tcp://{host}:*"
    return f"{bind}.{suffix}"  # ipc:// (a path) and inproc:// (a name)


def frames_nbytes(frames: Sequence[Any]) -> int:
    """The bytes of a message's frames (bytes, memoryviews or arrays alike)."""
    return sum(memoryview(f).nbytes for f in frames)


def peer_keys(directory: Optional[security.PathLike]) -> Optional[security.JobKeys]:
    """The keys of the shard-to-shard channel: the job's server pair on both ends, so that its ZAP handler admits
    the server key alone (a worker holds the client pair, never the server secret). None: keys are off."""
    keys = security.load_keys(directory, serve=True, connect=False)
    if keys is None:
        return None
    return replace(keys, client_public=keys.server_public, client_secret=keys.server_secret)


class _HeldAck:
    """A sync push's ack, held until every key it joined has a round the replicas acknowledged."""

    __slots__ = ("identity", "request_id", "want", "duplicate", "keys")

    def __init__(self, identity: bytes, request_id: int, keys: list[Key], want: list[int], duplicate: bool) -> None:
        self.identity, self.request_id, self.keys = identity, request_id, keys
        self.want, self.duplicate = want, duplicate


class _Flight:
    """A sync round's copy sent and not awaited (:meth:`Copier.commit` with ``pipelined``): the replicas yet to
    acknowledge it, and its frames (sent again to one that has not yet read that this shard serves the range)."""

    __slots__ = ("rid", "frames", "waiting", "deadline")

    def __init__(self, rid: int, frames: list[Any], waiting: set[int], deadline: float) -> None:
        self.rid, self.frames, self.waiting, self.deadline = rid, frames, waiting, deadline


class Copier:
    """The primary side of one key range: its copies to the range's live replicas, and the answers held until they
    acknowledged. Used from one thread: the one serving the range (its sockets are made there, on first use).

    Parameters
    ----------
    server : ShardLike
        The shard serving the range (its store and answers).
    context : zmq.Context
        The replication context (its sockets speak the shard-to-shard keys).
    keys : JobKeys or None
        Those keys (:func:`peer_keys`).
    sender, rng : int
        The rank of the shard serving the range (which the replicas check), and the range.
    token : str
        The job's replication token.
    endpoints : sequence
        Per shard, its announced endpoints (the first: its replication endpoint).
    tick : callable
        Called while a copy waits (the host shard's heartbeat and notices; a no-op off its serving thread); True:
        the job ended or failed, wait no more.
    """

    def __init__(self, server: ShardLike, context: Any, keys: Optional[security.JobKeys], sender: int, rng: int,
                 token: str, endpoints: Sequence[Sequence[str]], tick: Callable[[], bool]) -> None:
        self.server, self.sender, self.range, self.token = server, sender, rng, token
        self._ctx, self._keys, self.tick = context, keys, tick
        #: Per shard, its announced endpoints (replaced when a shard takes a dead one's place).
        self.endpoints: Sequence[Sequence[str]] = endpoints
        config = server.config
        self._timeout = config.send_timeout  # how long a copy may go unacknowledged by a replica not declared dead
        self._limits, self._hwm = config.limits, config.hwm
        #: The replicas to copy to (set by the host shard's thread from the scheduler's word; read here).
        self.live: tuple[int, ...] = ()
        self._dealers: dict[int, transport.DealerChannel] = {}
        self._connected: dict[int, str] = {}  # each dealer's endpoint (a shard that took a dead one's place: new)
        self._dropped: set[int] = set()  # replicas given up on (they refused, or never answered)
        self._fresh: set[int] = set()  # replicas connected since the last copy: they get the whole range first
        #: Replicas that acknowledged a copy of this shard's since they were connected: they take this shard for
        #: the range's primary, so a copy sent them without waiting is never refused as not the primary's.
        self._confirmed: set[int] = set()
        #: Sync rounds' copies sent and not yet acknowledged by every live replica, oldest first (pipelined).
        self._flights: deque[_Flight] = deque()
        #: Per worker, the seq of its first push in each key's open round (those pushes are not settled).
        self._open: dict[int, dict[Key, int]] = {}
        #: Per key, per worker of a round of it: what the key's state holds of the worker's pushes (:data:`Held`,
        #: holes as a bitmap), as of the last of its rounds that worker joined; every copy of the key carries it.
        self._holds: dict[Key, dict[int, Held]] = {}
        #: Per worker, the session :attr:`_holds` speaks of (a worker that restarted starts afresh).
        self._sessions: dict[int, int] = {w: wlog.session for w, wlog in server.store.workers.items()}
        self._acks: list[_HeldAck] = []
        #: Keys whose new state waits for the batch's copy (:meth:`defer`), in the order they changed.
        self._dirty: dict[Key, None] = {}
        self._depth = 0  # commits in progress (a newcomer's full copy may start one inside another)
        self._next_id = 1
        self.copies_sent = 0
        #: Bytes of every copy's frames, once per replica sent to (headers and tensors; not TCP's own).
        self.copy_bytes_sent = 0
        #: The range's embedding tables' copies (:class:`psrt.shard.tablecopy.TableCopies`, which sets itself).
        self.rows: Optional[Any] = None

    def _connect(self) -> list[int]:
        """The live replicas, connected (those the scheduler dropped, closed): called on the serving thread."""
        live = [j for j in self.live if j not in self._dropped]
        for j in [j for j in self._dealers if j not in live]:
            log.warning("shard %d no longer holds a copy of range %d (the scheduler says): not copying to it", j,
                        self.range)
            self._dealers.pop(j).close()
            self._confirmed.discard(j)
        for j in live:
            announced = self.endpoints[j] if j < len(self.endpoints) else ()
            if j in self._dealers and announced[:1] != (self._connected.get(j),):  # another shard in j's place
                self._dealers.pop(j).close()
                self._confirmed.discard(j)
            if j not in self._dealers:
                if not announced:
                    log.error("shard %d announced no replication endpoint: range %d is not copied there", j,
                              self.range)
                    self._dropped.add(j)
                    continue
                self._dealers[j] = transport.DealerChannel(self._ctx, announced[0], self._hwm, keys=self._keys,
                                                           max_frame=wire.CONTROL_LIMITS.max_header_bytes)
                self._connected[j] = announced[0]
                self._fresh.add(j)
        return [j for j in live if j in self._dealers]

    def joined(self, worker: int, seq: int, keys: list[Key], completed: Sequence[int],
               late: Optional[Sequence[bool]] = None) -> None:
        """A push (``seq`` of ``worker``, already recorded in the store's replay window) joined the rounds of
        ``keys``; those at ``completed`` stepped (and what each of those keys' state holds of its round's workers'
        pushes goes with its copy). ``late`` (backup workers): keys it was dropped for, whose rounds it did not join.

        A key whose round just completed holds every push of each of that round's workers the shard has taken and
        that touches it (no push of theirs is open on it now, and one a round ahead is queued, not taken), so what
        it holds of a worker is that worker's replay window as it is now: its highest seq taken, and its holes (in
        order, none). Exact in any order of arrival, where the round's own seq would not be: a push overtaken by a
        later one joins the key's next round, its seq below the one that overtook it. (A range taken over: the
        key also holds what its copies said it held, pushes its primary took that were not sent here again yet.)"""
        done = set(completed)
        opened = None
        logs = self.server.store.workers
        if self._sessions.get(worker) != logs[worker].session:
            self._new_session(worker, logs[worker].session)
        for i, key in enumerate(keys):
            if late is not None and late[i]:
                continue
            if i not in done:
                if opened is None:
                    opened = self._open.setdefault(worker, {})
                opened.setdefault(key, seq)
                continue
            holds = self._holds.get(key)
            if holds is None:
                holds = self._holds[key] = {}
            for w, o in self._open.items():
                if key in o:
                    del o[key]
                    holds[w] = _union(holds.get(w), _held_now(logs[w]))
            holds[worker] = _union(holds.get(worker), _held_now(logs[worker]))

    def _new_session(self, worker: int, session: int) -> None:
        """``worker`` restarted (a new session, numbered from 0): what keys held of its old one says nothing now."""
        for holds in self._holds.values():
            holds.pop(worker, None)
        self._sessions[worker] = session

    def adopt(self, held: dict[Key, tuple[dict[int, int], dict[int, Held]]]) -> None:
        """A range taken over: what its copies said its keys hold (:attr:`Replication._included`'s, holes as runs)
        becomes what this copier's copies say, for the workers whose sessions the range's state still has."""
        logs = self.server.store.workers
        self._sessions = {w: wlog.session for w, wlog in logs.items()}
        for key, (sessions, pushes) in held.items():
            mine: dict[int, Held] = {}
            for w, h in pushes.items():
                if w in logs and sessions.get(w) == logs[w].session:
                    mine[w] = h if type(h) is int else _held_now(WorkerLog.restored(0, h[0], h[1]))
            if mine:
                self._holds[key] = mine

    def hold_ack(self, identity: bytes, request_id: int, keys: list[Key], targets: list[int],
                 duplicate: bool) -> bool:
        """A sync push's ack: held (True) until the rounds it joined are held by the replicas too."""
        entries = self.server.store.entries
        if all(entries[k].version >= t for k, t in zip(keys, targets)):
            return False
        self._acks.append(_HeldAck(identity, request_id, keys, targets, duplicate))
        return True

    def defer(self, keys: Sequence[Key]) -> None:
        """The rounds of ``keys`` completed (in async and ssp modes: a push was applied) while the serving loop
        handles a batch of queued messages: their copy goes with the batch's (:meth:`flush`), one for every key
        the batch changed, each with its latest state; until the replicas acknowledged it every reply the shard
        makes is kept back (:meth:`psrt.shard.answers.ShardReplies.gate`)."""
        for opened in self._open.values():  # (now: a push of the key's next round in the batch stays open)
            for key in keys:
                opened.pop(key, None)
        for key in keys:
            self._dirty[key] = None
        self.server.replies.gate()

    def pending(self) -> bool:
        """Whether the batch changed something not copied yet, or keeps replies back (:meth:`flush` sends it)."""
        return bool(self._dirty or (self.server.replies.gated and not self._flights)
                    or (self.rows is not None and self.rows.pending()))

    def flush(self) -> None:
        """The end of a batch: what it changed (:meth:`defer`) goes in one copy to every live replica, awaited;
        then the replies kept back go, in order."""
        if self._flights:
            self.poll()
        if self.pending():
            self.commit([])

    def commit(self, keys: list[Key], settle: bool = False, pipelined: bool = False) -> None:
        """The rounds of ``keys`` completed (or ``init`` made them): copy their state, and that of the keys deferred
        (:meth:`defer`), to every live replica and wait until each acknowledged it (or the scheduler says it is
        gone); then send the replies kept back and release the acks it held. ``settle``: copy the workers' settled
        sequence numbers even when no key changed (:meth:`settle`).

        ``pipelined`` (a sync round): where it can, the copy is sent and not awaited; every reply made from then on
        is kept back until the replicas acknowledged it (:meth:`poll`), while the shard goes on serving, so the
        next piece's round is copied while this one's waits. Otherwise any copy still awaited is awaited first."""
        if pipelined and self._pipeline(keys):
            return
        self.drain()
        for opened in self._open.values():
            for key in keys:
                opened.pop(key, None)
        if self._dirty:
            keys = [*self._dirty, *(k for k in keys if k not in self._dirty)]
            self._dirty = {}
        self._depth += 1
        try:
            self._copy(keys, settle)
            if self.rows is not None:  # the tables a batch changed, each in one copy
                self.rows.flush()
        except BaseException:  # not copied: it goes with the next copy, and the replies kept back wait for it
            for key in keys:
                self._dirty[key] = None
            self.server.replies.gate()
            raise
        finally:
            self._depth -= 1
        if self._depth == 0:  # (an inner commit, a newcomer's, leaves the outer one's replies kept back)
            self.server.replies.ungate()
        if self._acks:
            self._release_acks()
        if self.rows is not None:
            self.rows.release()

    def _pipeline(self, keys: list[Key]) -> bool:
        """:meth:`commit` of a sync round without waiting for its copy, when it can be (False: it cannot): nothing
        else is to be copied with it, every live replica took this shard's copies before, and the replies kept
        back, if any, wait for earlier pipelined copies only."""
        replies = self.server.replies
        if self._dirty or self._depth or self._fresh or (replies.gated and not self._flights) \
                or (self.rows is not None and self.rows.pending()) or not keys:
            return False
        live = self._connect()
        if not live or self._fresh or any(j not in self._confirmed for j in live):
            return False
        for opened in self._open.values():
            for key in keys:
                opened.pop(key, None)
        store = self.server.store
        batches = _batches(keys, store)
        if len(batches) != 1:
            return False
        runs: dict[tuple[int, int], list[list[int]]] = {}  # (the round's keys hold their workers' windows now)
        settled, holes = self._settled(store, runs)
        rid = self._next_id
        self._next_id += 1
        frames = messages.encode_replicate(rid, self.token, self.sender, self.range, settled,
                                           [(k, store.entries[k]) for k in keys],
                                           [_held_runs(self._holds.get(k, {}), runs) for k in keys], False, holes)
        live = self._send(live, frames)
        self.copies_sent += 1
        self.copy_bytes_sent += frames_nbytes(frames) * len(live)
        replies.mark(rid)  # what is answered from now on tells of this round: kept back until it is held
        self._flights.append(_Flight(rid, frames, set(live), time.monotonic() + self._timeout))
        if self._acks:
            self._release_acks()  # (their acks go once the copy is held, kept back in order behind the mark)
        if self.rows is not None:
            self.rows.release()
        if not live:
            self.poll()
        return True

    def awaiting(self) -> list[Any]:
        """The sockets of the replicas a pipelined copy waits for (the serving loop polls them with its own)."""
        if not self._flights:
            return []
        waiting = set().union(*(f.waiting for f in self._flights))
        return [self._dealers[j].sock for j in waiting if j in self._dealers]

    def poll(self) -> None:
        """Read the replicas' answers to the pipelined copies (never waits): each copy every live replica holds
        releases, in order, the replies kept back behind it. A replica that does not answer within
        ``send_timeout`` (and is not named dead) is dropped, as a blocking copy's is."""
        flights = self._flights
        if not flights:
            return
        by_id = {f.rid: f for f in flights}
        for j in {j for f in flights for j in f.waiting}:
            ch = self._dealers.get(j)
            while ch is not None and ch.readable():
                reply = self._reply(j, ch)
                if reply is None:
                    continue
                flight = by_id.get(reply.id)
                if flight is None or j not in flight.waiting:
                    continue  # a late answer to a copy that was given up on
                flight.waiting.discard(j)
                if isinstance(reply, messages.ReplicationError):
                    log.error("shard %d refused range %d's copy: [%s] %s; it no longer holds a current copy",
                              j, self.range, reply.code, reply.message)
                    self._drop(j)
                    for f in flights:
                        f.waiting.discard(j)
                    ch = None
                else:
                    self._confirmed.add(j)
        now = time.monotonic()
        for f in flights:
            for j in list(f.waiting):
                if j not in self.live or j in self._dropped:  # the scheduler declared it dead meanwhile
                    f.waiting.discard(j)
                elif now > f.deadline:
                    log.error("shard %d did not acknowledge range %d's copy within %gs and the scheduler did not "
                              "declare it dead; going on without it", j, self.range, self._timeout)
                    self._drop(j)
                    for g in flights:
                        g.waiting.discard(j)
        held = None
        while flights and not flights[0].waiting:
            held = flights.popleft().rid
        if held is not None:
            self.server.replies.release(held, not flights)

    def drain(self) -> None:
        """Wait until every pipelined copy is acknowledged (or its replicas dropped), releasing what it kept back:
        before any copy that is awaited (its answers would otherwise overtake theirs)."""
        while self._flights:
            self.poll()
            if not self._flights:
                return
            if self.tick():
                return  # the job ended or failed: nothing will be answered any more
            socks = self.awaiting()
            if socks:
                transport.wait_readable(socks, _POLL)

    def _copy(self, keys: list[Key], settle: bool) -> None:
        store = self.server.store
        live = self._connect()
        full = bool(self._fresh)
        if full:  # a replica connected since the last copy (one that joined the job): the whole range, to all
            keys = list(store.entries)
            self._fresh.clear()
            if self.rows is not None and live:  # the tables first: the dense copy's `full` makes the range held
                self.rows.copy_all()
        if live and (keys or full or settle):  # (a range of tables alone still says, with no keys, that it is whole)
            runs: dict[tuple[int, int], list[list[int]]] = {}  # (a round's keys hold their workers' windows now)
            settled, holes = self._settled(store, runs)
            batches = _batches(keys, store)
            for n, batch in enumerate(batches):  # (a whole range in messages the replicas' limits take)
                rid = self._next_id
                self._next_id += 1
                frames = messages.encode_replicate(rid, self.token, self.sender, self.range, settled,
                                                   [(k, store.entries[k]) for k in batch],
                                                   [_held_runs(self._holds.get(k, {}), runs) for k in batch],
                                                   full and n == len(batches) - 1, holes)
                live = self._send(live, frames)
                self.copies_sent += 1
                self.copy_bytes_sent += frames_nbytes(frames) * len(live)
                if not self._await(rid, live, frames):
                    break
                live = [j for j in live if j in self._dealers]

    def settle(self) -> None:
        """A push dropped as late (backup workers) changed no key but is settled: its sequence number goes to
        every live replica (a copy of no keys) before the drop is answered, so that after a failover the push sent
        again is a duplicate there, neither applied nor lost."""
        self.commit([], settle=True)

    def newcomers(self) -> bool:
        """Whether a live replica is not connected yet (a server that took a dead one's place): it holds the
        range only once a full copy came, which :meth:`sync_newcomers` sends."""
        for j in self.live:
            announced = self.endpoints[j] if j < len(self.endpoints) else ()
            if j not in self._dropped and announced and (j not in self._dealers
                                                         or announced[:1] != (self._connected.get(j),)):
                return True
        return False

    def sync_newcomers(self) -> None:
        """Send a replica that joined the whole range now, when the range is idle, rather than with its next round:
        until it holds the range the job keeps one copy fewer (and a range whose primary dies meanwhile is lost)."""
        if self.newcomers():
            self.commit([])

    def catch_up(self) -> None:
        """A promoted range, before it serves: its whole state to its remaining replicas (whose last copy may be a
        round behind this one's)."""
        self.commit(list(self.server.store.entries))  # (its replicas are all new to it: its tables go whole too)

    def deliver(self, make: Callable[[int], list[Any]]) -> None:
        """One message other than a dense copy (a table's, :mod:`psrt.shard.tablecopy`) to every live replica,
        awaited as a round's copy is; ``make(request id)`` gives its frames. A replica that connected anew gets the
        whole range first."""
        self.drain()
        live = self._connect()
        if self._fresh:
            self.commit([])
            live = self._connect()
        if not live:
            return
        rid = self._next_id
        self._next_id += 1
        frames = make(rid)
        live = self._send(live, frames)
        self.copies_sent += 1
        self.copy_bytes_sent += frames_nbytes(frames) * len(live)
        self._await(rid, live, frames)

    def _send(self, live: list[int], frames: list[Any]) -> list[int]:
        """Queue a copy to each of ``live``; returns those it was queued to. One whose queue stays full past
        ``send_timeout`` (or whose connection failed) is dropped as one that never answers is."""
        sent = []
        for j in live:
            try:
                self._dealers[j].send(frames, self._timeout)
            except PsrtError as exc:
                log.error("range %d's copy could not be sent to shard %d (%s); going on without it", self.range, j,
                          exc)
                self._drop(j)
                continue
            sent.append(j)
        return sent

    def _reply(self, j: int, ch: Any) -> Any:
        """The next answer of replica ``j`` to a copy, read from its channel ``ch`` (readable); None: it was
        malformed, logged and dropped."""
        head = ch.recv_frame()
        more = ch.more()
        ch.discard_rest()
        try:
            if more:
                raise ProtocolError("a replica's reply is one frame")
            return messages.decode_replication_reply([head], self._limits)
        except ProtocolError as exc:
            log.error("shard %d sent a malformed reply to a copy: %s", j, exc)
            return None

    def _await(self, rid: int, live: list[int], frames: list[Any]) -> bool:
        """Wait until every one of ``live`` acknowledged copy ``rid`` (or is dropped); False: the job ended."""
        waiting = set(live)
        deadline = time.monotonic() + self._timeout
        while True:
            for j in list(waiting):
                if j not in self.live:  # the scheduler declared it dead meanwhile
                    waiting.discard(j)
                    continue
                ch = self._dealers[j]
                while ch.readable():
                    reply = self._reply(j, ch)
                    if reply is None:
                        continue
                    if reply.id != rid:
                        continue  # a late answer to a copy that was given up on
                    if isinstance(reply, messages.ReplicationError) and reply.code == "not_primary":
                        # It has not read the scheduler's word that this shard serves the range yet: again.
                        time.sleep(_POLL)
                        ch.send(frames, self._timeout)
                        break
                    waiting.discard(j)
                    if isinstance(reply, messages.ReplicationError):
                        log.error("shard %d refused range %d's copy: [%s] %s; it no longer holds a current copy",
                                  j, self.range, reply.code, reply.message)
                        self._drop(j)
                    else:
                        self._confirmed.add(j)
                    break
            if not waiting:
                return True
            if time.monotonic() > deadline:
                for j in waiting:
                    log.error("shard %d did not acknowledge range %d's copy within %gs and the scheduler did not "
                              "declare it dead; going on without it", j, self.range, self._timeout)
                    self._drop(j)
                return True
            if self.tick():  # heartbeats go on; a ranges notice may drop a dead replica from the wait
                return False  # the job ended or failed: nothing will be answered any more
            for j in waiting:
                if j in self._dealers:
                    self._dealers[j].poll(_POLL / max(1, len(waiting)))

    def _drop(self, j: int) -> None:
        self._dropped.add(j)
        self._confirmed.discard(j)
        ch = self._dealers.pop(j, None)
        if ch is not None:
            ch.close()

    def _settled(self, store: Store, runs: dict[tuple[int, int], list[list[int]]]
                 ) -> tuple[list[tuple[int, int, int]], dict[int, list[list[int]]]]:
        """Per worker ``(worker, session, seq)``: its pushes below the first still in an open round (below none: all
        of them) are settled, except its replay holes among them (:mod:`psrt.shard.replay`), given per worker that
        has any. ``runs`` gets each window's holes as runs by ``(last_seq, holes)``, which the keys whose round just
        completed hold (:meth:`joined`): the settled ones are those runs, cut at ``seq``."""
        out, holes = [], {}
        for worker, wlog in store.workers.items():
            if self._sessions.get(worker) != wlog.session:
                self._new_session(worker, wlog.session)
            opened = self._open.get(worker)
            seq, below = wlog.settled(min(opened.values()) if opened else None)
            out.append((worker, wlog.session, seq))
            if below:
                every = runs[(wlog.last_seq, wlog.holes)] = wlog.hole_runs()
                holes[worker] = [[first, min(count, seq - first + 1)] for first, count in every if first <= seq]
        return out, holes

    def _release_acks(self) -> None:
        entries, still = self.server.store.entries, []
        for ack in self._acks:
            if all(entries[k].version >= t for k, t in zip(ack.keys, ack.want)):
                self.server.replies.reply(ack.identity, wire.encode_ack(ack.request_id, ack.want, ack.duplicate))
            else:
                still.append(ack)
        self._acks = still

    def close(self) -> None:
        """Close the sockets to the replicas (from the thread that used them, or once it ended)."""
        for ch in self._dealers.values():
            ch.close()
        self._dealers.clear()

    def stats(self) -> dict[str, Any]:
        """The range's copy counters, for :meth:`Server.stats`."""
        return {"copies_sent": self.copies_sent, "copy_bytes_sent": self.copy_bytes_sent,
                "copied_to": ",".join(map(str, self._dealers))}


class Replication:
    """One shard's replication: its replication socket and standbys (bound now), and, once :meth:`start` has the
    job's table, its copies to its replicas (a :class:`Copier`) and from its primaries.

    Parameters
    ----------
    server : ShardLike
        The shard (its store, configuration and answers).
    replicas : int
        R, from the scheduler.
    make_standby : callable
        Makes the standby server of one backed range, bound to the endpoint it is given.
    """

    def __init__(self, server: ShardLike, replicas: int, make_standby: Callable[[str], ShardLike]) -> None:
        self.server = server
        self.replicas = replicas
        config = server.config
        self._limits = config.limits
        keys = peer_keys(config.keys)
        self._keys = keys
        self._ctx = transport.new_context()
        self._standbys: list[ShardLike] = []
        try:
            self._router = transport.RouterChannel(self._ctx, sibling_endpoint(server.endpoint, "replication"),
                                                   config.hwm, config.send_timeout, keys=keys,
                                                   max_frame=config.limits.max_frame_bytes)
            for i in range(1, replicas + 1):
                self._standbys.append(make_standby(sibling_endpoint(server.endpoint, f"standby-{i}")))
        except BaseException:
            self.close()
            raise
        #: What the shard announces when it registers: its replication endpoint, then each standby's.
        self.endpoints: tuple[str, ...] = (self._router.endpoint, *[s.endpoint for s in self._standbys])
        self.rank = -1
        self.token = ""
        #: Per range, its live holders (the one serving it first), as the scheduler said last.
        self.holders: tuple[tuple[int, ...], ...] = ()
        self.backed: tuple[int, ...] = ()
        #: This shard's own range's copies (made by :meth:`start`).
        self.copier: Optional[Copier] = None
        self._copiers: dict[int, Copier] = {}  # ranges taken over: their standbys' copiers
        #: Per backed range: per key, what its copied state holds of each worker's pushes beyond the settled ones
        #: (:data:`Held`, holes as runs), with the sessions they are of (its copy's ``workers``, shared by its keys).
        self._included: dict[int, dict[Key, tuple[dict[int, int], dict[int, Held]]]] = {}
        #: Backed ranges no full copy has come for yet (a shard that joined a running job): never taken over.
        self._unsynced: set[int] = set()
        self._endpoints: tuple[tuple[str, ...], ...] = ()
        self._promote: set[int] = set()
        self._promoted: set[int] = set()
        self._serving: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        #: Called while a copy of this shard's own range waits (its heartbeat and the scheduler's notices); True:
        #: the job ended or failed.
        self.tick: Callable[[], bool] = lambda: False
        self.copies_taken = self.copies_refused = 0
        #: Bytes of the copies taken (their frames: headers and tensors).
        self.copy_bytes_taken = 0
        #: Set when this shard cannot go on (promoted for a range it does not hold): its serving loop raises it.
        self.failure: Optional[PsrtError] = None

    # ------------------------------------------------------------------ set-up
    def start(self, table: wire.Table) -> None:
        """Adopt the job's table (rank, W, mode, the holders and endpoints), make this range's copier and start
        taking copies of the ranges this shard backs."""
        info = table.replication
        if info is None or info.replicas != self.replicas or len(info.endpoints) != table.num_servers:
            raise ProtocolError("the scheduler's table of a replicated job lacks its replication endpoints")
        self.rank, self.token, self.holders, self._endpoints = table.rank, info.token, info.holders, info.endpoints
        self.backed = backed_ranges(table.num_servers, self.replicas, self.rank)
        for standby in self._standbys:
            standby.set_job(table.num_workers, table.mode, table.staleness, table.backup_workers)
        self.copier = Copier(self.server, self._ctx, self._keys, self.rank, self.rank, self.token, self._endpoints,
                             lambda: self.tick())
        own = self.holders[self.rank]
        self.copier.live = own[1:] if own[:1] == (self.rank,) else ()
        # A shard that joined a running job (its own range served elsewhere) holds a range once a full copy came.
        self._unsynced = {k for k in self.backed if self.rank in self.holders[k]} if own[:1] != (self.rank,) \
            else set()
        self._thread = threading.Thread(target=self._serve_copies, name="psrt-replication", daemon=True)
        self._thread.start()
        log.info("shard %d: range copied to shards %s; backs ranges %s", self.rank, list(self.holders[self.rank][1:]),
                 list(self.backed))

    def close(self) -> None:
        """Stop the replication thread and every standby; close the sockets and the context."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        for standby in self._standbys:
            standby.stop()
        for thread in self._serving:
            thread.join(5.0)
        for standby in self._standbys:
            standby.close()  # (and a promoted one's copier)
        if self.copier is not None:
            self.copier.close()
        if getattr(self, "_router", None) is not None:
            self._router.close()
        self._ctx.term()

    # ------------------------------------------------------------------ the scheduler's word
    def on_ranges(self, notice: wire.Ranges) -> None:
        """A shard died: adopt the new holders; a backed range naming this shard first is taken over."""
        if len(notice.holders) != len(self.holders):
            log.warning("ignoring a ranges notice for %d ranges (the job has %d)", len(notice.holders),
                        len(self.holders))
            return
        self.holders = notice.holders
        if len(notice.endpoints) == len(self._endpoints):  # a shard in a dead one's place announced its own
            self._endpoints = notice.endpoints
            for copier in (self.copier, *self._copiers.values()):
                if copier is not None:
                    copier.endpoints = notice.endpoints
        if self.copier is not None and self.holders[self.rank][:1] == (self.rank,):
            self.copier.live = self.holders[self.rank][1:]
        with self._lock:
            for k, copier in self._copiers.items():
                copier.live = self.holders[k][1:] if self.holders[k][:1] == (self.rank,) else ()
            for k in self.backed:
                if self.holders[k][:1] == (self.rank,) and k not in self._promoted:
                    self._promote.add(k)  # the replication thread applies what is queued, then serves it

    def serving_ranges(self) -> list[int]:
        """The ranges this shard serves: its own, and those it took over."""
        return [self.rank, *sorted(self._promoted)]

    # ------------------------------------------------------------------ the server's hooks (its own range)
    def joined(self, worker: int, seq: int, keys: list[Key], completed: Sequence[int],
               late: Optional[Sequence[bool]] = None) -> None:
        """:meth:`Copier.joined` of this shard's own range."""
        assert self.copier is not None
        self.copier.joined(worker, seq, keys, completed, late)

    def hold_ack(self, identity: bytes, request_id: int, keys: list[Key], targets: list[int],
                 duplicate: bool) -> bool:
        """:meth:`Copier.hold_ack` of this shard's own range."""
        assert self.copier is not None
        return self.copier.hold_ack(identity, request_id, keys, targets, duplicate)

    def commit(self, keys: list[Key], settle: bool = False, pipelined: bool = False) -> None:
        """:meth:`Copier.commit` of this shard's own range."""
        assert self.copier is not None
        self.copier.commit(keys, settle, pipelined)

    def awaiting(self) -> list[Any]:
        """:meth:`Copier.awaiting` of this shard's own range."""
        return self.copier.awaiting() if self.copier is not None else []

    def poll(self) -> None:
        """:meth:`Copier.poll` of this shard's own range."""
        if self.copier is not None:
            self.copier.poll()

    def defer(self, keys: list[Key]) -> None:
        """:meth:`Copier.defer` of this shard's own range."""
        assert self.copier is not None
        self.copier.defer(keys)

    def flush(self) -> None:
        """:meth:`Copier.flush` of this shard's own range (a no-op before the job formed)."""
        if self.copier is not None:
            self.copier.flush()

    def settle(self) -> None:
        """:meth:`Copier.settle` of this shard's own range."""
        assert self.copier is not None
        self.copier.settle()

    def sync_newcomers(self) -> None:
        """:meth:`Copier.sync_newcomers` of this shard's own range (once it copies: the job has formed)."""
        if self.copier is not None:
            self.copier.sync_newcomers()

    # ------------------------------------------------------------------ replica side
    def _serve_copies(self) -> None:
        router = self._router
        while not self._stop.is_set():
            if router.poll(_POLL):
                while (msg := router.recv()) is not None:
                    self._take(*msg)
            if self._promote:
                while (msg := router.recv()) is not None:  # what the dead primary sent before it died, first
                    self._take(*msg)
                with self._lock:
                    promote, self._promote = sorted(self._promote), set()
                for k in promote:
                    self._take_over(k)

    def _take(self, identity: bytes, frames: list[Any]) -> None:
        if rowcopy.is_rows_copy(frames, self._limits):
            self._take_rows(identity, frames)
            return
        try:
            req = messages.decode_replicate(frames, self._limits)
        except ProtocolError as exc:
            self._refuse(identity, getattr(exc, "request_id", None) or 0, "protocol", str(exc))
            return
        why = self._refusal(req)
        if why is not None:
            self._refuse(identity, req.id, *why)
            return
        try:
            optimizers = [optim.from_wire(spec) for spec in req.optimizers]
        except ConfigError as exc:
            self._refuse(identity, req.id, "protocol", f"field 'optimizers': {exc}")
            return
        store = self._standbys[self.backed.index(req.range)].store
        problem = _check_copy(store, req, optimizers)
        if problem is not None:
            self._refuse(identity, req.id, "conflict", problem)
            return
        _apply_copy(store, req, optimizers)
        held = self._included.setdefault(req.range, {})
        sessions = {w: session for w, session, _ in req.workers}
        for meta, pushes, gaps in zip(req.tensors, req.included, req.included_holes or [{}] * len(req.tensors)):
            held[meta.key] = sessions, ({w: (q, gaps[w]) if w in gaps else q for w, q in pushes.items()} if gaps
                                        else pushes)
        if req.full and req.range in self._unsynced:
            self._unsynced.discard(req.range)
            log.warning("shard %d holds range %d now (a full copy from shard %d)", self.rank, req.range, req.sender)
        self.copies_taken += 1
        self.copy_bytes_taken += frames_nbytes(frames)
        try:
            self._router.send(identity, messages.encode_replicated(req.id))
        except transport.SendDropped:
            log.warning("the acknowledgement of range %d's copy could not be sent", req.range)

    def _take_rows(self, identity: bytes, frames: list[Any]) -> None:
        """A copy of one embedding table of a backed range (:mod:`psrt.shard.tablecopy`): checked as a dense copy
        is, then whole, before anything changes."""
        try:
            req = rowcopy.decode_replicate_rows(frames, self._limits)
        except ProtocolError as exc:
            self._refuse(identity, getattr(exc, "request_id", None) or 0, "protocol", str(exc))
            return
        why = self._refusal(req)
        if why is not None:
            self._refuse(identity, req.id, *why)
            return
        problem = tablecopy.take(self._standbys[self.backed.index(req.range)].tables, req)
        if problem is not None:
            self._refuse(identity, req.id, "conflict", problem)
            return
        self.copies_taken += 1
        self.copy_bytes_taken += frames_nbytes(frames)
        try:
            self._router.send(identity, messages.encode_replicated(req.id))
        except transport.SendDropped:
            log.warning("the acknowledgement of range %d's table copy could not be sent", req.range)

    def _refusal(self, req: messages.ReplicateRequest | rowcopy.RowsCopy) -> Optional[tuple[str, str]]:
        """Why a copy is not taken (None: it is): not the job's, not a range this shard backs, not from its
        current primary, or a range this shard serves itself now."""
        if not self.token or not hmac.compare_digest(req.token.encode(), self.token.encode()):
            return "not_job", "a copy without this job's replication token"
        if req.range not in self.backed:
            return "not_backed", f"shard {self.rank} holds no copy of range {req.range}"
        holders = self.holders[req.range] if req.range < len(self.holders) else ()
        if req.range in self._promoted or not holders or holders[0] != req.sender or req.sender == self.rank:
            return "not_primary", (f"shard {req.sender} is not range {req.range}'s primary (its holders are "
                                   f"{list(holders)})")
        return None

    def _refuse(self, identity: bytes, rid: int, code: str, message: str) -> None:
        self.copies_refused += 1
        log.warning("refused a replication message: [%s] %s", code, message)
        try:
            self._router.send(identity, messages.encode_replication_error(rid, code, message))
        except transport.SendDropped:
            pass

    def _take_over(self, k: int) -> None:
        if k in self._unsynced:  # serving what it does not hold would lose rounds silently: fail, loudly
            self._promoted.add(k)
            self.failure = PsrtError(f"shard {self.rank} was promoted for key range {k} before it received a full "
                                     "copy of it (it joined the job moments before); the range is lost")
            log.error("%s", self.failure)
            return
        standby = self._standbys[self.backed.index(k)]
        copier = Copier(standby, self._ctx, self._keys, self.rank, k, self.token, self._endpoints, lambda: False)
        with self._lock:
            self._promoted.add(k)
            copier.live = self.holders[k][1:] if self.holders[k][:1] == (self.rank,) else ()
            self._copiers[k] = copier
        held = self._included.pop(k, {})
        copier.adopt(held)
        standby.adopt_copier(copier, held)
        standby.take_rank(k)
        versions = [e.version for e in standby.store.entries.values()]
        log.warning("shard %d takes key range %d over at %s (%d keys, versions %s..%s; copied on to shards %s)",
                    self.rank, k, standby.endpoint, len(versions), min(versions, default=0),
                    max(versions, default=0), list(copier.live))

        def serve() -> None:
            copier.catch_up()  # the remaining replicas first get this whole range as it is now
            standby.serve()

        thread = threading.Thread(target=serve, name=f"psrt-range-{k}", daemon=True)
        thread.start()
        self._serving.append(thread)

    def checkpoint_at_exit(self) -> None:
        """At a clean shutdown: stop the ranges this shard took over, then write their final checkpoints."""
        promoted = [self._standbys[self.backed.index(k)] for k in sorted(self._promoted)]
        for standby in promoted:
            standby.stop()
        for thread in self._serving:
            thread.join(5.0)
        for standby in promoted:
            standby.checkpoint_at_exit()

    def stats(self) -> dict[str, Any]:
        """The replication counters and what this shard holds, for :meth:`Server.stats`."""
        own = self.copier.stats() if self.copier is not None else {}
        return {"replicas": self.replicas, **own, "copies_taken": self.copies_taken,
                "copy_bytes_taken": self.copy_bytes_taken,
                "copies_refused": self.copies_refused, "serving_ranges": ",".join(map(str, self.serving_ranges())),
                "backed_ranges": ",".join(str(k) for k in self.backed if k not in self._promoted)}


#: Most keys, and bytes of parameters and slots, one copy carries (a whole range goes in several): well inside the
#: replicas' decode limits (:class:`~psrt.config.WireLimits`: 1 MiB headers, 65,536 tensors).
COPY_KEYS = 1024
COPY_BYTES = 256 << 20


def _batches(keys: list[Key], store: Store) -> list[list[Key]]:
    """``keys`` in groups of at most :data:`COPY_KEYS` keys and about :data:`COPY_BYTES` bytes (a larger key alone)."""
    out: list[list[Key]] = [[]]
    size = 0
    for key in keys:
        entry = store.entries[key]
        nbytes = entry.param.nbytes * (1 + len(entry.slots))
        if out[-1] and (len(out[-1]) >= COPY_KEYS or size + nbytes > COPY_BYTES):
            out.append([])
            size = 0
        out[-1].append(key)
        size += nbytes
    return out


def _held_now(wlog: WorkerLog) -> Held:
    """What a key whose round just completed holds of a worker of it: its replay window now (:meth:`Copier.joined`)."""
    return (wlog.last_seq, wlog.holes) if wlog.holes else wlog.last_seq


def _union(a: Optional[Held], b: Held) -> Held:
    """What a key holds of a worker's pushes when it holds ``a`` and ``b`` (:data:`Held`, holes as bitmaps): each
    push either holds; ``a`` None: ``b``. (A key's own rounds give it its worker's window as it grows, which holds
    every earlier one: the union is the newer; what a range taken over was copied can hold more.)"""
    if a is None:
        return b
    if type(a) is int and type(b) is int:
        return a if a > b else b
    (la, ha), (lb, hb) = (a if type(a) is tuple else (a, 0)), (b if type(b) is tuple else (b, 0))
    if la < lb:
        (la, ha), (lb, hb) = (lb, hb), (la, ha)
    d = la - lb  # b holds none of lb + 1 .. la: holes, shifted in below b's
    hb = ((hb << d) | ((1 << d) - 1)) & _FULL if d < REPLAY_WINDOW else _FULL
    holes = ha & hb
    return (la, holes) if holes else la


def _held_runs(included: dict[int, Held], cache: dict[tuple[int, int], list[list[int]]]) -> dict[int, Held]:
    """``included`` (:attr:`Copier._holds`'s) for the wire: holes as runs (made once per window per copy)."""
    if all(type(h) is int for h in included.values()):  # in order: as it is
        return included
    out: dict[int, Held] = {}
    for w, held in included.items():
        if type(held) is int:
            out[w] = held
            continue
        runs = cache.get(held)
        if runs is None:
            runs = cache[held] = WorkerLog(0, *held).hole_runs()
        out[w] = (held[0], runs)
    return out


def holds(held: Optional[Held], seq: int) -> bool:
    """Whether a key whose copied state holds ``held`` of a worker's pushes (:data:`Held`; None: nothing beyond
    the settled ones) holds that worker's push ``seq``, which touches it."""
    if held is None:
        return False
    if type(held) is int:
        return held >= seq
    last, runs = held
    return last >= seq and not any(first <= seq < first + count for first, count in runs)


def replayed(included: dict[Key, tuple[dict[int, int], dict[int, Held]]], worker: int, session: int, seq: int,
             keys: Sequence[Key]) -> set[int]:
    """A range taken over: the indices of ``keys`` whose state already holds push ``seq`` of ``worker``'s
    ``session`` (its copy said so: :func:`holds`), though the push as a whole was not settled (another of its keys'
    rounds was still open). Exact in any order of arrival: a key may hold a later push of the worker and not this
    one; and a worker that restarted (another session) has none held."""
    out = set()
    for i, key in enumerate(keys):
        held = included.get(key)
        if held is not None and held[0].get(worker) == session and holds(held[1].get(worker), seq):
            out.add(i)
    return out


def apply_except(store: Store, worker: int, entries: list[Any], grads: list[np.ndarray], skip: set[int],
                 hold: bool = False, late: Optional[Sequence[bool]] = None) -> tuple[list[int], list[int]]:
    """:meth:`Store.apply_push` of the keys not in ``skip``; a skipped key's target is its version now (it holds
    the push already). ``late`` (backup workers): keys the push is dropped for, as ``apply_push`` takes it.
    Returns the targets and completed indices of every key, as ``apply_push`` does."""
    keep = [i for i in range(len(entries)) if i not in skip]
    targets = [e.version for e in entries]
    part_targets, part_done = store.apply_push(worker, [entries[i] for i in keep], [grads[i] for i in keep], hold,
                                               None if late is None else [late[i] for i in keep])
    for i, t in zip(keep, part_targets):
        targets[i] = t
    return targets, [keep[j] for j in part_done]


def _check_copy(store: Store, req: messages.ReplicateRequest, optimizers: list[optim.Optimizer]) -> Optional[str]:
    """What makes a copy inapplicable to ``store`` (None: nothing): every check before anything changes."""
    for meta, opt, names in zip(req.tensors, req.opt, req.slots):
        entry = store.entries.get(meta.key)
        optimizer = optimizers[opt]
        if set(names) != set(optimizer.slots):
            return f"tensor {meta.name!r} part {meta.part}: slots {list(names)} are not {optimizer.name}'s"
        if entry is not None and (entry.param.dtype != meta.dtype or entry.param.size != meta.count
                                  or entry.optimizer != optimizer):
            return f"tensor {meta.name!r} part {meta.part} is held with another dtype, size or optimizer"
    return None


def _apply_copy(store: Store, req: messages.ReplicateRequest, optimizers: list[optim.Optimizer]) -> None:
    clocks = req.clocks or [{} for _ in req.tensors]
    for meta, version, opt, names, arrays, clock in zip(req.tensors, req.versions, req.opt, req.slots, req.arrays,
                                                        clocks):
        entry = store.entries.get(meta.key)
        if entry is None:
            entry = store.create(meta.key, arrays[0], optimizers[opt])
        else:
            np.copyto(entry.param.reshape(-1), arrays[0])
        for name, values in zip(names, arrays[1:]):
            np.copyto(entry.slots[name].reshape(-1), values)
        entry.version = version
        entry.clocks = dict(clock)
    for worker, session, seq in req.workers:
        store.workers[worker] = WorkerLog.restored(session, seq, req.holes.get(worker))
