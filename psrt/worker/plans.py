"""A call's per-shard messages, computed once per set of tensors (a training loop repeats the same sets).

For each set of tensor names a client pushes or pulls, :class:`Plans` keeps one :class:`ShardPlan` per shard:
the messages over a network (:meth:`psrt.partition.PartitionMap.messages`, pipelined: each piece of a split
tensor on its own) and over a shared-memory lane or to a shard on this host (grouped), the bytes the call takes in
the lane (:func:`psrt.shm.lanes.call_bytes`), and for an uncompressed push each message's packed header prefix
(:func:`psrt.wire.push_prefix`), so that a step's push over the socket packs only its ``id, seq, clock`` (to a
sync shard, ``base`` too; :class:`psrt.worker.sender.ShardSender` sends them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from psrt import transport, wire
from psrt.partition import MAX_CACHED_PLANS, Chunk, PartitionMap, joined
from psrt.shm.lanes import call_bytes

__all__ = ["Plans", "ShardPlan", "cuts_for_network"]


def cuts_for_network(pipeline: str, cut: Optional[str], servers: Sequence[str]) -> bool:
    """Whether a client cuts tensors for shards across a network (:class:`psrt.partition.PartitionMap`'s
    ``network``).

    Every worker of a job must cut them alike: the shards hold the keys of the first worker's cut, and a worker
    that cut otherwise is refused. ``pipeline`` (:attr:`psrt.config.ClientConfig.pipeline`) ``"on"`` or ``"off"``
    decides. With ``"auto"``, the job's ``cut`` decides when a scheduler's table says it (decided once, from the
    endpoints the job formed with, so that a worker joining after a shard moved to another host cuts as the first
    ones did); without one, this client's ``servers``: for the network unless no shard can be more than this host
    away (``ipc://`` or loopback endpoints), as every worker listing the same endpoints decides.
    """
    if pipeline != "auto":
        return pipeline == "on"
    if cut is not None:
        return cut == "network"
    return not all(map(transport.on_this_host, servers))


@dataclass
class ShardPlan:
    """One shard's part of a call on a set of tensors."""

    shard: int
    #: The messages over a network: pipelined.
    messages: list[list[Chunk]]
    #: What the call takes in a lane (:func:`psrt.shm.lanes.call_bytes`).
    lane_bytes: int
    #: Per message, a push's packed header prefix (None for pulls, and with compression: the general path).
    prefixes: list[Optional[bytes]]
    #: The messages over a lane or to a shard on this host, which has no link to keep busy both ways: grouped.
    grouped: list[list[Chunk]]
    #: Per grouped message, a push's packed header prefix (as ``prefixes``).
    grouped_prefixes: list[Optional[bytes]]
    #: The messages over a network with a split tensor's pieces joined (:func:`psrt.partition.joined`): what calls
    #: that are not paced send.
    joined: list[list[Chunk]]
    #: Per joined message, a push's packed header prefix (as ``prefixes``).
    joined_prefixes: list[Optional[bytes]]


class Plans:
    """The :class:`ShardPlan` lists of the sets of tensors a client calls on, cached.

    Parameters
    ----------
    partition : PartitionMap
        The client's shard map (after it changes, :meth:`clear`).
    rank, session : int
        The worker's rank and session, in every push header.
    prefixes : bool
        Whether pushes have header prefixes (not with compression, whose header entries depend on the values).
    """

    def __init__(self, partition: PartitionMap, rank: int, session: int, prefixes: bool) -> None:
        self._map = partition
        self._rank, self._session, self._prefixes = rank, session, prefixes
        self._pushes: dict[tuple[str, ...], list[ShardPlan]] = {}
        self._push_pulls: dict[tuple[str, ...], list[ShardPlan]] = {}
        self._pulls: dict[tuple[str, ...], list[ShardPlan]] = {}

    def clear(self) -> None:
        """Forget every cached set (the tensors were partitioned again)."""
        self._pushes.clear()
        self._push_pulls.clear()
        self._pulls.clear()

    def push(self, names: tuple[str, ...], pull: bool) -> list[ShardPlan]:
        """The per-shard parts of a push (``pull``: push_pull) of the tensors ``names``."""
        cache = self._push_pulls if pull else self._pushes
        plan = cache.get(names)
        if plan is None:
            plan = []
            grouped = self._messages(names, pipelined=False)
            for shard, msgs in self._messages(names).items():
                prefixes = self._prefixes_of(msgs, pull)
                together = grouped[shard]
                if together == msgs:  # no piece of a split tensor in the call: one list serves them all
                    plan.append(ShardPlan(shard, msgs, call_bytes(msgs, True, pull), prefixes, msgs, prefixes,
                                          msgs, prefixes))
                    continue
                two = joined(msgs, self._map.partition_bytes)
                plan.append(ShardPlan(shard, msgs, call_bytes(together, True, pull), prefixes, together,
                                      self._prefixes_of(together, pull), two,
                                      prefixes if two == msgs else self._prefixes_of(two, pull)))
            self._keep(cache, names, plan)
        return plan

    def pull(self, names: tuple[str, ...]) -> list[ShardPlan]:
        """The per-shard parts of a pull of the tensors ``names``."""
        plan = self._pulls.get(names)
        if plan is None:
            grouped = self._messages(names, pipelined=False)
            plan = []
            for shard, msgs in self._messages(names).items():
                two = joined(msgs, self._map.partition_bytes)
                plan.append(ShardPlan(shard, msgs, call_bytes(grouped[shard], False, True), [None] * len(msgs),
                                      grouped[shard], [None] * len(grouped[shard]), two, [None] * len(two)))
            self._keep(self._pulls, names, plan)
        return plan

    def _messages(self, names: tuple[str, ...], pipelined: bool = True) -> dict[int, list[list[Chunk]]]:
        return self._map.messages(self._map.chunks_of(names), pipelined)

    @staticmethod
    def _keep(cache: dict[tuple[str, ...], list[ShardPlan]], names: tuple[str, ...], plan: list[ShardPlan]) -> None:
        if len(cache) < MAX_CACHED_PLANS:
            cache[names] = plan

    def _prefixes_of(self, msgs: list[list[Chunk]], pull: bool) -> list[Optional[bytes]]:
        if not self._prefixes:
            return [None] * len(msgs)
        return [self._prefix(msg, pull) for msg in msgs]

    def _prefix(self, msg: list[Chunk], pull: bool) -> bytes:
        entries = [wire.tensor_entry(c.name, c.part, c.dtype, (c.count,)) for c in msg]
        return wire.push_prefix(self._rank, self._session, entries, pull)
