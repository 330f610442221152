"""A shard's state: per-key parameters, optimizer slots, sync accumulators, versions, and per-worker sequence
numbers.

A key is ``(name, part)``: one chunk of a tensor, held flat. Its ``version`` counts the optimizer steps applied
to it. The store also owns the rules of a round, since they read nothing but its state: in sync mode a round's
pushes are summed into the key's single accumulator as they arrive, whatever W is, and the optimizer steps once
with ``scale = 1/W`` when the last of the W arrives (:meth:`Store.apply_push`, once :mod:`psrt.shard.admission`
checked the push); a worker already in a key's round must wait for it to complete before pushing again
(:meth:`Store.can_join`); and a pull may only ask for a version that this worker's pushes can still produce
(:meth:`Store.reachable`). With backup workers b a round closes on its first W - b pushes and a push computed from
parameters older than the round it could join is dropped (:meth:`Store.late`; the rule itself is
:mod:`psrt.shard.stragglers`). In async mode every push is one step.

An :class:`Entry` owns its parameters' storage: private memory, or, where pushes gather into rounds and the shard
has shared memory, an area of the shard's shared parameters (:mod:`psrt.shm.arena`) under a seqlock counter, from
which workers of this host copy a round's result themselves. The store decides which, in one place
(:meth:`Store.use_shared_memory`, for the keys it holds and every key it creates later).

Replies send parameters zero-copy; the store remembers the send trackers and, before a step would overwrite a
buffer ZeroMQ is still sending, swaps in a copy (copy-on-write; a shared key's copy is private, and its
readers of this host are answered through their lanes from then on). In BSP the previous round's replies are long
gone by the time the next round completes, so in practice no copy is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from psrt import kernels
from psrt.config import MODES
from psrt.errors import ConfigError
from psrt.optim import Optimizer
from psrt.shard import realign, replay, stragglers
from psrt.shard.replay import WorkerLog
from psrt.shm.arena import Arena, SharedArea
from psrt.wire import compression

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
    #: Sync mode: workers whose push is in the current round (in ``acc``, or in ``held``).
    contributors: set[int] = field(default_factory=set)
    #: Sync mode: gradients of the round still in their workers' shared memory (which stays untouched until
    #: the round's answer), summed in one pass when the round completes (:meth:`settle`).
    held: list[np.ndarray] = field(default_factory=list)
    #: Whether ``acc`` holds part of the current round.
    acc_filled: bool = False
    #: Elastic sync: the members when the current round began (a worker that joins later is not waited for).
    expected: frozenset[int] = frozenset()
    #: Sync mode: when the current round's first push came (``time.monotonic``), and ``(round, opened)`` of the
    #: last closed rounds (:mod:`psrt.shard.stragglers` measures each push against them).
    opened: float = 0.0
    closed: Any = None
    closed_at: float = 0.0
    #: Sync mode, after a push's base moved the version up (:func:`psrt.shard.realign.jump`): ``(from, to)``, the
    #: versions skipped, and the workers whose push of a skipped round was dropped; None once a round completed.
    skipped: Optional[tuple[int, int]] = None
    realigned: Optional[set[int]] = None
    #: ``ssp``: each worker's clock (its count of pushes) as far as its pushes to this key have been applied.
    clocks: dict[int, int] = field(default_factory=dict)
    #: Zero-copy sends of ``param`` that may still be reading it.
    trackers: list[Any] = field(default_factory=list)
    #: 16-bit copies of ``param`` for the replies of 16-bit workers: codec -> (version, (wire name, array) or None).
    packed: dict[str, tuple[int, Any]] = field(default_factory=dict)
    #: Where ``param`` lies while it is in the shard's shared memory, which workers of this host copy it from
    #: (:meth:`share`); None while it is private.
    shared: Optional[SharedArea] = None
    #: ``shared.seqlock`` while shared, else None: the parameters' seqlock counter, odd while a step writes them
    #: (kept at hand: every step reads it).
    seqlock: Optional[np.ndarray] = None

    def packed_param(self, codec: str) -> Any:
        """``param`` in a 16-bit form (:func:`psrt.wire.compression.encode`), made once per version: the W replies of
        a round share it instead of each converting the whole tensor again."""
        cached = self.packed.get(codec)
        if cached is None or cached[0] != self.version:
            cached = self.packed[codec] = (self.version, compression.encode(codec, self.param))
        return cached[1]

    def share(self, arena: Arena) -> bool:
        """Move the parameters into ``arena`` (shared memory), under a seqlock counter; False when it has no room
        (they stay private)."""
        area = arena.allocate(self.param.dtype, self.param.size)
        if area is None:
            return False
        np.copyto(area.param, self.param.reshape(-1))
        self.param = area.param.reshape(self.param.shape)
        self.shared, self.seqlock = area, area.seqlock
        return True

    def shared_place(self) -> list[int]:
        """``[generation, offset, counter]`` where a worker of this host copies the parameters from, or ``[]``
        where they are private (never shared, or copied since: copy-on-write) and the shard writes them into the
        worker's lane."""
        area = self.shared
        if area is None or self.seqlock is None:
            return []
        return [area.generation, area.offset, kernels.seq_read(self.seqlock)]

    def writable_param(self) -> np.ndarray:
        """The parameter buffer, replaced by a copy first if a zero-copy send may still be reading it."""
        if self.trackers:
            if any(not t.done for t in self.trackers):
                self.param = self.param.copy()
                # Private from now on: the shared area keeps this version for its readers; later ones get copies.
                self.shared = self.seqlock = None
            self.trackers.clear()
        return self.param

    def apply(self, grad: np.ndarray, scale: float) -> None:
        """One optimizer step with ``scale * grad``; bumps the version."""
        param = self.writable_param() if self.trackers else self.param
        if self.seqlock is not None:
            kernels.seq_bump(self.seqlock)  # odd: a worker of this host copying the parameters now tries again
        self.optimizer.step(param, self.slots, grad, scale, self.version + 1)
        self.version += 1
        if self.seqlock is not None:
            kernels.seq_bump(self.seqlock)

    def add_to_round(self, worker: int, grad: np.ndarray, hold: bool = False) -> None:
        """Add a worker's gradient to the round: summed into the accumulator now (the first one overwrites it),
        or with ``hold``, kept where it is until :meth:`settle` (the caller guarantees it stays unchanged)."""
        self.contributors.add(worker)
        if hold:
            self.held.append(grad)
            return
        if self.acc is None:
            self.acc = np.empty_like(self.param)
        if self.acc_filled:
            kernels.accumulate(self.acc, grad)
        else:
            np.copyto(self.acc, grad)
            self.acc_filled = True

    def settle(self) -> None:
        """Sum the held gradients into the accumulator (all of them in one pass over memory)."""
        if self.held:
            if self.acc is None:
                self.acc = np.empty_like(self.param)
            kernels.sum_into(self.acc, self.held, self.acc_filled)
            self.acc_filled = True
            self.held.clear()


