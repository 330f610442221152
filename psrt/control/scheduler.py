"""The control plane: rendezvous, node table, barriers and the end of a job. No tensor bytes pass through here.

Servers and workers register with the scheduler in any order. When all S servers and W workers are in, every
one of them gets the node table: its rank, W, S, the mode, and the shard endpoints in shard order (which fixes
the shard map every worker computes). If the job does not form before the start deadline, every process still
waiting gets an error naming who is missing, and the scheduler exits non-zero: no silent hang at start-up.

Workers call ``barrier`` (all W must arrive before any is released, within the deadline, else the error names
the missing ranks) and ``done`` when they finish; once all W are done the scheduler tells the servers to shut
down and exits.

Liveness: once the job has formed, every server and worker heartbeats (:mod:`psrt.control.link`). A process silent for
``heartbeat_timeout`` seconds (dead, stopped, or cut off) is named in an ``abort`` notice to every other process,
whose waits then raise :class:`~psrt.errors.PeerFailedError`, and the scheduler exits non-zero.
The workers of one process beat together, one ``beats`` message per interval naming their ranks, so a thousand
workers in four processes cost the scheduler four messages per interval; each rank's silence is still judged on
its own. The scheduler judges silence only once it has read every message waiting for it: a heartbeat it has
not yet read because it was itself starved of CPU is no silence.

A process that dies is named sooner: its kernel closes its connections at once, and the scheduler watches its own
socket's. When the connection a member heartbeats on closes while it was beating on time, the member is dead
once silent for two heartbeat intervals (or twice its latest gap between beats, when that is longer; never
longer than ``heartbeat_timeout``) unless it heartbeats again, over the connection its socket makes anew. A
process that is alive but slow, or stopped, keeps its connections open and is judged by ``heartbeat_timeout``
alone; a live one whose connection dropped connects anew and heartbeats at once (:mod:`psrt.control.link`), and
is not touched. A notice its old connection could not take (``members``, ``finished``, ``ranges``, ``moved``,
``shutdown``) is kept and sent after that heartbeat, in order; at the end of a job that succeeded, the scheduler
serves on (at most ``heartbeat_timeout``) until every server that missed its shutdown has it. A ``moved`` notice
goes once per worker process (its workers share one heartbeat socket) and is kept for one of them; if that one
is done or gone first, it waits with another worker of the same socket.

Elastic jobs (``elastic=True``): a worker that dies or says ``done`` leaves the job instead, and a worker may
register after the job formed (a free rank, or the rank of one that left). Every change is sent to the servers
as a ``members`` notice with a new epoch; a joining worker gets its table only once every server's heartbeat
confirms that epoch, so its first push finds it a member everywhere. The job ends when its last worker leaves
with ``done``. The semantics are written out in docs/elastic.md.

A replicated job (``replicas`` R > 0, :mod:`psrt.control.placement`): a server that dies does not end the job while
another holds each of its key ranges: the first live replica of every range it served is promoted (a ``ranges``
notice to the servers), and the workers are told where each such range is served now (``moved``).

A server that writes checkpoints and dies is waited for: restarted with ``--restore`` on any endpoint, it takes
its rank's slot back and the workers are told where it is now (:mod:`psrt.control.restarts`).

Who is slow: a server's heartbeat now and then says which workers it finds far later than the others; the
scheduler logs those slow on every shard every ``slow_every`` rounds and at the job's end (:mod:`psrt.control.slow`).

Control messages are single header frames with the data plane's framing and decode rules; their records and
encoders live in :mod:`psrt.wire.control`, which lists every field.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from psrt import transport, wire
from psrt.config import (
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    MODES,
    RESTART_GRACE,
    SLOW_EVERY,
    START_TIMEOUT,
    check_backup_workers,
)
from psrt.control import security
from psrt.control.barriers import Barriers
from psrt.control.formation import Formation
from psrt.control.link import SchedulerLink, Table
from psrt.control.placement import Placement, check_job_replicas
from psrt.control.restarts import Member as _Member
from psrt.control.restarts import Restarts
from psrt.control.slow import SlowWorkers
from psrt.errors import ConfigError, ProtocolError

__all__ = ["Scheduler", "SchedulerLink", "Table"]

log = logging.getLogger("psrt.scheduler")

Peer = tuple[str, int]  # (role, rank)


@dataclass(frozen=True)
class _Join:
    """A worker joining an elastic job: its table waits until every server has adopted ``epoch``."""

    identity: bytes
    rid: int
    rank: int
    epoch: int
    deadline: float


#: Seconds between the scheduler's looks at every member's last heartbeat (a silent one is named at most this late).
WATCH_EVERY = 0.1


def _ranges(ranks: list[int], most: int = 32) -> str:
    """Ranks as ranges, ``0-30, 92, 95-99``; past ``most`` ranges, how many more."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:most])
    return text + (f" and {sum(b - a + 1 for a, b in runs[most:])} more" if len(runs) > most else "")


