"""The worker's side of embedding tables: ``init_embedding``, ``pull_rows``, ``push_rows`` and their async forms.

:class:`EmbeddingClient` serves these calls for :class:`psrt.Client`. A table's rows are spread over the S shards
by a stable hash of the id, ``shard = mix64(id) % S`` (splitmix64's finaliser, :func:`psrt.kernels.rows.shard_of`),
so rows spread evenly whatever the id pattern (contiguous, strided, or hot ids alike) and every worker computes
the same map. A call sorts its ids by shard once (a counting sort, :func:`psrt.kernels.rows.shard_order`) and
sends one message per shard with that shard's ids as a contiguous int64 frame: no Python loop over rows. A pull
asks each shard for its distinct ids once (the shards' parts and their distinct ids come from one kernel call,
:func:`psrt.kernels.rows.unique_by_shard`: hashing, no sort) and puts each answer in place as it comes, every
row moved straight from the answer to each place it was asked for (:func:`psrt.kernels.rows.move_rows`), or, for
rows shorter than :data:`MOVED_ROW_BYTES`, gathers them all into the caller's order once the last answer is in
(:func:`psrt.kernels.rows.gather_rows`); with S = 1 and every id once, the rows land in the output directly. To
a shard of this host, a call of at least 64 KiB carries its ids and rows in the shard's shared-memory lane
(:meth:`psrt.worker.sender.ShardSender.pull_rows`, ``push_rows``), and a pull's answer is taken from there.

A push goes to every shard, even one with no ids this time (an empty message), so that in sync mode every
shard's round counts every worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from psrt import dtypes, optim, wire
from psrt.errors import ConfigError, ProtocolError, PsrtTypeError
from psrt.kernels import rows as rowkernels
from psrt.shm.lanes import LaneUse
from psrt.tablespec import INITIALIZERS, TableSpec
from psrt.worker.calls import ShardCalls
from psrt.worker.handles import Handle
from psrt.worker.sender import ShardSender

__all__ = ["EmbeddingClient", "RowsHandle"]

#: Most ids the client puts in one ``init_table`` message (the shard's default cap is 4x this).
_INIT_ROWS = 1 << 20


#: Rows of at least this many bytes are moved into the caller's output as each shard's answer comes; shorter ones
#: are put in a buffer as they come and into the caller's order by one gather at the end, whose writes run in
#: order: moving 64-byte rows into an output other work pushed out of cache made a pull at S = 4 level to 5 %
#: slower, while moving 128-byte rows made it 3-5 % faster and 1 KiB rows 12-16 % (docs/measurements.md).
MOVED_ROW_BYTES = 128


class RowsHandle(Handle):
    """A ``pull_rows`` in flight; :meth:`wait` returns the ``(len(ids), dim)`` rows in the caller's order.

    Each shard's answer has one row per distinct id the shard was asked for (``asked``). With ``buf`` it lands in
    ``buf[asked.start:asked.start + asked.count]`` and :meth:`wait` gathers the caller's rows from there
    (``gather``). Else it is put in place as it comes, while the others' are on their way: row
    ``asked.inverse[m]`` goes to ``out[asked.places[m]]`` (:func:`psrt.kernels.rows.move_rows`), straight from the
    request's lane area or the socket's frame; without ``places`` (S = 1) the caller's row m is answer row
    ``inverse[m]``; without ``inverse`` either (S = 1, every id once), the answer is ``out`` itself.
    """

    def __init__(self, calls: Any, name: str, out: np.ndarray, num_shards: int, buf: Optional[np.ndarray] = None,
                 gather: Optional[np.ndarray] = None) -> None:
        super().__init__(calls, "pull_rows", None)
        self._name, self._out, self._buf, self._gather = name, out, buf, gather
        #: Per shard, what it was asked for (set before its request is sent; None: nothing).
        self.asked: list[Optional[_Asked]] = [None] * num_shards

    def wait(self, timeout: Optional[float] = None) -> np.ndarray:  # type: ignore[override]
        """Wait for every shard's rows and return them (see :meth:`psrt.Handle.wait` for the errors)."""
        super().wait(timeout)
        if self._gather is not None and self._buf is not None:
            rowkernels.gather_rows(self._buf, self._gather, self._out, checked=True)  # (unique_by_shard's)
            self._gather = None
        return self._out

    def _take_rows(self, ch: Any, reply: wire.RowsReply, shard: int, lane: Optional[LaneUse] = None) -> None:
        """Put ``shard``'s ``rows`` in place, from the socket's frame or the request's lane area (called by
        :mod:`psrt.worker.calls`, which then takes the table's version in)."""
        asked, out = self.asked[shard], self._out
        if (asked is None or reply.table != self._name or reply.count != asked.count or reply.dim != out.shape[1]
                or reply.dtype != out.dtype):
            raise ProtocolError(f"rows reply for {reply.table!r} ({reply.count} x {reply.dim}) does not match "
                                f"the request ({asked.count if asked else 0} x {out.shape[1]} of {self._name!r})")
        count = asked.count
        shape = (count, out.shape[1])
        # Where the answer lands as it is: its part of the buffer, or out itself (S = 1, every id once).
        dest = out if asked.inverse is None else None
        if self._buf is not None:
            dest = self._buf[asked.start:asked.start + count]
        if reply.lane is not None:  # the shard wrote the rows into this request's area of the lane
            if lane is None or reply.lane != lane.ref.generation or len(lane.ref.outputs) != 1 or ch.more():
                raise ProtocolError("rows reply names a shared-memory lane this request did not use")
            rows = lane.output(0, out.dtype, count * out.shape[1]).reshape(shape)
            if dest is not None:
                np.copyto(dest, rows)
                return
        else:
            if not ch.more():
                raise ProtocolError("rows reply has no rows frame")
            rows = dest if dest is not None else np.empty(shape, out.dtype)
            got = ch.recv_into(memoryview(rows).cast("B") if rows.size else bytearray())
            if got != reply.nbytes or ch.more():
                raise ProtocolError(f"rows frame has {got} bytes (or extra frames); expected {reply.nbytes}")
            if dest is not None:
                return
        if asked.places is None:  # (the row kernel: np.take copies a short row with a call of its own)
            rowkernels.gather_rows(rows, asked.inverse, out, checked=True)  # (unique_first's)
        else:
            rowkernels.move_rows(rows, asked.inverse, out, asked.places, checked=True)  # (unique_by_shard's)


