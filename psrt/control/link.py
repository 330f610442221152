"""A server's or worker's side of the control plane: registration, barriers, and heartbeats to the scheduler.

:class:`SchedulerLink` registers a process and waits for the job's table, runs barriers, and says ``done``. Once
registered, a process heartbeats so the scheduler can tell within seconds when it dies or hangs, and it learns
in turn when the scheduler itself goes silent, or when the scheduler aborts the job because another process
died:

- A **server** heartbeats from its serving loop (:meth:`SchedulerLink.tick`), so a server that hangs stops
  heartbeating just as one that dies does.
- A **worker** heartbeats from a :class:`HeartbeatThread` with its own socket: the training loop may compute
  for minutes between calls into psrt. Its verdicts reach the training loop through :meth:`HeartbeatThread.check`,
  which every wait of the client calls; the new endpoints of shards that restarted elsewhere, through
  :attr:`HeartbeatThread.moves`.

A heartbeat is answered with ``ok``; no answer for ``heartbeat_timeout`` seconds means the scheduler is gone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Optional

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
        self._last_answer = time.monotonic()
        #: The newest membership of an elastic job this process has adopted.
        self.epoch = 0
        #: Called while a request waits; raises to end the wait (a worker passes :meth:`HeartbeatThread.check`).
        self.check: Callable[[], None] = lambda: None

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
                if forming is not None:
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
                 timeout: float = 130.0, restorable: bool = False, restore: bool = False) -> Table:
        """Register and wait until the job forms; returns this process's :class:`Table`.

        A server that writes checkpoints registers as ``restorable``; one that resumes from a checkpoint
        (``restore``, with the ``rank`` it belongs to) takes the slot of a dead server back in a running job.

        Raises
        ------
        ServerError
            When the scheduler refuses (the job did not form in time, the rank is taken, ...).
        PsrtTimeoutError
            When the scheduler does not answer within ``timeout`` seconds.
        """
        reply = self._ask("register", lambda rid: wire.encode_register(rid, role, endpoint, host, rank, restorable,
                                                                       restore), timeout)
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
             on_finished: Optional[Callable[[list[int]], None]] = None) -> bool:
        """A server's heartbeat, from its serving loop: send one when due and take in the scheduler's notices.

        Parameters
        ----------
        on_members : callable, optional
            Called with the worker ranks of an elastic job whenever they change; the next heartbeat (sent at
            once) tells the scheduler this server has adopted them.
        on_finished : callable, optional
            Called with the ranks of a fixed job's workers that said ``done`` while others go on.

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
        except (ProtocolError, ConnectionLostError) as exc:
            log.warning("ignoring a control message: %s", exc)
        if self.role and now >= self._next_beat:
            self._next_beat = now + self.heartbeat_interval
            try:
                self.channel.send(wire.encode_heartbeat(0, self.role, self.rank, os.getpid(), self.epoch), 1.0)
            except PsrtError:
                pass  # a full queue: the scheduler is not reading; its silence is judged below
        if self.role and now - self._last_answer > self.heartbeat_timeout:
            raise _silent(self.endpoint, now - self._last_answer)
        return False

    def close(self) -> None:
        """Close the socket."""
        self.channel.close()


class HeartbeatThread:
    """A worker's heartbeat to the scheduler: a daemon thread with its own socket.

    Started by :class:`psrt.Client` once it has registered (never at import). :meth:`check` raises the
    :class:`~psrt.errors.PeerFailedError` the thread learned of: the scheduler aborted the job because a peer
    died, or the scheduler itself went silent.

    Parameters
    ----------
    context : zmq.Context
        The ZeroMQ context (thread-safe; the socket is the thread's own).
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
        self._keys = security.load_keys(keys)  # here, not in the thread: a bad directory is the caller's error
        self.endpoint, self.rank = endpoint, rank
        self.interval, self.timeout = interval, timeout
        self.failure: Optional[PeerFailedError] = None
        #: Shards that came back on another endpoint (``moved`` notices): shard index -> endpoint, taken (popped)
        #: by the client's waits. Plain dict operations, atomic under the GIL.
        self.moves: dict[int, str] = {}
        self._ctx = context
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="psrt-heartbeat", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise the failure the heartbeat learned of, if any."""
        if self.failure is not None:
            # A fresh exception each time: raising one object again would add the later frames (close(), say) to
            # the traceback of the one the user is already being shown.
            raise PeerFailedError(str(self.failure), peer=self.failure.peer)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread (and close its socket)."""
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the thread still runs (it did not stop in time)."""
        return self._thread.is_alive()

    def _run(self) -> None:
        channel = transport.DealerChannel(self._ctx, self.endpoint, hwm=100, keys=self._keys,
                                          max_frame=wire.CONTROL_LIMITS.max_header_bytes)
        pid = os.getpid()
        last_answer = next_beat = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.interval
                    try:
                        channel.send(wire.encode_heartbeat(0, "worker", self.rank, pid), self.interval)
                    except PsrtError:
                        pass  # judged by the scheduler's silence below
                if channel.poll(max(0.0, min(next_beat - now, 0.1))):
                    while channel.readable():
                        notice = _recv(channel, self.endpoint)
                        last_answer = time.monotonic()
                        if isinstance(notice, wire.Abort):
                            self.failure = _aborted(self.endpoint, notice)
                            return
                        if isinstance(notice, wire.Moved):
                            self.moves[notice.shard] = notice.endpoint
                        elif isinstance(notice, wire.ControlError):
                            self.failure = PeerFailedError(f"the scheduler at {self.endpoint} no longer counts this "
                                                           f"worker in the job: {notice.message}",
                                                           peer=f"worker {self.rank}")
                            return
                silence = time.monotonic() - last_answer
                if silence > self.timeout:
                    self.failure = _silent(self.endpoint, silence)
                    return
        except PsrtError as exc:  # a malformed message from the scheduler: say so where the user will look
            self.failure = PeerFailedError(f"heartbeat to the scheduler at {self.endpoint} failed: {exc}")
        finally:
            channel.close()


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
