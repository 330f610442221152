"""A shard's state: per-key parameters, optimizer slots, sync accumulators, versions, and per-worker sequence
numbers.

A key is ``(name, part)``: one chunk of a tensor, held flat. Its ``version`` counts the optimizer steps applied
to it. In sync mode a round's pushes are summed into the key's single accumulator as they arrive, whatever W
is, and the optimizer steps once with ``scale = 1/W`` when the last of the W arrives.

Replies send parameters zero-copy; the store remembers the send trackers and, before a step would overwrite a
buffer ZeroMQ is still sending, swaps in a copy (copy-on-write). In BSP the previous round's replies are long
gone by the time the next round completes, so in practice no copy is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from psrt import kernels
from psrt.optim import Optimizer

__all__ = ["Entry", "Store", "WorkerLog"]

Key = tuple[str, int]


@dataclass
class Entry:
    """One key's parameters and everything the server keeps for it."""

    param: np.ndarray
    optimizer: Optimizer
    slots: dict[str, np.ndarray]
    version: int = 0
    #: Sync mode: the round's running sum (allocated on the first round that needs it, then reused).
    acc: Optional[np.ndarray] = None
    #: Sync mode: workers whose push is in the current round's accumulator.
    contributors: set[int] = field(default_factory=set)
    #: Zero-copy sends of ``param`` that may still be reading it.
    trackers: list[Any] = field(default_factory=list)

    def writable_param(self) -> np.ndarray:
        """The parameter buffer, replaced by a copy first if a zero-copy send may still be reading it."""
        if self.trackers:
            if any(not t.done for t in self.trackers):
                self.param = self.param.copy()
            self.trackers.clear()
        return self.param

    def apply(self, grad: np.ndarray, scale: float) -> None:
        """One optimizer step with ``scale * grad``; bumps the version."""
        param = self.writable_param()
        self.optimizer.step(param, self.slots, grad, scale, self.version + 1)
        self.version += 1

    def add_to_round(self, worker: int, grad: np.ndarray) -> None:
        """Sum a worker's gradient into the round's accumulator (the first push of a round overwrites it)."""
        if self.acc is None:
            self.acc = np.empty_like(self.param)
        if self.contributors:
            kernels.accumulate(self.acc, grad)
        else:
            np.copyto(self.acc, grad)
        self.contributors.add(worker)


@dataclass
class WorkerLog:
    """The last push sequence number applied for one worker, within its current session (incarnation)."""

    session: int
    last_seq: int = -1


class Store:
    """All keys of one shard, and the per-worker sequence numbers that make pushes exactly-once."""

    def __init__(self) -> None:
        self.entries: dict[Key, Entry] = {}
        self.workers: dict[int, WorkerLog] = {}

    def get(self, key: Key) -> Optional[Entry]:
        """The entry of ``key``, or None."""
        return self.entries.get(key)

    def create(self, key: Key, value: np.ndarray, optimizer: Optimizer) -> Entry:
        """Store a copy of ``value`` as the parameters of a new key, with fresh optimizer state."""
        param = np.array(value, copy=True).reshape(-1)
        entry = Entry(param=param, optimizer=optimizer, slots=optimizer.init_slots(param))
        self.entries[key] = entry
        return entry

    def is_duplicate(self, worker: int, session: int, seq: int) -> bool:
        """True when ``seq`` was already applied for this worker's session (a retry or replay).

        A new session (the worker restarted) starts a fresh sequence.
        """
        log = self.workers.get(worker)
        if log is None or log.session != session:
            return False
        return seq <= log.last_seq

    def record(self, worker: int, session: int, seq: int) -> None:
        """Remember that push ``seq`` of this worker's session has been applied."""
        log = self.workers.get(worker)
        if log is None or log.session != session:
            self.workers[worker] = WorkerLog(session, seq)
        else:
            log.last_seq = max(log.last_seq, seq)

    def nbytes(self) -> int:
        """Bytes of parameters held."""
        return sum(e.param.nbytes for e in self.entries.values())

    def accumulators(self) -> tuple[int, int]:
        """(number of sync accumulators allocated, their bytes)."""
        accs = [e.acc for e in self.entries.values() if e.acc is not None]
        return len(accs), sum(a.nbytes for a in accs)
