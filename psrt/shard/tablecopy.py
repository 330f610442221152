"""A replicated job's embedding tables (``--replicas R``): each table's rows of a range held by the range's replicas.

The dense keys' copies are :mod:`psrt.shard.replication`'s; a range's tables ride the same channel, to the same
replicas, under the same rules (docs/architecture.md, "Replication"), one ``replicate_rows`` message
(:mod:`psrt.wire.rowcopy`) per table and copy:

- **What goes.** A table's checkpoint record (:meth:`psrt.shard.embedding.RowTable.state`) cut down to what changed
  since its last copy: the rows the pushes since then touched (their values, optimizer slots, push clocks and
  times; rows made on a pull of a table whose rows never go), the ids evicted since then, the admission counts of
  the ids pushed and those that left the pending map, and whole the table's version, push clock, counters and
  round in progress; with the table's per-worker sequence numbers (and ssp clocks). A round's copy carries its
  resulting rows once, never each worker's pushes.
- **When.** In sync mode once a round is stepped, before anything it made true is answered: the pulls waiting for
  its version, and the ``push_rows`` acks of the round, held until then. In async and ssp modes every push is a
  step, copied before it is acknowledged. An ``init_table`` is copied before it is answered.
- **Whole tables.** A replica that connected anew (a server that took a dead one's place), and the remaining
  replicas of a range a standby took over, get every table whole (:meth:`TableCopies.copy_all`), which replaces
  theirs.

On the replica (:func:`take`) a copy is checked whole before anything changes: the job's token, a range it backs
and its current primary (the dense copies' checks), then the table's definition, dtype and shapes, and that the
rows and admission counts it leaves add up to what the record says.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np

from psrt.errors import ConfigError
from psrt.shard.embedding import RowTable
from psrt.shard.replay import WorkerLog
from psrt.wire import encode_ack
from psrt.wire import rowcopy as messages

__all__ = ["TableCopies", "take"]

log = logging.getLogger("psrt.replication")


class TableCopies:
    """The primary side of one range's tables: what changed since each one's last copy, its copies, and the sync
    acks held until their round is copied. Used from the thread serving the range (its :class:`Copier`'s).

    Parameters
    ----------
    copier : psrt.shard.replication.Copier
        The range's copier: its replicas, its channel, its token and rank.
    service : psrt.shard.tables.TableService
        The range's tables.
    """

    def __init__(self, copier: Any, service: Any) -> None:
        self.copier, self.service = copier, service
        self._touched: dict[str, list[np.ndarray]] = {}  # per table: the ids pushed (or set) since its last copy
        self._made: dict[str, int] = {}  # per table whose rows never go: its rows at its last copy (rows made after)
        self._acks: list[tuple[bytes, int, str, int, bool]] = []
        self._dirty: dict[str, RowTable] = {}  # tables stepped in the batch being handled, not copied yet (defer)
        self._whole: set[str] = set()  # tables whose delta was taken but not sent: their next copy goes whole
        for name, table in service.tables.items():
            self._watch(name, table)
        copier.rows = self

    def _watch(self, name: str, table: RowTable) -> None:
        if table.copy_removed is None:
            table.copy_removed = []
        if table.pending is not None and table.pending.copy_removed is None:
            table.pending.copy_removed = []
        self._touched.setdefault(name, [])
        self._made.setdefault(name, table.used)

    # ------------------------------------------------------------------ the table service's hooks
    def pushed(self, name: str, ids: np.ndarray) -> None:
        """A push of ``ids`` was taken into table ``name`` (rows made or stamped, admission counted)."""
        self._touched.setdefault(name, []).append(ids)

    def hold(self, identity: bytes, request_id: int, name: str, target: int, duplicate: bool) -> bool:
        """A sync ``push_rows``'s ack: held (True) until the table's round ``target`` is copied."""
        if self.service.tables[name].version >= target:
            return False
        self._acks.append((identity, request_id, name, target, duplicate))
        return True

    def defer(self, name: str, table: RowTable) -> None:
        """Table ``name`` stepped while the serving loop handles a batch of queued messages: what changed goes in
        one copy at the batch's end (:meth:`flush`, from the range's copier), and the shard keeps every reply back
        until it is acknowledged (as :meth:`psrt.shard.replication.Copier.defer` does for dense keys)."""
        if name not in self._made:
            self._watch(name, table)
        self._dirty[name] = table
        self.copier.server.replies.gate()

    def pending(self) -> bool:
        """Whether a table stepped in this batch is not copied yet."""
        return bool(self._dirty)

    def flush(self) -> None:
        """Each table the batch stepped: what changed since its last copy, one copy each, awaited."""
        while self._dirty:
            name = next(iter(self._dirty))
            table = self._dirty.pop(name)
            whole = name in self._whole
            try:
                if whole:
                    record, arrays = table.state(False)
                    arrays = [np.array(a) for a in arrays]
                else:
                    record, arrays = self._delta(name, table)
                self._send(name, record, arrays, whole)
            except BaseException:  # (what the delta took is gone from the lists: the next copy goes whole)
                self._dirty[name] = table
                self._whole.add(name)
                raise
            self._whole.discard(name)

    def release(self) -> None:
        """The sync acks whose table's round is copied now (once the replies kept back went)."""
        if self._acks:
            tables = self.service.tables
            for name in {a[2] for a in self._acks}:
                if name in tables:
                    self._release(name, tables[name])

    def commit(self, name: str, table: RowTable, ids: Optional[np.ndarray] = None) -> None:
        """Table ``name`` stepped (or ``init_table`` made or set rows, ``ids``): copy what changed to every live
        replica and wait for each one's answer; then release the acks its version reached."""
        if name not in self._made:
            self._watch(name, table)
        if ids is not None and len(ids):
            self._touched[name].append(ids)
        self._dirty.pop(name, None)  # (this copy holds what the batch changed in it)
        record, arrays = self._delta(name, table)
        self._send(name, record, arrays, False)
        if self._acks:
            self._release(name, table)

    def copy_all(self) -> None:
        """Every table whole, to every live replica (one that connected anew, or those of a range taken over)."""
        for name, table in self.service.tables.items():
            record, arrays = table.state(False)
            # Copies, not views: a replica given up on may leave the frames queued while the table grows (a realloc).
            self._send(name, record, [np.array(a) for a in arrays], True)

    # ------------------------------------------------------------------ internals
    def _send(self, name: str, record: dict[str, Any], arrays: list[np.ndarray], full: bool) -> None:
        service, copier = self.service, self.copier
        logs = [(w, wl.session, wl.last_seq) for (t, w), wl in service.logs.items() if t == name]
        holes = {w: wl.hole_runs() for (t, w), wl in service.logs.items() if t == name and wl.holes}
        clocks = dict(service.clocks_of(name))
        copier.deliver(lambda rid: messages.encode_replicate_rows(rid, copier.token, copier.sender, copier.range,
                                                                  name, record, arrays, logs, clocks, full, holes))

    def _delta(self, name: str, table: RowTable) -> tuple[dict[str, Any], list[np.ndarray]]:
        touched = self._touched[name]
        ids = np.unique(np.concatenate(touched)) if touched else np.empty(0, np.int64)
        self._touched[name] = []
        at = table.find(ids) if len(ids) else np.empty(0, np.int64)
        rows = at[at >= 0]
        if not table.spec.managed and table.used > self._made[name]:  # rows made by pulls (never moved since)
            rows = np.union1d(rows, np.arange(self._made[name], table.used, dtype=np.int64))
        self._made[name] = table.used
        record, arrays = table.rows_state(rows, _take_list(table.copy_removed), True)
        record["pending"] = None
        pending = table.pending
        if pending is not None:
            held = pending.find(ids) if len(ids) else np.empty(0, np.int64)
            held = held[held >= 0]
            record["pending"] = {"used": pending.used, "forgotten": pending.forgotten}
            arrays += [pending.ids[held], pending.counts[held], pending.last[held], pending.when[held],
                       _take_list(pending.copy_removed)]
        return record, arrays

    def _release(self, name: str, table: RowTable) -> None:
        still = []
        for identity, rid, t, target, duplicate in self._acks:
            if t == name and table.version >= target:
                self.service.reply(identity, encode_ack(rid, [target], duplicate))
            else:
                still.append((identity, rid, t, target, duplicate))
        self._acks = still


