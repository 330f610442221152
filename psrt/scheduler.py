"""The control plane: rendezvous, node table, barriers and the end of a job. No tensor bytes pass through here.

Servers and workers register with the scheduler in any order. When all S servers and W workers are in, every
one of them gets the node table: its rank, W, S, the mode, and the shard endpoints in shard order (which fixes
the shard map every worker computes). If the job does not form before the start deadline, every process still
waiting gets an error naming who is missing, and the scheduler exits non-zero: no silent hang at start-up.

Workers call ``barrier`` (all W must arrive before any is released, within the deadline, else the error names
the missing ranks) and ``done`` when they finish; once all W are done the scheduler tells the servers to shut
down and exits.

Liveness: once the job has formed, every server and worker heartbeats (:mod:`psrt.link`). A process silent for
``heartbeat_timeout`` seconds (dead, stopped, or cut off) is named in an ``abort`` notice to every other process,
whose waits then raise :class:`~psrt.errors.PeerFailedError`, and the scheduler exits non-zero.

Elastic jobs (``elastic=True``): a worker that dies or says ``done`` leaves the job instead, and a worker may
register after the job formed (a free rank, or the rank of one that left). Every change is sent to the servers
as a ``members`` notice with a new epoch; a joining worker gets its table only once every server's heartbeat
confirms that epoch, so its first push finds it a member everywhere. The job ends when its last worker leaves
with ``done``. The semantics are written out in docs/elastic.md.

Control messages are single header frames with the data plane's framing and decode rules; their records and
encoders live in :mod:`psrt.wire.control`, which lists every field.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from psrt import security, transport, wire
from psrt.config import MODES
from psrt.errors import ConfigError, ProtocolError
from psrt.link import SchedulerLink, Table

__all__ = ["Scheduler", "SchedulerLink", "Table"]

log = logging.getLogger("psrt.scheduler")

Peer = tuple[str, int]  # (role, rank)


@dataclass
class _Barrier:
    deadline: float
    arrived: dict[int, tuple[bytes, int]] = field(default_factory=dict)


@dataclass
class _Member:
    """A process the scheduler watches: where to send it notices, how to name it, and when it was last heard."""

    identity: bytes
    name: str
    last_seen: float
    restorable: bool = False


@dataclass(frozen=True)
class _Join:
    """A worker joining an elastic job: its table waits until every server has adopted ``epoch``."""

    identity: bytes
    rid: int
    rank: int
    epoch: int
    deadline: float


@dataclass(frozen=True)
class _Pending:
    """A registration waiting for the job to form."""

    identity: bytes
    request: wire.Register


class Scheduler:
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
    elastic : bool
        Let workers leave (by dying or ``done``) and join while the job runs, instead of failing the job.
    staleness : int
        ``ssp`` mode: how many pushes a worker may run ahead of the slowest, handed to the servers.
    restart_grace : float
        Seconds a server that writes checkpoints (``restorable``) may take to restart on its endpoint and take
        its slot back, before its death fails the job.
    keys : str or os.PathLike, optional
        The job's key directory: serve with CURVE, accepting only the job's client key. None: no security.

    Raises
    ------
    BindError
        When ``bind`` cannot be bound (e.g. the port is taken).
    ConfigError
        When ``keys`` names a missing or unusable key directory.
    """

    def __init__(self, bind: str, num_servers: int, num_workers: int, mode: str = "sync",
                 start_timeout: float = 120.0, heartbeat_timeout: float = 2.5, elastic: bool = False,
                 keys: Optional[security.PathLike] = None, restart_grace: float = 30.0, staleness: int = 0) -> None:
        if num_servers < 1 or num_workers < 1:
            raise ConfigError(f"need at least one server and one worker, got S={num_servers}, W={num_workers}")
        if mode not in MODES:
            raise ConfigError(f"mode must be 'sync', 'async' or 'ssp', got {mode!r}")
        self.num_servers, self.num_workers, self.mode = num_servers, num_workers, mode
        self.start_timeout = start_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.elastic = elastic
        self.restart_grace = restart_grace
        if type(staleness) is not int or staleness < 0:
            raise ConfigError(f"staleness must be a whole number of pushes >= 0, got {staleness!r}")
        self.staleness = staleness
        self._restarting: dict[int, tuple[float, str]] = {}  # server index -> (deadline, name)
        self._epoch = 0  # elastic: membership changes so far
        self._server_epochs: dict[int, int] = {}
        self._joins: list[_Join] = []
        self._emptied_at: Optional[float] = None  # elastic: when the last worker died (none left)
        job_keys = security.load_keys(keys, serve=True, connect=False)
        self._ctx = transport.new_context()
        try:
            self._chan = transport.RouterChannel(self._ctx, bind, hwm=10_000, send_timeout=5.0, keys=job_keys,
                                                 max_frame=wire.CONTROL_LIMITS.max_header_bytes)
        except BaseException:
            self._ctx.term()
            raise
        self.endpoint = self._chan.endpoint
        self._stop = threading.Event()
        self._pending: list[_Pending] = []  # registrations waiting for the table, in arrival order
        self.servers: list[tuple[bytes, str]] = []  # (identity, endpoint) in shard order, once formed
        self.workers: dict[int, bytes] = {}  # rank -> identity, once formed
        self._formed = False
        self._barriers: dict[str, _Barrier] = {}
        self._done: set[int] = set()
        self._members: dict[Peer, _Member] = {}  # watched once the job forms
        self.exit_code: Optional[int] = None

    def stop(self) -> None:
        """Ask :meth:`serve` to return."""
        self._stop.set()

    def serve(self) -> int:
        """Run until the job ends; returns 0 when every worker finished, 1 when the job failed to form."""
        deadline = time.monotonic() + self.start_timeout
        try:
            while not self._stop.is_set() and self.exit_code is None:
                if self._chan.poll(0.1):
                    for _ in range(256):
                        msg = self._chan.recv()
                        if msg is None:
                            break
                        self._handle(*msg)
                now = time.monotonic()
                if not self._formed and now > deadline:
                    self._fail_start()
                self._expire_barriers(now)
                self._watch(now)
                if self.elastic:
                    self._expire_joins(now)
            return self.exit_code if self.exit_code is not None else 0
        finally:
            # Give queued shutdown/error messages a moment to leave before the socket goes.
            self._chan.close(linger=1.0)
            self._ctx.term()

    # ------------------------------------------------------------------ handlers
    def _handle(self, identity: bytes, frames: list[Any]) -> None:
        try:
            req = wire.decode_control_request(frames)
        except ProtocolError as exc:
            rid = getattr(exc, "request_id", None)
            self._error(identity, rid if rid is not None else 0, "protocol", str(exc))
            return
        if isinstance(req, wire.Heartbeat):
            self._heartbeat(identity, req, frames[0])
        elif isinstance(req, wire.TableQuery):
            self._send_table(identity, req.id, -1)
        elif isinstance(req, wire.Register):
            self._register(identity, req)
        elif isinstance(req, wire.Barrier):
            self._barrier(identity, req)
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
            elif role == "server" and any(ep == req.endpoint for _, ep in self.servers):
                self._rejoin(identity, req)
            else:
                self._error(identity, req.id, "formed", f"the job has already formed with {self.num_servers} "
                                                        f"servers and {self.num_workers} workers; a new {role} "
                                                        "cannot join")
            return
        if role == "worker" and rank >= self.num_workers:
            self._error(identity, req.id, "rank", f"worker rank {rank} is out of range for {self.num_workers} "
                                                  "workers")
            return
        taken = {p.request.rank for p in self._pending if p.request.role == role and p.request.rank >= 0}
        if rank >= 0 and rank in taken:
            self._error(identity, req.id, "rank", f"{role} rank {rank} is already registered")
            return
        self._pending = [p for p in self._pending if p.identity != identity]  # a resend replaces the first
        self._pending.append(_Pending(identity, req))
        log.info("registered %s %s (%d/%d servers, %d/%d workers)", role, req.endpoint or req.host, *self._counts())
        n_servers, _, n_workers, _ = self._counts()
        if n_servers == self.num_servers and n_workers == self.num_workers:
            self._form()
        elif n_servers > self.num_servers or n_workers > self.num_workers:
            self._pending.pop()
            self._error(identity, req.id, "full", f"the job expects {self.num_servers} servers and "
                                                  f"{self.num_workers} workers; this {role} is one too many")

    def _registered(self, role: str) -> list[_Pending]:
        return [p for p in self._pending if p.request.role == role]

    def _counts(self) -> tuple[int, int, int, int]:
        return (len(self._registered("server")), self.num_servers, len(self._registered("worker")),
                self.num_workers)

    def _form(self) -> None:
        servers, workers = self._registered("server"), self._registered("worker")
        self.servers = [(p.identity, p.request.endpoint) for p in servers]
        free = iter(sorted(set(range(self.num_workers)) - {p.request.rank for p in workers if p.request.rank >= 0}))
        ranks = [p.request.rank if p.request.rank >= 0 else next(free) for p in workers]
        self.workers = {rank: p.identity for rank, p in zip(ranks, workers)}
        self._formed = True
        for index, p in enumerate(servers):
            self._send_table(p.identity, p.request.id, index)
        for rank, p in zip(ranks, workers):
            self._send_table(p.identity, p.request.id, rank)
        self._pending = []
        now = time.monotonic()
        for index, p in enumerate(servers):
            self._members[("server", index)] = _Member(p.identity, f"server {index} ({p.request.endpoint})", now,
                                                       p.request.restorable)
        for rank, p in zip(ranks, workers):
            where = p.request.host or "host unknown"
            self._members[("worker", rank)] = _Member(p.identity, f"worker {rank} ({where})", now)
        log.info("job formed: %d servers, %d workers", self.num_servers, self.num_workers)

    def _send_table(self, identity: bytes, rid: int, rank: int) -> None:
        workers = len(self.workers) if self.elastic and self._formed else self.num_workers
        self._send(identity, wire.encode_table(rid, rank, self.num_servers, workers, self.mode,
                                               [ep for _, ep in self.servers], self.elastic, self.staleness))

    def _fail_start(self) -> None:
        n_servers, _, n_workers, _ = self._counts()
        have_w = sorted(p.request.rank for p in self._registered("worker"))
        have_s = [p.request.endpoint for p in self._registered("server")]
        message = (f"the job did not form within {self.start_timeout:g}s: missing "
                   f"{self.num_servers - n_servers} of {self.num_servers} servers and "
                   f"{self.num_workers - n_workers} of {self.num_workers} workers "
                   f"(registered servers: {have_s or 'none'}; registered workers: {n_workers}"
                   f"{' with requested ranks ' + str([r for r in have_w if r >= 0]) if have_w else ''})")
        log.error(message)
        for p in self._pending:
            self._error(p.identity, p.request.id, "start_timeout", message)
        self._pending = []
        self.exit_code = 1

    def _barrier(self, identity: bytes, req: wire.Barrier) -> None:
        if not self._formed or req.rank not in self.workers:
            self._error(identity, req.id, "rank", f"barrier from rank {req.rank}, which is not a registered worker")
            return
        b = self._barriers.setdefault(req.name, _Barrier(time.monotonic() + self.start_timeout))
        b.arrived[req.rank] = (identity, req.id)
        self._release_barriers()

    def _release_barriers(self) -> None:
        for name, b in list(self._barriers.items()):
            if set(self.workers) <= set(b.arrived):
                for ident, r in b.arrived.values():
                    self._send(ident, wire.encode_ok(r))
                del self._barriers[name]

    def _expire_barriers(self, now: float) -> None:
        for name, b in list(self._barriers.items()):
            if now > b.deadline:
                missing = sorted(set(self.workers) - set(b.arrived))
                message = f"barrier {name!r} timed out after {self.start_timeout:g}s waiting for worker ranks {missing}"
                for ident, r in b.arrived.values():
                    self._error(ident, r, "barrier_timeout", message)
                del self._barriers[name]

    def _finish(self, identity: bytes, req: wire.Done) -> None:
        self._done.add(req.rank)
        self._members.pop(("worker", req.rank), None)  # a worker that is done may stop heartbeating
        self._send(identity, wire.encode_ok(req.id))
        if self.elastic and req.rank in self.workers:
            self._leave([req.rank], "said done")
        if self._formed and self._done >= set(self.workers) and not self._joins:
            for ident, _ in self.servers:
                self._send(ident, wire.encode_shutdown())
            log.info("all %d workers done; servers told to shut down", self.num_workers)
            self.exit_code = 0

    # ------------------------------------------------------------------ liveness
    def _heartbeat(self, identity: bytes, req: wire.Heartbeat, frame: Any) -> None:
        member = self._members.get((req.role, req.rank))
        if member is None:
            self._error(identity, req.id, "not_member", f"{req.role} {req.rank} is not a member of the job")
            return
        if member.identity != identity and req.role == "worker":
            # A worker heartbeats from its own socket: notices go there from now on, named by its address.
            member.identity = identity
            member.name = f"worker {req.rank} ({transport.peer_address(frame) or 'local'}, pid {req.pid})"
        member.last_seen = time.monotonic()
        self._send(identity, wire.encode_ok(req.id))
        if req.role == "server" and self._joins:
            self._server_epochs[req.rank] = req.epoch
            self._admit_joins()

    def _watch(self, now: float) -> None:
        if self.exit_code is not None:
            return
        dead = [(peer, m) for peer, m in self._members.items() if now - m.last_seen > self.heartbeat_timeout]
        for (role, index), m in [d for d in dead if d[1].restorable]:
            log.warning("%s stopped heartbeating; waiting up to %gs for it to restart from its checkpoint",
                        m.name, self.restart_grace)
            del self._members[(role, index)]
            self._restarting[index] = (now + self.restart_grace, m.name)
        dead = [d for d in dead if not d[1].restorable]
        late = [name for deadline, name in self._restarting.values() if now > deadline]
        if late:
            self._abort("; ".join(f"{name} stopped heartbeating and did not restart within {self.restart_grace:g}s"
                                  for name in late) + "; the job cannot go on")
            return
        if self.elastic and dead and all(role == "worker" for (role, _), _ in dead):
            for (_, rank), m in dead:
                log.warning("%s stopped heartbeating %.1fs ago; it leaves the job", m.name, now - m.last_seen)
                del self._members[("worker", rank)]
            self._leave([rank for (_, rank), _ in dead], "stopped heartbeating")
            if not self.workers:
                self._emptied_at = now
        elif dead:
            for peer, _ in dead:
                del self._members[peer]
            self._abort("; ".join(f"{m.name} stopped heartbeating {now - m.last_seen:.1f}s ago" for _, m in dead)
                        + "; the job cannot go on")
        elif self._emptied_at is not None and not self.workers and now - self._emptied_at > self.start_timeout:
            self._abort(f"every worker of the elastic job died and none joined within {self.start_timeout:g}s")

    def _abort(self, message: str) -> None:
        """End the job: every process still in it hears why, and the scheduler exits non-zero."""
        log.error(message)
        for m in self._members.values():
            self._send(m.identity, wire.encode_abort("peer_failed", message))
        for b in self._barriers.values():
            for ident, r in b.arrived.values():
                self._error(ident, r, "peer_failed", message)
        self._barriers.clear()
        self.exit_code = 1

    def _rejoin(self, identity: bytes, req: wire.Register) -> None:
        """A server restarted on its endpoint (from its checkpoint) takes its old slot back."""
        index = next(i for i, (_, ep) in enumerate(self.servers) if ep == req.endpoint)
        self.servers[index] = (identity, req.endpoint)
        self._restarting.pop(index, None)
        name = f"server {index} ({req.endpoint})"
        self._members[("server", index)] = _Member(identity, name, time.monotonic(), req.restorable)
        self._server_epochs.pop(index, None)
        log.warning("%s restarted and rejoined the job", name)
        self._send_table(identity, req.id, index)
        if self.elastic and self._epoch:
            self._send(identity, wire.encode_members(self._epoch, sorted(self.workers)))

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
        for ident, _ in self.servers:
            self._send(ident, wire.encode_members(self._epoch, sorted(self.workers)))

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
            self._members.pop(("worker", join.rank), None)
            self._leave([join.rank], "could not join")

    # ------------------------------------------------------------------ sending
    def _send(self, identity: bytes, frames: list[Any]) -> None:
        try:
            self._chan.send(identity, frames)
        except transport.SendDropped as exc:
            log.warning("control message to a departed peer dropped: %s", exc)

    def _error(self, identity: bytes, rid: int, code: str, message: str) -> None:
        self._send(identity, wire.encode_control_error(rid, code, message))
