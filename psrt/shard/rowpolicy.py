"""What decides which ids of an embedding table hold a row: admission counters, and the rows to evict.

Three table options (:class:`psrt.tablespec.TableSpec`) bound a table that would otherwise grow forever:

- ``admit_after=k``: an id gets a row on its k-th push to this shard. Until then its pushes are counted in a
  :class:`Pending` map, not applied. The map is an **exact bounded map**, not a sketch: at most ``max_pending``
  ids per table and shard, each with its exact count; when a push would hold more, the least recently pushed
  pending ids (ties: the smaller id first) are forgotten and start counting again from 0. So its only error is
  one-sided: an id is never admitted early, and an id pushed k times while among the ``max_pending`` most
  recently pushed pending ids is admitted exactly at its k-th push; one pushed more sparsely than that may be
  admitted later than its k-th push, or never.
- ``capacity=C``: making a row beyond C evicts the least recently pushed rows (:func:`lru_victims`).
- ``ttl=T``: rows (and pending counts) not pushed for T seconds are evicted (:func:`expired`).

Every choice here is a pure function of the pushes' order, their ids and their times, never of where a row
happens to lie in memory (ties are broken by id), so a table restored from a checkpoint, whose rows lie in
another order, evicts exactly what the original would have. The work is vectorized: a pass over the held ids
(``np.partition``) finds the next eighth of them to evict at once (:class:`Oldest`), and one compiled loop does a
batch of index changes (:func:`compact`); a ttl sweep is one comparison per row, at most every ``ttl / 16``.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from psrt.kernels import rows as rowkernels

__all__ = ["Pending", "Oldest", "compact", "lru_victims", "expired", "DEFAULT_MAX_PENDING"]

#: Pending ids a table holds per shard when ``max_pending`` is not given.
DEFAULT_MAX_PENDING = 1 << 20
_MIN = 1024


def lru_victims(stamps: np.ndarray, ids: np.ndarray, count: int, pinned: Optional[np.ndarray] = None) -> np.ndarray:
    """The ``count`` slots with the oldest stamps (ties: the smaller id first), never one of ``pinned``.

    Parameters
    ----------
    stamps : numpy.ndarray
        Each slot's last push (a logical clock: larger is more recent), int64.
    ids : numpy.ndarray
        Each slot's id.
    count : int
        How many to choose; fewer when fewer are not pinned.
    pinned : numpy.ndarray, optional
        Slots that may not be chosen (the rows of a sync round in progress).
    """
    n = len(stamps)
    keyed = stamps.astype(np.int64, copy=True)
    if pinned is not None and len(pinned):
        keyed[pinned] = np.iinfo(np.int64).max
        n -= len(np.unique(pinned))
    count = min(count, n)
    if count <= 0:
        return np.empty(0, np.int64)
    kth = np.partition(keyed, count - 1)[count - 1]
    older = np.flatnonzero(keyed < kth)
    tie = np.flatnonzero(keyed == kth)
    tie = tie[np.argsort(ids[tie], kind="stable")[:count - len(older)]]
    return np.concatenate([older, tie]).astype(np.int64, copy=False)


class Oldest:
    """The least recently pushed rows, found in one pass over the held ids for many evictions, not for each.

    A pass (:func:`lru_victims`' rule) takes the rows whose stamp is at most ``S``, the ``n``-th smallest (``n``
    at least an eighth of the rows), sorted by (stamp, id): the *candidates*, by id. Every other row has a stamp
    above ``S``, and a stamp only grows (a push gives the current clock, above every stamp held), so as long as
    candidates remain whose stamp is still at most ``S``, the oldest rows of the whole table are the first of
    them, in order: the choice is exactly :func:`lru_victims`'. A candidate pushed again (stamp above ``S``) or
    gone (no longer found) is skipped for good; a new pass runs when they run out. So at capacity, with new ids
    in every push, eviction costs about 8 compiled lookups per evicted row, not a pass over the table per push.
    """

    def __init__(self) -> None:
        self.ids = np.empty(0, np.int64)
        self.pos = 0
        self.bound = -1

    def take(self, find: Any, stamps: np.ndarray, ids: np.ndarray, count: int,
             pinned: Optional[np.ndarray] = None) -> np.ndarray:
        """The slots of the ``count`` oldest rows (fewer when fewer are not pinned), as :func:`lru_victims`.

        ``find(ids)`` gives the current slots of ids (-1: none); ``stamps`` and ``ids`` are the held rows'.
        """
        out: list[np.ndarray] = []
        need, fresh = count, False
        pinned = np.empty(0, np.int64) if pinned is None else pinned
        while need > 0:
            if self.pos >= len(self.ids):
                if fresh:
                    break  # a pass found nothing to take (all pinned)
                self._pass(stamps, ids, need, np.concatenate([pinned, *out]))  # (those taken are still held)
                fresh = True
                continue
            chunk = self.ids[self.pos:self.pos + 2 * need + 64]
            slots = find(np.ascontiguousarray(chunk))
            ok = slots >= 0
            ok[ok] = stamps[slots[ok]] <= self.bound
            if (len(pinned) or out) and ok.any():
                ok[ok] = ~np.isin(slots[ok], np.concatenate([pinned, *out]))
            good = np.flatnonzero(ok)[:need]
            if len(good) < need:
                self.pos += len(chunk)
            else:
                self.pos += int(good[-1]) + 1
            out.append(slots[good])
            need -= len(good)
        return np.concatenate(out).astype(np.int64, copy=False) if out else np.empty(0, np.int64)

    def _pass(self, stamps: np.ndarray, ids: np.ndarray, need: int, pinned: np.ndarray) -> None:
        keyed = stamps.astype(np.int64, copy=True)
        avail = len(keyed)
        if len(pinned):
            keyed[pinned] = np.iinfo(np.int64).max
            avail -= len(np.unique(pinned))
        self.pos, self.ids = 0, np.empty(0, np.int64)
        if avail <= 0:
            return
        n = min(max(need, len(keyed) // 8, 1), avail)
        self.bound = int(np.partition(keyed, n - 1)[n - 1])
        sel = np.flatnonzero(keyed <= self.bound)
        self.ids = ids[sel][np.lexsort((ids[sel], keyed[sel]))].astype(np.int64, copy=True)


def expired(when: np.ndarray, now: float, ttl: float, pinned: Optional[np.ndarray] = None) -> np.ndarray:
    """The slots last pushed ``ttl`` seconds or more before ``now`` (never one of ``pinned``)."""
    old = now - when >= ttl
    if pinned is not None and len(pinned):
        old[pinned] = False
    return np.flatnonzero(old).astype(np.int64, copy=False)


def compact(index: np.ndarray, row_ids: np.ndarray, used: int, victims: np.ndarray,
            columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Remove the rows ``victims`` (distinct slots below ``used``) and keep the rest in ``[0, used - len)``.

    Each hole below the new end takes a row from above it (the row's columns, its id, and its place in the
    index move together), so the table stays contiguous. Returns ``(removed ids, holes, movers)``: the row that
    was at ``movers[i]`` is now at ``holes[i]``.
    """
    victims = np.unique(victims)
    end = used - len(victims)
    gone = row_ids[victims].copy()
    rowkernels.index_remove(index, gone, np.empty(len(gone), np.int64))
    is_victim = np.zeros(used - end, bool)
    above = victims[victims >= end]
    is_victim[above - end] = True
    holes = victims[victims < end]
    movers = np.flatnonzero(~is_victim).astype(np.int64) + end
    if len(holes):
        for a in columns:
            a[holes] = a[movers]
        row_ids[holes] = row_ids[movers]
        rowkernels.index_set(index, np.ascontiguousarray(row_ids[holes]), holes)
    return gone, holes, movers


