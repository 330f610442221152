"""How a blocking sync call's pieces cross a network: paced a piece a message, or joined and sent at once.

A tensor cut for a network (:data:`psrt.partition.PIPELINE_PIECES` pieces per shard) can go two ways:

- **paced**: a piece a message, at most :attr:`psrt.config.ClientConfig.in_flight` ahead of the shard's answers
  (:meth:`psrt.worker.sender.ShardSender._paced`). A sync round closes when every worker's piece is in; held in
  step, the workers' pieces land side by side, each round closes as its last piece lands, and the answers flow
  out while the next pieces flow in. This is what a link-bound job wants: measured on 1 Gbit/s emulated links
  (W=4, S=2, 4 MB) it reaches 0.86x of the full-duplex floor where sending everything at once reaches 0.7x.
- **at once**: pieces joined into messages of at least 256 KiB (:func:`psrt.partition.joined`), everything
  queued at once. This is what a CPU-bound job wants (a link so fast that the processes' cost per message
  decides): half the messages or fewer, and no wait on a round trip before the next piece goes.

Which one a job is, the client cannot know beforehand (the link's rate, the CPUs, W), so :class:`Pacing` times
both on the calls themselves: after a set of tensors' first calls, alternate calls each way until each has
:data:`FIRST_SAMPLES` times, then the way whose recent calls took less (median of the last :data:`SAMPLES`),
with one call in :data:`EXPLORE_EVERY` the other way, so that a change of the job's load is noticed. Every
worker of a sync job makes its calls in step, so a worker's call of either way is the others' too; whatever each
chooses, no two workers can wait on each other (a paced worker holds a piece back only behind pieces before it,
in an order all workers share, whose rounds can close).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Hashable, Optional

__all__ = ["Pacing", "FIRST_SAMPLES", "SAMPLES", "EXPLORE_EVERY", "WARM_UP_CALLS"]

#: A set of tensors' first calls, sent at once and not timed (the shards make their tensors and the sockets their
#: buffers).
WARM_UP_CALLS = 2
#: Times of each way before the first choice (the calls alternate).
FIRST_SAMPLES = 4
#: Times kept of each way: the newest.
SAMPLES = 8
#: Then one call in this many goes the way not chosen (at a cost of its difference, once in so many calls).
EXPLORE_EVERY = 64
#: Sets of tensors timed apart (a training loop repeats a few; one that pushes each tensor apart, that many).
MAX_SETS = 4096


class _Set:
    __slots__ = ("calls", "times")

    def __init__(self) -> None:
        self.calls = 0
        # (at once, paced): the newest times of each way
        self.times: tuple[deque[float], deque[float]] = (deque(maxlen=SAMPLES), deque(maxlen=SAMPLES))

    def best(self) -> Optional[bool]:
        at_once, paced = self.times
        if len(at_once) < FIRST_SAMPLES or len(paced) < FIRST_SAMPLES:
            return None
        return statistics.median(paced) <= statistics.median(at_once)


class Pacing:
    """Chooses, per set of tensors, whether a blocking sync call's pieces are paced (see the module)."""

    def __init__(self) -> None:
        self._sets: dict[Hashable, _Set] = {}

    def paced(self, key: Hashable) -> bool:
        """Whether the next call on the set ``key`` is paced; :meth:`took` follows with its time."""
        state = self._sets.get(key)
        if state is None:
            if len(self._sets) >= MAX_SETS:
                return False
            state = self._sets[key] = _Set()
        n = state.calls
        if n < WARM_UP_CALLS:
            return False
        best = state.best()
        if best is None:
            return (n - WARM_UP_CALLS) % 2 == 0  # paced, at once, paced, ...
        return best if n % EXPLORE_EVERY else not best

    def took(self, key: Hashable, paced: bool, seconds: float) -> None:
        """The call on ``key`` just made (``paced`` as :meth:`paced` said) took ``seconds``."""
        state = self._sets.get(key)
        if state is None:
            return
        state.calls += 1
        if state.calls > WARM_UP_CALLS:
            state.times[paced].append(seconds)

    def chosen(self, key: Hashable) -> Optional[bool]:
        """The way the recent calls on ``key`` found faster: True paced (None: not timed enough yet)."""
        state = self._sets.get(key)
        return None if state is None else state.best()
