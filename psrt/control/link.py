"""A server's or worker's side of the control plane: registration, barriers, and heartbeats to the scheduler.

:class:`SchedulerLink` registers a process and waits for the job's table, runs barriers, and says ``done``. Once
registered, a process heartbeats so the scheduler can tell within seconds when it dies or hangs, and it learns
in turn when the scheduler itself goes silent, or when the scheduler aborts the job because another process
died:

- A **server** heartbeats from its serving loop (:meth:`SchedulerLink.tick`), so a server that hangs stops
  heartbeating just as one that dies does.
- A **worker** heartbeats from its process's heartbeat thread, with a socket of its own: the training loop may
  compute for minutes between calls into psrt. Every worker of the process shares that thread, which names them
  all in one ``beats`` message per interval (:class:`HeartbeatThread` is one worker's part in it). Its verdicts
  reach the training loop through :meth:`HeartbeatThread.check`, which every wait of the client calls; the new
  endpoints of shards that restarted elsewhere, through :attr:`HeartbeatThread.moves`.

A heartbeat is answered with ``ok``; no answer for ``heartbeat_timeout`` seconds means the scheduler is gone. A
socket that connects to the scheduler anew (its connection dropped) heartbeats at once: the scheduler saw the old
connection close, and takes a member whose connection closed for dead unless it hears from it within two intervals.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Optional, Sequence

from psrt import transport, wire
from psrt.config import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, WARN_AFTER
from psrt.control import security
from psrt.errors import (
    ConfigError,
    ConnectionLostError,
    PeerFailedError,
    ProtocolError,
    PsrtError,
    PsrtTimeoutError,
    ServerError,
)

__all__ = ["SchedulerLink", "HeartbeatThread", "Table", "join_as_worker"]

log = logging.getLogger("psrt.scheduler")

#: What the scheduler tells a registered process about the job (the decoded ``table`` reply).
Table = wire.Table


def _recv(channel: transport.DealerChannel, endpoint: str) -> wire.ControlReply:
    frame = channel.recv_frame()
    more = channel.more()
    channel.discard_rest()
    try:
        if more:
            raise ProtocolError("control messages are one frame")
        return wire.decode_control_reply([frame])
    except ProtocolError as exc:
        raise ProtocolError(f"the scheduler at {endpoint} sent a malformed message: {exc}") from None


#: When each kind of wait last warned in this process: a process of hundreds of workers that all wait for the same
#: thing (the job to form, a barrier) logs it once, not once per worker.
_warned: dict[str, float] = {}


def _first_word(wait: str, now: float, within: float) -> bool:
    """Whether a warning about ``wait`` is news: none was logged in this process for ``within`` seconds."""
    if now - _warned.get(wait, -within) < within:
        return False
    _warned[wait] = now  # a race between two threads costs at most one line more
    return True


def _silent(endpoint: str, seconds: float) -> PeerFailedError:
    return PeerFailedError(f"the scheduler at {endpoint} stopped answering heartbeats {seconds:.1f}s ago: it died, "
                           "or this process is cut off from it; this process cannot go on in the job",
                           peer=f"the scheduler at {endpoint}")


def _aborted(endpoint: str, notice: wire.Abort) -> PeerFailedError:
    return PeerFailedError(f"the job failed (scheduler {endpoint}): {notice.message}", peer=notice.message)


class SchedulerLink:
    """A server's or worker's connection to the scheduler.

    Parameters
    ----------
    context : zmq.Context
        The ZeroMQ context to open the DEALER socket in (:func:`psrt.transport.new_context`).
    endpoint : str
        The scheduler's endpoint.
    warn_after : float
        Seconds a request may go unanswered before a warning saying what is awaited, and where, is logged once.
    heartbeat_interval, heartbeat_timeout : float
        Seconds between a server's heartbeats (:meth:`tick`), and of silence after which the scheduler is
        taken for dead.
    keys : str or os.PathLike, optional
        The job's key directory: connect with CURVE. None: no security.

    Raises
    ------
    ConfigError
        When ``keys`` names a missing or unusable key directory.
    """

    def __init__(self, context: Any, endpoint: str, warn_after: float = WARN_AFTER,
                 heartbeat_interval: float = HEARTBEAT_INTERVAL, heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
                 keys: Optional[security.PathLike] = None) -> None:
        self.endpoint = endpoint
        self.channel = transport.DealerChannel(context, endpoint, hwm=1000, keys=security.load_keys(keys),
                                               max_frame=wire.CONTROL_LIMITS.max_header_bytes)
        self._next_id = 1
        self.rank = -1
        self.role = ""
        self.warn_after = warn_after
        self.heartbeat_interval, self.heartbeat_timeout = heartbeat_interval, heartbeat_timeout
        self._next_beat = 0.0
        self._connections = 0  # the channel's handshakes so far: one more is a new connection, to beat on at once
        self._last_answer = time.monotonic()
        #: The newest membership of an elastic job this process has adopted.
        self.epoch = 0
        #: Called while a request waits; raises to end the wait (a worker passes :meth:`HeartbeatThread.check`).
        self.check: Callable[[], None] = lambda: None
        #: A server's word on who is slow for its next heartbeat, when it has one (its serving loop sets it).
        self.report: Optional[Callable[[], Optional[wire.SlowReport]]] = None

    def _ask(self, op: str, encode: Any, timeout: float) -> wire.ControlReply:
        rid = self._next_id
        self._next_id += 1
        self.channel.send(encode(rid), timeout)
        start = time.monotonic()
        deadline = start + timeout
        warn_at = start + self.warn_after if self.warn_after < timeout else None
        forming: Optional[wire.Forming] = None  # the scheduler took a registration and the job is forming
        while True:
            self.check()
            now = time.monotonic()
            if warn_at is not None and now >= warn_at:
                warn_at = None  # once per request: one line says it all
                # Said once per process: its other workers (psrt worker --clients N) wait for the same thing.
                if not _first_word(f"{op} {self.endpoint}", now, self.warn_after):
                    pass
                elif forming is not None:
                    log.warning("job forming: %d of %d servers and %d of %d workers registered with the scheduler "
                                "at %s after %.0fs; waiting for the rest (start deadline %gs)", forming.servers,
                                forming.num_servers, forming.workers, forming.num_workers, self.endpoint,
                                now - start, timeout)
                else:
                    log.warning("still waiting for the scheduler at %s to answer %s after %.0fs (timeout %gs); "
                                "is a psrt scheduler running there, and is it reachable from this host?",
                                self.endpoint, op, now - start, timeout)
            remaining = deadline - now
            if remaining <= 0:
                raise PsrtTimeoutError(f"the scheduler at {self.endpoint} did not answer {op} within {timeout:g}s")
            # Short slices: a failure another thread learns of (check) ends the wait within a fraction of a second.
            wait = min(remaining, 0.25) if warn_at is None else min(remaining, warn_at - now, 0.25)
            if not self.channel.poll(wait):
                continue
            reply = _recv(self.channel, self.endpoint)
            if isinstance(reply, wire.Abort):
                raise _aborted(self.endpoint, reply)
            if reply.id != rid:
                continue  # a stale reply to an earlier, timed-out request (or an unprompted notice)
            if isinstance(reply, wire.Forming):
                forming = reply  # answered: the table follows once everyone is in
                continue
            if isinstance(reply, wire.ControlError):
                raise ServerError(f"scheduler {self.endpoint}: [{reply.code}] {reply.message}",
                                  shard=self.endpoint, code=reply.code)
            return reply

    def _expect(self, reply: wire.ControlReply, kind: type, op: str) -> Any:
        if not isinstance(reply, kind):
            raise ProtocolError(f"the scheduler at {self.endpoint} answered {op} with {reply.op!r}")
        return reply

    def register(self, role: str, endpoint: str = "", host: str = "", rank: int = -1,
                 timeout: float = 130.0, restorable: bool = False, restore: bool = False,
                 replication: Sequence[str] = ()) -> Table:
        """Register and wait until the job forms; returns this process's :class:`Table`.

        A server that writes checkpoints registers as ``restorable``; one that resumes from a checkpoint
        (``restore``, with the ``rank`` it belongs to) takes the slot of a dead server back in a running job.
        A server of a replicated job announces its ``replication`` endpoints (:mod:`psrt.control.placement`).

        Raises
        ------
        ServerError
            When the scheduler refuses (the job did not form in time, the rank is taken, ...).
        PsrtTimeoutError
            When the scheduler does not answer within ``timeout`` seconds.
        """
        reply = self._ask("register", lambda rid: wire.encode_register(rid, role, endpoint, host, rank, restorable,
                                                                       restore, replication), timeout)
        table: Table = self._expect(reply, wire.Table, "register")
        self.role, self.rank = role, table.rank
        self._last_answer = time.monotonic()
        return table

    def barrier(self, name: str, timeout: float) -> None:
        """Wait until every worker has reached the barrier ``name``."""
        self._expect(self._ask("barrier", lambda rid: wire.encode_barrier(rid, self.rank, name), timeout),
                     wire.Ok, "barrier")

    def done(self, timeout: float = 5.0) -> None:
        """Tell the scheduler this worker has finished."""
        self._expect(self._ask("done", lambda rid: wire.encode_done(rid, self.rank), timeout), wire.Ok, "done")

    def table(self, timeout: float = 5.0) -> Table:
        """The scheduler's current view of the job (for monitoring; does not register)."""
        return self._expect(self._ask("table", wire.encode_table_query, timeout), wire.Table, "table")

    def failed(self, message: str, timeout: float = 2.0) -> None:
        """Tell the scheduler this worker's program raised (``message``: what, in one line)."""
        self._expect(self._ask("failed", lambda rid: wire.encode_failed(rid, self.rank, message), timeout),
                     wire.Ok, "failed")

    def tick(self, on_members: Optional[Callable[[list[int]], None]] = None,
             on_finished: Optional[Callable[[list[int]], None]] = None,
             on_ranges: Optional[Callable[[wire.Ranges], None]] = None) -> bool:
        """A server's heartbeat, from its serving loop: send one when due and take in the scheduler's notices.

        Parameters
        ----------
        on_members : callable, optional
            Called with the worker ranks of an elastic job whenever they change; the next heartbeat (sent at
            once) tells the scheduler this server has adopted them.
        on_finished : callable, optional
            Called with the ranks of a fixed job's workers that said ``done`` while others go on.
        on_ranges : callable, optional
            A replicated job: called with the ``ranges`` notice when a shard died (who holds each range now).

        Returns
        -------
        bool
            True once the scheduler has said the job is over (every worker is done).

        Raises
        ------
        PeerFailedError
            When the scheduler aborted the job (naming the process that died), or stopped answering.
        """
        now = time.monotonic()
        try:
            while self.channel.poll(0):
                notice = _recv(self.channel, self.endpoint)
                self._last_answer = now
                if isinstance(notice, wire.Shutdown):
                    return True
                if isinstance(notice, wire.Abort):
                    raise _aborted(self.endpoint, notice)
                if isinstance(notice, wire.Members) and notice.epoch > self.epoch:
                    if on_members is not None:
                        on_members(notice.workers)
                    self.epoch = notice.epoch
                    self._next_beat = 0.0  # confirm at once: a joining worker waits for every server's word
                if isinstance(notice, wire.Finished) and on_finished is not None:
                    on_finished(notice.workers)
                if isinstance(notice, wire.Ranges) and on_ranges is not None:
                    on_ranges(notice)
        except (ProtocolError, ConnectionLostError) as exc:
            log.warning("ignoring a control message: %s", exc)
        if self.channel.connections != self._connections:
            self._connections = self.channel.connections
            self._next_beat = 0.0  # connected anew: the scheduler, which saw the old connection close, waits for word
        if self.role and now >= self._next_beat:
            self._next_beat = now + self.heartbeat_interval
            try:
                report = self.report() if self.report is not None else None
                self.channel.send(wire.encode_heartbeat(0, self.role, self.rank, os.getpid(), self.epoch, report),
                                  1.0)
            except PsrtError:
                pass  # a full queue: the scheduler is not reading; its silence is judged below
        if self.role and now - self._last_answer > self.heartbeat_timeout:
            raise _silent(self.endpoint, now - self._last_answer)
        return False

    def close(self) -> None:
        """Close the socket."""
        self.channel.close()


