"""The scheduler's side of servers that restart from their checkpoints: which slot each one takes back.

A checkpoint belongs to a shard's rank, not its address, so a server restarted with ``--restore`` on any endpoint
says which rank it restores (``register`` with ``rank`` and ``restore``; -1 when it does not know). Once the job has
formed, the scheduler gives it that slot only when the slot's server has died and waits for a restart (within
``restart_grace``); a registration that comes before the old server is judged dead (a restart faster than the
heartbeat timeout) waits for that verdict, and one for a slot whose server stays alive is refused, naming it. A
server that does not know its rank gets the slot of its old endpoint, or the only slot waiting for a restart.

When the slot's endpoint changed, every worker is sent a ``moved`` notice through its heartbeat, and its client
re-points that shard's socket and sends again what the dead server never answered (:mod:`psrt.worker.calls`).

Before the job forms, servers asking for a rank get it (:meth:`psrt.control.formation.Formation.servers`), so a whole
job restarted from its checkpoints finds every shard in its old place.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from psrt import wire

__all__ = ["Member", "Restarts"]

log = logging.getLogger("psrt.scheduler")


@dataclass
class Member:
    """A process the scheduler watches: where to send it notices, how to name it, and when it was last heard."""

    identity: bytes
    name: str
    last_seen: float
    restorable: bool = False
    #: When the connection its notices go over closed while it was heartbeating on time; None once it heartbeats
    #: again (or while none closed).
    closed_at: Optional[float] = None
    #: Seconds between its last two heartbeats: a process beating late is given longer to prove itself alive.
    gap: float = 0.0
    #: Notices its connection could not take when they were sent (it closed as they went, the socket connecting
    #: anew): sent again, in order, after its next heartbeat, which comes over the new connection.
    undelivered: list[list[Any]] = field(default_factory=list)


@dataclass(frozen=True)
class _Claim:
    """A restarted server's registration, waiting until the slot it asks for is free to take back."""

    identity: bytes
    request: wire.Register
    deadline: float


class Restarts:
    """Mixed into :class:`psrt.control.scheduler.Scheduler`: restarted servers taking their slots back."""

    num_servers: int
    elastic: bool
    heartbeat_timeout: float
    servers: list[tuple[bytes, str]]
    workers: dict[int, bytes]
    _members: dict[tuple[str, int], Member]
    _restarting: dict[int, tuple[float, str]]
    _server_epochs: dict[int, int]
    _epoch: int
    _claims: list[_Claim]

    if TYPE_CHECKING:  # the scheduler's own
        def _send(self, identity: bytes, frames: list[Any]) -> None: ...
        def _error(self, identity: bytes, rid: int, code: str, message: str) -> None: ...
        def _send_table(self, identity: bytes, rid: int, rank: int, server: bool = False) -> None: ...

    def _claim(self, identity: bytes, req: wire.Register) -> None:
        """A server resuming from its checkpoint registers after the job formed: it waits for its slot."""
        if req.rank >= self.num_servers:
            self._error(identity, req.id, "rank", f"server rank {req.rank} is out of range for {self.num_servers} "
                                                  "servers")
            return
        self._claims = [c for c in self._claims if c.identity != identity]  # a resend replaces the first
        # A dead server is judged so within the heartbeat timeout of its last heartbeat, which came before this.
        self._claims.append(_Claim(identity, req, time.monotonic() + self.heartbeat_timeout + 1.0))
        self._place_claims(time.monotonic())

    def _slot_for(self, req: wire.Register) -> Optional[int]:
        if req.rank >= 0:
            return req.rank
        same = [i for i, (_, ep) in enumerate(self.servers) if ep == req.endpoint]
        if same:
            return same[0]
        return next(iter(self._restarting)) if len(self._restarting) == 1 else None

    def _place_claims(self, now: float) -> None:
        """Give each waiting restarted server its slot once that slot waits for a restart; past its deadline,
        refuse it, saying why."""
        for claim in list(self._claims):
            index, req = self._slot_for(claim.request), claim.request
            if index is not None and index in self._restarting:
                self._claims.remove(claim)
                self._rejoin(claim.identity, req, index)
            elif now > claim.deadline:
                self._claims.remove(claim)
                if index is None:
                    waiting = sorted(self._restarting)
                    why = (f"servers {waiting} wait for a restart: say which this one is with --rank R" if waiting
                           else "no server of the job died: there is no slot to take back")
                    self._error(claim.identity, req.id, "rank", f"the job has already formed; {why}")
                else:
                    member = self._members.get(("server", index))
                    alive = f", heard {now - member.last_seen:.1f}s ago" if member is not None else ""
                    self._error(claim.identity, req.id, "rank_alive",
                                f"server {index} ({self.servers[index][1]}) is alive{alive}; a server started "
                                "with --restore takes back only the slot of one that died")

    def _refuse_claims(self, message: str) -> None:
        """The job failed: restarted servers still waiting for a slot hear why."""
        for claim in self._claims:
            self._error(claim.identity, claim.request.id, "peer_failed", message)
        self._claims = []

    def _rejoin(self, identity: bytes, req: wire.Register, index: int) -> None:
        """A server restarted from its checkpoint takes slot ``index`` back, on whatever endpoint it serves."""
        old = self.servers[index][1]
        self.servers[index] = (identity, req.endpoint)
        self._restarting.pop(index, None)
        name = f"server {index} ({req.endpoint})"
        self._members[("server", index)] = Member(identity, name, time.monotonic(), req.restorable)
        self._server_epochs.pop(index, None)
        log.warning("%s restarted and rejoined the job%s", name, "" if old == req.endpoint else f" (was {old})")
        self._send_table(identity, req.id, index, server=True)
        if self.elastic and self._epoch:
            self._send(identity, wire.encode_members(self._epoch, sorted(self.workers)))
        if old != req.endpoint:  # the workers' clients re-point their socket to this shard
            # Once per socket: the workers of one process share their heartbeat's (and hear it for all of them).
            for ident in {m.identity: None for (role, _), m in self._members.items() if role == "worker"}:
                self._send(ident, wire.encode_moved(index, req.endpoint, replica=False))