def _take_list(parts: Optional[list[np.ndarray]]) -> np.ndarray:
    """The ids of ``parts`` as one array, emptying the list."""
    if not parts:
        return np.empty(0, np.int64)
    out = np.concatenate(parts).astype(np.int64, copy=False)
    parts.clear()
    return out


# ---------------------------------------------------------------------------------------------- replica side
def take(service: Any, req: messages.RowsCopy) -> Optional[str]:
    """Apply a checked-as-authentic copy to a standby's tables (``service``); what makes it inapplicable (None:
    it was applied). Everything is checked before anything changes."""
    record, arrays = req.record, req.arrays
    if record["name"] != req.table:
        return f"the record of table {record['name']!r} came as table {req.table!r}'s"
    try:
        spec = RowTable.spec_of(record)
    except (ConfigError, KeyError, TypeError, ValueError) as exc:
        return f"table {req.table!r}: {exc}"
    if sorted(spec.optimizer.slots) != list(record["slots"]):
        return f"table {req.table!r}: slots {record['slots']} are not {spec.optimizer.name}'s"
    if record["used"] > record["max_rows"]:
        return f"table {req.table!r}: {record['used']} rows above its cap of {record['max_rows']}"
    table = service.tables.get(req.table)
    if table is not None and table.spec != spec:
        return f"table {req.table!r} is held with another definition ({table.spec.differences(spec)})"
    target = RowTable(spec, record["max_rows"], req.table) if req.full or table is None else table
    problem = _check(target, record, arrays)
    if problem is not None:
        return f"table {req.table!r}: {problem}"
    try:
        target.apply_delta(record, arrays)
    except (ValueError, IndexError) as exc:  # (checked above: a primary's bug, not a peer's input)
        log.error("table %r's copy left it inconsistent: %s", req.table, exc)
        return f"table {req.table!r}: {exc}"
    service.tables[req.table] = target
    if req.full:  # the whole table: its sequence numbers are the copy's alone
        for key in [k for k in service.logs if k[0] == req.table]:
            del service.logs[key]
    for worker, session, seq in req.logs:
        service.logs[(req.table, worker)] = WorkerLog.restored(session, seq, req.holes.get(worker))
    service.set_clocks(req.table, req.clocks)
    return None


