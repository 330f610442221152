"""The control plane: rendezvous, node table, barriers and the end of a job. No tensor bytes pass through here.

Servers and workers register with the scheduler in any order. When all S servers and W workers are in, every
one of them gets the node table: its rank, W, S, the mode, and the shard endpoints in shard order (which fixes
the shard map every worker computes). If the job does not form before the start deadline, every process still
waiting gets an error naming who is missing, and the scheduler exits non-zero: no silent hang at start-up.

Workers call ``barrier`` (all W must arrive before any is released, within the deadline, else the error names
the missing ranks) and ``done`` when they finish; once all W are done the scheduler tells the servers to shut
down and exits.

Control messages are single msgpack frames with the data plane's framing rules (``v``, ``op``, ``id``; decoded
with the same limits). Requests: ``register {role, endpoint, host, rank}``, ``barrier {rank, name}``,
``done {rank}``, ``table {}``. Replies: ``table``, ``ok``, ``error {code, message}``; servers also receive an
unsolicited ``shutdown``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import zmq

from psrt import transport, wire
from psrt.config import MODES, WireLimits
from psrt.errors import ConfigError, ConnectionLostError, ProtocolError, PsrtTimeoutError, ServerError

__all__ = ["Scheduler", "SchedulerLink", "Table"]

log = logging.getLogger("psrt.scheduler")

_FIELDS = {
    "register": frozenset({"v", "op", "id", "role", "endpoint", "host", "rank"}),
    "barrier": frozenset({"v", "op", "id", "rank", "name"}),
    "done": frozenset({"v", "op", "id", "rank"}),
    "table": frozenset({"v", "op", "id"}),
}
_CONTROL_LIMITS = WireLimits(max_header_bytes=1 << 16, max_tensors=1 << 12)


@dataclass(frozen=True)
class Table:
    """What the scheduler tells each registered process about the job."""

    rank: int
    num_servers: int
    num_workers: int
    mode: str
    servers: list[str]


@dataclass
class _Barrier:
    deadline: float
    arrived: dict[int, tuple[bytes, int]] = field(default_factory=dict)


def _decode(frames: list[Any]) -> dict[str, Any]:
    if len(frames) != 1:
        raise ProtocolError(f"control messages are one frame, got {len(frames)}")
    header = wire.unpack_header(frames[0], _CONTROL_LIMITS)
    rid = header.get("id")
    wire.check_version(header)
    op = header.get("op")
    fields = _FIELDS.get(op) if type(op) is str else None
    if fields is None:
        raise ProtocolError(f"unknown control op {op!r}; known: {sorted(_FIELDS)}")
    if set(header) != fields:
        raise ProtocolError(f"control op {op!r}: expected fields {sorted(fields)}, got {sorted(header)}")
    if type(rid) is not int or rid < 0:
        raise ProtocolError("field 'id' must be a non-negative integer")
    if op == "register":
        if header["role"] not in ("server", "worker"):
            raise ProtocolError(f"role must be 'server' or 'worker', got {header['role']!r}")
        if type(header["endpoint"]) is not str or type(header["host"]) is not str:
            raise ProtocolError("endpoint and host must be strings")
        if header["role"] == "server" and "://" not in header["endpoint"]:
            raise ProtocolError(f"a server must announce an endpoint like tcp://HOST:PORT, got {header['endpoint']!r}")
    if op in ("register", "barrier", "done") and (type(header["rank"]) is not int or header["rank"] < -1):
        raise ProtocolError("field 'rank' must be an integer >= -1 (-1: let the scheduler assign one)")
    if op == "barrier" and (type(header["name"]) is not str or len(header["name"]) > 256):
        raise ProtocolError("barrier name must be a string of at most 256 characters")
    return header


class Scheduler:
    """The job's scheduler, bound to ``bind``.

    Parameters
    ----------
    bind : str
        Endpoint to bind (``tcp://HOST:*`` picks a free port; see :attr:`endpoint`).
    num_servers, num_workers : int
        S and W: the job forms when all have registered.
    mode : str
        ``"sync"`` or ``"async"``, handed to the servers in the table.
    start_timeout : float
        Seconds from start for everyone to register, and for each barrier to fill.
    """

    def __init__(self, bind: str, num_servers: int, num_workers: int, mode: str = "sync",
                 start_timeout: float = 120.0) -> None:
        if num_servers < 1 or num_workers < 1:
            raise ConfigError(f"need at least one server and one worker, got S={num_servers}, W={num_workers}")
        if mode not in MODES:
            raise ConfigError(f"mode must be 'sync' or 'async', got {mode!r}")
        self.num_servers, self.num_workers, self.mode = num_servers, num_workers, mode
        self.start_timeout = start_timeout
        self._ctx = transport.new_context()
        try:
            self._chan = transport.RouterChannel(self._ctx, bind, hwm=10_000, send_timeout=5.0)
        except BaseException:
            self._ctx.term()
            raise
        self.endpoint = self._chan.endpoint
        self._stop = threading.Event()
        # Registrations waiting for the table: (identity, request id, role, requested rank, endpoint, host).
        self._pending: list[tuple[bytes, int, str, int, str, str]] = []
        self.servers: list[tuple[bytes, str]] = []  # (identity, endpoint) in shard order, once formed
        self.workers: dict[int, bytes] = {}  # rank -> identity, once formed
        self._formed = False
        self._barriers: dict[str, _Barrier] = {}
        self._done: set[int] = set()
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
            return self.exit_code if self.exit_code is not None else 0
        finally:
            # Give queued shutdown/error messages a moment to leave before the socket goes.
            self._chan.sock.close(linger=1000)
            self._ctx.term()

    # ------------------------------------------------------------------ handlers
    def _handle(self, identity: bytes, frames: list[Any]) -> None:
        try:
            h = _decode(frames)
        except ProtocolError as exc:
            self._send(identity, {"op": "error", "id": 0, "code": "protocol", "message": str(exc)})
            return
        op, rid = h["op"], h["id"]
        if op == "table":
            self._send(identity, {"op": "table", "id": rid, **self._table_fields(-1)})
        elif op == "register":
            self._register(identity, rid, h)
        elif op == "barrier":
            self._barrier(identity, rid, h["rank"], h["name"])
        else:
            self._finish(identity, rid, h["rank"])

    def _register(self, identity: bytes, rid: int, h: dict[str, Any]) -> None:
        role, rank = h["role"], h["rank"]
        if self._formed:
            # A restarted worker re-registering under its rank gets the table again.
            if role == "worker" and rank in self.workers:
                self.workers[rank] = identity
                self._send(identity, {"op": "table", "id": rid, **self._table_fields(rank)})
            else:
                self._error(identity, rid, "formed", f"the job has already formed with {self.num_servers} servers "
                                                     f"and {self.num_workers} workers; a new {role} cannot join")
            return
        if role == "worker" and rank >= self.num_workers:
            self._error(identity, rid, "rank", f"worker rank {rank} is out of range for {self.num_workers} workers")
            return
        taken = {p[3] for p in self._pending if p[2] == role and p[3] >= 0}
        if rank >= 0 and rank in taken:
            self._error(identity, rid, "rank", f"{role} rank {rank} is already registered")
            return
        self._pending = [p for p in self._pending if p[0] != identity]  # a resend replaces the first
        self._pending.append((identity, rid, role, rank, h["endpoint"], h["host"]))
        log.info("registered %s %s (%d/%d servers, %d/%d workers)", role, h["endpoint"] or h["host"],
                 *self._counts())
        n_servers, _, n_workers, _ = self._counts()
        if n_servers == self.num_servers and n_workers == self.num_workers:
            self._form()
        elif n_servers > self.num_servers or n_workers > self.num_workers:
            self._pending.pop()
            self._error(identity, rid, "full", f"the job expects {self.num_servers} servers and {self.num_workers} "
                                               f"workers; this {role} is one too many")

    def _counts(self) -> tuple[int, int, int, int]:
        servers = sum(1 for p in self._pending if p[2] == "server")
        workers = sum(1 for p in self._pending if p[2] == "worker")
        return servers, self.num_servers, workers, self.num_workers

    def _form(self) -> None:
        servers = [p for p in self._pending if p[2] == "server"]
        workers = [p for p in self._pending if p[2] == "worker"]
        self.servers = [(p[0], p[4]) for p in servers]
        free = iter(sorted(set(range(self.num_workers)) - {p[3] for p in workers if p[3] >= 0}))
        ranks = [p[3] if p[3] >= 0 else next(free) for p in workers]
        self.workers = {rank: p[0] for rank, p in zip(ranks, workers)}
        self._formed = True
        for index, p in enumerate(servers):
            self._send(p[0], {"op": "table", "id": p[1], **self._table_fields(index)})
        for rank, p in zip(ranks, workers):
            self._send(p[0], {"op": "table", "id": p[1], **self._table_fields(rank)})
        self._pending = []
        log.info("job formed: %d servers, %d workers", self.num_servers, self.num_workers)

    def _table_fields(self, rank: int) -> dict[str, Any]:
        return {"rank": rank, "num_servers": self.num_servers, "num_workers": self.num_workers,
                "mode": self.mode, "servers": [ep for _, ep in self.servers]}

    def _fail_start(self) -> None:
        n_servers, _, n_workers, _ = self._counts()
        have_w = sorted(p[3] for p in self._pending if p[2] == "worker")
        have_s = [p[4] for p in self._pending if p[2] == "server"]
        message = (f"the job did not form within {self.start_timeout:g}s: missing "
                   f"{self.num_servers - n_servers} of {self.num_servers} servers and "
                   f"{self.num_workers - n_workers} of {self.num_workers} workers "
                   f"(registered servers: {have_s or 'none'}; registered workers: {n_workers}"
                   f"{' with requested ranks ' + str([r for r in have_w if r >= 0]) if have_w else ''})")
        log.error(message)
        for p in self._pending:
            self._error(p[0], p[1], "start_timeout", message)
        self._pending = []
        self.exit_code = 1

    def _barrier(self, identity: bytes, rid: int, rank: int, name: str) -> None:
        if not self._formed or rank not in self.workers:
            self._error(identity, rid, "rank", f"barrier from rank {rank}, which is not a registered worker")
            return
        b = self._barriers.setdefault(name, _Barrier(time.monotonic() + self.start_timeout))
        b.arrived[rank] = (identity, rid)
        if len(b.arrived) == self.num_workers:
            for ident, r in b.arrived.values():
                self._send(ident, {"op": "ok", "id": r})
            del self._barriers[name]

    def _expire_barriers(self, now: float) -> None:
        for name, b in list(self._barriers.items()):
            if now > b.deadline:
                missing = sorted(set(range(self.num_workers)) - set(b.arrived))
                message = f"barrier {name!r} timed out after {self.start_timeout:g}s waiting for worker ranks {missing}"
                for ident, r in b.arrived.values():
                    self._error(ident, r, "barrier_timeout", message)
                del self._barriers[name]

    def _finish(self, identity: bytes, rid: int, rank: int) -> None:
        self._done.add(rank)
        self._send(identity, {"op": "ok", "id": rid})
        if self._formed and self._done >= set(self.workers):
            for ident, _ in self.servers:
                self._send(ident, {"op": "shutdown", "id": 0})
            log.info("all %d workers done; servers told to shut down", self.num_workers)
            self.exit_code = 0

    # ------------------------------------------------------------------ sending
    def _send(self, identity: bytes, header: dict[str, Any]) -> None:
        try:
            self._chan.send(identity, wire.encode(header))
        except transport.SendDropped as exc:
            log.warning("control message to a departed peer dropped: %s", exc)

    def _error(self, identity: bytes, rid: int, code: str, message: str) -> None:
        self._send(identity, {"op": "error", "id": rid, "code": code, "message": message})


class SchedulerLink:
    """A server's or worker's connection to the scheduler.

    Parameters
    ----------
    context : zmq.Context
        The ZeroMQ context to open the DEALER socket in.
    endpoint : str
        The scheduler's endpoint.
    warn_after : float
        Seconds a request may go unanswered before a warning saying what is awaited, and where, is logged once.
    """

    def __init__(self, context: zmq.Context, endpoint: str, warn_after: float = 5.0) -> None:
        self.endpoint = endpoint
        self.channel = transport.DealerChannel(context, endpoint, hwm=1000)
        self._next_id = 1
        self.rank = -1
        self.warn_after = warn_after

    def _ask(self, header: dict[str, Any], timeout: float) -> dict[str, Any]:
        rid = self._next_id
        self._next_id += 1
        self.channel.send(wire.encode({**header, "id": rid}), timeout)
        start = time.monotonic()
        deadline = start + timeout
        warn_at = start + self.warn_after if self.warn_after < timeout else None
        while True:
            now = time.monotonic()
            if warn_at is not None and now >= warn_at:
                warn_at = None
                why = (" (the job forms once every server and worker has registered)"
                       if header["op"] == "register" else "")
                log.warning("still waiting for the scheduler at %s to answer %s after %.0fs (timeout %gs)%s; "
                            "is a psrt scheduler running there, and is it reachable from this host?",
                            self.endpoint, header["op"], now - start, timeout, why)
            remaining = deadline - now
            wait = remaining if warn_at is None else min(remaining, warn_at - now)
            if remaining <= 0:
                raise PsrtTimeoutError(f"the scheduler at {self.endpoint} did not answer {header['op']} "
                                       f"within {timeout:g}s")
            if not self.channel.sock.poll(int(wait * 1000) + 1):
                continue
            reply = self._recv()
            if reply.get("id") != rid:
                continue  # a stale reply to an earlier, timed-out request
            if reply.get("op") == "error":
                raise ServerError(f"scheduler {self.endpoint}: [{reply.get('code')}] {reply.get('message')}",
                                  shard=self.endpoint, code=str(reply.get("code")))
            return reply

    def _recv(self) -> dict[str, Any]:
        frame = self.channel.recv_frame()
        self.channel.discard_rest()
        header = wire.unpack_header(frame, _CONTROL_LIMITS)
        wire.check_version(header)
        return header

    def register(self, role: str, endpoint: str = "", host: str = "", rank: int = -1,
                 timeout: float = 130.0) -> Table:
        """Register and wait until the job forms; returns this process's :class:`Table`.

        Raises
        ------
        ServerError
            When the scheduler refuses (the job did not form in time, the rank is taken, ...).
        PsrtTimeoutError
            When the scheduler does not answer within ``timeout`` seconds.
        """
        h = self._ask({"op": "register", "role": role, "endpoint": endpoint, "host": host, "rank": rank}, timeout)
        try:
            table = Table(rank=h["rank"], num_servers=h["num_servers"], num_workers=h["num_workers"],
                          mode=h["mode"], servers=list(h["servers"]))
        except (KeyError, TypeError):
            raise ProtocolError(f"scheduler {self.endpoint} sent a malformed table") from None
        self.rank = table.rank
        return table

    def barrier(self, name: str, timeout: float) -> None:
        """Wait until every worker has reached the barrier ``name``."""
        self._ask({"op": "barrier", "rank": self.rank, "name": name}, timeout)

    def done(self, timeout: float = 5.0) -> None:
        """Tell the scheduler this worker has finished."""
        self._ask({"op": "done", "rank": self.rank}, timeout)

    def table(self, timeout: float = 5.0) -> dict[str, Any]:
        """The scheduler's current view of the job (for monitoring; does not register)."""
        return self._ask({"op": "table"}, timeout)

    def shutdown_requested(self) -> bool:
        """Take in queued control messages; True once the scheduler has said the job is over."""
        try:
            while self.channel.sock.poll(0):
                if self._recv().get("op") == "shutdown":
                    return True
        except (ProtocolError, ConnectionLostError):
            return False
        return False

    def close(self) -> None:
        """Close the socket."""
        self.channel.close()
