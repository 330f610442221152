"""A shard's embedding tables: rows addressed by int64 ids, created on first touch, stepped row by row.

A :class:`RowTable` keeps its rows in one contiguous ``(capacity, dim)`` array, with every optimizer slot in an
array of the same shape, and maps ids to row slots with an open-addressing hash index (linear probing, load at
most 1/2, two int64 cells per entry; :func:`psrt.kernels.rows.index_find`), so a lookup or insert is amortized O(1)
and a batch of ids is looked up in one compiled loop. A dict would cost ~100 ns per id in the interpreter; the
compiled index costs a few ns. The row arrays grow geometrically, by 1.2x, through ``ndarray.resize`` (a
``realloc``, which Linux satisfies for large blocks by remapping pages, not copying), so the capacity slack
stays under 20% and no view of the table ever escapes this class (a resize would leave it dangling).

A row made on first touch is initialized from ``(seed, id)`` alone (:func:`psrt.kernels.rows.init_rows`), so every
shard and worker agree, and a restarted job gets the same rows. Optimizer steps follow torch's sparse semantics:
only the touched rows and their slots change, duplicate ids are summed first (coalesced), and the step count
that drives AdaGrad's ``lr_decay`` and Adam's bias correction is the table's (one per applied step), as torch
counts steps per parameter tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from psrt import optim
from psrt.kernels import rows as rowkernels
from psrt.tablespec import TableSpec

__all__ = ["RowTable", "RowRound", "coalesce"]

_GROWTH = 1.2
_MIN_ROWS = 1024


def coalesce(slots: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum the rows of repeated slots: ``(sorted distinct slots, their summed rows)``."""
    uniq, inverse = np.unique(slots, return_inverse=True)
    summed = np.zeros((len(uniq), rows.shape[1]), rows.dtype)
    rowkernels.scatter_add_rows(summed, inverse.reshape(-1).astype(np.int64, copy=False), rows)
    return uniq.astype(np.int64, copy=False), summed