def _check(table: RowTable, record: dict[str, Any], arrays: list[np.ndarray]) -> Optional[str]:
    """Whether ``record`` and ``arrays`` applied to ``table`` add up to the rows and counts the record says."""
    n_slots = len(record["slots"])
    ids, removed = arrays[1 + n_slots], arrays[4 + n_slots]
    if len(np.unique(ids)) != len(ids):
        return "the copy lists a row's id twice"
    gone = table.find(np.ascontiguousarray(removed)) if len(removed) else np.empty(0, np.int64)
    gone_ids = np.unique(removed[gone >= 0]) if len(removed) else removed
    at = table.find(ids) if len(ids) else np.empty(0, np.int64)
    new = (at < 0) | np.isin(ids, gone_ids)
    used = table.used - len(gone_ids) + int(new.sum())
    if used != record["used"] or used > table.max_rows:
        return f"the copy leaves {used} rows, its record says {record['used']}"
    rest = arrays[5 + n_slots:]
    if record["round"]:
        round_ids, rest = rest[0], rest[2:]
        held = table.find(np.ascontiguousarray(round_ids)) >= 0 if len(round_ids) else np.ones(0, bool)
        held &= ~np.isin(round_ids, gone_ids)
        held |= np.isin(round_ids, ids)
        if not held.all():
            return "the round in progress names ids without a row"
    if (record["pending"] is None) != (table.pending is None):
        return "the copy's admission counts do not match the table's definition"
    if table.pending is not None:
        p_ids, p_removed = rest[0], rest[4]
        if len(np.unique(p_ids)) != len(p_ids):
            return "the copy lists a pending id twice"
        pend = table.pending
        p_gone = pend.find(np.ascontiguousarray(p_removed)) if len(p_removed) else np.empty(0, np.int64)
        p_gone_ids = np.unique(p_removed[p_gone >= 0]) if len(p_removed) else p_removed
        p_at = pend.find(p_ids) if len(p_ids) else np.empty(0, np.int64)
        p_used = pend.used - len(p_gone_ids) + int(((p_at < 0) | np.isin(p_ids, p_gone_ids)).sum())
        if p_used != record["pending"]["used"]:
            return f"the copy leaves {p_used} pending ids, its record says {record['pending']['used']}"
    return None
