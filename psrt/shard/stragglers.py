"""Backup workers and who is slow: the rules that let a sync round close without its slowest workers, and what a
shard measures of each worker's lateness.

With ``b`` backup workers (``--backup-workers b``, ``0 <= b < W``) a key's round closes as soon as W - b workers
pushed it, and steps with the mean of those pushes (Chen et al. 2016, "Revisiting Distributed Synchronous SGD").
A worker whose push arrives for a round that already closed is late: its gradient was computed from parameters
older than the key's, so it is dropped (counted, never applied) and its ``push_pull`` is answered with the newest
parameters, from which it joins the next round. A push says which version it was computed from (its ``base``:
the version of the parameters the worker held, :class:`psrt.wire.PushRequest`), which tells "late for a closed
round" from "early for the next one" (queued, as without backup workers).

Without backup workers (b = 0) nothing is ever late: every round waits for every worker (or member), as before,
and ``base`` is not read. What is measured (:class:`Lateness`) is measured either way.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Optional, Sequence

import numpy as np

from psrt import transport, wire

__all__ = ["round_done", "late", "closing", "Lateness", "AutoBackup"]

#: Lateness samples kept per worker (the median and p99 are of these).
SAMPLES = 1024
#: A worker is named slow when its median lateness is over this many times the workers' typical (median) one,
#: and over :data:`SLOW_FLOOR_S`; the shard logs who, every :data:`REPORT_EVERY_S` seconds and when it stops, and
#: tells the scheduler on a heartbeat every :data:`TELL_EVERY_S` seconds (:meth:`Lateness.report`).
SLOW_FACTOR = 4.0
SLOW_FLOOR_S = 0.010
REPORT_EVERY_S = 30.0
TELL_EVERY_S = 1.0


def round_done(contributors: set[int], num_workers: int, members: Optional[frozenset[int]],
               expected: frozenset[int], backup_workers: int) -> bool:
    """Whether a round with these ``contributors`` is complete.

    A fixed job (``members`` None): W - b pushes. An elastic job: every member the round waits for (``expected``
    that are still members), or, with backup workers, all but b of them (at least one push).
    """
    if members is None:
        return len(contributors) >= num_workers - backup_workers
    waited = expected & members
    if contributors >= waited:
        return True
    return backup_workers > 0 and len(contributors & waited) >= max(1, len(waited) - backup_workers)


def late(backup_workers: int, worker: int, entries: Sequence[Any], base: Any) -> Optional[list[bool]]:
    """Per key, whether a push of ``worker`` computed from version ``base`` (an int, a list of one per key, or
    None: not said) is late for a round that closed without it; None when none is.

    Its gradient belongs to round ``base`` (the one producing version ``base + 1``). The round it could join is
    the key's current one, or, where it is in that round already, the next: a base older than that round is
    late. ``entries``: anything with ``version`` and ``contributors`` (an :class:`~psrt.shard.store.Entry`).
    """
    if not backup_workers or base is None:
        return None
    mask = None
    for i, entry in enumerate(entries):
        b = base if type(base) is int else base[i]
        if b < entry.version + (1 if worker in entry.contributors else 0):
            if mask is None:
                mask = [False] * len(entries)
            mask[i] = True
    return mask


#: Closed rounds whose opening time a key remembers (a dropped push is measured against its round's).
HISTORY = 64


def closing(entry: Any) -> None:
    """``entry``'s current round (the one producing version ``entry.version + 1``) is closing: remember when it
    opened, and when it closed (:class:`Lateness` measures the gap to the next round's first push)."""
    if entry.closed is None:
        entry.closed = deque(maxlen=HISTORY)
    entry.closed.append((entry.version, entry.opened))
    entry.closed_at = time.monotonic()


class Lateness:
    """Per worker: how late its pushes arrive after their round's first push, and how many were dropped.

    A push that opens a round is 0 late; one that joins it, the seconds since the round's first push; one dropped
    as late, the seconds since the first push of the round it was computed for. One sample per
    push message, taken on its first key (a message's keys join their rounds together).
    """

    def __init__(self) -> None:
        self.samples: dict[int, deque[float]] = {}
        self.pushes: dict[int, int] = {}
        self.dropped: dict[int, int] = {}
        #: Where each worker's pushes come from: the IP address of its connection, or "local" (ipc://, or a
        #: shared-memory lane: this host).
        self.hosts: dict[int, str] = {}
        #: Seconds from a round's end to the next round's first push (the fastest worker's step: compute and
        #: network), over the last :data:`SAMPLES` rounds (:class:`AutoBackup` reads them).
        self.gaps: deque[float] = deque(maxlen=SAMPLES)
        self._medians: dict[int, float] = {}  # each worker's median, as of its last sample (see medians())
        self._stale: set[int] = set()  # the workers sampled since their median was taken

    def seen(self, worker: int, buffers: Sequence[Any], lane: bool) -> None:
        """Learn where ``worker``'s pushes come from, from a push's received ``buffers`` (once per worker)."""
        if worker not in self.hosts:
            address = "" if lane or not buffers else transport.peer_address(buffers[0])
            self.hosts[worker] = address or "local"

    def joined(self, worker: int, entry: Any, now: Optional[float] = None) -> None:
        """``worker``'s push is about to join ``entry``'s round (call before it is added)."""
        now = time.monotonic() if now is None else now
        if not entry.contributors:
            entry.opened = now
            if entry.closed_at:  # from the last round's end to this one's first push
                self.gaps.append(now - entry.closed_at)
            self._sample(worker, 0.0)
        else:
            self._sample(worker, now - entry.opened)

    def missed(self, worker: int, entry: Any, base: Any, now: Optional[float] = None) -> None:
        """``worker``'s push to ``entry``, computed from version ``base`` (an int, or a list whose first is
        ``entry``'s), was dropped: round ``base`` closed without it. Measured from when that round opened (or, for
        a round older than the key remembers, the oldest it does: a lower bound)."""
        now = time.monotonic() if now is None else now
        self.dropped[worker] = self.dropped.get(worker, 0) + 1
        base = base if type(base) is int else base[0]
        opened = entry.opened if base >= entry.version else None  # (its own earlier push is in the open round)
        for number, at in () if opened is not None else reversed(entry.closed or ()):
            opened = at
            if number <= base:
                break
        self._sample(worker, max(0.0, now - opened) if opened is not None else 0.0)

    def _sample(self, worker: int, seconds: float) -> None:
        queue = self.samples.get(worker)
        if queue is None:
            queue = self.samples[worker] = deque(maxlen=SAMPLES)
        queue.append(seconds)
        self._stale.add(worker)
        self.pushes[worker] = self.pushes.get(worker, 0) + 1

    def medians(self) -> dict[int, float]:
        """Each measured worker's median lateness over its last :data:`SAMPLES` pushes.

        Taken again only for the workers sampled since the last call: a shard of W peers reports every second,
        and the median of 1,024 samples costs tens of microseconds, so taking all W of them each time (W = 256:
        ~10 ms a second, on each shard) cost more than the pushes they describe. The dict is the cache itself:
        do not modify it.
        """
        if len(self._medians) != len(self.samples):  # (samples set directly, as a test may)
            self._stale.update(w for w in self.samples if w not in self._medians)
        for w in self._stale:
            q = self.samples.get(w)
            if q:
                self._medians[w] = float(np.median(np.fromiter(q, float, len(q))))
        self._stale.clear()
        return self._medians

    def _slow(self) -> tuple[dict[int, float], float, list[int]]:
        """Each measured worker's median lateness, their typical (median) one, and the slow workers, slowest first
        (none with fewer than two measured)."""
        medians = self.medians()
        if len(medians) < 2:
            return medians, 0.0, []
        typical = float(np.median(list(medians.values())))
        slow = sorted((w for w, m in medians.items() if m > max(SLOW_FLOOR_S, SLOW_FACTOR * typical)),
                      key=lambda w: -medians[w])
        return medians, typical, slow

    def slow(self) -> Optional[str]:
        """A line naming the workers whose median lateness is far above the others' (:data:`SLOW_FACTOR`), or None
        (none, or fewer than two workers measured)."""
        medians, typical, slow = self._slow()
        if not slow:
            return None
        named = ", ".join(f"worker {w} ({self.hosts.get(w) or 'host unknown'}) {1e3 * medians[w]:.0f} ms, "
                          f"{self.dropped.get(w, 0)} of {self.pushes.get(w, 0)} pushes dropped" for w in slow)
        return (f"slow workers (median lateness of their pushes after their round's first push): {named}; the "
                f"workers' typical median is {1e3 * typical:.0f} ms")

    def report(self, round_: int) -> Optional[wire.SlowReport]:
        """What the shard's heartbeat tells the scheduler of who is slow at its round ``round_`` (the scheduler
        names the workers slow on every shard, :mod:`psrt.control.slow`); None before anything was measured."""
        medians, typical, slow = self._slow()
        if not medians:
            return None
        rows = tuple((w, medians[w], self.pushes.get(w, 0), self.dropped.get(w, 0)) for w in slow[:wire.MAX_SLOW_ROWS])
        return wire.SlowReport(round_, len(medians), typical, rows)

    def stats(self) -> dict[str, Any]:
        """The per-worker stats as one entry, ``workers``: a row ``[rank, pushes, dropped, late_p50_s, late_p99_s,
        host]`` per worker measured (over the last :data:`SAMPLES` pushes); nothing when none was. One entry, not
        five per worker, so that a shard's stats stay one small map at any W
        (:func:`psrt.control.metrics.per_worker` reads the rows back by rank)."""
        rows = []
        for worker in sorted(self.samples):
            values = np.fromiter(self.samples[worker], float)
            p50, p99 = np.percentile(values, [50, 99]) if values.size else (0.0, 0.0)
            rows.append([worker, self.pushes.get(worker, 0), self.dropped.get(worker, 0), float(p50), float(p99),
                         self.hosts.get(worker, "")])
        return {"workers": rows} if rows else {}



class AutoBackup:
    """``--backup-workers auto``: b picked from the measured lateness, as DBW (Dynamic Backup Workers, arXiv
    2004.14696) does from the workers' arrival times.

    A round that waits for the first k pushes takes about ``t_k + c``: ``t_k`` the k-th smallest of the workers'
    median lateness (how long after a round's first push the k-th comes), ``c`` the median gap from a round's
    end to the next one's first push (a step of the fastest worker). It steps with k gradients, so the gradients
    per second are ``k / (t_k + c)``; the shard waits for the k that maximizes them, at least half of the workers
    (fewer would trade too much of each step's gradient for speed), and picks again every :data:`EVERY` seconds,
    once every worker has :data:`MIN_SAMPLES` measured pushes. Until then b is :meth:`first`: one backup worker
    (where W > 2), so that a straggler present from the start does not set the pace while it is measured.
    """

    EVERY = 0.1
    MIN_SAMPLES = 3

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._next = 0.0

    def first(self) -> int:
        """b before anything is measured."""
        return 1 if self.num_workers > 2 else 0

    def choose(self, lateness: Lateness, current: int, workers: Optional[Sequence[int]] = None,
               now: Optional[float] = None) -> int:
        """The b to use from now on (``current`` between picks); ``workers``: those whose lateness counts (the
        members of an elastic job; default all measured)."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return current
        self._next = now + self.EVERY
        samples = lateness.samples
        ranks = list(samples) if workers is None else [w for w in workers if w in samples]
        n = len(ranks) if workers is not None else self.num_workers
        if n < 2 or len(ranks) < n or any(len(samples[w]) < self.MIN_SAMPLES for w in ranks):
            return current
        taken = lateness.medians()
        medians = sorted(taken[w] for w in ranks)
        gap = float(np.median(np.fromiter(lateness.gaps, float))) if lateness.gaps else 0.0
        best_k, best = n, n / (medians[n - 1] + gap + 1e-4)
        for k in range(n - 1, (n + 1) // 2 - 1, -1):
            rate = k / (medians[k - 1] + gap + 1e-4)
            if rate > best * 1.05:  # (within 5 %, the larger k: more gradients a step)
                best_k, best = k, rate
        return n - best_k
