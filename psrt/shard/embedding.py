"""A shard's embedding tables: rows addressed by int64 ids, created on first touch, stepped row by row.

A :class:`RowTable` keeps its rows in one contiguous ``(capacity, dim)`` array, with every optimizer slot in an
array of the same shape, and maps ids to row slots with an open-addressing hash index (linear probing, load at
most 1/2, an id and its slot side by side in a cell: one cache miss a lookup; :func:`psrt.kernels.rows.index_find`),
so a lookup or insert is amortized O(1)
and a batch of ids is looked up in one compiled loop. A dict would cost ~100 ns per id in the interpreter; the
compiled index costs a few ns. The row arrays grow geometrically, by 1.2x, through ``ndarray.resize`` (a
``realloc``, which Linux satisfies for large blocks by remapping pages, not copying), so the capacity slack
stays under 20% and no view of the table ever escapes this class (a resize would leave it dangling). The rows,
their slots and the index are backed by transparent huge pages where Linux has them
(:func:`psrt.memory.advise_huge_pages`): a batch touches rows all over the table, and with 4 KiB pages each is a
TLB miss.

A row made on first touch is initialized from ``(seed, id)`` alone (:func:`psrt.kernels.rows.init_rows`), so every
shard and worker agree, and a restarted job gets the same rows. Optimizer steps follow torch's sparse semantics:
only the touched rows and their slots change, duplicate ids are summed first (coalesced), and the step count
that drives AdaGrad's ``lr_decay`` and Adam's bias correction is the table's (one per applied step), as torch
counts steps per parameter tensor.

Rows can also go (:mod:`psrt.shard.rowpolicy`): with ``admit_after``, ``capacity`` or ``ttl`` a table keeps, per
row, its last push (a logical clock, ``last``, and the time, ``when``), and evicting a row removes it from the
index (backward shift, :func:`psrt.kernels.rows.index_remove`) and moves a row from the end into its place, so
the rows stay contiguous. Such a table never makes a row on a pull: a pull of an id without a row (pending,
evicted, or never pushed) returns the id's initial value, which is the row the id would get.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from psrt import optim
from psrt.kernels import rows as rowkernels
from psrt.memory import advise_huge_pages
from psrt.shard.rowpolicy import DEFAULT_MAX_PENDING, Oldest, Pending, compact, expired
from psrt.tablespec import TableSpec

__all__ = ["RowTable", "RowRound", "coalesce"]

_GROWTH = 1.2
_MIN_ROWS = 1024


def coalesce(slots: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum the rows of repeated slots: ``(sorted distinct slots, their summed rows)``, each slot's rows summed in
    the order they come.

    The distinct slots are found by hashing (:func:`psrt.kernels.rows.unique_first`) and only they are sorted:
    a third of what ``np.unique(slots, return_inverse=True)`` costs for 8,192 Zipf ids, the same result.
    """
    first, inverse = rowkernels.unique_first(np.ascontiguousarray(slots, np.int64))
    order = np.argsort(first)
    uniq = first[order]
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order), dtype=np.int64)
    inverse = rank[inverse]
    summed = np.zeros((len(uniq), rows.shape[1]), rows.dtype)
    rowkernels.scatter_add_rows(summed, inverse, rows)
    return uniq, summed


@dataclass
class RowRound:
    """A sync round of one table: the coalesced sum of its pushes so far, and who pushed."""

    contributors: set[int] = field(default_factory=set)
    expected: frozenset[int] = frozenset()
    slots: Optional[np.ndarray] = None
    acc: Optional[np.ndarray] = None
    #: The clock (the worker's count of pushes to the table) of the round's first push: in a sync job, every push
    #: of a round has it (:mod:`psrt.shard.realign` reads it after a restore). None: not known.
    clock: Optional[int] = None

    def add(self, worker: int, slots: np.ndarray, rows: np.ndarray, clock: Optional[int] = None) -> None:
        """Sum a worker's coalesced rows into the round (``clock``: its push's)."""
        if not self.contributors:
            self.clock = clock
        if self.slots is None or self.acc is None:
            self.slots, self.acc = slots, rows
        else:
            self.slots, self.acc = coalesce(np.concatenate([self.slots, slots]), np.concatenate([self.acc, rows]))
        self.contributors.add(worker)

    def clear(self) -> None:
        """Forget the round (after it was applied)."""
        self.contributors.clear()
        self.slots = self.acc = None
        self.clock = None

    def nbytes(self) -> int:
        """Bytes held by the round's sum."""
        return 0 if self.acc is None or self.slots is None else self.acc.nbytes + self.slots.nbytes


