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

A plain ``push`` (then a ``pull``) is acknowledged as it arrives, so the previous life may have taken one worker's
push of a round and died before another's came: the first worker's pull, sent again after the restart, is answered
with the restored parameters, and its next push says the same base as the other worker's push of the round it
lost. What tells them apart is that pull: sent again (:attr:`psrt.wire.PullRequest.again`, any version will do),
it still asks for the version its worker's push targeted, and a version beyond the key's that no push of that
worker here targets is of a round whose push from it was lost (:func:`pulled_again`): the key moves up to it, as
a push's base would move it, so that the other worker's push of that round is dropped (or its open round, when it
came first). The pull is then answered labelled with that version, and a worker whose round closed in the previous
life but whose answer was lost gets the version its partner got, so their next pushes pair.

Either way every worker loses the same rounds (those since the checkpoint), and the next round is made of pushes
computed from the same parameters. Without a restore a base never exceeds its key's version: the shard looks at
bases only from a restore until each key has completed a round (:attr:`~psrt.shard.store.Store.realigning`). A
shard with backup workers drops a push with an old base anyway (:func:`psrt.shard.stragglers.late`).

An embedding table is kept in step by another mark (:func:`restored_tables`, :func:`stale_round`,
:func:`lost_push`): a row push is acknowledged as it arrives, its worker then pulls the version the round will
make, and after a restart that pull is sent again asking for any version, answered at once with the restored
rows. A base then says what the worker last received, not which round its push is of: two workers whose pushes
belong together can say different bases. What does say it is the push's ``clock``, the worker's count of pushes
to the table, the same in every round of a sync job: a round is made of pushes of one clock. The previous life
may have taken one worker's push of round s and died before another's came (a window as wide as the workers'
skew); the first worker then pushes round s + 1, the second round s, and by arrival they would be paired for the
rest of the job, its end waiting on the last push of the worker behind. So, from a restore until the table
completes a round:

- a push whose clock is below the open round's is of a round whose other pushes were lost: dropped, acknowledged
  with the table's version as it is (its worker pulls the rows as they are and pushes its next);
- a push whose clock is above the open round's, from a worker not in it, shows that round's clock lost for
  someone: the open round is dropped (its pushes were acknowledged; the version moves on by one with the rows
  unchanged, which answers their pulls), and the push opens the next.

Every worker loses the same rounds, and the next round is made of pushes of the same clock. A round in
progress in the checkpoint keeps its clock there; an older checkpoint's (no clock) is joined by arrival. Only a
fixed job's workers count alike (in an elastic job a worker that joined counts from 1): an elastic job's tables
and a job with backup workers (whose rule is the base's) are joined by arrival after a restore, as before.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = ["behind", "drop_round", "dropped", "jump", "lost_push", "pulled_again", "restored", "restored_tables",
           "settled", "settled_table", "stale_round"]


def _bases(base: Any, n: int) -> Sequence[int]:
    return [base] * n if type(base) is int else base


def restored(store: Any) -> None:
    """``store`` was restored from a checkpoint: until each of its keys completes a round, a push's base is
    compared with its key's version (a shard that never restored is never behind its workers, and skips that)."""
    for entry in store.entries.values():
        entry.skipped, entry.realigned = (entry.version, entry.version), set()  # (nothing skipped yet)
    store.realigning = len(store.entries)


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
        if entry.skipped is None:
            entry.skipped = (entry.version, b)
            entry.realigned = set()
            store.realigning += 1
        else:
            entry.skipped = (entry.skipped[0], b)
        entry.version = b
    return dropped_rounds


def pulled_again(store: Any, entries: Sequence[Any], versions: Sequence[int]) -> list[int]:
    """A pull sent again after the restart, asking for ``versions`` (per key; 0 where this worker's pushes that
    reached the restored shard target it): a version beyond a key's is a round whose push from this worker the
    previous life acknowledged and lost. Its other pushes, here or to come, would pair with this worker's next
    step; so the round is lost for every worker: the key moves up to that version as a push's base moves it
    (:func:`jump`; the caller answers the pushes of an open round it drops), and a push of the round still to
    come is dropped as behind (:func:`behind`). Returns the indices of the keys whose open round was dropped."""
    return jump(store, entries, versions)


def behind(worker: int, entries: Sequence[Any], base: Any) -> Optional[list[bool]]:
    """Per key, whether ``worker``'s push computed from ``base`` belongs to a round a jump skipped (it is dropped:
    not applied, answered with the parameters as they are); None when no key's is."""
    mask = None
    for i, (entry, b) in enumerate(zip(entries, _bases(base, len(entries)))):
        skipped = entry.skipped
        if skipped is None:
            continue
        if skipped[0] <= b < skipped[1] and worker not in entry.realigned and worker not in entry.contributors:
            if mask is None:
                mask = [False] * len(entries)
            mask[i] = True
    return mask


def settled(store: Any, entry: Any) -> None:
    """A round of ``entry`` completed: every worker is in step again, and nothing is skipped any more."""
    if entry.skipped is not None:
        entry.skipped = entry.realigned = None
        store.realigning -= 1


def dropped(worker: int, entries: Sequence[Any], mask: Sequence[bool]) -> None:
    """``worker``'s push was dropped on the keys of ``mask`` (:func:`behind`): its next pushes there join."""
    for entry, x in zip(entries, mask):
        if x and entry.realigned is not None:
            entry.realigned.add(worker)


# ---------------------------------------------------------------------------------------------- tables
def restored_tables(service: Any) -> None:
    """The tables of ``service`` (a :class:`~psrt.shard.tables.TableService`) were restored from a checkpoint:
    until each completes a round, its pushes' clocks decide the rounds (see the module's docstring)."""
    for table in service.tables.values():
        table.realigning = True
    service.realigning = len(service.tables)


def stale_round(table: Any, worker: int, clock: int) -> bool:
    """Whether a push of ``worker`` at ``clock`` shows the open round of ``table`` (a restored
    :class:`~psrt.shard.embedding.RowTable`) to be of a clock some worker's push was lost at: the caller drops
    the round (:func:`drop_round`)."""
    open_clock = _open_clock(table, worker)
    return open_clock is not None and clock > open_clock


def drop_round(table: Any) -> None:
    """Drop the open round of ``table`` unapplied; the version moves on by one with the rows as they are, so that
    its pushers' pulls (of the version their acknowledgements named) are answered."""
    table.round.clear()
    table.version += 1


def lost_push(table: Any, worker: int, clock: int) -> bool:
    """Whether a push of ``worker`` at ``clock`` is of a round whose other pushes were lost (the open round is of
    a later clock): it is dropped, acknowledged with the version as it is."""
    open_clock = _open_clock(table, worker)
    return open_clock is not None and clock < open_clock


def _open_clock(table: Any, worker: int) -> Optional[int]:
    """The clock of ``table``'s open round when a push of ``worker`` is to be judged by it (the table is restored
    and not yet settled, the round has pushes of a known clock, none of them ``worker``'s); else None."""
    rnd = table.round
    if not table.realigning or not rnd.contributors or worker in rnd.contributors:
        return None
    return rnd.clock


def settled_table(service: Any, table: Any) -> None:
    """A round of ``table`` completed: its workers are in step, and clocks decide nothing any more."""
    if table.realigning:
        table.realigning = False
        service.realigning -= 1
