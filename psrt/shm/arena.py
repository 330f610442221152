"""Shared parameters: in sync mode a shard keeps its parameters in shared memory that the workers of its host
map read-only, so each worker copies a round's result itself (one copy, in parallel) instead of the shard
writing it into every worker's lane (docs/sharedmem.md).

Each key's parameters lie in a segment ``psrt-<tag>-<pid>-a<generation>`` (:mod:`psrt.shm`), 64-byte aligned,
after one cache line holding its seqlock counter (:func:`psrt.kernels.seq_bump`): odd while an optimizer step
writes the parameters, even otherwise. A reply names ``[generation, offset, counter]``; a worker copies the
parameters and keeps the copy only if the counter read before and after equals the one named
(:func:`psrt.kernels.seq_read`), else it asks again over the socket.

The arena only hands out areas (:meth:`Arena.allocate`); a shard's entry decides to move its parameters there
and owns them from then on (:class:`psrt.shard.store.Entry`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from psrt import kernels, shm
from psrt.errors import ProtocolError, PsrtError

__all__ = ["ARENA_BYTES", "Arena", "ArenaReader", "SharedArea"]

log = logging.getLogger("psrt.arena")

#: The smallest segment of shared parameters a shard makes.
ARENA_BYTES = 1 << 20
_COUNTER = np.dtype(np.uint64)


@dataclass(frozen=True)
class SharedArea:
    """Where one key's parameters lie in a shard's shared parameters (the shard's entry owns it).

    Parameters
    ----------
    generation : int
        The segment's generation.
    offset : int
        Where the parameters start in the segment (64-byte aligned; the counter's cache line is just before).
    param : numpy.ndarray
        The parameters there, flat and writable.
    seqlock : numpy.ndarray
        Their seqlock counter there (one uint64): odd while a step writes the parameters.
    """

    generation: int
    offset: int
    param: np.ndarray
    seqlock: np.ndarray


class Arena:
    """A shard's shared parameters: segments it fills front to back (keys are never removed).

    Parameters
    ----------
    tag : str
        The shard's name tag (:func:`psrt.shm.endpoint_tag`).
    generation : callable
        Returns a new generation number (shared with the shard's lanes, so names never collide).
    """

    def __init__(self, tag: str, generation: Any) -> None:
        self._tag = tag
        self._next = generation
        self._segments: list[shm.Segment] = []
        self._top = 0

    def allocate(self, dtype: np.dtype, count: int) -> Optional[SharedArea]:
        """Room for ``count`` parameters of ``dtype`` under a seqlock counter (which starts at 0).

        Returns None when /dev/shm has no room: the parameters then stay private, and the key is answered
        through lanes.
        """
        nbytes = np.dtype(dtype).itemsize * count
        need = shm.ALIGN + shm.aligned(nbytes)  # the counter's cache line, then the parameters
        segment = self._segments[-1] if self._segments else None
        if segment is None or self._top + need > segment.size:
            # Sized by what is there already: few segments for a large model, little reserved beyond it.
            placed = sum(a.size for a in self._segments)
            size = shm.HEADER_BYTES + max(need, ARENA_BYTES, min(placed, 64 << 20))
            generation = self._next()
            try:
                name = shm.SegmentName.own(self._tag, shm.SegmentName.ARENA, generation)
                segment = shm.Segment.create(str(name), generation, size)
            except OSError as exc:
                log.info("parameters stay private (no room in %s: %s)", shm.SHM_DIR, exc.strerror)
                return None
            self._segments.append(segment)
            self._top = shm.HEADER_BYTES
        offset = self._top + shm.ALIGN
        self._top = offset + shm.aligned(nbytes)
        return SharedArea(segment.generation, offset, segment.array(offset, dtype, count),
                          segment.array(offset - shm.ALIGN, _COUNTER, 1))

    def close(self) -> None:
        """Remove the segments' files (mappings held elsewhere stay valid)."""
        for segment in self._segments:
            segment.unlink()


class ArenaReader:
    """A worker's read-only view of one shard's shared parameters (segments mapped on first use)."""

    def __init__(self) -> None:
        #: The name of the shard's beacon, which its segments' names derive from (None until a lane is set up).
        self.beacon: Optional[shm.SegmentName] = None
        self._segments: dict[int, shm.Segment] = {}

    def forget(self) -> None:
        """The shard restarted: its successor numbers segments afresh, so nothing mapped may be reused."""
        self._segments = {}

    def copy(self, place: list[int], dest: np.ndarray) -> bool:
        """Copy parameters into ``dest`` (flat); False when they changed while being copied (or already had).

        Raises
        ------
        ProtocolError
            When the place is not inside a segment of this shard's.
        """
        generation, offset, counter = place
        segment = self._segments.get(generation)
        if segment is None:
            if self.beacon is None:
                raise ProtocolError(f"cannot map the shard's shared parameters of generation {generation}: no lane "
                                    "to this shard names its segments")
            name = str(self.beacon.sibling(shm.SegmentName.ARENA, generation))
            try:
                segment = self._segments[generation] = shm.Segment.read_only(name, generation)
            except (PsrtError, OSError) as exc:
                raise ProtocolError(f"cannot map the shard's shared parameters {name}: {exc}") from None
        if offset < shm.HEADER_BYTES + shm.ALIGN or offset % shm.ALIGN or offset + dest.nbytes > segment.size:
            raise ProtocolError(f"shared parameters at offset {offset} lie outside segment {segment.name}")
        seq = segment.array(offset - shm.ALIGN, _COUNTER, 1)
        if counter % 2 or kernels.seq_read(seq) != counter:
            return False
        np.copyto(dest, segment.array(offset, dest.dtype, dest.size))
        return kernels.seq_read(seq) == counter