class HeartbeatThread:
    """A worker's heartbeat to the scheduler, sent by its process's heartbeat thread.

    Started by :class:`psrt.Client` once it has registered (never at import). Every worker of a process that beats
    to the same scheduler shares one daemon thread and one socket (:class:`_Beater`), which sends one ``beats``
    message per interval naming all of them: a process hosting hundreds of workers (``psrt worker --clients N``)
    costs the scheduler one message per interval, not hundreds, and runs one thread for them, not hundreds. Each
    worker is still its own peer: it beats until :meth:`stop`, and the scheduler judges each rank's silence on
    its own.

    :meth:`check` raises the :class:`~psrt.errors.PeerFailedError` the thread learned of: the scheduler aborted the
    job because a peer died, stopped counting this worker, or itself went silent.

    Parameters
    ----------
    context : zmq.Context
        Unused: the process's heartbeat thread runs in a context of its own, so that closing a client's context
        never waits for it. Kept so that callers need not change.
    endpoint : str
        The scheduler's endpoint.
    rank : int
        This worker's rank.
    interval, timeout : float
        Seconds between heartbeats, and of silence after which the scheduler is taken for dead.
    keys : str or os.PathLike, optional
        The job's key directory: connect with CURVE. None: no security.
    """

    def __init__(self, context: Any, endpoint: str, rank: int, interval: float = HEARTBEAT_INTERVAL,
                 timeout: float = HEARTBEAT_TIMEOUT, keys: Optional[security.PathLike] = None) -> None:
        job_keys = security.load_keys(keys)  # here, not in the thread: a bad directory is the caller's error
        self.endpoint, self.rank = endpoint, rank
        self.interval, self.timeout = interval, timeout
        self.failure: Optional[PeerFailedError] = None
        #: Shards that came back on another endpoint (``moved`` notices): shard index -> (endpoint, whether a
        #: replica took its range over), taken (popped) by the client's waits. Plain dict operations, atomic under
        #: the GIL.
        self.moves: dict[int, tuple[str, bool]] = {}
        self._beater = _Beater.join(self, endpoint, interval, timeout, job_keys)

    def check(self) -> None:
        """Raise the failure the heartbeat learned of, if any."""
        if self.failure is not None:
            # A fresh exception each time: raising one object again would add the later frames (close(), say) to
            # the traceback of the one the user is already being shown.
            raise PeerFailedError(str(self.failure), peer=self.failure.peer)

    def stop(self, timeout: float = 2.0, failure: Optional[str] = None) -> None:
        """Stop beating for this worker (the process's thread ends, closing its socket, with its last worker).

        ``failure``: this worker's program raised (one line saying how) in a job that cannot go on without it. The
        other workers of this process then fail at once, as the scheduler's abort would tell them a moment later,
        so that the process ends promptly with the first error rather than with the job's.
        """
        self._beater.leave(self, timeout, failure)

    @property
    def alive(self) -> bool:
        """Whether the heartbeat still runs for this worker (it did not stop in time)."""
        return self._beater.beats_for(self)


