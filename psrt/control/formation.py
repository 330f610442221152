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
        self.pending: list[Pending] = []  # in arrival order
        self._reported_at, self._reported = now, self.counts()

    def of(self, role: str) -> list[Pending]:
        """The registrations of ``role``, in arrival order."""
        return [p for p in self.pending if p.request.role == role]

    def counts(self) -> tuple[int, int, int, int]:
        """(servers registered, S, workers registered, W)."""
        return len(self.of("server")), self.num_servers, len(self.of("worker")), self.num_workers

    @property
    def complete(self) -> bool:
        """Whether every server and worker has registered."""
        servers, _, workers, _ = self.counts()
        return servers == self.num_servers and workers == self.num_workers

    def add(self, identity: bytes, req: wire.Register) -> Optional[tuple[str, str]]:
        """Take a registration; returns ``(code, message)`` of the error that refuses it instead, or None."""
        role, rank = req.role, req.rank
        limit = self.num_workers if role == "worker" else self.num_servers
        if rank >= limit:  # a server's rank: the shard its checkpoint belongs to
            return "rank", f"{role} rank {rank} is out of range for {limit} {role}s"
        if rank >= 0 and any(p.request.role == role and p.request.rank == rank and p.identity != identity
                             for p in self.pending):
            return "rank", f"{role} rank {rank} is already registered"
        self.pending = [p for p in self.pending if p.identity != identity]  # a resend replaces the first
        servers, _, workers, _ = self.counts()
        if (servers if role == "server" else workers) >= (self.num_servers if role == "server" else self.num_workers):
            return "full", (f"the job expects {self.num_servers} servers and {self.num_workers} workers; this {role} "
                            "is one too many")
        self.pending.append(Pending(identity, req))
        return None

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
