"""The shard map: which shard holds which contiguous piece of which tensor.

Tensors larger than ``partition_bytes`` are split into the fewest contiguous chunks of at most that size, of
near-equal length (BytePS found ~4 MB partitions spread over servers balance load and let transfers pipeline).
A tensor of at least two :data:`MIN_PIECE_BYTES` pieces is also cut, where its pieces stay that large, into a
multiple of the shard count, so one tensor keeps every shard busy (as ps-lite splits each key over all servers);
when the shards are reached over a network, pieces of at least :data:`NETWORK_PIECE_BYTES`, into
:data:`PIPELINE_PIECES` pieces per shard. A shard answers a sync round piece by piece, so the replies of one
piece flow out while the next piece still arrives, and a step costs a link's traffic one way plus a small tail,
not both ways in turn (docs/perfmodel.md, "The pull tail"). A 4 MiB tensor on 2 shards is then 32 pieces of
128 KiB, 16 on each, and a 40 MB one on 3 shards 48 pieces; with every shard on the workers' host
(``network=False``) 2 and 12. Small tensors share messages, over a network of at most :data:`MIN_PIECE_BYTES`
for the same reason (:meth:`PartitionMap.messages`). How the pieces travel (a piece a message and paced, or
joined and at once: :func:`joined`) is each client's choice (:mod:`psrt.worker.pacing`); the keys are the map's.
Chunks and whole small tensors are then assigned to shards largest first, each to the shard holding the fewest
bytes so far (ties to the lowest shard index). The result depends only on the tensors' names, shapes and dtypes,
the number of shards and the partition size — never on dict order — so every worker computes the same map.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from psrt.errors import ConfigError

__all__ = ["Chunk", "PartitionMap", "busiest_shard", "check_replicas", "replica_ring", "range_holders",
           "backed_ranges", "joined"]

#: Most chunks sent in one message (keeps headers far below the decode limits).
MAX_CHUNKS_PER_MESSAGE = 4096
#: A header's bytes per chunk beyond its name (msgpack of ``[name, part, dtype, [count]]``, a version, a lane
#: place: about 30), with room to spare; a message's chunks fill at most half of ``max_header_bytes``, the other
#: half is the fixed fields' (an optimizer's spec, lane references).
HEADER_BYTES_PER_CHUNK = 64
#: Most sets of tensor names a client keeps the messages of (a training loop repeats a few sets; one that pushes
#: each tensor of a model apart repeats that many).
MAX_CACHED_PLANS = 4096
#: The smallest piece a tensor is cut into to spread it over the shards of the workers' host (smaller ones cost
#: more per message than they gain in parallel).
MIN_PIECE_BYTES = 256 << 10
#: Pieces per shard a large tensor is cut into for a network, so that a shard's replies to a sync round's first
#: pieces flow out while its later pieces arrive: the replies still to send when a round's last push is in are then
#: ~1/16 of a shard's traffic, and a step costs ~1.06x a link's traffic one way instead of 2x (both ways in turn).
#: With the workers' pieces held in step (:attr:`psrt.config.ClientConfig.in_flight`) the rounds close one by one
#: as their pieces land; sent all at once, 16 pieces gain nothing over 8 (the rounds close in bursts).
PIPELINE_PIECES = 16
#: The smallest piece a tensor is cut into for a network (1 ms of a 1 Gbit/s link, ~10x a shard's cost per
#: message); the pieces cut only to spread a tensor over the shards of one host stay :data:`MIN_PIECE_BYTES`.
NETWORK_PIECE_BYTES = 128 << 10


@dataclass(frozen=True)
class Chunk:
    """A contiguous piece ``[start, start+count)`` of the flattened tensor ``name``, held by ``shard``."""

    name: str
    part: int
    start: int
    count: int
    dtype: np.dtype
    shard: int
    #: How many pieces its tensor is cut into (1: the chunk is the whole tensor).
    pieces: int = 1

    @property
    def key(self) -> tuple[str, int]:
        """The key this chunk has on its shard."""
        return (self.name, self.part)

    @property
    def nbytes(self) -> int:
        """Size of the chunk in bytes."""
        return self.count * self.dtype.itemsize

    def of(self, array: np.ndarray) -> np.ndarray:
        """This chunk's elements of its C-contiguous tensor ``array``, flat: a view, never a copy (the whole
        array's flat view when the chunk is all of it)."""
        flat = array.reshape(-1)
        return flat if self.start == 0 and self.count == flat.size else flat[self.start:self.start + self.count]


