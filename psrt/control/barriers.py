"""The job's barriers: which workers arrived at each, until every member has, or its deadline passes.

The scheduler (:mod:`psrt.control.scheduler`) keeps one :class:`Barriers`, hands it each arrival, and sends what it
returns: the ``ok`` replies of a barrier every worker reached, the errors of one that timed out (naming the ranks
that never arrived), or of every barrier when the job fails.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

__all__ = ["Barriers"]

#: Where a waiting worker's answer goes: (its identity, its request id).
Waiting = tuple[bytes, int]


@dataclass
class _Barrier:
    deadline: float
    arrived: dict[int, Waiting] = field(default_factory=dict)


class Barriers:
    """Named barriers, each with a deadline ``timeout`` seconds after its first arrival."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._open: dict[str, _Barrier] = {}

    def arrive(self, name: str, rank: int, waiting: Waiting, now: float) -> None:
        """Worker ``rank`` reached barrier ``name``."""
        self._open.setdefault(name, _Barrier(now + self.timeout)).arrived[rank] = waiting

    def release(self, members: AbstractSet[int]) -> list[Waiting]:
        """The workers to let go: those of every barrier that all of ``members`` have reached."""
        released = []
        for name, b in list(self._open.items()):
            # The count first: a barrier of W workers checks its members once, not at each of W arrivals.
            if len(b.arrived) >= len(members) and members <= b.arrived.keys():
                released += b.arrived.values()
                del self._open[name]
        return released

    def expire(self, now: float, members: AbstractSet[int]) -> list[tuple[Waiting, str]]:
        """The workers of every barrier past its deadline, each with the error saying who never came."""
        expired = []
        for name, b in list(self._open.items()):
            if now > b.deadline:
                missing = sorted(members - set(b.arrived))
                message = f"barrier {name!r} timed out after {self.timeout:g}s waiting for worker ranks {missing}"
                expired += [(w, message) for w in b.arrived.values()]
                del self._open[name]
        return expired

    def clear(self) -> list[Waiting]:
        """Every waiting worker, of every barrier (the job failed)."""
        waiting = [w for b in self._open.values() for w in b.arrived.values()]
        self._open.clear()
        return waiting
