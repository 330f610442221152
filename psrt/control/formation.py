"""A job while it forms: the registrations the scheduler holds until every server and worker is in.

:class:`Formation` keeps them in arrival order, checks each (rank range, rank taken, one too many), counts how far
the job got, decides when to tell the waiting processes (at most every 2 s, when the counts moved), assigns the
workers' ranks and the servers' shard order once all are in, and words the error of a job that missed its start
deadline. The scheduler (:mod:`psrt.control.scheduler`) sends the messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from psrt import wire

__all__ = ["Formation", "Pending"]

#: Seconds between progress reports to the waiting processes.
REPORT_EVERY = 2.0


@dataclass(frozen=True)
class Pending:
    """A registration waiting for the job to form."""

    identity: bytes
    request: wire.Register


class Formation:
    """The registrations of a job of ``num_servers`` servers and ``num_workers`` workers that has not formed yet.

    Parameters
    ----------
    num_servers, num_workers : int
        S and W.
    now : float
        The monotonic time the scheduler started.
    """

    def __init__(self, num_servers: int, num_workers: int, now: float) -> None:
        self.num_servers, self.num_workers = num_servers, num_workers
        # By identity, in arrival order; the counts and the requested ranks kept beside them, so that a
        # registration costs the same whether it is the first or the thousandth.
        self._pending: dict[bytes, Pending] = {}
        self._count = {"server": 0, "worker": 0}
        self._asked: dict[tuple[str, int], bytes] = {}  # (role, requested rank) -> identity
        self._reported_at, self._reported = now, self.counts()

    @property
    def pending(self) -> list[Pending]:
        """The registrations waiting, in arrival order."""
        return list(self._pending.values())

    def clear(self) -> None:
        """Forget every registration (they were answered: the job formed, or failed to)."""
        self._pending.clear()
        self._asked.clear()
        self._count = {"server": 0, "worker": 0}

    def of(self, role: str) -> list[Pending]:
        """The registrations of ``role``, in arrival order."""
        return [p for p in self._pending.values() if p.request.role == role]

    def counts(self) -> tuple[int, int, int, int]:
        """(servers registered, S, workers registered, W)."""
        return self._count["server"], self.num_servers, self._count["worker"], self.num_workers

    @property
    def complete(self) -> bool:
        """Whether every server and worker has registered."""
        return self._count["server"] == self.num_servers and self._count["worker"] == self.num_workers

    def add(self, identity: bytes, req: wire.Register) -> Optional[tuple[str, str]]:
        """Take a registration; returns ``(code, message)`` of the error that refuses it instead, or None."""
        role, rank = req.role, req.rank
        limit = self.num_workers if role == "worker" else self.num_servers
        if rank >= limit:  # a server's rank: the shard its checkpoint belongs to
            return "rank", f"{role} rank {rank} is out of range for {limit} {role}s"
        if rank >= 0 and self._asked.get((role, rank), identity) != identity:
            return "rank", f"{role} rank {rank} is already registered"
        self._remove(identity)  # a resend replaces the first
        if self._count[role] >= limit:
            return "full", (f"the job expects {self.num_servers} servers and {self.num_workers} workers; this {role} "
                            "is one too many")
        self._pending[identity] = Pending(identity, req)
        self._count[role] += 1
        if rank >= 0:
            self._asked[(role, rank)] = identity
        return None

    def _remove(self, identity: bytes) -> None:
        old = self._pending.pop(identity, None)
        if old is not None:
            self._count[old.request.role] -= 1
            if old.request.rank >= 0:
                self._asked.pop((old.request.role, old.request.rank), None)

    def report_due(self, now: float) -> bool:
        """Whether to tell the waiting processes how far the job got (the counts moved, 2 s since the last)."""
        counts = self.counts()
        if now - self._reported_at < REPORT_EVERY or counts == self._reported:
            return False
        self._reported_at, self._reported = now, counts
        return True

    def servers(self) -> list[Pending]:
        """The servers in shard order once complete: each that asked for a rank (the one its checkpoint belongs
        to) at it, the others in arrival order, so a job restarted from its checkpoints has every shard in place."""
        servers = self.of("server")
        asked = {p.request.rank: p for p in servers if p.request.rank >= 0}
        rest = iter([p for p in servers if p.request.rank < 0])
        return [asked[i] if i in asked else next(rest) for i in range(len(servers))]

    def ranks(self) -> list[tuple[int, Pending]]:
        """The workers' ranks once complete: the one each asked for, else the free ones in arrival order."""
        workers = self.of("worker")
        free = iter(sorted(set(range(self.num_workers)) - {p.request.rank for p in workers if p.request.rank >= 0}))
        return [(p.request.rank if p.request.rank >= 0 else next(free), p) for p in workers]

    def missing(self, timeout: float) -> str:
        """The error of a job that did not form within ``timeout`` seconds, naming who is missing."""
        servers, _, workers, _ = self.counts()
        asked = sorted(p.request.rank for p in self.of("worker") if p.request.rank >= 0)
        have_s = [p.request.endpoint for p in self.of("server")]
        return (f"the job did not form within {timeout:g}s: missing {self.num_servers - servers} of "
                f"{self.num_servers} servers and {self.num_workers - workers} of {self.num_workers} workers "
                f"(registered servers: {have_s or 'none'}; registered workers: {workers}"
                f"{' with requested ranks ' + str(asked) if asked else ''})")