class _Beater:
    """One process's heartbeat thread and socket to one scheduler, beating for every worker that joined it."""

    _lock = threading.Lock()
    _running: dict[tuple[Any, ...], _Beater] = {}

    def __init__(self, key: tuple[Any, ...], endpoint: str, interval: float, timeout: float,
                 keys: Optional[security.JobKeys]) -> None:
        self._key, self.endpoint, self.interval, self.timeout, self._keys = key, endpoint, interval, timeout, keys
        self._members: dict[int, HeartbeatThread] = {}  # rank -> handle; changed under _lock
        self._joined = threading.Event()  # a new member: beat at once, so that it is seen as soon as it registered
        self._done = False  # set under _lock once the thread is ending: a later worker starts a fresh one
        self._ended: Optional[PeerFailedError] = None  # why the thread ended, for a worker that joined meanwhile
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="psrt-heartbeat", daemon=True)

    @classmethod
    def join(cls, handle: HeartbeatThread, endpoint: str, interval: float, timeout: float,
             keys: Optional[security.JobKeys]) -> _Beater:
        """The running beater for this scheduler (and keys, and timing), started if there is none, with ``handle``
        among its members."""
        key = (endpoint, None if keys is None else keys.client_public, interval, timeout, os.getpid())
        with cls._lock:
            beater = cls._running.get(key)
            if beater is None or beater._done:
                beater = cls._running[key] = _Beater(key, endpoint, interval, timeout, keys)
                beater._members[handle.rank] = handle
                beater._thread.start()
            else:
                beater._members[handle.rank] = handle
                beater._joined.set()
        return beater

    def leave(self, handle: HeartbeatThread, timeout: float, failure: Optional[str] = None) -> None:
        with self._lock:
            if self._members.get(handle.rank) is handle:
                del self._members[handle.rank]
            last = not self._members
            if failure is not None:
                for h in self._members.values():
                    if h.failure is None:
                        h.failure = PeerFailedError(f"worker {handle.rank} (in this process) failed: {failure}; the "
                                                    "job cannot go on", peer=f"worker {handle.rank}")
            if last:
                self._end()  # a worker that comes later starts a fresh thread
        if last:
            self._joined.set()  # wake the thread: it sees no members and ends
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)

    def _end(self) -> None:
        """Mark this beater as ending (under ``_lock``); a worker that joined since it failed shares its failure."""
        self._done = True
        if self._running.get(self._key) is self:
            del self._running[self._key]
        if self._ended is not None:
            for h in self._members.values():
                if h.failure is None:
                    h.failure = self._ended

    def beats_for(self, handle: HeartbeatThread) -> bool:
        return self._thread.is_alive() and self._members.get(handle.rank) is handle

    def _fail(self, failure: PeerFailedError, ranks: Optional[Sequence[int]] = None) -> None:
        with self._lock:
            if ranks is None:
                self._ended = failure
            handles = list(self._members.values()) if ranks is None else [
                self._members[r] for r in ranks if r in self._members]
        for h in handles:
            h.failure = failure if ranks is None else PeerFailedError(
                f"the scheduler at {self.endpoint} no longer counts worker {h.rank} in the job: {failure}",
                peer=f"worker {h.rank}")

    def _run(self) -> None:
        # A context of its own: the clients' contexts close with them, this socket lives as long as its last worker.
        context = transport.new_context()
        channel = transport.DealerChannel(context, self.endpoint, hwm=100, keys=self._keys,
                                          max_frame=wire.CONTROL_LIMITS.max_header_bytes)
        last_answer = next_beat = time.monotonic()
        connections = 0
        try:
            while True:
                with self._lock:
                    ranks = sorted(r for r, h in self._members.items() if h.failure is None)
                    if not self._members:
                        self._end()
                        return
                now = time.monotonic()
                if channel.connections != connections:  # connected anew: beat at once (see the module's docstring)
                    connections = channel.connections
                    next_beat = now
                if now >= next_beat or self._joined.is_set():
                    self._joined.clear()
                    next_beat = now + self.interval
                    for i in range(0, len(ranks), wire.MAX_BEAT_RANKS):
                        try:
                            channel.send(wire.encode_beats(0, ranks[i:i + wire.MAX_BEAT_RANKS], self._pid),
                                         self.interval)
                        except PsrtError:
                            pass  # judged by the scheduler's silence below
                if channel.poll(max(0.0, min(next_beat - now, 0.1))):
                    while channel.readable():
                        notice = _recv(channel, self.endpoint)
                        last_answer = time.monotonic()
                        if isinstance(notice, wire.Abort):
                            self._fail(_aborted(self.endpoint, notice))
                            return
                        if isinstance(notice, wire.Moved):
                            with self._lock:
                                handles = list(self._members.values())
                            for h in handles:
                                h.moves[notice.shard] = (notice.endpoint, notice.replica)
                        elif isinstance(notice, wire.NotMembers):
                            self._fail(PeerFailedError(notice.message), notice.workers)
                        elif isinstance(notice, wire.ControlError):
                            self._fail(PeerFailedError(f"the scheduler at {self.endpoint} refused this process's "
                                                       f"heartbeat: [{notice.code}] {notice.message}"))
                            return
                silence = time.monotonic() - last_answer
                if silence > self.timeout:
                    self._fail(_silent(self.endpoint, silence))
                    return
        except Exception as exc:  # noqa: BLE001 - a malformed message (or a bug): say so where the user will look
            self._fail(PeerFailedError(f"heartbeat to the scheduler at {self.endpoint} failed: "
                                       f"{type(exc).__name__}: {exc}"))
        finally:
            with self._lock:
                self._end()
            channel.close()
            context.term()


