"""Which shards hold each key range, and which one serves it: the scheduler's side of replication.

With ``--replicas R`` shard k's key range is held by shard k (its primary) and by the next R shards on the ring
(:func:`psrt.partition.range_holders`). :class:`Placement` keeps, per range, the holders still alive in promotion
order; the first is the one that serves the range. When liveness names a dead shard, :meth:`Placement.lose`
drops it everywhere: a range whose primary it was is promoted to its first live replica (which copies it on to
the range's other live holders), and a range left with no holder is lost (the job cannot go on). Only the
scheduler promotes, and only the first live holder of a range in ring order; a shard takes over a range only when
the scheduler's ``ranges`` notice names it first (docs/architecture.md, "Replication").

Each shard announces, when it registers, its replication endpoint and one standby endpoint per range it backs
(``backed_ranges``, nearest first): a promoted replica serves the range there, so the scheduler can tell the
workers where the range went (a ``moved`` notice) in the same instant it promotes.
"""

from __future__ import annotations

from typing import Optional, Sequence

from psrt.errors import ConfigError
from psrt.partition import backed_ranges, check_replicas, range_holders

__all__ = ["Placement", "check_job_replicas"]


def check_job_replicas(replicas: int, num_servers: int, mode: str, elastic: bool,
                       backup_workers: object = 0) -> None:
    """Refuse a replicated job psrt cannot run (yet): R out of range for S, elastic. (``backup_workers``: any b
    runs replicated, kept for the callers that pass it.)

    Raises
    ------
    ConfigError
        Saying what holds and what to change.
    """
    check_replicas(replicas, num_servers)
    if replicas and elastic:
        raise ConfigError("--replicas with --elastic is not supported yet: leave one of them out")


class Placement:
    """The live holders of every key range of a job of ``num_servers`` shards with ``replicas`` copies each.

    Parameters
    ----------
    num_servers, replicas : int
        S and R (checked: 0 <= R < S).
    """

    def __init__(self, num_servers: int, replicas: int) -> None:
        check_replicas(replicas, num_servers)
        self.num_servers, self.replicas = num_servers, replicas
        #: Per range, its live holders, the one serving it first.
        self.holders: list[list[int]] = [list(range_holders(num_servers, replicas, k)) for k in range(num_servers)]
        #: Per shard, the endpoints it announced: ``[replication, standby of range j-1, ..., of range j-R]``.
        self.endpoints: list[list[str]] = [[] for _ in range(num_servers)]

    def primary(self, rank: int) -> Optional[int]:
        """The shard serving range ``rank`` (None: every copy is gone)."""
        holders = self.holders[rank]
        return holders[0] if holders else None

    def serving_endpoint(self, rank: int, main: Sequence[str]) -> Optional[str]:
        """Where range ``rank`` is served: its own shard's endpoint (``main[rank]``), or a promoted replica's
        standby endpoint for it."""
        primary = self.primary(rank)
        if primary is None:
            return None
        if primary == rank:
            return main[rank]
        offset = (primary - rank) % self.num_servers  # the primary backs this range as its offset-th
        announced = self.endpoints[primary]
        return announced[offset] if offset < len(announced) else None

    def lose(self, rank: int) -> tuple[list[tuple[int, int]], list[int]]:
        """Shard ``rank`` died: drop it from every range.

        Returns
        -------
        promoted : list of (range, shard)
            Ranges it served, each now served by its first live replica.
        lost : list of int
            Ranges no live shard holds any more.
        """
        promoted, lost = [], []
        for k, holders in enumerate(self.holders):
            if rank not in holders:
                continue
            was_primary = holders[0] == rank
            holders.remove(rank)
            if not holders:
                lost.append(k)
            elif was_primary:  # it first copies the whole range to the others, then each round as before
                promoted.append((k, holders[0]))
        return promoted, lost

    def rejoin(self, rank: int, endpoints: list[str]) -> list[int]:
        """A server takes dead shard ``rank``'s place as a replica (its endpoints: ``endpoints``): it is added, last,
        to the holders of every live range it backs; returns those ranges. Its own range stays where it is served."""
        self.endpoints[rank] = list(endpoints)
        backs = []
        for k in backed_ranges(self.num_servers, self.replicas, rank):
            holders = self.holders[k]
            if holders and rank not in holders:
                holders.append(rank)
                backs.append(k)
        return backs

    def alive(self, rank: int) -> bool:
        """Whether shard ``rank`` still holds any range (a dead one holds none)."""
        return any(rank in h for h in self.holders)