@dataclass
class _Asked:
    """What one shard was asked for by a ``pull_rows``: ``count`` distinct ids, and where their rows go (see
    :class:`RowsHandle`)."""

    count: int
    inverse: Optional[np.ndarray]
    places: Optional[np.ndarray]
    start: int = 0


@dataclass
class _Table:
    dim: int
    dtype: np.dtype
    num_rows: Optional[int]


class EmbeddingClient:
    """The embedding-table calls of a :class:`psrt.Client`, which checks it is open before each.

    Parameters
    ----------
    calls : ShardCalls
        The client's requests in flight.
    senders : sequence of ShardSender
        The client's senders, in shard order.
    rank, session : int
        The worker's rank and session.
    """

    def __init__(self, calls: ShardCalls, senders: Sequence[ShardSender], rank: int, session: int) -> None:
        self._calls = calls
        self._senders = senders
        self._rank, self._session = rank, session
        self._tables: dict[str, _Table] = {}
        self._seq: dict[str, list[int]] = {}  # per table, the next push sequence number per shard
        self._clock: dict[str, int] = {}  # per table, this worker's push_rows so far (ssp)

    def init_embedding(self, name: str, dim: int, optimizer: Optional[optim.Optimizer], initial: Optional[Any],
                       num_rows: Optional[int], dtype: Any, init: str, std: float, low: float, high: float, seed: int,
                       timeout: Optional[float], admit_after: int = 1, capacity: Optional[int] = None,
                       ttl: Optional[float] = None, max_pending: Optional[int] = None) -> None:
        """:meth:`psrt.Client.init_embedding`."""
        optimizer = optim.SGD(lr=0.01) if optimizer is None else optimizer
        dtype = np.dtype(dtype)
        if dtype not in dtypes.SUPPORTED:
            raise PsrtTypeError(f"dtype must be {dtypes.describe()}, got {dtype}")
        rows = None
        if initial is not None:
            rows = np.ascontiguousarray(initial, dtype=dtype)
            if rows.ndim != 2 or rows.shape[1] != dim or (num_rows is not None and rows.shape[0] != num_rows):
                raise ConfigError(f"initial must have shape (num_rows, {dim}), got {rows.shape}")
            num_rows = rows.shape[0]
        if init not in INITIALIZERS:
            raise ConfigError(f"init must be one of {sorted(INITIALIZERS)}, got {init!r}")
        a, b = (low, high) if init == "uniform" else (0.0, std)
        policy = TableSpec(dim=dim, dtype=dtype, optimizer=optimizer, init=init, a=float(a), b=float(b), seed=seed,
                           num_rows=num_rows, admit_after=admit_after, capacity=capacity, ttl=ttl,
                           max_pending=max_pending).policy()  # checks every field before anything is sent
        handle = Handle(self._calls, "init_embedding", None)
        spec = optimizer.to_wire()
        splits = self._split(np.arange(num_rows, dtype=np.int64)) if rows is not None else None
        for shard, sender in enumerate(self._senders):
            pieces: list[tuple[np.ndarray, Optional[np.ndarray]]] = [(np.empty(0, np.int64), None)]
            if splits is not None and rows is not None:
                order, offsets = splits
                sel = order[offsets[shard]:offsets[shard + 1]] if order is not None else slice(None)
                ids, mine = np.arange(num_rows, dtype=np.int64)[sel], rows[sel]
                pieces = [(ids[i:i + _INIT_ROWS], np.ascontiguousarray(mine[i:i + _INIT_ROWS]))
                          for i in range(0, max(len(ids), 1), _INIT_ROWS)]
            for ids, part in pieces:
                sender.send(handle, lambda rid, i=ids, p=part: wire.encode_init_table(
                    rid, self._rank, name, dim, dtype, spec, init, float(a), float(b), seed, num_rows, i, p, policy),
                    table=name)
        handle.wait(timeout)
        self._tables[name] = _Table(dim, dtype, num_rows)

    def _split(self, ids: np.ndarray) -> tuple[Optional[np.ndarray], np.ndarray]:
        """``(order, offsets)``: ids sorted by shard (None: already in order, S = 1) and each shard's range."""
        s = len(self._senders)
        if s == 1:
            return None, np.array([0, len(ids)])
        order, offsets, _ = rowkernels.shard_order(ids, s)  # (a counting sort: a stable argsort costs more)
        return order, offsets

    def _ids(self, name: str, ids: Any) -> tuple[_Table, np.ndarray]:
        table = self._tables.get(name)
        if table is None:
            raise ConfigError(f"table {name!r} was never initialized; call client.init_embedding({name!r}, ...)")
        a = np.asarray(ids)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise PsrtTypeError(f"ids must be a 1-D integer array, got {a.ndim}-D {a.dtype}")
        if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
            raise ConfigError("ids must fit int64")
        a = np.ascontiguousarray(a, dtype=np.int64)
        if table.num_rows is not None and a.size and (int(a.min()) < 0 or int(a.max()) >= table.num_rows):
            bad = a[(a < 0) | (a >= table.num_rows)][0]
            raise ConfigError(f"id {int(bad)} is outside table {name!r}'s rows [0, {table.num_rows})")
        return table, a

    def pull_rows_async(self, name: str, ids: Any, out: Optional[np.ndarray]) -> RowsHandle:
        """:meth:`psrt.Client.pull_rows_async`."""
        table, a = self._ids(name, ids)
        shape = (len(a), table.dim)
        if out is None:
            out = np.empty(shape, table.dtype)
        elif (not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != table.dtype
              or not out.flags.c_contiguous or not out.flags.writeable):
            raise ConfigError(f"out must be a writable C-contiguous array of shape {shape} and dtype {table.dtype}")
        # A repeated id travels once: each shard is asked for its distinct ids, and its answer is put in place as
        # it comes, or, rows shorter than MOVED_ROW_BYTES, gathered into place once at the end (RowsHandle).
        num_shards = len(self._senders)
        versions = self._calls.versions.tables
        clock = self._clock.get(name, 0)
        row_bytes = table.dim * table.dtype.itemsize
        if num_shards == 1:
            handle = RowsHandle(self._calls, name, out, 1)
            distinct, inverse = rowkernels.unique_first(a)
            if len(a):
                handle.asked[0] = _Asked(len(distinct), None if len(distinct) == len(a) else inverse, None)
                self._senders[0].pull_rows(handle, self._rank, name, versions[0].get(name, 0), distinct, clock,
                                           len(distinct) * row_bytes)
            return handle
        moved = row_bytes >= MOVED_ROW_BYTES
        distinct, starts, gather, order, offsets, inverse = rowkernels.unique_by_shard(a, num_shards, moved)
        handle = RowsHandle(self._calls, name, out, num_shards) if moved else RowsHandle(
            self._calls, name, out, num_shards, np.empty((len(distinct), table.dim), table.dtype), gather)
        for shard, sender in enumerate(self._senders):
            first, last = int(starts[shard]), int(starts[shard + 1])
            if first == last:
                continue
            if moved:
                lo, hi = int(offsets[shard]), int(offsets[shard + 1])  # type: ignore[index]
                handle.asked[shard] = _Asked(last - first, inverse[lo:hi], order[lo:hi])  # type: ignore[index]
            else:
                handle.asked[shard] = _Asked(last - first, None, None, first)
            sender.pull_rows(handle, self._rank, name, versions[shard].get(name, 0), distinct[first:last], clock,
                             (last - first) * row_bytes)
        return handle

    def push_rows_async(self, name: str, ids: Any, grads: Any) -> Handle:
        """:meth:`psrt.Client.push_rows_async`."""
        table, a = self._ids(name, ids)
        g = np.ascontiguousarray(grads)
        if g.dtype != table.dtype:
            raise PsrtTypeError(f"grads of table {name!r} must be {table.dtype}, got {g.dtype}")
        if g.shape != (len(a), table.dim):
            raise ConfigError(f"grads must have shape {(len(a), table.dim)} for {len(a)} ids, got {g.shape}")
        order, offsets = self._split(a)  # (with order, each shard's ids and rows are gathered once, by its sender)
        handle = Handle(self._calls, "push_rows", None)
        seqs = self._seq.setdefault(name, [0] * len(self._senders))
        clock = self._clock[name] = self._clock.get(name, 0) + 1  # ssp: this worker's pushes to the table, this too
        for shard, sender in enumerate(self._senders):
            lo, hi = int(offsets[shard]), int(offsets[shard + 1])
            seq = seqs[shard]
            seqs[shard] += 1
            # Every push says the table version its rows were computed from (the last pulled from that shard), by
            # which a shard with backup workers drops a straggler's. Always, not only once a shard said it has
            # backup workers: a worker of tables alone sends no dense init, whose answer says it (other shards
            # ignore it).
            base = self._calls.versions.held_tables[shard].get(name, 0)
            if order is None:
                sender.push_rows(handle, name, seq, a[lo:hi], g[lo:hi], clock, base)
            else:
                sender.push_rows(handle, name, seq, a, g, clock, base, order[lo:hi])
        return handle
