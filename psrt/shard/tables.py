"""A shard's embedding-table ops: ``init_table``, ``push_rows`` and ``pull_rows``, with their sync rounds.

The dense rules carry over, per table: in sync mode a round's pushes are coalesced and summed per row as they
arrive (one sum per table, never a copy per worker), and once all W are in (the elastic members, in an elastic
job) the row-wise optimizer steps once with ``scale = 1/W`` and the table's version goes up by one. A worker
already in a table's round has its next push held, validated, until the round completes; a ``pull_rows`` asking
for a version the table has not reached waits, queued, for the round that makes it. In async mode (or W = 1)
every push is one step. Pushes are exactly-once per ``(table, worker, session, seq)``.

Every request is validated in full before any state changes (ids and row counts, dtype and dim, fixed tables'
id range, NaN/Inf by the shard's policy, and the caps of :class:`~psrt.config.RowLimits`), so a refused message
changes nothing. The shard (:class:`psrt.shard.server.Server`) hands these requests to :class:`TableService`.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Optional, Union

import numpy as np

from psrt import kernels, optim, wire
from psrt.config import RowLimits
from psrt.errors import ConfigError, RequestRefused
from psrt.shard import realign, replay, stragglers
from psrt.shard.embedding import RowTable
from psrt.shard.replay import WorkerLog
from psrt.tablespec import TableSpec

__all__ = ["TableService", "REQUESTS"]

#: The requests :class:`TableService` serves.
REQUESTS = (wire.InitTableRequest, wire.PushRowsRequest, wire.PullRowsRequest, wire.TableStatsRequest)
RowRequest = Union[wire.InitTableRequest, wire.PushRowsRequest, wire.PullRowsRequest, wire.TableStatsRequest]


class TableService:
    """The embedding tables of one shard and their rounds.

    Parameters
    ----------
    store : Store
        The shard's dense store: its mode, W and elastic members are the tables' too.
    reply : callable
        ``reply(identity, frames)`` sends a reply.
    error : callable
        ``error(identity, request_id, code, message)`` sends an error reply.
    nonfinite : str
        The shard's NaN/Inf policy (``"reject"`` refuses such gradients).
    limits : RowLimits, optional
        Caps (the shard's :attr:`ServerConfig.row_limits <psrt.config.ServerConfig>`); from the environment when
        omitted.
    """

    def __init__(self, store: Any, reply: Callable[[bytes, list[Any]], None],
                 error: Callable[[bytes, int, str, str], None], nonfinite: str = "reject",
                 limits: Optional[RowLimits] = None) -> None:
        self.store = store
        self._reply = reply
        self._error = error
        self.nonfinite = nonfinite
        self.limits = limits if limits is not None else RowLimits()
        self.tables: dict[str, RowTable] = {}
        self.logs: dict[tuple[str, int], WorkerLog] = {}
        self._deferred: dict[tuple[str, int], deque[tuple[bytes, wire.PushRowsRequest]]] = {}
        self._waiting: dict[str, list[tuple[bytes, wire.PullRowsRequest]]] = {}
        self.pushes = self.pulls = self.rounds = 0
        self.dropped_pushes = 0  # push_rows too late for a round closed without them, or of a round a restore lost
        #: Tables whose rounds their pushes' clocks decide, from a restore until each completes a round
        #: (:mod:`psrt.shard.realign`).
        self.realigning = 0
        #: ``ssp``: how many pushes a worker may run ahead of the slowest (set with the job's mode).
        self.staleness = 0
        self._clocks: dict[str, dict[int, int]] = {}  # ssp: per table, each worker's latest applied clock
        #: The time rows are stamped with and their ttl is judged by (wall time: it survives a restart).
        self.clock: Callable[[], float] = time.time
        #: Says why a sync round needing a finished worker is refused (set by :meth:`set_finished`).
        self.finished_message: Callable[[int], str] = str
        #: A replicated job: the copies of these tables to the range's replicas
        #: (:class:`psrt.shard.tablecopy.TableCopies`), made before anything a push or init made true is answered.
        self.copies: Optional[Any] = None

    # ------------------------------------------------------------------ dispatch
    def handle(self, identity: bytes, req: RowRequest) -> None:
        """Serve one table request; a refused one gets an error reply and changes nothing."""
        try:
            self._handle(identity, req)
        except RequestRefused as exc:
            self._error(identity, req.id, exc.code, str(exc))

    def _handle(self, identity: bytes, req: RowRequest) -> None:
        if isinstance(req, wire.TableStatsRequest):
            self._reply(identity, wire.encode_stats(req.id, self.table_stats(self._table(req.table))))
            return
        if len(req.ids) > self.limits.max_rows_per_message:
            raise RequestRefused("too_many_rows", f"{len(req.ids)} ids in one message; this shard takes at most "
                                           f"{self.limits.max_rows_per_message} (PSRT_MAX_ROWS_PER_MESSAGE)")
        if isinstance(req, wire.PushRowsRequest):
            self._push(identity, req)
        elif isinstance(req, wire.PullRowsRequest):
            self._pull(identity, req)
        else:
            self._init(identity, req)

    def _table(self, name: str) -> RowTable:
        table = self.tables.get(name)
        if table is None:
            raise RequestRefused("unknown_table", f"table {name!r} is not initialized on this shard; call "
                                           "client.init_embedding() first")
        return table

    def _check_ids(self, table: RowTable, ids: np.ndarray) -> None:
        n = table.spec.num_rows
        if n is not None and len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n):
            bad = ids[(ids < 0) | (ids >= n)][0]
            raise RequestRefused("id_range", f"id {int(bad)} is outside table {table.name!r}'s rows [0, {n})")
        if not table.room_for(len(ids)):
            found = table.find(ids)
            new = len(np.unique(ids[found < 0]))
            if not table.room_for(new):
                raise RequestRefused("table_full", f"table {table.name!r} would hold {table.used + new} rows on this "
                                            f"shard; the cap is {table.max_rows} (PSRT_MAX_TABLE_ROWS)")

    def _check_rows(self, table: RowTable, req: Any, rows: np.ndarray, what: str) -> None:
        spec = table.spec
        if req.dim != spec.dim or req.dtype != spec.dtype:
            raise RequestRefused("mismatch", f"table {table.name!r} holds rows of {spec.dim} x {spec.dtype} but the "
                                      f"message has {req.dim} x {req.dtype}")
        if self.nonfinite == "reject" and not kernels.all_finite(rows.reshape(-1)):
            raise RequestRefused("nonfinite", f"{what} of table {table.name!r} has NaN or Inf; nothing was applied")

    # ------------------------------------------------------------------ init
    def _init(self, identity: bytes, req: wire.InitTableRequest) -> None:
        try:
            spec = TableSpec(dim=req.dim, dtype=req.dtype, optimizer=optim.from_wire(req.optimizer), init=req.init,
                             a=req.a, b=req.b, seed=req.seed, num_rows=req.num_rows, **(req.policy or {}))
        except ConfigError as exc:
            raise RequestRefused("bad_table", f"table {req.table!r}: {exc}") from None
        if spec.capacity is not None and spec.capacity > self.limits.max_table_rows:
            raise RequestRefused("bad_table", f"table {req.table!r}: capacity {spec.capacity} is above this shard's "
                                 f"cap of {self.limits.max_table_rows} rows per table (PSRT_MAX_TABLE_ROWS)")
        table = self.tables.get(req.table)
        existed = table is not None
        if table is not None and table.spec != spec:
            raise RequestRefused("mismatch", f"table {req.table!r} exists with another definition (the table's vs this "
                                      f"init's: {table.spec.differences(spec)}); every worker must pass the same one")
        if table is None:
            table = RowTable(spec, self.limits.max_table_rows, req.table)
        if req.rows is not None:
            self._check_rows(table, req, req.rows, "initial value")
            self._check_ids(table, req.ids)
            if len(np.unique(req.ids)) != len(req.ids):
                raise RequestRefused("duplicate_ids", "initial rows list an id twice")
        self.tables[req.table] = table  # only once everything above passed
        if req.rows is not None:
            table.set_missing(req.ids, req.rows)
        if self.copies is not None:  # the table (and its rows) held R + 1 times before any worker learns of it
            self.copies.commit(req.table, table, req.ids if req.rows is not None else None)
        self._reply(identity, wire.encode_ack(req.id, [table.version], existed))

    # ------------------------------------------------------------------ push
    def _push(self, identity: bytes, req: wire.PushRowsRequest) -> None:
        table = self._table(req.table)
        if not self.store.is_member(req.worker):
            raise RequestRefused("not_member", f"worker {req.worker} is not a member of this elastic job")
        self._check_rows(table, req, req.grads, "gradient")
        self._check_ids(table, req.ids)
        key = (req.table, req.worker)
        replay.check_window(self.logs.get(key), req.session, req.seq, f"push_rows of worker {req.worker}")
        if self._by_clock() and realign.stale_round(table, req.worker, req.clock) \
                and not replay.is_duplicate(self.logs.get(key), req.session, req.seq):
            realign.drop_round(table)  # (restored: a push of this round was lost with the previous life)
            self._completed(req.table, table)  # its pushers' pulls are answered, their next pushes taken
        late = self._late(table, req)  # (a round that closed without this push, or one a restore lost)
        if self.store.finished and not late \
                and not replay.is_duplicate(self.logs.get(key), req.session, req.seq):
            missing = self.store.missing_finished(table.round, req.worker)
            if missing is not None:
                raise RequestRefused("peer_finished", self.finished_message(missing))
        if self._deferred.get(key) or (self.store.rounds and req.worker in table.round.contributors and not late):
            self._deferred.setdefault(key, deque()).append((identity, req))  # a round ahead: wait for it
            return
        self._accept(identity, table, req)

    def _accept(self, identity: bytes, table: RowTable, req: wire.PushRowsRequest) -> None:
        if replay.is_duplicate(self.logs.get((req.table, req.worker)), req.session, req.seq):
            target = table.version + (1 if req.worker in table.round.contributors else 0)
            if self.copies is None or not self.copies.hold(identity, req.id, req.table, target, True):
                self._reply(identity, wire.encode_ack(req.id, [target], True))
            return
        if self._late(table, req):  # dropped, never applied; taken (its seq), answered with what its pushes reach
            replay.record(self.logs, (req.table, req.worker), req.session, req.seq)
            self.pushes += 1
            self.dropped_pushes += 1
            target = table.version + (1 if req.worker in table.round.contributors else 0)
            self._reply(identity, wire.encode_ack(req.id, [target], False))
            return
        now = self.clock()  # (a dropped push counts toward no admission and refreshes no row)
        slots, grads = table.push(req.ids, req.grads, now)
        if self.copies is not None:
            self.copies.pushed(req.table, req.ids)
        replay.record(self.logs, (req.table, req.worker), req.session, req.seq)
        self.pushes += 1
        if not self.store.rounds:
            table.apply(slots, grads, 1.0, marked=True)  # (push marked its rows changed)
            table.evict_due(now)
            if self.store.mode == "ssp":
                clocks = self._clocks.setdefault(req.table, {})
                clocks[req.worker] = max(clocks.get(req.worker, 0), req.clock)
            if self.copies is not None:  # every push is a step: held R + 1 times before it is acknowledged (its
                self.copies.defer(req.table, table)  # copy and ack go with the batch's, the ack kept back till then)
            self._reply(identity, wire.encode_ack(req.id, [table.version], False))
            self._completed(req.table, table)
            return
        rnd = table.round
        if not rnd.contributors and self.store.members is not None:
            rnd.expected = self.store.members
        rnd.add(req.worker, slots, grads, req.clock)
        table.evict_due(now)  # never the round's rows: a capacity may be passed until the round completes
        if self.copies is None or not self.copies.hold(identity, req.id, req.table, table.version + 1, False):
            self._reply(identity, wire.encode_ack(req.id, [table.version + 1], False))
        if self._round_done(table):
            self._step_round(req.table, table)

    def _round_done(self, table: RowTable) -> bool:
        rnd = table.round
        return bool(rnd.contributors) and stragglers.round_done(rnd.contributors, self.store.num_workers,
                                                                self.store.members, rnd.expected,
                                                                self.store.backup_workers)

    def _late(self, table: RowTable, req: wire.PushRowsRequest) -> bool:
        """Whether ``req`` joins no round: with backup workers, it was computed from rows older than the round it
        could join (:func:`psrt.shard.stragglers.late`); in any sync job, it belongs to a round a restore lost
        (:func:`psrt.shard.realign.lost_push`)."""
        store = self.store
        if not store.rounds:
            return False
        if not store.drops_late:
            return self._by_clock() and realign.lost_push(table, req.worker, req.clock)
        if req.base is None:
            raise RequestRefused("config", f"this shard runs with --backup-workers {store.backup_workers}, whose "
                                 f"push_rows must say which table version their rows were computed from; worker "
                                 f"{req.worker}'s does not (an older psrt): run the same psrt everywhere")
        return req.base < table.version + (1 if req.worker in table.round.contributors else 0)

    def _by_clock(self) -> bool:
        """Whether pushes' clocks may decide a restored table's rounds (:mod:`psrt.shard.realign`): a fixed sync
        job's, whose every worker counts the same pushes (in an elastic one a worker that joined counts from 1;
        with backup workers a push's base decides)."""
        store = self.store
        return bool(self.realigning) and store.rounds and not store.drops_late and store.members is None

    def _step_round(self, name: str, table: RowTable) -> None:
        rnd = table.round
        assert rnd.slots is not None and rnd.acc is not None
        table.apply(rnd.slots, rnd.acc, 1.0 / len(rnd.contributors))  # the mean over the round's workers
        rnd.clear()
        realign.settled_table(self, table)
        table.evict_due(self.clock())
        self.rounds += 1
        if self.copies is not None:  # the round's rows held R + 1 times before its pulls and acks are answered
            self.copies.commit(name, table)
        self._completed(name, table)

    def _completed(self, name: str, table: RowTable) -> None:
        """A step was applied: answer the pulls it completes, admit pushes that can now join."""
        waiting = self._waiting.pop(name, [])
        still = [(i, r) for i, r in waiting if not self._ready(name, table, r)]
        if still:
            self._waiting[name] = still
        for identity, req in waiting:
            if self._ready(name, table, req):
                self._answer(identity, table, req)
        for key in [k for k in self._deferred if k[0] == name]:
            queue = self._deferred.get(key)
            while queue and not (self.store.rounds and key[1] in table.round.contributors):
                identity, req = queue.popleft()
                self._accept(identity, table, req)
            if not queue:
                self._deferred.pop(key, None)

    def set_members(self) -> None:
        """The elastic members changed: complete the rounds that no longer wait for anyone."""
        for key in [k for k in self._deferred if not self.store.is_member(k[1])]:
            del self._deferred[key]
        for name, table in self.tables.items():
            if table.round.contributors and self._round_done(table):
                self._step_round(name, table)
            elif self.store.mode == "ssp":
                self._completed(name, table)  # the slowest worker may have been the one that left

    def set_finished(self, message: Callable[[int], str]) -> None:
        """A fixed job's workers finished (``store.finished``): refuse the pulls and queued pushes of sync rounds
        that still need one of them (``message(worker)`` says why), now and from now on."""
        self.finished_message = message
        finished = self.store.finished
        if not self.store.rounds:
            if self.store.mode == "ssp":
                for name, table in self.tables.items():
                    self._completed(name, table)  # they no longer bound the others' reads
            return
        for name, table in self.tables.items():
            missing = self.store.missing_finished(table.round)
            if missing is None:
                continue
            for identity, req in self._waiting.pop(name, []):
                self._error(identity, req.id, "peer_finished", message(missing))
        for key in [k for k in self._deferred if k[0] in self.tables]:
            for identity, req in self._deferred.pop(key):
                self._error(identity, req.id, "peer_finished", message(min(finished)))

    # ------------------------------------------------------------------ pull
    def _pull(self, identity: bytes, req: wire.PullRowsRequest) -> None:
        table = self._table(req.table)
        self._check_ids(table, req.ids)
        queued = len(self._deferred.get((req.table, req.worker), ()))
        reachable = table.version + (1 + queued if self.store.mode == "sync" else 0)
        if req.min_version > reachable:
            raise RequestRefused("version", f"pull of table {req.table!r} asks for version {req.min_version} but it is "
                                     f"at {table.version}; no push of this worker will produce it")
        if req.min_version > table.version and self.store.finished:
            missing = self.store.missing_finished(table.round)
            if missing is not None:
                raise RequestRefused("peer_finished", self.finished_message(missing))
        self.pulls += 1
        if self._ready(req.table, table, req):
            self._answer(identity, table, req)
        else:
            self._waiting.setdefault(req.table, []).append((identity, req))

    def _ready(self, name: str, table: RowTable, req: wire.PullRowsRequest) -> bool:
        """Whether a pull can be answered: its version is there (sync), or (ssp) every worker's pushes to the
        table have reached the pull's clock minus the staleness bound."""
        if self.store.mode != "ssp":
            return req.min_version <= table.version
        clocks = self._clocks.get(name, {})
        return min((clocks.get(w, 0) for w in self.store.clocked_workers()), default=0) >= req.clock - self.staleness

    def _answer(self, identity: bytes, table: RowTable, req: wire.PullRowsRequest) -> None:
        if not table.room_for(len(req.ids)):
            try:
                self._check_ids(table, req.ids)
            except RequestRefused as exc:
                self._error(identity, req.id, exc.code, str(exc))
                return
        table.evict_due(self.clock())  # a pull sees no row whose ttl has passed
        if req.lane is not None and req.out is not None:  # over a shared-memory lane: gathered into its area there
            rows = table.gather(req.ids, req.out)
            self._reply(identity, wire.encode_rows(req.id, req.table, table.version, rows, req.lane.generation))
            return
        self._reply(identity, wire.encode_rows(req.id, req.table, table.version, table.gather(req.ids)))

    # ------------------------------------------------------------------ replication
    def reply(self, identity: bytes, frames: list[Any]) -> None:
        """Send a reply (an ack held until its round was copied)."""
        self._reply(identity, frames)

    def clocks_of(self, name: str) -> dict[int, int]:
        """ssp: each worker's latest applied clock of table ``name``."""
        return self._clocks.get(name, {})

    def set_clocks(self, name: str, clocks: dict[int, int]) -> None:
        """A replica: adopt the ssp clocks of table ``name`` its copy carried."""
        self._clocks[name] = dict(clocks)

    # ------------------------------------------------------------------ checkpoints
    def state(self, delta: bool = False) -> tuple[list[tuple[dict[str, Any], list[np.ndarray]]], list[list[Any]]]:
        """Every table's checkpoint record and arrays (``delta``: only rows changed since the last checkpoint,
        :meth:`psrt.shard.embedding.RowTable.state`), and the per-table worker sequence numbers."""
        now = self.clock()
        for t in self.tables.values():
            t.evict_due(now)
        # (A log's replay holes, where it has any, are a fifth element: older psrt reads four.)
        logs = [[t, w, log.session, log.last_seq] + ([log.hole_runs()] if log.holes else [])
                for (t, w), log in self.logs.items()]
        return [t.state(delta) for t in self.tables.values()], logs

    def saved(self) -> None:
        """The last :meth:`state` is on disk: the next delta starts from here."""
        for t in self.tables.values():
            t.saved()

    def restore(self, tables: list[RowTable], logs: list[list[Any]]) -> None:
        """Adopt tables and sequence numbers read from a checkpoint."""
        self.tables = {t.name: t for t in tables}
        self.logs = {(t, w): WorkerLog.restored(session, seq, holes[0] if holes else None)
                     for t, w, session, seq, *holes in logs}
        realign.restored_tables(self)  # (its previous life may have taken a push of a round and not another)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """Counters and memory of the tables: rows held, bytes of rows, optimizer slots and id index."""
        mem = [t.memory() for t in self.tables.values()]
        return {"tables": len(self.tables), "table_rows": sum(t.used for t in self.tables.values()),
                "table_row_bytes": sum(m["rows"] for m in mem), "table_slot_bytes": sum(m["slots"] for m in mem),
                "table_index_bytes": sum(m["index"] for m in mem),
                "table_round_bytes": sum(t.round.nbytes() for t in self.tables.values()),
                "row_pushes": self.pushes, "row_pulls": self.pulls, "row_rounds": self.rounds,
                "dropped_row_pushes": self.dropped_pushes,
                "queued_row_pulls": sum(len(w) for w in self._waiting.values())}

    def table_stats(self, t: RowTable) -> dict[str, Any]:
        """A table's counters (the ``table_stats`` reply): ``rows`` (held), ``evicted``, ``admitted`` (rows
        made), ``pending`` (ids counted but not yet admitted), ``forgotten`` (pending ids dropped, for the bound
        or by ttl), ``bytes`` (allocated for rows, optimizer state, index and pending counts), ``version``; as
        the last push, pull or checkpoint left them (a ttl sweep waits for those)."""
        pending = t.pending
        return {"rows": t.used, "evicted": t.evicted, "admitted": t.admitted,
                "pending": pending.used if pending is not None else 0,
                "forgotten": pending.forgotten if pending is not None else 0,
                "bytes": sum(t.memory().values()), "version": t.version}
