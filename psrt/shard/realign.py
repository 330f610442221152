"""Sync rounds after a restore: every push says the version it was computed from, so rounds stay in step.

A sync round is the pushes computed from one version of a key. Arrival order makes the rounds as long as every
shard remembers every round it answered; a shard restored from a checkpoint does not. Its previous life may have
answered a round to some workers and died before answering the others: those it answered push their next step,
the others send their unanswered push again, and the restored shard, taking pushes in arrival order, would pair
one worker's step ``s + 1`` with another's ``s`` for the rest of the job. At its end the last push of the worker
that was behind waits for a partner that has finished: the job hangs until its timeout.

So a push to a sync shard carries its ``base`` (:attr:`psrt.wire.PushRequest.base`), and on a key:

- a base beyond the key's version (a version only the shard's previous life reached) moves the key's version up to
  it (:func:`jump`): the rounds in between were lost with that life. A round still open there holds pushes computed
  from an older version, which the previous life had answered to someone: it is dropped, its pushes answered as
  lost rounds (each of their workers then pushes from the version it gets);
- a base inside the versions a jump skipped is a push of a lost round (:func:`behind`): dropped, answered at once
  with the parameters as they are, once per worker and key (a worker that only pushes, never pulling, keeps an
  old base: its later pushes join).

Either way every worker loses the same rounds (those since the checkpoint), and the next round is made of pushes
computed from the same parameters. Without a restore a base never exceeds its key's version: the shard looks at
bases only from a restore until each key has completed a round (:attr:`~psrt.shard.store.Store.realigning`). A
shard with backup workers drops a push with an old base anyway (:func:`psrt.shard.stragglers.late`).

An embedding table is one such key (:func:`jump_table`, :func:`behind_table`; a ``push_rows`` says its table's
``base``, :attr:`psrt.wire.PushRowsRequest.base`). A row push is acknowledged as it arrives, so there the window is
wide: a worker's push of round s taken (and acknowledged) by the previous life, the other's still being computed
when it died, is enough.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = ["behind", "behind_table", "dropped", "dropped_table", "jump", "jump_table", "restored", "restored_tables",
           "settled"]


def _bases(base: Any, n: int) -> Sequence[int]:
    return [base] * n if type(base) is int else base


def restored(store: Any) -> None:
    """``store`` was restored from a checkpoint: until each of its keys completes a round, a push's base is
    compared with its key's version (a shard that never restored is never behind its workers, and skips that)."""
    for entry in store.entries.values():
        entry.skipped, entry.realigned = (entry.version, entry.version), set()  # (nothing skipped yet)
    store.realigning = len(store.entries)


def restored_tables(service: Any) -> None:
    """:func:`restored`, for the embedding tables of ``service`` (a :class:`~psrt.shard.tables.TableService`)."""
    for table in service.tables.values():
        table.skipped, table.realigned = (table.version, table.version), set()
    service.realigning = len(service.tables)


def _move_up(owner: Any, key: Any, base: int) -> None:
    """Move ``key``'s version up to ``base``, remembering the versions skipped (``owner.realigning`` counts the keys
    that have any)."""
    if key.skipped is None:
        key.skipped = (key.version, base)
        key.realigned = set()
        owner.realigning += 1
    else:
        key.skipped = (key.skipped[0], base)
    key.version = base


def _behind(worker: int, key: Any, base: int, contributors: Any) -> bool:
    skipped = key.skipped
    return skipped is not None and skipped[0] <= base < skipped[1] and worker not in key.realigned \
        and worker not in contributors


def jump(store: Any, entries: Sequence[Any], base: Any) -> list[int]:
    """Move each key whose version is below the push's ``base`` up to it (see the module's docstring).

    ``store``: the :class:`~psrt.shard.store.Store` (its count of keys still realigning); ``entries``:
    :class:`~psrt.shard.store.Entry` objects (``version``, ``contributors``, the round's sums); ``base``: an int
    or one per entry. Returns the indices of the keys whose open round was dropped: the caller answers the pushes
    waiting on them.
    """
    dropped_rounds = []
    for i, (entry, b) in enumerate(zip(entries, _bases(base, len(entries)))):
        if b <= entry.version:
            continue
        if entry.contributors:  # pushes from an older version, answered by the previous life to someone
            entry.contributors.clear()
            entry.held.clear()
            entry.acc_filled = False
            dropped_rounds.append(i)
        _move_up(store, entry, b)
    return dropped_rounds


def jump_table(service: Any, table: Any, base: int) -> bool:
    """:func:`jump` for an embedding table (a :class:`~psrt.shard.embedding.RowTable`): returns whether its version
    moved (the caller then answers the pulls that waited for it, the pushers' of a dropped round among them: a row
    push is acknowledged as it comes, so nothing else of theirs waits)."""
    if base <= table.version:
        return False
    table.round.clear()  # (pushes from an older version, acknowledged by the previous life to someone)
    _move_up(service, table, base)
    return True


def behind(worker: int, entries: Sequence[Any], base: Any) -> Optional[list[bool]]:
    """Per key, whether ``worker``'s push computed from ``base`` belongs to a round a jump skipped (it is dropped:
    not applied, answered with the parameters as they are); None when no key's is."""
    mask = None
    for i, (entry, b) in enumerate(zip(entries, _bases(base, len(entries)))):
        if _behind(worker, entry, b, entry.contributors):
            if mask is None:
                mask = [False] * len(entries)
            mask[i] = True
    return mask


def behind_table(worker: int, table: Any, base: int) -> bool:
    """:func:`behind` for an embedding table: whether ``worker``'s push from ``base`` is one of a lost round (it is
    dropped, acknowledged with the table's version; :func:`dropped_table` then lets its next pushes join)."""
    return _behind(worker, table, base, table.round.contributors)


def dropped_table(worker: int, table: Any) -> None:
    """:func:`dropped` for an embedding table."""
    if table.realigned is not None:
        table.realigned.add(worker)


def settled(store: Any, entry: Any) -> None:
    """A round of ``entry`` (a dense key, or a table of a :class:`~psrt.shard.tables.TableService` ``store``)
    completed: every worker is in step again, and nothing is skipped any more."""
    if entry.skipped is not None:
        entry.skipped = entry.realigned = None
        store.realigning -= 1


def dropped(worker: int, entries: Sequence[Any], mask: Sequence[bool]) -> None:
    """``worker``'s push was dropped on the keys of ``mask`` (:func:`behind`): its next pushes there join."""
    for entry, x in zip(entries, mask):
        if x and entry.realigned is not None:
            entry.realigned.add(worker)