#: What the scheduler adds to a silence when the member's connection closed too: it says why it was named early.
_CLOSED = "its connection to the scheduler closed"


def _silence(m: _Member, now: float) -> str:
    """``stopped heartbeating 1.0s ago``, and whether its connection closed (a process that ended)."""
    return f"stopped heartbeating {now - m.last_seen:.1f}s ago" + (f", {_CLOSED}" if m.closed_at is not None else "")


def _silence_report(dead: list[tuple[tuple[str, int], _Member]], now: float) -> str:
    """Who stopped heartbeating: each by name when few, else the servers by name and the workers as rank ranges (a
    thousand names in one line would say less)."""
    if len(dead) <= 8:
        return "; ".join(f"{m.name} {_silence(m, now)}" for _, m in dead)
    parts = [f"{m.name} {_silence(m, now)}" for (role, _), m in dead if role == "server"]
    workers = [(rank, m) for (role, rank), m in dead if role == "worker"]
    if workers:
        quiet = [now - m.last_seen for _, m in workers]
        closed = sum(m.closed_at is not None for _, m in workers)
        parts.append(f"{len(workers)} workers ({_ranges([r for r, _ in workers])}) stopped heartbeating "
                     f"{min(quiet):.1f}-{max(quiet):.1f}s ago" +
                     (f", the connections of {closed} of them to the scheduler closed" if closed else ""))
    return "; ".join(parts)


