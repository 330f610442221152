"""The NumPy oracle of the combination suite (tests/test_combinations.py): what each read of a job must hold.

From the documented semantics, with SGD (lr = 1, no momentum) from zeros and the gradients of
tests/_combo_worker.py: a sync round steps with the mean of the pushes it got (of those who pushed it, once a
worker left an elastic job); async and ssp apply each push once, on arrival, with scale 1, so every read is the
sum of a prefix of each worker's pushes, which the workers' counter entries name; ssp (staleness s) answers a
worker that has pushed a tensor c times only once every worker still in the job has pushed it c - s times.
Every value involved is exact in float32 (and in fp16 where fp16 carries it), so every check is exact.
"""

from __future__ import annotations

import math
from functools import cache
from typing import NamedTuple, Optional

import _combo_worker as cw
import numpy as np

from psrt.config import ClientConfig

__all__ = ["WORKERS", "SERVERS", "STEPS", "STALENESS", "LEAVE_AFTER", "BACKUP", "sent", "compression_ratio",
           "Oracle", "exact"]

#: The shape of every job: W workers, S shards, steps per worker, ssp's bound.
WORKERS, SERVERS, STEPS, STALENESS = 2, cw.SHARDS, 6, 2
#: A worker that leaves the job (by closing its client, or by a script that raises) leaves after this many steps.
LEAVE_AFTER = 3
#: sync rounds with one backup worker, where worker 1 always pushes after worker 0 closed the round (dropped).
BACKUP = "sync_b1"


def compression_ratio(compression: Optional[str]) -> Optional[float]:
    """RATIO of ``topk:RATIO``; None for any other compression."""
    if compression and compression.startswith("topk:"):
        return float(compression.split(":", 1)[1])
    return None


class Piece(NamedTuple):
    """One chunk of a tensor, as every client's shard map cuts it."""

    start: int
    count: int
    shard: int


@cache
def pieces(tensor: int, network: bool) -> tuple[Piece, ...]:
    """The chunks of tensor ``t{tensor}``, in order, cut for a network (``PSRT_PIPELINE=on``) or not."""
    from psrt.partition import PartitionMap

    pmap = PartitionMap(SERVERS, ClientConfig().partition_bytes, network=network)
    pmap.add({f"t{t}": ((n,), np.dtype(np.float32)) for t, n in enumerate(cw.SIZES)})
    return tuple(sorted(Piece(c.start, c.count, c.shard) for c in pmap.chunks[f"t{tensor}"]))


@cache
def sent(kind: str, ratio: Optional[float], worker: int, tensor: int, network: bool = False,
         resets: Optional[tuple[Optional[float], ...]] = None) -> np.ndarray:
    """``(STEPS, n)``: what worker ``worker``'s pushes of ``tensor`` carry to the shards, step by step.

    Without top-k, the gradient itself (fp16 carries these values exactly). With top-k, the documented rule, chunk
    by chunk (:func:`pieces`): the ``ceil(ratio * count)`` entries of largest magnitude of gradient + residual
    travel, the rest is the residual; and a chunk's residual starts from zero again when the client learns that
    its shard restarted: ``resets[i]`` is when for chunk i, in steps (``k - 0.5``: before step k's push was made,
    0-based; ``k + 0.5``: after it; None: never).
    """
    grads = np.stack([cw.dense_grad(kind, worker, s, tensor).astype(np.float64) for s in range(STEPS)])
    if ratio is None:
        return grads
    chunks = pieces(tensor, network)
    return np.concatenate([_topk(grads[:, p.start:p.start + p.count], ratio, resets[i] if resets else None)
                           for i, p in enumerate(chunks)], axis=1)


def _topk(grads: np.ndarray, ratio: float, reset: Optional[float]) -> np.ndarray:
    """One chunk's pushes under top-k with error feedback (see :func:`sent`)."""
    n = grads.shape[1]
    k = min(n, max(1, math.ceil(ratio * n)))
    residual = np.zeros(n)
    out = np.zeros_like(grads)
    for s in range(STEPS):
        if reset is not None and s - 0.5 == reset:
            residual = np.zeros(n)
        total = grads[s] + residual
        mags = np.abs(total)
        order = np.argsort(-mags, kind="stable")
        # The test's own precondition: with a tie at the boundary, top-k may pick either entry.
        assert mags[order[k - 1]] > mags[order[k]], "the test's gradients tie at top-k's boundary"
        out[s, order[:k]] = total[order[:k]]
        residual = total
        residual[order[:k]] = 0.0
        if reset is not None and s + 0.5 == reset:
            residual = np.zeros(n)
    return out


