"""Pulls that wait on a shard: a pull (or the pull half of a push_pull) answered once its keys reach versions.

A pull names, per key, the least version its answer must have: the round its own worker's pushes joined. The
shard queues it (never polls) under every key still short of its version, and :meth:`PullQueue.wake` releases it
when the last of those keys gets there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["Waiter", "PullQueue"]

Key = tuple[str, int]


@dataclass
class Waiter:
    """A pull waiting for keys to reach versions; ``keys`` are what its reply carries, in order."""

    identity: bytes
    request_id: int
    keys: list[Key]
    want: dict[Key, int]
    remaining: int = 0
    #: The 16-bit form (``"fp16"``/``"bf16"``) the reply's float32 parameters travel in, if any.
    codec: Optional[str] = None
    #: A shared-memory lane's segment and the offsets the parameters go to (:mod:`psrt.shm.lanes`), if any.
    lane: Optional[tuple[Any, list[int]]] = None


class PullQueue:
    """The pulls waiting on one shard.

    Parameters
    ----------
    version_of : callable
        The current version of a key.
    """

    def __init__(self, version_of: Callable[[Key], int]) -> None:
        self._version_of = version_of
        self._by_key: dict[Key, list[Waiter]] = {}

    def add(self, waiter: Waiter) -> bool:
        """Queue ``waiter`` under every key short of its version; True when it needs no wait at all."""
        for key, version in waiter.want.items():
            if self._version_of(key) < version:
                waiter.remaining += 1
                self._by_key.setdefault(key, []).append(waiter)
        return waiter.remaining == 0

    def wake(self, key: Key) -> list[Waiter]:
        """The pulls that ``key``'s new version completes (their other keys are there already)."""
        waiters = self._by_key.get(key)
        if not waiters:
            return []
        version = self._version_of(key)
        ready, still = [], []
        for waiter in waiters:
            if version >= waiter.want[key]:
                waiter.remaining -= 1
                if waiter.remaining == 0:
                    ready.append(waiter)
            else:
                still.append(waiter)
        if still:
            self._by_key[key] = still
        else:
            del self._by_key[key]
        return ready

    def take(self, keys: Any) -> list[Waiter]:
        """Remove and return every pull waiting on any of ``keys`` (from under all of its keys): pulls that can
        no longer be answered, to be refused."""
        taken: dict[int, Waiter] = {}
        for key in keys:
            for waiter in self._by_key.pop(key, ()):
                taken[id(waiter)] = waiter
        if taken:
            for key in list(self._by_key):
                still = [w for w in self._by_key[key] if id(w) not in taken]
                if still:
                    self._by_key[key] = still
                else:
                    del self._by_key[key]
        return list(taken.values())

    def __bool__(self) -> bool:
        """True while any pull waits (cheaper than ``len``, which counts them)."""
        return bool(self._by_key)

    def __len__(self) -> int:
        """Queued (waiter, key) pairs: how many answers the shard owes, counted per key."""
        return sum(len(w) for w in self._by_key.values())