class Scheduler(Restarts):
    """The job's scheduler, bound to ``bind``.

    Parameters
    ----------
    bind : str
        Endpoint to bind (``tcp://HOST:*`` picks a free port; see :attr:`endpoint`).
    num_servers, num_workers : int
        S and W: the job forms when all have registered.
    mode : str
        ``"sync"``, ``"async"`` or ``"ssp"``, handed to the servers in the table.
    start_timeout : float
        Seconds from start for everyone to register, and for each barrier to fill.
    heartbeat_timeout : float
        Seconds of silence after which a registered process is taken for dead.
    heartbeat_interval : float
        Seconds between the members' heartbeats (the job's ``PSRT_HEARTBEAT_INTERVAL``): a member whose connection
        closed is dead once silent for two of them (see the module's docstring).
    elastic : bool
        Let workers leave (by dying or ``done``) and join while the job runs, instead of failing the job.
    staleness : int
        ``ssp`` mode: how many pushes a worker may run ahead of the slowest, handed to the servers.
    backup_workers : int or "auto"
        Sync mode: backup workers b (``0 <= b < num_workers``), handed to the servers: a round closes on the first
        W - b pushes; ``"auto"``: each shard picks b from how late the workers' pushes come.
    restart_grace : float
        Seconds a server that writes checkpoints (``restorable``) may take to restart (on any endpoint) and take
        its slot back, before its death fails the job (:mod:`psrt.control.restarts`).
    keys : str or os.PathLike, optional
        The job's key directory: serve with CURVE, accepting only the job's client key. None: no security.
    replicas : int
        Copies of each shard's key range on the next R shards of the ring (sync mode; 0 <= R < S): a dead shard's
        ranges are promoted to their first live replicas instead of ending the job.
    slow_every : int
        Rounds of the job between two log lines naming the workers slow on every shard (and one at the end).

    Raises
    ------
    BindError
        When ``bind`` cannot be bound (e.g. the port is taken).
    ConfigError
        When ``keys`` names a missing or unusable key directory.
    """

    def __init__(self, bind: str, num_servers: int, num_workers: int, mode: str = "sync",
                 start_timeout: float = START_TIMEOUT, heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
                 elastic: bool = False, keys: Optional[security.PathLike] = None,
                 restart_grace: float = RESTART_GRACE, staleness: int = 0, replicas: int = 0,
                 backup_workers: int | str = 0, heartbeat_interval: float = HEARTBEAT_INTERVAL,
                 slow_every: int = SLOW_EVERY) -> None:
        if num_servers < 1 or num_workers < 1:
            raise ConfigError(f"need at least one server and one worker, got S={num_servers}, W={num_workers}")
        if mode not in MODES:
            raise ConfigError(f"mode must be 'sync', 'async' or 'ssp', got {mode!r}")
        check_job_replicas(replicas, num_servers, mode, elastic, backup_workers)
        self.replicas = replicas
        #: A replicated job: each range's live holders; the token its servers' replication messages carry.
        self._placement = Placement(num_servers, replicas) if replicas else None
        self._token = secrets.token_hex(16) if replicas else ""
        self._own_endpoints: list[str] = []  # each server's endpoint as it registered (its own range's)
        self.num_servers, self.num_workers, self.mode = num_servers, num_workers, mode
        self.start_timeout = start_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.heartbeat_interval = heartbeat_interval
        self.elastic = elastic
        self.restart_grace = restart_grace
        if type(staleness) is not int or staleness < 0:
            raise ConfigError(f"staleness must be a whole number of pushes >= 0, got {staleness!r}")
        self.staleness = staleness
        check_backup_workers(backup_workers, num_workers, mode)
        self.backup_workers = backup_workers
        if type(slow_every) is not int or slow_every < 1:
            raise ConfigError(f"slow_every must be a whole number of rounds >= 1, got {slow_every!r} (PSRT_SLOW_EVERY)")
        self._slow = SlowWorkers(slow_every)  # the servers' word on who is slow
        self._restarting: dict[int, tuple[float, str]] = {}  # server index -> (deadline, name)
        self._claims = []  # restarted servers waiting for their slot (psrt.control.restarts)
        self._epoch = 0  # elastic: membership changes so far
        self._server_epochs: dict[int, int] = {}
        self._joins: list[_Join] = []
        self._emptied_at: Optional[float] = None  # elastic: when the last worker died (none left)
        job_keys = security.load_keys(keys, serve=True, connect=False)
        self._ctx = transport.new_context()
        try:
            self._chan = transport.RouterChannel(self._ctx, bind, hwm=10_000, send_timeout=5.0, keys=job_keys,
                                                 max_frame=wire.CONTROL_LIMITS.max_header_bytes,
                                                 watch_connections=True)
        except BaseException:
            self._ctx.term()
            raise
        self.endpoint = self._chan.endpoint
        self._stop = threading.Event()
        self._forming = Formation(num_servers, num_workers, time.monotonic())  # registrations, until it forms
        self.servers: list[tuple[bytes, str]] = []  # (identity, endpoint) in shard order, once formed
        self._cut: Optional[str] = None  # the job's tensor cut, once formed (see _form)
        self.workers: dict[int, bytes] = {}  # rank -> identity, once formed
        self._formed = False
        self._barriers = Barriers(start_timeout)
        #: News of a worker's end, held back a moment (see _hold).
        self._news: list[tuple[float, Callable[[], None]]] = []
        self._done: set[int] = set()
        self._members: dict[Peer, _Member] = {}  # watched once the job forms
        #: The connection (its descriptor) each peer socket's messages come in on, and the sockets on each.
        self._conn: dict[bytes, int] = {}
        self._on_conn: dict[int, set[bytes]] = {}
        self._next_watch = 0.0
        self.exit_code: Optional[int] = None
        self._drain_until: Optional[float] = None  # at the job's end, while notices wait for heartbeats
        self._holding = False  # some member may hold a notice it missed (a hint: a heartbeat then looks)

    def stop(self) -> None:
        """Ask :meth:`serve` to return."""
        self._stop.set()

    def serve(self) -> int:
        """Run until the job ends; returns 0 when every worker finished, 1 when the job failed to form."""
        deadline = time.monotonic() + self.start_timeout
        try:
            while not self._stop.is_set() and (self.exit_code is None or self._delivering()):
                caught_up = True
                closed: list[int] = []
                if self._chan.poll(0.1):
                    # The closes before the messages: a dead process's last heartbeat, still queued behind its
                    # connection's close, is read before the close counts, so it cannot clear it.
                    closed = self._chan.closed()
                    for _ in range(4096):
                        msg = self._chan.recv()
                        if msg is None:
                            break
                        self._handle(*msg)
                    else:
                        caught_up = False  # more waiting: read on before judging anyone silent
                now = time.monotonic()
                if closed:
                    self._closed(closed, now)
                if not self._formed:
                    self._report_forming(now)
                if not self._formed and now > deadline:
                    self._fail_start()
                for (ident, r), message in self._barriers.expire(now, self.workers.keys()):
                    self._error(ident, r, "barrier_timeout", message)
                while self._news and self._news[0][0] <= now:
                    self._news.pop(0)[1]()
                # A heartbeat still queued here is no silence (a starved scheduler reads late); and the watch looks
                # at every member, so it runs a few times per interval, not after every message.
                if caught_up and now >= self._next_watch:
                    self._next_watch = now + WATCH_EVERY
                    self._watch(now)
                if self._claims:
                    self._place_claims(now)
                if self.elastic:
                    self._expire_joins(now)
            return self.exit_code if self.exit_code is not None else 0
        finally:
            self._refuse_claims("the job has ended")
            # Give queued shutdown/error messages a moment to leave before the socket goes.
            self._chan.close(linger=1.0)
            self._ctx.term()

    # ------------------------------------------------------------------ handlers
    def _handle(self, identity: bytes, frames: list[Any]) -> None:
        fd = self._chan.source
        if fd >= 0 and self._conn.get(identity) != fd:
            self._conn[identity] = fd
            self._on_conn.setdefault(fd, set()).add(identity)
        try:
            req = wire.decode_control_request(frames)
        except ProtocolError as exc:
            data_rid = wire.data_request_id(frames, wire.CONTROL_LIMITS)
            if data_rid is not None:  # a client was given this address as a shard's: say so, in its own protocol
                self._send(identity, wire.encode_error(data_rid, "not_a_shard", (
                    f"{self.endpoint} is a psrt scheduler, not a shard server: pass it as scheduler= (or "
                    "PSRT_SCHEDULER), or list the endpoints of `psrt server` processes in servers=[...]")))
                return
            rid = getattr(exc, "request_id", None)
            self._error(identity, rid if rid is not None else 0, "protocol", str(exc))
            return
        if isinstance(req, wire.Beats):
            self._beats(identity, req, frames[0])
        elif isinstance(req, wire.Heartbeat):
            self._heartbeat(identity, req, frames[0])
        elif isinstance(req, wire.TableQuery):
            self._send_table(identity, req.id, -1)
        elif isinstance(req, wire.Register):
            self._register(identity, req)
        elif isinstance(req, wire.Barrier):
            self._barrier(identity, req)
        elif isinstance(req, wire.Failed):
            self._failed(identity, req)
        else:
            self._finish(identity, req)

    def _register(self, identity: bytes, req: wire.Register) -> None:
        role, rank = req.role, req.rank
        if self._formed:
            # A restarted worker re-registering under its rank gets the table again.
            if role == "worker" and rank in self.workers:
                self.workers[rank] = identity
                self._send_table(identity, req.id, rank)
            elif role == "worker" and self.elastic:
                self._join(identity, req)
            elif role == "server" and req.restore:
                self._claim(identity, req)
            elif role == "server" and self._placement is not None and req.replication:
                self._rejoin_replica(identity, req)
            else:
                self._error(identity, req.id, "formed", f"the job has already formed with {self.num_servers} "
                                                        f"servers and {self.num_workers} workers; a new {role} "
                                                        "cannot join")
            return
        refused = self._forming.add(identity, req)
        if refused is not None:
            self._error(identity, req.id, *refused)
            return
        # Each at debug level (a thousand workers make a thousand lines); the progress is logged every few seconds.
        log.debug("registered %s %s (%d/%d servers, %d/%d workers)", role, req.endpoint or req.host,
                  *self._forming.counts())
        if self._forming.complete:
            self._form()
        else:  # taken at once: the process waits knowing the job is forming, not wondering whether anyone listens
            self._send(identity, wire.encode_forming(req.id, *self._forming.counts()))

    def _report_forming(self, now: float) -> None:
        """While the job forms, tell every waiting process how far it got."""
        if self._forming.report_due(now):
            counts = self._forming.counts()
            log.info("job forming: %d of %d servers and %d of %d workers registered", *counts)
            for p in self._forming.pending:
                self._send(p.identity, wire.encode_forming(p.request.id, *counts))

    def _form(self) -> None:
        servers, workers = self._forming.servers(), self._forming.ranks()
        self.servers = [(p.identity, p.request.endpoint) for p in servers]
        self.workers = {rank: p.identity for rank, p in workers}
        self._formed = True
        self._own_endpoints = [p.request.endpoint for p in servers]
        # How every worker cuts tensors, decided once from the endpoints the job formed with (as a client without a
        # scheduler decides from its own list): a worker that joins after a shard moved elsewhere cuts them as the
        # first workers did, so the keys it pushes are the ones the shards hold.
        self._cut = "host" if all(map(transport.on_this_host, self._own_endpoints)) else "network"
        if self._placement is not None:
            self._placement.endpoints = [list(p.request.replication) for p in servers]
        for index, p in enumerate(servers):
            self._send_table(p.identity, p.request.id, index, server=True)
        for rank, p in workers:
            self._send_table(p.identity, p.request.id, rank)
        self._forming.clear()
        now = time.monotonic()
        for index, p in enumerate(servers):
            self._members[("server", index)] = _Member(p.identity, f"server {index} ({p.request.endpoint})", now,
                                                       p.request.restorable)
        for rank, p in workers:
            where = p.request.host or "host unknown"
            self._members[("worker", rank)] = _Member(p.identity, f"worker {rank} ({where})", now)
        log.info("job formed: %d servers, %d workers", self.num_servers, self.num_workers)

    def _send_table(self, identity: bytes, rid: int, rank: int, server: bool = False) -> None:
        workers = len(self.workers) if self.elastic and self._formed else self.num_workers
        replication = None
        if self._placement is not None:  # the token goes to the job's servers alone
            placement = self._placement
            replication = wire.Replication(self.replicas, tuple(map(tuple, placement.holders)),
                                           tuple(map(tuple, placement.endpoints)) if self._formed else (),
                                           self._token if server else "")
        self._send(identity, wire.encode_table(rid, rank, self.num_servers, workers, self.mode,
                                               [ep for _, ep in self.servers], self.elastic, self.staleness,
                                               replication, self.backup_workers, self._cut))

    def _fail_start(self) -> None:
        message = self._forming.missing(self.start_timeout)
        log.error(message)
        for p in self._forming.pending:
            self._error(p.identity, p.request.id, "start_timeout", message)
        self._forming.clear()
        self.exit_code = 1

    def _barrier(self, identity: bytes, req: wire.Barrier) -> None:
        if not self._formed or req.rank not in self.workers:
            self._error(identity, req.id, "rank", f"barrier from rank {req.rank}, which is not a registered worker")
            return
        self._barriers.arrive(req.name, req.rank, (identity, req.id), time.monotonic())
        self._release_barriers()

    def _release_barriers(self) -> None:
        for ident, r in self._barriers.release(self.workers.keys()):
            self._send(ident, wire.encode_ok(r))

    def _finish(self, identity: bytes, req: wire.Done) -> None:
        self._done.add(req.rank)
        member = self._forget(("worker", req.rank))  # a worker that is done may stop heartbeating
        if member is not None:
            self._slow.names[req.rank] = member.name
        self._send(identity, wire.encode_ok(req.id))
        if self.elastic and req.rank in self.workers:
            self._leave([req.rank], "said done")
        if self._formed and self._done >= set(self.workers) and not self._joins:
            self._tell_servers(wire.encode_shutdown())
            log.info("all %d workers done; servers told to shut down", self.num_workers)
            self._log_slow(final=True)
            self.exit_code = 0
        elif self._formed and not self.elastic and req.rank in self.workers:
            # The others go on; a sync round that needs a finished worker can never complete: the servers say so.
            finished = wire.encode_finished(sorted(self._done & set(self.workers)))
            self._hold(lambda: self._tell_servers(finished))

    def _tell_servers(self, frames: list[Any]) -> None:
        # Once each: a shard may serve several ranges, and one that rejoined a replicated job serves none.
        members = {m.identity: m for (role, _), m in self._members.items() if role == "server"}
        idents = {ident: None for ident, _ in self.servers}
        idents.update(dict.fromkeys(members))
        for ident in idents:
            member = members.get(ident)
            if member is not None:
                self._notify(member, frames)
            else:
                self._send(ident, frames)

    def _notify(self, member: _Member, frames: list[Any]) -> None:
        """Send a notice to a member; one its connection cannot take now (it closed as the notice went, its socket
        connecting anew) is kept and sent after the member's next heartbeat (:meth:`_deliver`), which comes over
        the new connection. A shard that missed the news of a dead replica, or of the job's end, would otherwise
        wait for ever."""
        try:
            self._chan.send(member.identity, frames)
        except transport.SendDropped as exc:
            member.undelivered.append(frames)
            self._holding = True
            log.info("a notice to %s waits for its next heartbeat (%s)", member.name, exc)

    def _deliver(self, member: _Member) -> None:
        """Send a member the notices it missed, in order (after the answer to its heartbeat)."""
        held, member.undelivered = member.undelivered, []
        for frames in held:
            self._notify(member, frames)

    def _forget(self, peer: Peer) -> Optional[_Member]:
        """Take a member out of the job. The notices kept for it wait on with another member of its socket, if
        any: a notice for every worker of a process is kept for one of them (:meth:`_fail_over`), and the others
        still need it once that one is done or gone."""
        member = self._members.pop(peer, None)
        if member is not None and member.undelivered:
            heir = next((m for m in self._members.values() if m.identity == member.identity), None)
            if heir is not None:
                heir.undelivered += member.undelivered
            member.undelivered = []
        return member

    def _delivering(self) -> bool:
        """At the job's end: whether to serve on for a while, because notices (a shutdown) wait for members'
        heartbeats; at most one heartbeat timeout."""
        if self.exit_code != 0 or not any(m.undelivered for m in self._members.values()):
            return False  # (a failed job ends at once: its processes learn it from the scheduler's silence too)
        now = time.monotonic()
        if self._drain_until is None:
            self._drain_until = now + self.heartbeat_timeout
            log.info("the job has ended; serving on up to %gs for the members that missed a notice",
                     self.heartbeat_timeout)
        return now < self._drain_until

    def _rejoin_replica(self, identity: bytes, req: wire.Register) -> None:
        """A replicated job: a server started after a shard died takes that rank's place as a replica of the ranges
        it backs; each range's primary copies it the whole range before anything else (so it is promoted, last of
        the range's holders, only once it holds the range)."""
        placement = self._placement
        assert placement is not None
        free = [j for j in range(self.num_servers) if ("server", j) not in self._members
                and j not in self._restarting and (req.rank < 0 or j == req.rank)]
        if not free or len(req.replication) != self.replicas + 1:
            why = ("no server of the job died: there is no place to take" if not free else
                   f"it announced {len(req.replication)} replication endpoints, the job's R = {self.replicas} "
                   f"needs {self.replicas + 1}")
            self._error(identity, req.id, "formed", f"the job has already formed; {why}")
            return
        rank = free[0]
        backs = placement.rejoin(rank, list(req.replication))
        self._members[("server", rank)] = _Member(identity, f"server {rank} ({req.endpoint})", time.monotonic())
        log.warning("server %d (%s) joined the job again as a replica of key ranges %s", rank, req.endpoint, backs)
        self._send_table(identity, req.id, rank, server=True)
        self._tell_servers(wire.encode_ranges(placement.holders, placement.endpoints))

    def _hold(self, deliver: Callable[[], None]) -> None:
        """Deliver the news of a worker's end in a second: by then its process is gone, so a launcher sees it end
        before the others that the news ends, and reports its exit code, not theirs."""
        self._news.append((time.monotonic() + 1.0, deliver))

    def _failed(self, identity: bytes, req: wire.Failed) -> None:
        """A worker's program raised: the job fails at once, naming it (an elastic job goes on without it)."""
        self._send(identity, wire.encode_ok(req.id))
        member = self._forget(("worker", req.rank))
        if member is None or self.exit_code is not None:
            return  # not a member (any more): nothing waits on it
        if not self.elastic:
            message = f"{member.name} failed: {req.message}; the job cannot go on"
            self._hold(lambda: self._abort(message) if self.exit_code is None else None)
            return
        log.warning("%s failed (%s); it leaves the job", member.name, req.message)
        self._leave([req.rank], "failed")
        if not self.workers:
            self._emptied_at = time.monotonic()

    # ------------------------------------------------------------------ liveness
    def _heartbeat(self, identity: bytes, req: wire.Heartbeat, frame: Any) -> None:
        member = self._members.get((req.role, req.rank))
        if member is None and req.role == "worker" and req.rank in self._done:
            return  # the last beat of a worker that said done, sent as it closed: nothing to answer
        if member is None:
            self._error(identity, req.id, "not_member", f"{req.role} {req.rank} is not a member of the job")
            return
        if member.identity != identity and req.role == "worker":
            # A worker heartbeats from its own socket: notices go there from now on, named by its address.
            member.identity = identity
            member.name = f"worker {req.rank} ({transport.peer_address(frame) or 'local'}, pid {req.pid})"
        elif member.identity != identity:
            # A server's socket connected anew (its connection dropped): its notices follow it.
            self.servers = [(identity if ident == member.identity else ident, ep) for ident, ep in self.servers]
            member.identity = identity
        self._seen(member, time.monotonic())
        self._send(identity, wire.encode_ok(req.id), beat=True)
        if member.undelivered:
            self._deliver(member)
        if req.role == "server" and req.lateness is not None and self._slow.add(req.rank, req.lateness):
            self._log_slow()
        if req.role == "server" and self._joins:
            self._server_epochs[req.rank] = req.epoch
            self._admit_joins()

    def _log_slow(self, final: bool = False) -> None:
        """Log the workers slow on every shard (every ``slow_every`` rounds, and at the job's end), if any."""
        for (role, rank), member in self._members.items():
            if role == "worker":
                self._slow.names[rank] = member.name
        line = self._slow.line(final)
        if line is not None:
            log.warning("%s", line)

    def _beats(self, identity: bytes, req: wire.Beats, frame: Any) -> None:
        """The heartbeat of a process's workers, all in one message."""
        now = time.monotonic()
        strangers = []
        address = None
        for rank in req.ranks:
            member = self._members.get(("worker", rank))
            if member is None:
                if rank not in self._done:  # the last beat of a worker that said done needs no answer
                    strangers.append(rank)
                continue
            if member.identity != identity:
                # Notices go to the heartbeat's socket from now on, and the member is named by its address.
                if address is None:
                    address = transport.peer_address(frame) or "local"
                member.identity = identity
                member.name = f"worker {rank} ({address}, pid {req.pid})"
            self._seen(member, now)
        self._send(identity, wire.encode_ok(req.id), beat=True)
        if self._holding:  # (rare: a beat naming a thousand workers is not looked through for nothing)
            for rank in req.ranks:
                member = self._members.get(("worker", rank))
                if member is not None and member.undelivered:
                    self._deliver(member)
            self._holding = any(m.undelivered for m in self._members.values())
        if strangers:
            self._send(identity, wire.encode_not_members(req.id, strangers, (
                f"worker{'s' if len(strangers) > 1 else ''} {_ranges(strangers)} "
                f"{'are' if len(strangers) > 1 else 'is'} not a member of the job")))

    @staticmethod
    def _seen(member: _Member, now: float) -> None:
        """A member's heartbeat: it is alive, whether or not a connection of it closed."""
        member.gap = now - member.last_seen
        member.last_seen = now
        member.closed_at = None

    def _closed(self, fds: list[int], now: float) -> None:
        """Connections closed: the members whose notices go over them (a server's one socket; a worker's heartbeat
        socket, or before its first beat the one it registered on), if they were beating on time, are dead unless
        they heartbeat again soon (:meth:`_confirm`). A descriptor is reused by later connections, so a close only
        ever shortens the wait for a heartbeat: a member that beats again is untouched."""
        for fd in fds:
            gone = self._on_conn.pop(fd, set())
            for identity in gone:
                self._conn.pop(identity, None)
            hurried = [(peer, m) for peer, m in self._members.items() if m.identity in gone
                       # One silent for long before its connection closed (the transport dropped a connection its
                       # host left unacknowledged) is not hurried: its silence is judged by the heartbeat timeout alone.
                       and m.closed_at is None and now - m.last_seen <= self._confirm(m)] if gone else []
            for _, m in hurried:
                m.closed_at = now
            if hurried:
                # One line per connection: a process of a thousand workers heartbeats on one.
                (_, first), *_ = hurried
                workers = [rank for (role, rank), _ in hurried if role == "worker"]
                who = first.name if len(hurried) == 1 else f"workers {_ranges(workers)}"
                log.warning("%s: %s; taken for dead unless heard from within %.1fs", who, _CLOSED,
                            max(self._confirm(m) - (now - m.last_seen) for _, m in hurried))

    def _confirm(self, member: _Member) -> float:
        """How long a member whose connection closed may be silent (since its last heartbeat) before it is dead: two
        heartbeat intervals (a live process beats again over the connection its socket makes anew, at once and at
        the latest within one), or two of its own latest gaps between beats when it beats late; never longer than
        the heartbeat timeout."""
        return min(self.heartbeat_timeout, 2 * max(self.heartbeat_interval, member.gap))

    def _watch(self, now: float) -> None:
        if self.exit_code is not None:
            return
        dead = [(peer, m) for peer, m in self._members.items() if now - m.last_seen > self.heartbeat_timeout or
                (m.closed_at is not None and now - m.last_seen > self._confirm(m))]
        if self._placement is not None and any(role == "server" for (role, _), _ in dead):
            if not self._fail_over([d for d in dead if d[0][0] == "server"], now):
                return
            dead = [d for d in dead if d[0][0] != "server"]
        for (role, index), m in [d for d in dead if d[1].restorable]:
            log.warning("%s %s; waiting up to %gs for it to restart from its checkpoint",
                        m.name, _silence(m, now), self.restart_grace)
            self._forget((role, index))
            self._restarting[index] = (now + self.restart_grace, m.name)
        dead = [d for d in dead if not d[1].restorable]
        late = [name for deadline, name in self._restarting.values() if now > deadline]
        if late:
            self._abort("; ".join(f"{name} stopped heartbeating and did not restart within {self.restart_grace:g}s"
                                  for name in late) + "; the job cannot go on")
            return
        if self.elastic and dead and all(role == "worker" for (role, _), _ in dead):
            for (_, rank), m in dead:
                log.warning("%s %s; it leaves the job", m.name, _silence(m, now))
                self._forget(("worker", rank))
            self._leave([rank for (_, rank), _ in dead], "stopped heartbeating")
            if not self.workers:
                self._emptied_at = now
        elif dead:
            for peer, _ in dead:
                del self._members[peer]
            self._abort(_silence_report(dead, now) + "; the job cannot go on")
        elif self._emptied_at is not None and not self.workers and now - self._emptied_at > self.start_timeout:
            self._abort(f"every worker of the elastic job died and none joined within {self.start_timeout:g}s")

    def _fail_over(self, dead: list[tuple[Peer, _Member]], now: float) -> bool:
        """Replicated job: dead servers' ranges go to their first live replicas; False when a range lost every
        copy (the job is aborted, naming it).

        The servers hear the new holders (``ranges``) before the workers hear where the ranges went (``moved``):
        a promoted replica's standby socket holds what the workers send it until it serves.
        """
        placement = self._placement
        assert placement is not None
        moves = []
        for (_, index), member in dead:
            del self._members[("server", index)]
            promoted, lost = placement.lose(index)
            if lost:
                self._abort(f"{member.name} {_silence(member, now)} and no live "
                            f"shard holds key range{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} "
                            f"any more (--replicas {self.replicas}); the job cannot go on")
                return False
            for rng, primary in promoted:
                endpoint = placement.serving_endpoint(rng, self._own_endpoints)
                holder = self._members.get(("server", primary))
                if endpoint is None or holder is None:
                    self._abort(f"{member.name} stopped heartbeating and shard {primary}, which holds its range "
                                f"{rng}, announced no standby endpoint for it; the job cannot go on")
                    return False
                log.warning("%s %s: key range %d is served by its replica, server %d, at %s from now on",
                            member.name, _silence(member, now), rng, primary, endpoint)
                self.servers[rng] = (holder.identity, endpoint)
                moves.append((rng, endpoint))
        self._tell_servers(wire.encode_ranges(placement.holders, placement.endpoints))
        # Once per socket (a process's virtual workers share one), held for that member when it cannot take it.
        sockets = {m.identity: m for (role, _), m in self._members.items() if role == "worker"}
        for member in sockets.values():
            for rng, endpoint in moves:
                self._notify(member, wire.encode_moved(rng, endpoint, replica=True))
        return True

    def _abort(self, message: str) -> None:
        """End the job: every process still in it hears why, and the scheduler exits non-zero."""
        log.error(message)
        for ident in {m.identity: None for m in self._members.values()}:  # once per socket, in order
            self._send(ident, wire.encode_abort("peer_failed", message))
        for ident, r in self._barriers.clear():
            self._error(ident, r, "peer_failed", message)
        self._refuse_claims(message)
        self.exit_code = 1

    # ------------------------------------------------------------------ elastic membership
    def _join(self, identity: bytes, req: wire.Register) -> None:
        joining = {j.rank for j in self._joins}
        rank = req.rank
        if rank < 0:
            rank = next(r for r in range(len(self.workers) + len(joining) + 1)
                        if r not in self.workers and r not in joining)
        elif rank in joining:
            self._error(identity, req.id, "rank", f"worker rank {rank} is already joining")
            return
        now = time.monotonic()
        self.workers[rank] = identity
        self._done.discard(rank)
        self._emptied_at = None
        self._members[("worker", rank)] = _Member(identity, f"worker {rank} ({req.host or 'host unknown'})", now)
        self._broadcast_members(f"worker {rank} joins")
        self._joins.append(_Join(identity, req.id, rank, self._epoch, now + 10.0))
        self._admit_joins()

    def _leave(self, ranks: list[int], why: str) -> None:
        for rank in ranks:
            self.workers.pop(rank, None)
        self._broadcast_members(f"worker{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} {why}")
        self._release_barriers()

    def _broadcast_members(self, why: str) -> None:
        self._epoch += 1
        log.info("members, epoch %d (%s): workers %s", self._epoch, why, sorted(self.workers))
        self._tell_servers(wire.encode_members(self._epoch, sorted(self.workers)))

    def _admit_joins(self) -> None:
        confirmed = min((self._server_epochs.get(i, 0) for i in range(len(self.servers))), default=0)
        for join in [j for j in self._joins if j.epoch <= confirmed]:
            self._joins.remove(join)
            self._send_table(join.identity, join.rid, join.rank)

    def _expire_joins(self, now: float) -> None:
        for join in [j for j in self._joins if now > j.deadline]:
            self._joins.remove(join)
            self._error(join.identity, join.rid, "join_timeout", "the servers did not confirm this worker's joining "
                                                                 "within 10s")
            self._forget(("worker", join.rank))
            self._leave([join.rank], "could not join")

    # ------------------------------------------------------------------ sending
    def _send(self, identity: bytes, frames: list[Any], beat: bool = False) -> None:
        try:
            self._chan.send(identity, frames)
        except transport.SendDropped as exc:
            if beat:
                # The answer to a heartbeat whose connection closed as it came in (the member's socket connects
                # anew and beats again over the new one): nothing is lost, and a warning would cry wolf.
                log.debug("heartbeat answer to a closed connection dropped: %s", exc)
            else:
                log.warning("control message to a departed peer dropped: %s", exc)

    def _error(self, identity: bytes, rid: int, code: str, message: str) -> None:
        self._send(identity, wire.encode_control_error(rid, code, message))