@dataclass
class RowRound:
    """A sync round of one table: the coalesced sum of its pushes so far, and who pushed."""

    contributors: set[int] = field(default_factory=set)
    expected: frozenset[int] = frozenset()
    slots: Optional[np.ndarray] = None
    acc: Optional[np.ndarray] = None

    def add(self, worker: int, slots: np.ndarray, rows: np.ndarray) -> None:
        """Sum a worker's coalesced rows into the round."""
        if self.slots is None or self.acc is None:
            self.slots, self.acc = slots, rows
        else:
            self.slots, self.acc = coalesce(np.concatenate([self.slots, slots]), np.concatenate([self.acc, rows]))
        self.contributors.add(worker)

    def clear(self) -> None:
        """Forget the round (after it was applied)."""
        self.contributors.clear()
        self.slots = self.acc = None

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
        cap = min(_MIN_ROWS, max_rows)
        self.param = np.zeros((cap, spec.dim), spec.dtype)
        self.slots = {name: np.zeros_like(self.param) for name in spec.optimizer.slots}
        self.row_ids = np.zeros(cap, np.int64)
        self._keys = np.zeros(2 * _MIN_ROWS, np.int64)
        self._vals = np.full(2 * _MIN_ROWS, -1, np.int64)

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
            self.row_ids.resize(cap, refcheck=False)
        if 2 * need > len(self._keys):
            cells = len(self._keys)
            while 2 * need > cells:
                cells *= 2
            self._keys, self._vals = np.zeros(cells, np.int64), np.full(cells, -1, np.int64)
            if self.used:  # re-insert every id in slot order, so each keeps its slot
                known = self.row_ids[:self.used].copy()
                rowkernels.index_find(self._keys, self._vals, known, np.empty(self.used, np.int64), self.row_ids,
                                      0, True)

    # ------------------------------------------------------------------ rows
    def find(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where the id has no row yet (creates nothing)."""
        out = np.empty(len(ids), np.int64)
        if len(ids):
            rowkernels.index_find(self._keys, self._vals, ids, out, self.row_ids, self.used, False)
        return out

    def slots_of(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, creating (and initializing) the rows of ids not seen before.

        The caller checked :meth:`room_for` with the number of new ids (an upper bound: ``len(ids)``).
        """
        out = self.find(ids)
        missing = out < 0
        if not missing.any():
            return out  # the common case: nothing to create, and no room to reserve
        new_ids = np.ascontiguousarray(ids[missing])
        self._reserve(len(new_ids))  # an upper bound: repeats of a new id take one slot
        old, got = self.used, np.empty(len(new_ids), np.int64)
        self.used = rowkernels.index_find(self._keys, self._vals, new_ids, got, self.row_ids, old, True)
        self._init_new(old, self.used)
        out[missing] = got
        return out

    def _init_new(self, start: int, stop: int) -> None:
        spec = self.spec
        rowkernels.init_rows(self.param, start, self.row_ids[start:stop], spec.seed, spec.init, spec.a, spec.b)
        for name, a in self.slots.items():
            a[start:stop] = spec.optimizer.slot_fill(name)

    def set_missing(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Give the rows of ids not seen before the values ``rows`` (distinct ids); existing rows are kept."""
        self._reserve(len(ids))
        old = self.used
        out = np.empty(len(ids), np.int64)
        self.used = rowkernels.index_find(self._keys, self._vals, ids, out, self.row_ids, old, True)
        if self.used > old:
            self._init_new(old, self.used)  # the slots; the values come next
            new = out >= old
            self.param[out[new]] = rows[new]

    def gather(self, ids: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The rows of ``ids`` (created on first touch), as a new ``(len(ids), dim)`` array."""
        slots = self.slots_of(ids)
        if out is None:
            out = np.empty((len(ids), self.spec.dim), self.spec.dtype)
        rowkernels.gather_rows(self.param, slots, out)
        return out

    def apply(self, slots: np.ndarray, grad: np.ndarray, scale: float) -> None:
        """One optimizer step on the rows ``slots`` (distinct) with ``scale * grad``; bumps the version."""
        self.spec.optimizer.step_rows(self.param, self.slots, slots, grad, scale, self.version + 1)
        self.version += 1

    def push(self, ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slots of a push's ids (rows created on first touch), coalesced: ``(distinct slots, summed rows)``."""
        return coalesce(self.slots_of(ids), grads)

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> tuple[dict[str, Any], list[np.ndarray]]:
        """What a checkpoint keeps of the table: a msgpack-able record and its arrays, in order."""
        spec = self.spec
        record = {"name": self.name, "dim": spec.dim, "dtype": spec.dtype.str, "optimizer": spec.optimizer.to_wire(),
                  "init": spec.init, "a": spec.a, "b": spec.b, "seed": spec.seed, "num_rows": spec.num_rows,
                  "max_rows": self.max_rows, "used": self.used, "version": self.version,
                  "contributors": sorted(self.round.contributors), "expected": sorted(self.round.expected),
                  "slots": sorted(self.slots)}
        arrays = [self.param[:self.used], *(self.slots[n][:self.used] for n in record["slots"]),
                  self.row_ids[:self.used]]
        if self.round.slots is not None and self.round.acc is not None:
            arrays += [self.round.slots, self.round.acc]
        return record, arrays

    @classmethod
    def from_state(cls, record: dict[str, Any], arrays: list[np.ndarray]) -> RowTable:
        """The table a checkpoint's :meth:`state` describes (the id index is rebuilt from the rows' ids)."""
        spec = TableSpec(dim=record["dim"], dtype=np.dtype(record["dtype"]),
                         optimizer=optim.from_wire(record["optimizer"]), init=record["init"], a=record["a"],
                         b=record["b"], seed=record["seed"], num_rows=record["num_rows"])
        table = cls(spec, record["max_rows"], record["name"])
        used = record["used"]
        table._reserve(used)
        n = len(record["slots"])
        param, slots, row_ids, round_arrays = arrays[0], arrays[1:1 + n], arrays[1 + n], arrays[2 + n:]
        table.param[:used] = param.reshape(used, spec.dim)
        for name, a in zip(record["slots"], slots):
            table.slots[name][:used] = a.reshape(used, spec.dim)
        got = np.empty(used, np.int64)
        table.used = rowkernels.index_find(table._keys, table._vals, np.ascontiguousarray(row_ids), got,
                                           table.row_ids, 0, True)
        table.version = record["version"]
        if round_arrays:
            table.round.slots, table.round.acc = round_arrays[0], round_arrays[1].reshape(-1, spec.dim)
            table.round.contributors = set(record["contributors"])
            table.round.expected = frozenset(record["expected"])
        return table

    # ------------------------------------------------------------------ accounting
    def memory(self) -> dict[str, int]:
        """Bytes allocated: ``rows`` (parameters), ``slots`` (optimizer state), ``index`` (id index, slot ids)."""
        return {"rows": self.param.nbytes, "slots": sum(a.nbytes for a in self.slots.values()),
                "index": self._keys.nbytes + self._vals.nbytes + self.row_ids.nbytes}