def join_as_worker(context: Any, scheduler: str, cluster: Any, rank: Optional[int], num_workers: Optional[int],
                   warn_after: float = WARN_AFTER, keys: Optional[security.PathLike] = None,
                   ) -> tuple[SchedulerLink, HeartbeatThread, Table]:
    """Register a worker with the scheduler (a requested ``rank``, or None), wait for the job to form, and start
    its heartbeat: from then on the scheduler watches it. Returns the link, the heartbeat and the job's table.

    ``cluster`` is the :class:`~psrt.config.ClusterConfig` (start deadline, heartbeat timing, node host).

    Raises
    ------
    ConfigError
        When ``num_workers`` is given and the job has another W.
    """
    link = SchedulerLink(context, scheduler, warn_after=warn_after, keys=keys)
    try:
        table = link.register("worker", host=cluster.node_host or "", rank=-1 if rank is None else rank,
                              timeout=cluster.start_timeout + 10.0)
        if num_workers is not None and num_workers != table.num_workers:
            raise ConfigError(f"num_workers={num_workers} but the scheduler's job has {table.num_workers}")
    except BaseException:
        link.close()
        raise
    heartbeat = HeartbeatThread(context, scheduler, table.rank, cluster.heartbeat_interval, cluster.heartbeat_timeout,
                          keys=keys)
    link.check = heartbeat.check
    return link, heartbeat, table
