"""Exactly-once pushes: a replay window per worker session, as IPsec's anti-replay window or DTLS keep one.

A client numbers the pushes it sends one shard ``0, 1, 2, ...`` within its session (each
:class:`psrt.worker.sender.ShardSender` counts its own, and an embedding table's pushes are counted per table and
shard), so a shard sees every number of a session unless a message never reached it. In-order arrival is the
rule, but not a guarantee: a push lost inside a dying TCP connection, while a later one still sat in the client
DEALER's pipe, arrives *after* that later one once the client sends it again on the new connection. A shard that
kept only the highest number applied would take the resent push for a duplicate: acknowledged, never applied.

So a :class:`WorkerLog` keeps the highest number applied (``last_seq``) and which of the
:data:`REPLAY_WINDOW` numbers at and below it were *not* applied (``holes``). A number above ``last_seq`` is new; in
the window, it is new if and only if it is a hole (each is applied once, in any order); below the window nothing can
be told, and the shard refuses the push with an error (:func:`check_window`) rather than guess: taking it for a
duplicate could lose a gradient silently, applying it could apply one twice. A number the shard never saw (a
message refused, or lost for good) is a hole: "not applied here", which is what it is.

The holes are a bitmap (a Python int: bit ``i`` set when ``last_seq - i`` was not applied), which in-order pushes,
the usual case, leave 0, so that a push costs a comparison and a shift of 0. Replication and checkpoints carry it
as runs of numbers not applied, ``[[first, count], ...]`` (none: the session's pushes up to ``last_seq`` are all
in, which is also what a copy or a checkpoint of an older psrt meant).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from psrt.errors import RequestRefused

__all__ = ["REPLAY_WINDOW", "WorkerLog", "check_window", "is_duplicate", "record"]

#: How many sequence numbers at and below the highest applied one a shard can tell applied or not. A client's
#: pushes to one shard that are in flight at once (sent, not yet answered) are what can arrive out of order: in sync
#: mode at most one step's messages (a large tensor is up to :data:`psrt.partition.PIPELINE_PIECES` messages per
#: shard, so a model of a few hundred large tensors sends a shard a few thousand a step), more where the overlap
#: pipeline or ``push_async`` keep steps in flight. 65536 leaves a wide margin over that, and costs nothing while
#: pushes arrive in order (only holes are stored); a push older than that is refused loudly (:func:`check_window`).
REPLAY_WINDOW = 1 << 16


_FULL = (1 << REPLAY_WINDOW) - 1


@dataclass
class WorkerLog:
    """The pushes applied for one worker's session (incarnation): the highest sequence number applied, and which of
    the :data:`REPLAY_WINDOW` numbers at and below it were not (its holes).

    ``last_seq`` -1: none applied yet. ``holes``: bit ``i`` set when push ``last_seq - i`` was not applied.
    """

    session: int
    last_seq: int = -1
    holes: int = 0

    def applied(self, seq: int) -> bool:
        """Whether push ``seq`` was applied (False above the window's top; True below its floor: a caller that must
        not guess checks :meth:`too_old` first)."""
        back = self.last_seq - seq
        if back < 0:
            return False
        return back >= REPLAY_WINDOW or not (self.holes >> back) & 1

    def too_old(self, seq: int) -> bool:
        """Whether ``seq`` is below the window: the log cannot tell whether it was applied."""
        return self.last_seq - seq >= REPLAY_WINDOW

    def take(self, seq: int) -> None:
        """Remember that push ``seq`` has been applied (or taken: a push dropped as late counts as taken)."""
        ahead = seq - self.last_seq
        if ahead <= 0:  # an earlier one, arriving late: no longer a hole
            if -ahead < REPLAY_WINDOW:
                self.holes &= ~(1 << -ahead)
            return
        self.last_seq = seq
        if ahead == 1:
            if self.holes:
                self.holes = (self.holes << 1) & _FULL
            return
        # The numbers jumped over are not applied (yet): holes, as far as the window reaches.
        jumped = ((1 << min(ahead - 1, REPLAY_WINDOW)) - 1) << 1
        self.holes = ((self.holes << ahead) | jumped) & _FULL if ahead < REPLAY_WINDOW else jumped & _FULL

    def settled(self, below: Optional[int] = None) -> tuple[int, int]:
        """``(last, holes)`` of the pushes applied, or with ``below``, of those applied with a sequence number below
        it (the settled ones, when ``below`` is the first still in an open round): what a copy carries."""
        if below is None or below > self.last_seq:
            return self.last_seq, self.holes
        # (``below - 1`` itself may be a hole: bit 0 then says so.)
        return below - 1, self.holes >> (self.last_seq - below + 1)

    def hole_runs(self) -> list[list[int]]:
        """The holes as runs ``[first seq, count]``, lowest first (empty: none), as copies and checkpoints carry
        them (a few runs where a few pushes were overtaken, whatever the window's size)."""
        if not self.holes:
            return []
        last, bits = self.last_seq, bin(self.holes)[:1:-1]  # bit i, i.e. seq last - i, at index i
        return [[last - m.end() + 1, m.end() - m.start()] for m in reversed(list(re.finditer("1+", bits)))]

    @classmethod
    def restored(cls, session: int, last_seq: int, runs: Optional[Iterable[Sequence[int]]] = None) -> WorkerLog:
        """A log read back from a copy or a checkpoint (``runs``: :meth:`hole_runs`); None or empty (one of an
        older psrt): every push of the session up to ``last_seq`` applied, as such a copy meant. Runs reaching
        beyond the window or above ``last_seq`` are cut to it."""
        holes = 0
        for first, count in runs or ():
            top = min(first + count - 1, last_seq)
            low = max(first, last_seq - REPLAY_WINDOW + 1)
            if top >= low:
                holes |= ((1 << (top - low + 1)) - 1) << (last_seq - top)
        return cls(session, last_seq, holes)


def is_duplicate(log: Optional[WorkerLog], session: int, seq: int) -> bool:
    """True when push ``seq`` of ``session`` was already applied per ``log`` (a retry or a replay); a new session
    (the worker restarted) starts a fresh sequence. Below the window: True (:func:`check_window` refuses it first
    where a push is taken in)."""
    return log is not None and log.session == session and log.applied(seq)


def record(logs: dict, key: object, session: int, seq: int) -> None:
    """Remember in ``logs[key]`` that push ``seq`` of ``session`` has been applied (a new session: a fresh log, whose
    numbers below ``seq`` are holes: a push of it that arrives later is still taken)."""
    log = logs.get(key)
    if log is None or log.session != session:
        log = logs[key] = WorkerLog(session)
    log.take(seq)


def check_window(log: Optional[WorkerLog], session: int, seq: int, what: str) -> None:
    """Refuse push ``seq`` of ``session`` when it is older than ``log``'s window, so nothing can tell whether it was
    applied.

    Raises
    ------
    RequestRefused
        ``replay_window``: the push is neither applied nor acknowledged.
    """
    if log is not None and log.session == session and log.too_old(seq):
        raise RequestRefused(
            "replay_window", f"{what}: sequence number {seq} is more than {REPLAY_WINDOW} below the highest this "
            f"shard applied for the session ({log.last_seq}), so it cannot tell whether it was applied; a client "
            f"keeps fewer than {REPLAY_WINDOW} pushes to one shard unanswered (wait for pushes before sending more)")