class Oracle:
    """What a case's reads and final values must hold.

    Parameters
    ----------
    mode : str
        ``sync``, ``async`` or ``ssp`` (with :data:`STALENESS`), or :data:`BACKUP`.
    compression : str or None
        The workers' compression (``PSRT_COMPRESSION``).
    leaves : bool
        Whether worker 1 leaves the job after :data:`LEAVE_AFTER` steps.
    restart : (int, str, int, int or None), optional
        A shard restarts: its index, the workers' call pattern, the steps done before its death, and how many of a
        split tensor's pieces for it a paced call sends before it waits (None: the call is not paced, every
        piece goes at once). The workers' first push to it afterwards waits for its return, during which they
        learn of it (and reset the top-k residuals of its chunks): after that push was made, so before any later
        push of the same step (only ``one_by_one`` makes one), and before the next step's. A paced call makes
        (encodes) a held-back piece only as it sends it, once the shard answered the ones before: after the
        reset.
    network : bool
        Whether the clients cut tensors for a network (``PSRT_PIPELINE=on``): top-k picks per chunk.
    """

    def __init__(self, mode: str, compression: Optional[str], leaves: bool,
                 restart: Optional[tuple[int, str, int]] = None, network: bool = False) -> None:
        self.mode = mode
        ratio = compression_ratio(compression)
        kind = cw.grad_kind(compression)
        resets: dict[int, tuple[Optional[float], ...]] = {}
        if restart is not None:
            victim, calls, done, ahead = restart
            on_it = [t for t in range(len(cw.SIZES)) if any(p.shard == victim for p in pieces(t, network))]
            for i, t in enumerate(on_it):  # one_by_one pushes t0, t1, ... one call each; others all at once
                if calls == "one_by_one" and i > 0:
                    resets[t] = tuple(done - 0.5 if p.shard == victim else None for p in pieces(t, network))
                    continue
                whens: list[Optional[float]] = []
                sent_at_once = 0  # a paced call sends the first ``ahead`` pieces of a split tensor, in key order
                for p in pieces(t, network):
                    if p.shard != victim:
                        whens.append(None)
                        continue
                    held = ahead is not None and len(pieces(t, network)) > 1 and sent_at_once >= ahead
                    sent_at_once += 1
                    whens.append(done - 0.5 if held else done + 0.5)
                resets[t] = tuple(whens)
        self.sent = {(w, t): sent(kind, ratio, w, t, network, resets.get(t)) for w in range(WORKERS)
                     for t in range(len(cw.SIZES))}
        #: Pushes per worker (each step pushes every tensor once, and the table once).
        self.pushes = [LEAVE_AFTER if leaves and w == 1 else STEPS for w in range(WORKERS)]
        self.row_ids = cw.all_row_ids(WORKERS, SERVERS)
        self.position = {int(i): p for p, i in enumerate(self.row_ids)}
        from psrt.kernels.rows import shard_of

        self.row_shard = shard_of(self.row_ids, SERVERS)

    def pushers(self, step: int) -> list[int]:
        """The workers whose pushes make round ``step`` (0-based): with a backup worker, worker 0 alone (worker 1's
        pushes come late for every round, :data:`BACKUP`)."""
        return [w for w in range(WORKERS) if step < self.pushes[w] and (self.mode != BACKUP or w == 0)]

    # ---------------------------------------------------------------- dense
    def sync_params(self, tensor: int, rounds: int) -> np.ndarray:
        """The parameters after ``rounds`` sync rounds: each steps with the mean of its pushes (lr = 1)."""
        p = np.zeros(cw.SIZES[tensor])
        for r in range(rounds):
            who = self.pushers(r)
            p -= sum(self.sent[(w, tensor)][r] for w in who) / len(who)
        return p

    def applied(self, tensor: int, counts: list[int]) -> np.ndarray:
        """The parameters once the first ``counts[w]`` pushes of each worker w were applied (scale 1, lr = 1)."""
        return -sum(self.sent[(w, tensor)][:c].sum(axis=0) for w, c in enumerate(counts))

    # ---------------------------------------------------------------- table
    def row_delta(self, worker: int, step: int) -> np.ndarray:
        """Worker ``worker``'s push to the table at ``step``, summed per row (rows in :attr:`row_ids` order)."""
        ids, grads = cw.row_push(worker, step, SERVERS)
        out = np.zeros((len(self.row_ids), cw.DIM))
        np.add.at(out, [self.position[int(i)] for i in ids], grads.astype(np.float64))
        return out

    def sync_rows(self, rounds: int) -> np.ndarray:
        rows = np.zeros((len(self.row_ids), cw.DIM))
        for r in range(rounds):
            who = self.pushers(r)
            rows -= sum(self.row_delta(w, r) for w in who) / len(who)
        return rows

    def applied_rows(self, counts: list[int]) -> np.ndarray:
        return -sum((self.row_delta(w, s) for w, c in enumerate(counts) for s in range(c)),
                    np.zeros((len(self.row_ids), cw.DIM)))

    # ---------------------------------------------------------------- checks
    def counts(self, what: str, values: np.ndarray, per: np.ndarray) -> list[int]:
        """The pushes of each worker a read holds, from the workers' counter entries (async and ssp)."""
        counts = []
        for w in range(WORKERS):
            c = -float(values[w]) / per[w]
            assert c == int(c) and 0 <= c <= self.pushes[w], f"{what}: worker {w}'s counter reads {values[w]}"
            counts.append(int(c))
        return counts

    def check_staleness(self, what: str, own: int, reader: int, counts: list[int]) -> None:
        assert counts[reader] == own, f"{what}: holds {counts[reader]} of this worker's {own} pushes"
        if self.mode == "ssp":
            for w, c in enumerate(counts):
                floor = min(own - STALENESS, self.pushes[w])  # a worker that left is no longer waited for
                assert c >= floor, (f"{what}: read after {own} pushes while worker {w} had {c} applied "
                                    f"(staleness bound {STALENESS}: at least {floor})")

    def check_dense(self, what: str, reader: int, step: int, tensor: int, value: np.ndarray, final: bool) -> None:
        value = value.astype(np.float64)
        if self.mode in ("sync", BACKUP):
            exact(what, value, self.sync_params(tensor, STEPS if final else step))
            return
        # A tensor's chunks are applied apart (async, ssp): each span between counters holds its own prefix.
        starts = cw.counter_starts(tensor)
        for start, end in zip(starts, (*starts[1:], cw.SIZES[tensor])):
            where = what if len(starts) == 1 else f"{what}, [{start}:{end}]"
            counts = self.counts(where, value[start:start + WORKERS], np.full(WORKERS, cw.COUNT))
            if final:
                assert counts == self.pushes, f"{where}: final values hold {counts} pushes, not {self.pushes}"
            else:
                self.check_staleness(where, step, reader, counts)
            exact(where, value[start:end], self.applied(tensor, counts)[start:end])

    def check_rows(self, what: str, reader: int, step: int, rows: np.ndarray, final: bool) -> None:
        rows = rows.astype(np.float64)
        if self.mode in ("sync", BACKUP):
            exact(what, rows, self.sync_rows(STEPS if final else step))
            return
        # Each shard applies a push's rows at once; shards may be at different prefixes.
        for shard in range(SERVERS):
            on = self.row_shard == shard
            counters = [self.position[int(cw.count_ids(w, SERVERS)[shard])] for w in range(WORKERS)]
            where = f"{what}, shard {shard}"
            counts = self.counts(where, rows[counters, 0], np.ones(WORKERS))
            if final:
                assert counts == self.pushes, f"{where}: final rows hold {counts} pushes, not {self.pushes}"
            else:
                self.check_staleness(where, step, reader, counts)
            exact(where, rows[on], self.applied_rows(counts)[on])


def exact(what: str, actual: np.ndarray, expected: np.ndarray) -> None:
    """Fail, saying where and by how much, unless ``actual`` equals ``expected`` bit for bit."""
    if not np.array_equal(actual, expected):
        bad = np.flatnonzero(actual.reshape(-1) != expected.reshape(-1))
        raise AssertionError(f"{what}: {bad.size} of {actual.size} values differ from the oracle (max "
                             f"{np.abs(actual - expected).max():g}; first at flat index {bad[0]}: "
                             f"{actual.reshape(-1)[bad[0]]} != {expected.reshape(-1)[bad[0]]})")