class PartitionMap:
    """A deterministic assignment of tensor chunks to ``num_shards`` shards.

    Parameters
    ----------
    num_shards : int
        How many shards share the parameters.
    partition_bytes : int
        Largest chunk, in bytes; larger tensors are split.
    max_header_bytes : int
        The shards' header limit (:attr:`psrt.config.WireLimits.max_header_bytes`): a message carries no more
        chunks than their names fit in half of it (4,096 chunks of long names would exceed it).
    network : bool
        Whether a worker reaches a shard over a network: then large tensors are cut into
        :data:`PIPELINE_PIECES` pieces per shard. When every shard is on the workers' host (their endpoints are
        ``ipc://`` or loopback; :func:`psrt.transport.on_this_host`), nothing pipelines and each piece would only
        cost more: tensors are cut to spread them over the shards alone. Every worker of a job lists the same
        endpoints, so every one decides the same.
    """

    def __init__(self, num_shards: int, partition_bytes: int, max_header_bytes: int = 1 << 20,
                 network: bool = True) -> None:
        if num_shards < 1:
            raise ConfigError(f"need at least one shard, got {num_shards}")
        if partition_bytes < 8:
            raise ConfigError(f"partition_bytes must be at least 8, got {partition_bytes}")
        self.num_shards = num_shards
        self.partition_bytes = partition_bytes
        self.network = network
        self.header_budget = max_header_bytes // 2
        self.shard_bytes = [0] * num_shards
        self.tensors: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self.chunks: dict[str, list[Chunk]] = {}

    def add(self, specs: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> list[Chunk]:
        """Partition and assign new tensors, given as ``name -> (shape, dtype)``; returns their chunks.

        Raises
        ------
        ConfigError
            When a name is already in the map.
        """
        for name in specs:  # check everything first: a refused call leaves the map as it was
            if name in self.tensors:
                raise ConfigError(f"tensor {name!r} is already initialized")
        runs = _runs(specs, self.num_shards, self.partition_bytes, self.network)
        for name in sorted(specs):
            shape, dtype = specs[name]
            self.tensors[name] = (tuple(shape), np.dtype(dtype))
        shards = _assign([-run[0] for run in runs for _ in range(run[3])], self.shard_bytes)
        out: list[Chunk] = []
        for chunk in _chunks(runs, shards):
            self.chunks.setdefault(chunk.name, []).append(chunk)
            out.append(chunk)
        for name in specs:
            self.chunks[name].sort(key=lambda c: c.part)
        return out

    def remove(self, names: Iterable[str]) -> None:
        """Forget tensors added by the last :meth:`add` (a refused ``init`` undoes its addition this way).

        Removing exactly what the last ``add`` returned restores the map as it was before that call.
        """
        for name in names:
            self.tensors.pop(name, None)
            for chunk in self.chunks.pop(name, ()):
                self.shard_bytes[chunk.shard] -= chunk.nbytes

    def chunks_of(self, names: Iterable[str]) -> list[Chunk]:
        """All chunks of the given tensors, in order of the names then parts."""
        out = []
        for name in names:
            try:
                out.extend(self.chunks[name])
            except KeyError:
                raise ConfigError(f"tensor {name!r} was never initialized; call client.init() with it first") from None
        return out

    def messages(self, chunks: Iterable[Chunk], pipelined: bool = True) -> dict[int, list[list[Chunk]]]:
        """Group chunks into per-shard messages of at most ``partition_bytes`` (a lone larger chunk goes alone),
        :data:`MAX_CHUNKS_PER_MESSAGE` chunks and the header budget.

        Small tensors share a message. ``pipelined`` (the messages of a socket): a split tensor's pieces each
        travel in their own, so that a shard applies one, and answers it, while the next is still on the wire;
        and in a map cut for a network small tensors share messages of at most :data:`MIN_PIECE_BYTES`, for the
        same reason (a shard answers a message once all of it arrived: a model of many small tensors in one
        message of ``partition_bytes`` crossed the link one way, then the other). Otherwise (a shared-memory
        lane's, whose bytes are all there at once) pieces share messages as small tensors do, and a call costs as
        few messages as before its tensors were cut for the network.
        """
        most = min(self.partition_bytes, MIN_PIECE_BYTES) if pipelined and self.network else self.partition_bytes
        out: dict[int, list[list[Chunk]]] = {}
        open_msg: dict[int, tuple[list[Chunk], int, int]] = {}
        for chunk in chunks:
            msg, size, header = open_msg.get(chunk.shard, ([], 0, 0))
            entry = len(chunk.name.encode("utf-8", "surrogatepass")) + HEADER_BYTES_PER_CHUNK
            alone = pipelined and chunk.pieces > 1
            if msg and (alone or size + chunk.nbytes > most or len(msg) >= MAX_CHUNKS_PER_MESSAGE
                        or header + entry > self.header_budget):
                out.setdefault(chunk.shard, []).append(msg)
                msg, size, header = [], 0, 0
            if alone:  # nothing joins a piece's message either
                out.setdefault(chunk.shard, []).append([chunk])
                open_msg[chunk.shard] = ([], 0, 0)
                continue
            msg.append(chunk)
            open_msg[chunk.shard] = (msg, size + chunk.nbytes, header + entry)
        for shard, (msg, _, _) in open_msg.items():
            if msg:
                out.setdefault(shard, []).append(msg)
        return out


def joined(messages: list[list[Chunk]], most_bytes: int) -> list[list[Chunk]]:
    """``messages`` (a split tensor's pieces each alone) with successive pieces of one tensor joined into messages
    of at least :data:`MIN_PIECE_BYTES` (a piece left smaller at the end joins the message before it), each within
    ``most_bytes``.

    The map cuts tensors fine for a network so that a paced call's rounds close one by one
    (:attr:`psrt.config.ClientConfig.in_flight`); a call that sends everything at once gains nothing from pieces
    that small and pays each message's cost, so it sends them joined: as many messages as the map's pieces were
    before they were made finer for pacing. A shard answers such a message once all its rounds closed; its keys
    are the same.
    """
    out: list[list[Chunk]] = []
    run: list[Chunk] = []  # the message being joined: pieces of one tensor
    size = 0

    def close() -> None:
        nonlocal run, size
        if run:
            last = out[-1] if out else None
            if (size < MIN_PIECE_BYTES and last is not None and last[0].name == run[0].name and len(last) > 1
                    and sum(c.nbytes for c in last) + size <= most_bytes):
                last.extend(run)  # a short end joins the message before it
            else:
                out.append(run)
        run, size = [], 0

    for msg in messages:
        if len(msg) != 1 or msg[0].pieces == 1:  # small tensors sharing a message, or a whole one: as it is
            close()
            out.append(msg)
            continue
        piece = msg[0]
        if run and (run[0].name != piece.name or size >= MIN_PIECE_BYTES or size + piece.nbytes > most_bytes):
            close()
        run.append(piece)
        size += piece.nbytes
    close()
    return out


def _parts(count: int, itemsize: int, num_shards: int, partition_bytes: int, network: bool) -> int:
    """How many pieces a tensor of ``count`` elements is cut into (the module's docstring says the rule)."""
    parts = max(1, -(-count // max(1, partition_bytes // itemsize)))
    nbytes = count * itemsize
    least = NETWORK_PIECE_BYTES if network else MIN_PIECE_BYTES
    if nbytes >= 2 * least and (network or num_shards > 1):
        most = nbytes // least  # pieces no smaller than the least ...
        if most >= num_shards:
            most -= most % num_shards  # ... and as many on every shard, where there are enough
        wanted = -(-max(parts, (PIPELINE_PIECES if network else 1) * num_shards) // num_shards) * num_shards
        parts = max(parts, min(wanted, most))
    return parts


#: A row of equal pieces of one tensor: ``(-bytes of each, name, first part, pieces, elements each, dtype,
#: elements of the tensor // parts, elements of the tensor % parts, parts)``.
_Run = tuple[int, str, int, int, int, np.dtype, int, int, int]


def _runs(specs: Mapping[str, tuple[tuple[int, ...], np.dtype]], num_shards: int, partition_bytes: int,
          network: bool) -> list[_Run]:
    """The pieces ``specs`` are cut into, as rows of equal pieces in assignment order.

    Largest first, then by name and part: a total order, so every worker assigns identically. A tensor's pieces
    differ by at most one element, the larger ones first, so each tensor makes at most two rows, and sorting the
    rows orders the pieces as sorting the pieces would.
    """
    runs: list[_Run] = []
    for name, (shape, dtype) in specs.items():
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        parts = _parts(count, dtype.itemsize, num_shards, partition_bytes, network)
        base, extra = divmod(count, parts)
        if extra:
            runs.append((-(base + 1) * dtype.itemsize, name, 0, extra, base + 1, dtype, base, extra, parts))
        if parts > extra:
            runs.append((-base * dtype.itemsize, name, extra, parts - extra, base, dtype, base, extra, parts))
    runs.sort(key=lambda r: r[:3])
    return runs


def _assign(sizes: Sequence[int], loads: list[int]) -> list[int]:
    """The shard of each piece, placed in turn on the shard holding the fewest bytes (ties to the lowest index).

    ``loads`` holds each shard's bytes so far and is updated. A heap finds that shard in O(log S) per piece, so a
    map of a thousand shards costs little more than one of four; its entries are ``bytes * S + shard``, which
    order as ``(bytes, shard)`` do, as plain integers. Two shortcuts give the same shards as placing each piece
    in turn, for maps of many shards and many equal pieces (the performance model asks for up to a thousand):
    while every shard holds the same, the next pieces go one to each, in shard order; and at least S equal
    pieces of ``p`` bytes, while no two shards differ by ``p`` or more, go round after round to the shards in the
    order of their bytes (each round adds ``p`` to every shard, so the order stays).
    """
    n = len(loads)
    first = 0
    if loads and min(loads) == max(loads):
        while first < min(n, len(sizes)) and sizes[first] > 0:
            first += 1
    heap = [(load + sizes[shard] if shard < first else load) * n + shard for shard, load in enumerate(loads)]
    heapq.heapify(heap)
    out = list(range(first))
    replace = heapq.heapreplace
    i = first
    while i < len(sizes):
        size = sizes[i]
        end = i + 1
        while end < len(sizes) and sizes[end] == size:
            end += 1
        left, i = end - i, end
        while left:
            if left >= n and max(heap) // n - heap[0] // n < size:
                order = sorted(heap)
                rounds, rest = divmod(left, n)
                out.extend(([entry % n for entry in order] * (rounds + 1))[:left])
                heap = [entry + (rounds + (k < rest)) * size * n for k, entry in enumerate(order)]
                heapq.heapify(heap)
                left = 0
            else:
                for _ in range(min(left, n)):
                    top = heap[0]
                    replace(heap, top + size * n)
                    out.append(top % n)
                left -= min(left, n)
    for entry in heap:
        loads[entry % n] = entry // n
    return out


def _chunks(runs: Sequence[_Run], shards: Sequence[int]) -> Iterable[Chunk]:
    """The chunks of ``runs``' pieces, on the shards :func:`_assign` gave them."""
    i = 0
    for _, name, first, n, count, dtype, base, extra, parts in runs:
        for part in range(first, first + n):
            yield Chunk(name, part, part * base + min(part, extra), count, dtype, shards[i], parts)
            i += 1


def busiest_shard(specs: Mapping[str, tuple[tuple[int, ...], np.dtype]], num_shards: int,
                  partition_bytes: int, network: bool = True) -> list[Chunk]:
    """The chunks of the shard holding the most bytes (the lowest index of equals) in a new map of ``specs``.

    The same chunks as ``PartitionMap(num_shards, partition_bytes).add(specs)`` puts on that shard, in
    ``(name, part)`` order, without building the rest of the map: the performance model asks this for every
    shard count up to a thousand.

    Parameters
    ----------
    specs : mapping
        ``name -> (shape, dtype)``, as :meth:`PartitionMap.add` takes them.
    num_shards, partition_bytes : int
        As :class:`PartitionMap` takes them.
    network : bool
        As :class:`PartitionMap` takes it.

    Returns
    -------
    list of Chunk
        The busiest shard's chunks; :meth:`PartitionMap.messages` groups them into its messages.
    """
    PartitionMap(num_shards, partition_bytes)  # the same checks of the arguments
    runs = _runs(specs, num_shards, partition_bytes, network)
    loads = [0] * num_shards
    shards = _assign([-run[0] for run in runs for _ in range(run[3])], loads)
    busiest = max(range(num_shards), key=loads.__getitem__)
    offsets = list(itertools.accumulate((run[3] for run in runs), initial=0))
    out = []
    for i in (i for i, shard in enumerate(shards) if shard == busiest):
        r = bisect.bisect_right(offsets, i) - 1
        _, name, first, _, count, dtype, base, extra, parts = runs[r]
        part = first + i - offsets[r]
        out.append(Chunk(name, part, part * base + min(part, extra), count, dtype, busiest, parts))
    return sorted(out, key=lambda c: (c.name, c.part))


# ---------------------------------------------------------------------------------------------- replication ring
# Shard k's key range is the chunks the map puts on shard k. With R replicas it is also held by the next R shards
# on the ring k+1, ..., k+R (mod S): a pure function of S, R and k, so the scheduler, every shard and every
# worker compute the same holders without being told.

def check_replicas(replicas: int, num_shards: int) -> None:
    """Refuse a replica count that no ring of ``num_shards`` shards can hold.

    Raises
    ------
    ConfigError
        When ``replicas`` is not a whole number >= 0, or is ``num_shards`` or more: a range and its R copies are
        R + 1 distinct shards, so R is at most S - 1 (where every shard holds every range).
    """
    if type(replicas) is not int or replicas < 0:
        raise ConfigError(f"replicas must be a whole number >= 0 (0: no copies), got {replicas!r}")
    if type(num_shards) is not int or num_shards < 1:
        raise ConfigError(f"need at least one shard, got {num_shards!r}")
    if replicas >= num_shards:
        raise ConfigError(
            f"--replicas {replicas} with {num_shards} shard{'s' if num_shards > 1 else ''}: a key range is held by "
            f"its shard and the next R on the ring, R + 1 distinct shards, so R must be at most S - 1 = "
            f"{num_shards - 1} (with R = S - 1 every shard holds every range); start more shards "
            f"(--servers) or ask for fewer replicas")


def replica_ring(num_shards: int, replicas: int, shard: int) -> tuple[int, ...]:
    """The shards that hold copies of shard ``shard``'s key range, in promotion order: the next ``replicas`` on
    the ring.

    Examples
    --------
    >>> replica_ring(4, 2, 3)
    (0, 1)
    """
    check_replicas(replicas, num_shards)
    if type(shard) is not int or not 0 <= shard < num_shards:
        raise ConfigError(f"shard must be in [0, {num_shards}), got {shard!r}")
    return tuple((shard + i) % num_shards for i in range(1, replicas + 1))


def range_holders(num_shards: int, replicas: int, shard: int) -> tuple[int, ...]:
    """Every shard holding key range ``shard`` while none has died: its own shard (the primary) first, then its
    replicas in promotion order."""
    return (shard, *replica_ring(num_shards, replicas, shard))


def backed_ranges(num_shards: int, replicas: int, shard: int) -> tuple[int, ...]:
    """The key ranges whose copies ``shard`` holds (besides its own), nearest first: shard - 1, ..., shard - R.

    ``backed_ranges(S, R, j)[i - 1] == k`` exactly when ``replica_ring(S, R, k)[i - 1] == j``: the i-th replica of
    range k is the shard i places after it.
    """
    check_replicas(replicas, num_shards)
    if type(shard) is not int or not 0 <= shard < num_shards:
        raise ConfigError(f"shard must be in [0, {num_shards}), got {shard!r}")
    return tuple((shard - i) % num_shards for i in range(1, replicas + 1))