def _cells_for(n: int) -> int:
    cells = 2 * _MIN
    while 2 * n >= cells:
        cells *= 2
    return cells


class Pending:
    """The push counts of ids not yet admitted, exact, at most ``limit`` ids (see the module's docstring).

    Parameters
    ----------
    admit_after : int
        k: the push that makes an id's count reach k admits it.
    limit : int
        The most ids held.
    """

    def __init__(self, admit_after: int, limit: int) -> None:
        self.admit_after, self.limit = admit_after, limit
        self.used = 0
        self.forgotten = 0  # ids dropped for the bound or by ttl, counts and all
        self.removed: list[np.ndarray] = []  # ids that left (admitted or forgotten) since the last checkpoint
        #: Ids that left since the last copy to the replicas (a replicated job sets a list: psrt.shard.tablecopy).
        self.copy_removed: Optional[list[np.ndarray]] = None
        self._oldest = Oldest()
        self._alloc(min(_MIN, limit + 1))

    def _alloc(self, cap: int) -> None:
        self.ids = np.zeros(cap, np.int64)
        self.counts = np.zeros(cap, np.int64)
        self.last = np.zeros(cap, np.int64)
        self.when = np.zeros(cap, np.float64)
        self.dirty = np.zeros(cap, bool)  # counted since the last checkpoint
        self._index = rowkernels.index_cells(_cells_for(cap))

    def _reserve(self, new: int) -> None:
        need = self.used + new
        if need > len(self.ids):
            cap = max(need, int(len(self.ids) * 1.5) + 1)
            for a in (self.ids, self.counts, self.last, self.when, self.dirty):
                a.resize(cap, refcheck=False)
        if need + 1 >= len(self._index) // 2:
            self._index = rowkernels.index_cells(_cells_for(need + 1))
            if self.used:
                known = self.ids[:self.used].copy()
                rowkernels.index_find(self._index, known, np.empty(self.used, np.int64), self.ids, 0, True)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where it is not pending."""
        out = np.empty(len(ids), np.int64)
        if len(ids):
            rowkernels.index_find(self._index, ids, out, self.ids, self.used, False)
        return out

    def count(self, ids: np.ndarray, tick: int, now: float) -> np.ndarray:
        """Count one push of each of ``ids`` (distinct, none holding a row) at ``tick`` and ``now``; returns
        which of them this push admits (they leave the map). Then forgets the least recently pushed beyond
        the bound."""
        ids = np.ascontiguousarray(ids, np.int64)
        if not len(ids):
            return np.zeros(0, bool)
        self._reserve(len(ids))
        slots, old = np.empty(len(ids), np.int64), self.used
        self.used = rowkernels.index_find(self._index, ids, slots, self.ids, self.used, True)
        self.counts[old:self.used] = 0  # new ids: their slots may hold a dropped id's count
        self.counts[slots] += 1
        self.last[slots] = tick
        self.when[slots] = now
        self.dirty[slots] = True
        admitted = self.counts[slots] >= self.admit_after
        if admitted.any():
            self._drop(slots[admitted])
        if self.used > self.limit:
            self.forgotten += self.used - self.limit
            self._drop(self._oldest.take(self.find, self.last[:self.used], self.ids[:self.used],
                                         self.used - self.limit))
        return admitted

    def expire(self, now: float, ttl: float) -> None:
        """Forget the ids not pushed for ``ttl`` seconds."""
        old = expired(self.when[:self.used], now, ttl)
        self.forgotten += len(old)
        self._drop(old)

    def _drop(self, slots: np.ndarray) -> None:
        if len(slots):
            gone, _, _ = compact(self._index, self.ids, self.used, slots,
                                 [self.counts, self.last, self.when, self.dirty])
            self.used -= len(gone)
            self.removed.append(gone)
            if self.copy_removed is not None:
                self.copy_removed.append(gone)

    def counts_of(self, ids: np.ndarray) -> np.ndarray:
        """Each id's count so far (0: not pending)."""
        slots = self.find(np.ascontiguousarray(ids, np.int64))
        return np.where(slots >= 0, self.counts[np.maximum(slots, 0)], 0)

    def nbytes(self) -> int:
        """Bytes allocated."""
        return sum(a.nbytes for a in (self.ids, self.counts, self.last, self.when, self.dirty, self._index))

    # ------------------------------------------------------------------ checkpoints
    def state(self, delta: bool = False) -> tuple[dict[str, Any], list[np.ndarray]]:
        """A checkpoint's record and arrays of the map; ``delta``: only the ids counted since the last
        checkpoint (:meth:`saved`), and those that left since."""
        at = np.flatnonzero(self.dirty[:self.used]) if delta else slice(0, self.used)
        removed = np.concatenate(self.removed) if delta and self.removed else np.empty(0, np.int64)
        return {"used": self.used, "forgotten": self.forgotten}, [self.ids[at], self.counts[at], self.last[at],
                                                                  self.when[at], removed]

    def saved(self) -> None:
        """A checkpoint with this map's :meth:`state` is on disk."""
        self.dirty[:self.used] = False
        self.removed = []

    def apply(self, record: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """Apply a checkpoint's :meth:`state` (full onto an empty map, or a delta onto the one before)."""
        ids, counts, last, when, removed = arrays
        if len(removed):
            at = self.find(np.ascontiguousarray(removed, np.int64))
            self._drop(at[at >= 0])
        ids = np.ascontiguousarray(ids, np.int64)
        self._reserve(len(ids))
        at = np.empty(len(ids), np.int64)
        self.used = rowkernels.index_find(self._index, ids, at, self.ids, self.used, True)
        self.counts[at], self.last[at], self.when[at] = counts, last, when
        if self.used != record["used"]:
            raise ValueError(f"the pending counts hold {self.used} ids after their checkpoints, not {record['used']}")
        self.forgotten = record["forgotten"]
        self.saved()