class Store:
    """All keys of one shard, the round rules, and the per-worker sequence numbers that make pushes exactly-once.

    Parameters
    ----------
    mode : str
        ``"sync"`` (a round of W pushes, one step), ``"async"`` or ``"ssp"`` (a step per push).
    num_workers : int
        W.
    backup_workers : int or "auto"
        Sync mode: b, a round closes on its first W - b pushes (:mod:`psrt.shard.stragglers`); ``"auto"``: b is
        picked from the measured lateness (:attr:`auto`, which sets :attr:`backup_workers`).
    """

    def __init__(self, mode: str = "sync", num_workers: int = 1, backup_workers: int = 0) -> None:
        self.entries: dict[Key, Entry] = {}
        self.workers: dict[int, WorkerLog] = {}
        self.mode, self.num_workers = "sync", 1
        #: Elastic jobs: the current member ranks (None: a fixed job of ranks 0..W-1).
        self.members: Optional[frozenset[int]] = None
        #: A fixed job's workers that said ``done`` while others go on (the scheduler's ``finished`` notice).
        self.finished: frozenset[int] = frozenset()
        #: The shard's shared parameters, where keys of a job with rounds live (:meth:`use_shared_memory`).
        self.arena: Optional[Arena] = None
        self.backup_workers = 0
        #: ``--backup-workers auto``: what picks :attr:`backup_workers` (None: a fixed b).
        self.auto: Optional[stragglers.AutoBackup] = None
        #: Keys restored from a checkpoint (or moved up since) that have not completed a round yet: while any is,
        #: a push's base is compared with its keys' versions (:mod:`psrt.shard.realign`).
        self.realigning = 0
        self.set_job(mode, num_workers, backup_workers)

    def set_job(self, mode: str, num_workers: int, backup_workers: int = 0) -> None:
        """Adopt the job's mode, W and backup workers (before any push)."""
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        if type(num_workers) is not int or num_workers < 1:
            raise ConfigError(f"num_workers must be a positive integer, got {num_workers!r}")
        auto = backup_workers == "auto" and mode == "sync"
        if not auto and (type(backup_workers) is not int or backup_workers < 0):
            raise ConfigError(f"backup_workers must be a whole number >= 0 or auto, got {backup_workers!r}")
        self.mode, self.num_workers = mode, num_workers
        # (Only sync rounds have stragglers to leave behind.)
        self.auto = stragglers.AutoBackup(num_workers) if auto else None
        if self.auto is not None:
            self.backup_workers = self.auto.first()
        else:
            self.backup_workers = 0 if mode != "sync" else int(backup_workers)

    @property
    def drops_late(self) -> bool:
        """Whether pushes too late for a closed round are dropped (backup workers, fixed or auto)."""
        return bool(self.backup_workers or self.auto is not None)

    @property
    def rounds(self) -> bool:
        """True when pushes gather into rounds (sync mode with W > 1, or any elastic sync job)."""
        return self.mode == "sync" and (self.num_workers > 1 or self.members is not None)

    def is_member(self, worker: int) -> bool:
        """Whether ``worker`` may push (always, in a fixed job)."""
        return self.members is None or worker in self.members

    def set_members(self, workers: frozenset[int]) -> list[Key]:
        """Adopt an elastic job's new member set; returns the keys whose round it completed.

        A round in progress completes once every member it was waiting for has pushed: a worker that left is no
        longer waited for, and the round's step averages over the workers that did push.
        """
        joined = frozenset(workers) - (self.members if self.members is not None else frozenset())
        if joined and self.mode == "ssp":
            for entry in self.entries.values():  # a joining worker starts at the slowest clock, not at 0
                slowest = self.slowest_clock(entry)
                for w in joined:
                    entry.clocks[w] = max(entry.clocks.get(w, 0), slowest)
        self.members = frozenset(workers)
        completed = []
        for key, entry in self.entries.items():
            if entry.contributors and self._round_done(entry):
                self._step_round(entry)
                completed.append(key)
        return completed

    def _round_done(self, entry: Entry) -> bool:
        return stragglers.round_done(entry.contributors, self.num_workers, self.members, entry.expected,
                                     self.backup_workers)

    def _step_round(self, entry: Entry) -> None:
        stragglers.closing(entry)
        entry.settle()
        assert entry.acc is not None
        entry.apply(entry.acc, 1.0 / len(entry.contributors))  # the mean of the pushes in the round
        entry.contributors.clear()
        entry.acc_filled = False
        if entry.skipped is not None:
            realign.settled(self, entry)

    # ------------------------------------------------------------------ the round
    def can_join(self, worker: int, entries: list[Entry], late: Optional[list[bool]] = None) -> bool:
        """Whether a push of ``worker`` to these keys can be taken now (else it waits for their rounds); ``late``
        (:meth:`late`): keys it is late for, which it does not join (they are dropped at once)."""
        if late is None:
            return not self.rounds or not any(worker in e.contributors for e in entries)
        return not self.rounds or not any(worker in e.contributors for e, x in zip(entries, late) if not x)

    def late(self, worker: int, entries: list[Entry], base: Any) -> Optional[list[bool]]:
        """Per key, whether a push of ``worker`` computed from version(s) ``base`` is late for a round that closed
        without it (backup workers, :func:`psrt.shard.stragglers.late`); None when none is."""
        if not self.drops_late or not self.rounds:
            return None
        return stragglers.late(1, worker, entries, base)

    def apply_push(self, worker: int, entries: list[Entry], grads: list[np.ndarray],
                   hold: bool = False, late: Optional[list[bool]] = None) -> tuple[list[int], list[int]]:
        """Apply one push: sum it into each key's round (sync) or step with it (async, or W = 1).

        The caller has checked :meth:`can_join` and validated every gradient (:mod:`psrt.shard.admission`), so
        nothing here can fail halfway.
        ``hold``: the gradients stay unchanged until their round completes (a push_pull over a shared-memory
        lane), so a round sums them all at its end (:meth:`Entry.settle`) instead of one by one.
        ``late`` (:meth:`late`): keys whose gradient is dropped, not applied; their target is what this worker's
        earlier pushes reach.

        Returns
        -------
        targets : list of int
            Per key, the version that will include this push.
        completed : list of int
            Indices of the keys whose version moved (a round completed, or the push was applied).
        """
        targets, completed = [], []
        rounds = self.rounds
        for i, (entry, grad) in enumerate(zip(entries, grads)):
            if late is not None and late[i]:
                targets.append(entry.version + (1 if worker in entry.contributors else 0))
                continue
            if not rounds:
                entry.apply(grad, 1.0)
                completed.append(i)
                targets.append(entry.version)
                continue
            if not entry.contributors and self.members is not None:
                entry.expected = self.members  # who this round waits for
            entry.add_to_round(worker, grad, hold)
            targets.append(entry.version + 1)
            if self._round_done(entry):
                self._step_round(entry)
                completed.append(i)
        return targets, completed

    @staticmethod
    def tick_clocks(worker: int, entries: list[Entry]) -> None:
        """``ssp``: one more push of ``worker`` to these keys is applied. Clocks are per key (so per tensor): a
        worker's clock for a key counts its pushes of it, whatever else each push carried."""
        for e in entries:
            e.clocks[worker] = e.clocks.get(worker, 0) + 1

    def slowest_clock(self, entry: Entry) -> int:
        """``ssp``: the least clock of the job's workers (or members) as far as this key has seen their pushes."""
        return min((entry.clocks.get(w, 0) for w in self.clocked_workers()), default=0)

    def clocked_workers(self) -> Any:
        """``ssp``: the workers whose clocks bound a read: the members, less those that finished (their pushes
        are all in, so waiting for them would wait forever)."""
        workers = self.members if self.members is not None else range(self.num_workers)
        return [w for w in workers if w not in self.finished] if self.finished else workers

    def missing_finished(self, entry: Any, worker: Optional[int] = None) -> Optional[int]:
        """Sync rounds: a finished worker that the round a push of ``worker`` would join (or, with ``worker``
        None, the round in progress) still needs; None when there is none. Such a round can never complete.
        ``entry``: anything whose ``contributors`` are its round's (an :class:`Entry`, a table's round)."""
        if not self.finished or not self.rounds:
            return None
        # (With b backup workers a round completes without b pushes: b finished workers can be missing.)
        if worker is not None and worker in entry.contributors:
            # It would join the next round, which every finished worker misses.
            return min(self.finished) if len(self.finished) > self.backup_workers else None
        if worker is None and not entry.contributors:
            return None  # no round in progress
        missing = [w for w in sorted(self.finished) if w not in entry.contributors]
        return missing[0] if len(missing) > self.backup_workers else None

    def targets(self, worker: int, entries: list[Entry]) -> list[int]:
        """Per key, the version that includes everything ``worker`` has pushed so far (for a replayed push)."""
        return [e.version + (1 if worker in e.contributors else 0) for e in entries]

    def reachable(self, entry: Entry, queued: int) -> int:
        """The highest version of ``entry`` a worker with ``queued`` pushes waiting to join can still cause."""
        return entry.version + (1 + queued if self.mode == "sync" else 0)

    def get(self, key: Key) -> Optional[Entry]:
        """The entry of ``key``, or None."""
        return self.entries.get(key)

    def create(self, key: Key, value: np.ndarray, optimizer: Optimizer) -> Entry:
        """Store a copy of ``value`` as the parameters of a new key, with fresh optimizer state (in shared memory
        where :meth:`use_shared_memory` says)."""
        param = np.array(value, copy=True).reshape(-1)
        entry = Entry(param=param, optimizer=optimizer, slots=optimizer.init_slots(param))
        self.entries[key] = entry
        self._place(entry)
        return entry

    def use_shared_memory(self, arena: Optional[Arena]) -> None:
        """Keep parameters in ``arena`` (None: nowhere) where pushes gather into rounds: those of every key held now
        (a restored checkpoint's), and of each key created later.

        A round's result stays put until every worker pushes again, so the workers of this host copy it from the
        shard's memory themselves; where every push is a step (async, ssp, W = 1) they stay private and each
        answer is written into the worker's lane.
        """
        self.arena = arena
        for entry in self.entries.values():
            self._place(entry)

    def _place(self, entry: Entry) -> None:
        # The one decision of where a key's parameters live; a key that stays private is answered through lanes.
        if self.arena is not None and self.rounds and entry.shared is None:
            entry.share(self.arena)

    def is_duplicate(self, worker: int, session: int, seq: int) -> bool:
        """True when ``seq`` was already applied for this worker's session (a retry or replay), in any order
        (:mod:`psrt.shard.replay`: a push below the highest one applied that was not is no duplicate).

        A new session (the worker restarted) starts a fresh sequence.
        """
        return replay.is_duplicate(self.workers.get(worker), session, seq)

    def check_window(self, worker: int, session: int, seq: int) -> None:
        """Refuse a push older than the worker's replay window (:func:`psrt.shard.replay.check_window`)."""
        replay.check_window(self.workers.get(worker), session, seq, f"push of worker {worker}")

    def record(self, worker: int, session: int, seq: int) -> None:
        """Remember that push ``seq`` of this worker's session has been applied."""
        replay.record(self.workers, worker, session, seq)

    def nbytes(self) -> int:
        """Bytes of parameters held."""
        return sum(e.param.nbytes for e in self.entries.values())

    def accumulators(self) -> tuple[int, int]:
        """(number of sync accumulators allocated, their bytes)."""
        accs = [e.acc for e in self.entries.values() if e.acc is not None]
        return len(accs), sum(a.nbytes for a in accs)