class RowTable:
    """One embedding table's rows on one shard, with their optimizer slots and the id index.

    Parameters
    ----------
    spec : TableSpec
        The table's definition.
    max_rows : int
        The most rows this shard holds for the table; touching more is refused.
    name : str
        The table's name (for messages).
    """

    def __init__(self, spec: TableSpec, max_rows: int, name: str = "") -> None:
        self.spec = spec
        self.name = name
        self.max_rows = max_rows
        self.used = 0
        self.version = 0
        self.round = RowRound()
        #: Sync mode: restored from a checkpoint and no round completed since, so pushes' clocks decide the rounds
        #: (:mod:`psrt.shard.realign`).
        self.realigning = False
        cap = min(_MIN_ROWS, max_rows)
        self.param = np.zeros((cap, spec.dim), spec.dtype)
        self.slots = {name: np.zeros_like(self.param) for name in spec.optimizer.slots}
        self.row_ids = np.zeros(cap, np.int64)
        self.last = np.zeros(cap, np.int64)  # per row: the push clock (``tick``) of its last push
        self.when = np.zeros(cap, np.float64)  # per row: the time of its last push
        self.dirty = np.zeros(cap, bool)  # per row: changed since the last checkpoint
        self._index = rowkernels.index_cells(2 * _MIN_ROWS)
        self.tick = 0  # pushes taken in, the clock of least-recently-pushed eviction
        self.evicted = self.admitted = 0
        self.removed: list[np.ndarray] = []  # ids evicted since the last checkpoint
        #: Ids evicted since the last copy to the replicas (a replicated job sets a list: psrt.shard.tablecopy).
        self.copy_removed: Optional[list[np.ndarray]] = None
        self.pending = Pending(spec.admit_after, spec.max_pending or DEFAULT_MAX_PENDING) \
            if spec.admit_after > 1 else None
        self._swept = -np.inf  # when ttl's last sweep ran
        self._oldest = Oldest()  # capacity's next victims

    @property
    def capacity(self) -> int:
        """Rows allocated."""
        return self.param.shape[0]

    # ------------------------------------------------------------------ growth
    def room_for(self, new: int) -> bool:
        """Whether ``new`` more rows fit under ``max_rows``."""
        return self.used + new <= self.max_rows

    def _reserve(self, new: int) -> None:
        need = self.used + new
        if need > self.capacity:
            cap = min(max(need, int(self.capacity * _GROWTH) + 1), self.max_rows)
            for a in (self.param, *self.slots.values()):
                a.resize((cap, self.spec.dim), refcheck=False)  # realloc: no copy of pages Linux can remap
            for b in (self.row_ids, self.last, self.when, self.dirty):
                b.resize(cap, refcheck=False)
            # Rows are touched at random: one TLB entry per 2 MiB, not per 4 KiB. So are the per-row marks a push
            # writes (its clock, time and checkpoint flag), one random write each per row pushed.
            for a in (self.param, *self.slots.values(), self.last, self.when, self.dirty):
                advise_huge_pages(a)
        if 2 * need > len(self._index):
            cells = len(self._index)
            while 2 * need > cells:
                cells *= 2
            self._index = rowkernels.index_cells(cells)
            advise_huge_pages(self._index)
            if self.used:  # re-insert every id in slot order, so each keeps its slot
                known = self.row_ids[:self.used].copy()
                rowkernels.index_find(self._index, known, np.empty(self.used, np.int64), self.row_ids,
                                      0, True)

    # ------------------------------------------------------------------ rows
    def find(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where the id has no row yet (creates nothing)."""
        out = np.empty(len(ids), np.int64)
        if len(ids):
            rowkernels.index_find(self._index, ids, out, self.row_ids, self.used, False)
        return out

    def slots_of(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, creating (and initializing) the rows of ids not seen before.

        The caller checked :meth:`room_for` with the number of new ids (an upper bound: ``len(ids)``).
        """
        n = len(ids)
        if n and self.used + n <= self.capacity and 2 * (self.used + n) <= len(self._index):
            # Room for every id to be new, so nothing would grow: one pass finds the ids and gives the new ones the
            # next slots, in the order they first appear, as the general way below does.
            out, old = np.empty(n, np.int64), self.used
            self.used = rowkernels.index_find(self._index, ids, out, self.row_ids, old, True)
            if self.used > old:
                self._init_new(old, self.used)
            return out
        out = self.find(ids)
        missing = out < 0
        if not missing.any():
            return out  # the common case: nothing to create, and no room to reserve
        new_ids = np.ascontiguousarray(ids[missing])
        self._reserve(len(new_ids))  # an upper bound: repeats of a new id take one slot
        old, got = self.used, np.empty(len(new_ids), np.int64)
        self.used = rowkernels.index_find(self._index, new_ids, got, self.row_ids, old, True)
        self._init_new(old, self.used)
        out[missing] = got
        return out

    def _init_new(self, start: int, stop: int, now: float = 0.0) -> None:
        spec = self.spec
        rowkernels.init_rows(self.param, start, self.row_ids[start:stop], spec.seed, spec.init, spec.a, spec.b)
        for name, a in self.slots.items():
            a[start:stop] = spec.optimizer.slot_fill(name)
        self.last[start:stop], self.when[start:stop], self.dirty[start:stop] = self.tick, now, True
        self.admitted += stop - start

    def set_missing(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Give the rows of ids not seen before the values ``rows`` (distinct ids); existing rows are kept."""
        self._reserve(len(ids))
        old = self.used
        out = np.empty(len(ids), np.int64)
        self.used = rowkernels.index_find(self._index, ids, out, self.row_ids, old, True)
        if self.used > old:
            self._init_new(old, self.used)  # the slots; the values come next
            new = out >= old
            self.param[out[new]] = rows[new]

    def gather(self, ids: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The rows of ``ids`` as a new ``(len(ids), dim)`` array: created on first touch, or (a table whose rows
        come and go, :attr:`TableSpec.managed`) the initial value of an id without a row, making nothing."""
        if out is None:
            out = np.empty((len(ids), self.spec.dim), self.spec.dtype)
        # The usual pull: every id holds a row, and one kernel call looks them up and copies their rows.
        slots = np.empty(len(ids), np.int64)
        if not rowkernels.index_gather(self._index, ids, self.param, out, slots):
            return out
        if not self.spec.managed:  # rows to make first (in the order the ids first appear), then every row again
            rowkernels.gather_rows(self.param, self.slots_of(ids), out)
            return out
        held = slots >= 0  # (their rows are in out already)
        spec, missing = self.spec, np.ascontiguousarray(ids[~held])
        fresh = np.empty((len(missing), spec.dim), spec.dtype)
        rowkernels.init_rows(fresh, 0, missing, spec.seed, spec.init, spec.a, spec.b)
        out[~held] = fresh
        return out

    def apply(self, slots: np.ndarray, grad: np.ndarray, scale: float, marked: bool = False) -> None:
        """One optimizer step on the rows ``slots`` (distinct) with ``scale * grad``; bumps the version.

        ``marked``: the rows are marked changed already (the :meth:`push` that just gave these slots did).
        """
        self.spec.optimizer.step_rows(self.param, self.slots, slots, grad, scale, self.version + 1)
        if not marked:
            self.dirty[slots] = True
        self.version += 1

    def push(self, ids: np.ndarray, grads: np.ndarray, now: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """Take a push in: ``(distinct slots, summed rows)`` of its ids that hold a row, coalesced.

        An id without a row gets one now (initialized from ``(seed, id)``, fresh optimizer slots), unless the
        table admits ids after k pushes and this is not its k-th: then the push is counted, and its gradient
        dropped. Every row pushed is marked changed (for the next incremental checkpoint) and, in a table whose
        rows come and go (:attr:`TableSpec.managed`, whose eviction reads them), gets the push clock ``tick``
        and the time ``now`` as its last push.
        """
        # The distinct ids and their summed rows first (one hashing pass, no sort); new rows are made in the order
        # the ids first appear. Where a row lies never decides what is admitted or evicted (psrt.shard.rowpolicy
        # breaks every tie by id), so the order of the distinct ids is free.
        uniq, summed = rowkernels.coalesce_rows(np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(grads))
        if not self.spec.managed:
            slots = self.slots_of(uniq)
            # Only the checkpoint flag: no eviction reads a last push here, and each mark is a random write per row.
            self.dirty[slots] = True
            self.tick += 1
            return slots, summed
        slots = self.find(uniq)
        missing = slots < 0
        if self.pending is not None and missing.any():
            keep = ~missing
            keep[missing] = self.pending.count(uniq[missing], self.tick, now)
            uniq, summed, slots = uniq[keep], summed[keep], slots[keep]
            missing = slots < 0
        if missing.any():
            new_ids = np.ascontiguousarray(uniq[missing])
            self._reserve(len(new_ids))
            old, got = self.used, np.empty(len(new_ids), np.int64)
            self.used = rowkernels.index_find(self._index, new_ids, got, self.row_ids, old, True)
            self._init_new(old, self.used, now)
            slots[missing] = got
        rowkernels.touch_rows(self.last, self.when, self.dirty, slots, self.tick, now)
        self.tick += 1
        return slots, summed

    # ------------------------------------------------------------------ eviction
    def evict_due(self, now: float) -> int:
        """Evict what the table's capacity and ttl say must go now; returns how many rows went.

        Rows of a sync round in progress are never evicted (the table may hold more than its capacity until
        the round completes). The ttl sweep runs when ``ttl / 16`` passed since the last one, so a row not pushed
        for ``ttl`` seconds is gone before a request is served at most ``ttl / 16`` later.
        """
        spec, gone = self.spec, 0
        pinned = self.round.slots
        if spec.ttl is not None and now - self._swept >= spec.ttl / 16:
            self._swept = now
            gone += self.remove(expired(self.when[:self.used], now, spec.ttl, pinned))
            if self.pending is not None:
                self.pending.expire(now, spec.ttl)
        if spec.capacity is not None and self.used > spec.capacity:
            gone += self.remove(self._oldest.take(self.find, self.last[:self.used], self.row_ids[:self.used],
                                                  self.used - spec.capacity, pinned))
        return gone

    def remove(self, victims: np.ndarray) -> int:
        """Evict the rows at the slots ``victims`` (distinct, none in a round in progress), with their optimizer
        state; an evicted id starts over, admission included. Returns how many went."""
        if not len(victims):
            return 0
        columns = [self.param, *self.slots.values(), self.last, self.when, self.dirty]
        gone, holes, movers = compact(self._index, self.row_ids, self.used, victims, columns)
        if self.round.slots is not None and len(holes):
            where = np.arange(self.used, dtype=np.int64)
            where[movers] = holes
            self.round.slots = where[self.round.slots]
        self.used -= len(gone)
        self.evicted += len(gone)
        self.removed.append(gone)
        if self.copy_removed is not None:
            self.copy_removed.append(gone)
        return len(gone)

    # ------------------------------------------------------------------ checkpoints
    def state(self, delta: bool = False) -> tuple[dict[str, Any], list[np.ndarray]]:
        """What a checkpoint keeps of the table: a msgpack-able record and its arrays, in order.

        ``delta``: only the rows changed since the last checkpoint (:meth:`saved` says when one is on disk) and
        the ids evicted since then; everything else (version, round, counters, pending counts) whole.
        """
        rows = np.flatnonzero(self.dirty[:self.used]) if delta else slice(0, self.used)
        removed = np.concatenate(self.removed) if delta and self.removed else np.empty(0, np.int64)
        record, arrays = self.rows_state(rows, removed, delta)
        record["pending"] = None
        if self.pending is not None:
            record["pending"], pending = self.pending.state(delta)
            arrays += pending
        return record, arrays

    def rows_state(self, rows: Any, removed: np.ndarray, delta: bool) -> tuple[dict[str, Any], list[np.ndarray]]:
        """The record and arrays of the table with only ``rows`` (positions, or a slice) and the evicted ids
        ``removed``: what a checkpoint (:meth:`state`) and a replica's copy (:mod:`psrt.shard.tablecopy`) both
        send, before each adds the pending counts its own way."""
        spec, rnd = self.spec, self.round
        record = {"name": self.name, "dim": spec.dim, "dtype": spec.dtype.str, "optimizer": spec.optimizer.to_wire(),
                  "init": spec.init, "a": spec.a, "b": spec.b, "seed": spec.seed, "num_rows": spec.num_rows,
                  "max_rows": self.max_rows, "used": self.used, "version": self.version,
                  "contributors": sorted(rnd.contributors), "expected": sorted(rnd.expected),
                  "round_clock": rnd.clock, "slots": sorted(self.slots), "layout": 2, "delta": delta,
                  "policy": spec.policy(), "tick": self.tick, "evicted": self.evicted, "admitted": self.admitted}
        arrays = [self.param[rows], *(self.slots[n][rows] for n in record["slots"]), self.row_ids[rows],
                  self.last[rows], self.when[rows], removed]
        record["rows"] = len(arrays[0])
        record["round"] = rnd.slots is not None and rnd.acc is not None
        if rnd.slots is not None and rnd.acc is not None:
            arrays += [self.row_ids[rnd.slots], rnd.acc]  # by id: restored rows lie elsewhere
        return record, arrays

    def saved(self) -> None:
        """A checkpoint with this table's :meth:`state` is on disk: the next delta starts from here."""
        self.dirty[:self.used] = False
        self.removed = []
        if self.pending is not None:
            self.pending.saved()

    @staticmethod
    def spec_of(record: dict[str, Any]) -> TableSpec:
        """The definition a checkpoint record holds."""
        policy = record.get("policy") or {}
        return TableSpec(dim=record["dim"], dtype=np.dtype(record["dtype"]),
                         optimizer=optim.from_wire(record["optimizer"]), init=record["init"], a=record["a"],
                         b=record["b"], seed=record["seed"], num_rows=record["num_rows"], **policy)

    @classmethod
    def from_state(cls, record: dict[str, Any], arrays: list[np.ndarray]) -> RowTable:
        """The table a full checkpoint's :meth:`state` describes (the id index is rebuilt from the rows' ids)."""
        if record.get("delta"):
            raise ValueError(f"table {record['name']!r}: a delta record without the full one it builds on")
        table = cls(cls.spec_of(record), record["max_rows"], record["name"])
        if record.get("layout", 1) == 1:  # psrt before eviction: rows, slots, ids, then the round by slot
            used, n = record["used"], len(record["slots"])
            table._upsert(arrays[1 + n], arrays[0], dict(zip(record["slots"], arrays[1:1 + n])), None, None)
            round_arrays = arrays[2 + n:]
            if round_arrays:
                table.round.slots = round_arrays[0]
                table.round.acc = round_arrays[1].reshape(-1, table.spec.dim)
            table.version = record["version"]
            table.round.contributors = set(record["contributors"])
            table.round.expected = frozenset(record["expected"])
            if table.used != used:
                raise ValueError(f"table {record['name']!r} holds {table.used} distinct ids, not {used}")
            return table
        table.apply_delta(record, arrays)
        return table

    def apply_delta(self, record: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """Apply a checkpoint's :meth:`state` to this table: evict the ids it says went, write its rows (an id
        without a row gets one), and take its version, round, counters and pending counts."""
        if self.spec_of(record) != self.spec:
            raise ValueError(f"table {record['name']!r} changed definition between checkpoints")
        n, names = len(record["slots"]), record["slots"]
        it = iter(arrays)
        param, slots = next(it), {name: next(it) for name in names}
        ids, last, when, removed = next(it), next(it), next(it), next(it)
        if len(removed):
            at = self.find(np.ascontiguousarray(removed, np.int64))
            self.remove(at[at >= 0])
        self._upsert(ids, param, slots, last, when)
        self.round.clear()
        if record["round"]:
            round_ids, acc = next(it), next(it)
            at = self.find(np.ascontiguousarray(round_ids, np.int64))
            if (at < 0).any():
                raise ValueError(f"table {record['name']!r}: the round in progress names ids without a row")
            self.round.slots, self.round.acc = at, acc.reshape(-1, self.spec.dim)
        self.round.contributors = set(record["contributors"])
        self.round.expected = frozenset(record["expected"])
        self.round.clock = record.get("round_clock")  # (None from a checkpoint written before it was kept)
        if self.pending is not None and record["pending"] is not None:
            self.pending.apply(record["pending"], [next(it) for _ in range(5)])
        if next(it, None) is not None or n != len(self.slots):
            raise ValueError(f"table {record['name']!r}: arrays do not match its record")
        if self.used != record["used"]:
            raise ValueError(f"table {record['name']!r} holds {self.used} rows after its checkpoints, not "
                             f"{record['used']}")
        self.version, self.tick = record["version"], record["tick"]
        self.evicted, self.admitted = record["evicted"], record["admitted"]
        self.saved()

    def _upsert(self, ids: np.ndarray, param: np.ndarray, slots: dict[str, np.ndarray],
                last: Optional[np.ndarray], when: Optional[np.ndarray]) -> None:
        ids = np.ascontiguousarray(ids, np.int64)
        self._reserve(len(ids))
        at = np.empty(len(ids), np.int64)
        self.used = rowkernels.index_find(self._index, ids, at, self.row_ids, self.used, True)
        dim = self.spec.dim
        self.param[at] = param.reshape(len(ids), dim)
        for name, a in slots.items():
            self.slots[name][at] = a.reshape(len(ids), dim)
        if last is not None and when is not None:
            self.last[at], self.when[at] = last, when

    # ------------------------------------------------------------------ accounting
    def memory(self) -> dict[str, int]:
        """Bytes allocated: ``rows`` (parameters), ``slots`` (optimizer state), ``index`` (id index, slot ids)."""
        return {"rows": self.param.nbytes, "slots": sum(a.nbytes for a in self.slots.values()),
                "index": self._index.nbytes + self.row_ids.nbytes + self.last.nbytes
                + self.when.nbytes + self.dirty.nbytes,
                "pending": self.pending.nbytes() if self.pending is not None else 0}
