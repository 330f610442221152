"""The shard map: which shard holds which contiguous piece of which tensor.

Tensors larger than ``partition_bytes`` are split into the fewest contiguous chunks of at most that size, of
near-equal length (BytePS found ~4 MB partitions spread over servers balance load and let transfers pipeline).
With several shards, a tensor of at least two :data:`MIN_PIECE_BYTES` pieces is split into a multiple of the
shard count where its pieces stay that large, so one tensor keeps every shard busy (as ps-lite splits each key
over all servers): a 4 MB tensor on 2 shards goes half to each, a 40 MB one on 3 shards in 12 pieces, not 10.
Chunks and whole small tensors are then assigned to shards largest first, each to the shard holding the fewest
bytes so far (ties to the lowest shard index). The result depends only on the tensors' names, shapes and dtypes,
the number of shards and the partition size — never on dict order — so every worker computes the same map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

from psrt.errors import ConfigError

__all__ = ["Chunk", "PartitionMap"]

#: Most chunks sent in one message (keeps headers far below the decode limits).
MAX_CHUNKS_PER_MESSAGE = 4096
#: A header's bytes per chunk beyond its name (msgpack of ``[name, part, dtype, [count]]``, a version, a lane
#: place: about 30), with room to spare; a message's chunks fill at most half of ``max_header_bytes``, the other
#: half is the fixed fields' (an optimizer's spec, lane references).
HEADER_BYTES_PER_CHUNK = 64
#: Most sets of tensor names a client keeps the messages of (a training loop repeats a few sets; one that pushes
#: each tensor of a model apart repeats that many).
MAX_CACHED_PLANS = 4096
#: The smallest piece a tensor is cut into to spread it over the shards (smaller ones cost more per message
#: than they gain in parallel).
MIN_PIECE_BYTES = 256 << 10


@dataclass(frozen=True)
class Chunk:
    """A contiguous piece ``[start, start+count)`` of the flattened tensor ``name``, held by ``shard``."""

    name: str
    part: int
    start: int
    count: int
    dtype: np.dtype
    shard: int

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
    """

    def __init__(self, num_shards: int, partition_bytes: int, max_header_bytes: int = 1 << 20) -> None:
        if num_shards < 1:
            raise ConfigError(f"need at least one shard, got {num_shards}")
        if partition_bytes < 8:
            raise ConfigError(f"partition_bytes must be at least 8, got {partition_bytes}")
        self.num_shards = num_shards
        self.partition_bytes = partition_bytes
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
        pieces: list[tuple[str, int, int, int, np.dtype]] = []
        for name in sorted(specs):
            shape, dtype = specs[name]
            dtype = np.dtype(dtype)
            count = math.prod(shape)
            per_chunk = max(1, self.partition_bytes // dtype.itemsize)
            parts = max(1, -(-count // per_chunk))
            nbytes = count * dtype.itemsize
            if self.num_shards > 1 and nbytes >= 2 * MIN_PIECE_BYTES:
                balanced = -(-parts // self.num_shards) * self.num_shards
                parts = min(balanced, max(parts, nbytes // MIN_PIECE_BYTES))
            base, extra = divmod(count, parts)
            start = 0
            for part in range(parts):
                n = base + (1 if part < extra else 0)
                pieces.append((name, part, start, n, dtype))
                start += n
            self.tensors[name] = (tuple(shape), dtype)
        # Largest first, then by name and part: a total order, so every worker assigns identically.
        pieces.sort(key=lambda p: (-p[3] * p[4].itemsize, p[0], p[1]))
        out: list[Chunk] = []
        for name, part, start, count, dtype in pieces:
            shard = min(range(self.num_shards), key=lambda s: (self.shard_bytes[s], s))
            chunk = Chunk(name, part, start, count, dtype, shard)
            self.shard_bytes[shard] += chunk.nbytes
            self.chunks.setdefault(name, []).append(chunk)
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

    def messages(self, chunks: Iterable[Chunk]) -> dict[int, list[list[Chunk]]]:
        """Group chunks into per-shard messages of at most ``partition_bytes`` (a lone larger chunk goes alone),
        :data:`MAX_CHUNKS_PER_MESSAGE` chunks and the header budget.

        Small tensors share a message; a split tensor's chunks each travel in their own, so a shard can apply
        one while the next is still on the wire.
        """
        out: dict[int, list[list[Chunk]]] = {}
        open_msg: dict[int, tuple[list[Chunk], int, int]] = {}
        for chunk in chunks:
            msg, size, header = open_msg.get(chunk.shard, ([], 0, 0))
            entry = len(chunk.name.encode("utf-8", "surrogatepass")) + HEADER_BYTES_PER_CHUNK
            if msg and (size + chunk.nbytes > self.partition_bytes or len(msg) >= MAX_CHUNKS_PER_MESSAGE
                        or header + entry > self.header_budget):
                out.setdefault(chunk.shard, []).append(msg)
                msg, size, header = [], 0, 0
            msg.append(chunk)
            open_msg[chunk.shard] = (msg, size + chunk.nbytes, header + entry)
        for shard, (msg, _, _) in open_msg.items():
            if msg:
                out.setdefault(shard, []).append(msg)
        return out
