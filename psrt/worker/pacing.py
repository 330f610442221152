"""How a blocking sync call's pieces cross a network: paced a piece a message, or joined and sent at once.

A tensor cut for a network (:data:`psrt.partition.PIPELINE_PIECES` pieces per shard) can go three ways, from the
finest to the coarsest:

- **paced**: a piece a message, at most :attr:`psrt.config.ClientConfig.in_flight` ahead of the shard's answers
  (:meth:`psrt.worker.sender.ShardSender._paced`). A sync round closes when every worker's piece is in; held in
  step, the workers' pieces land side by side, each round closes as its last piece lands, and the answers flow
  out while the next pieces flow in. This is what a link-bound job wants: on 1 Gbit/s emulated links (W=4, S=2,
  4 MB, README "Across hosts") psrt reaches 0.81x of the full-duplex floor (median of four runs) where it
  reached 0.73x sending everything at once.
- **joined**: pieces joined into messages of at least 256 KiB (:func:`psrt.partition.joined`), everything
  queued at once: half the messages or fewer, and no wait on a round trip before the next piece goes, while a
  shard still answers a message's pieces as the next message arrives.
- **grouped**: a shard's pieces share messages up to ``partition_bytes`` (as over a shared-memory lane), all at
  once: the fewest messages, no pipelining. This is what a CPU-bound job wants (a link so fast that the
  processes' cost per message decides).

Which one a job is, the client cannot know beforehand (the link's rate, the CPUs, W), so :class:`Pacing` times
them on the calls themselves, climbing from one way to the next coarser one while that is faster. The calls go in
blocks of :data:`BLOCK` of one way, and a block is timed from the end of the call before it to the end of its last
(:meth:`Pacing.ended`): steps of the job, the same for every worker, whose calls end together as their rounds
close, give or take the order in which the shards' answers reach them. A call's own duration is not the same for
every worker: it counts from when this worker came to the rounds, first (and waited for the others) or last.
Timed call by call, and by that, the workers of one job chose different ways (on 10 Gbit/s emulated links three
grouped, one joined, and the job ran at the joined one's pace). After a set of tensors' first calls, alternate
blocks paced and joined until each has :data:`FIRST_SAMPLES` times (or :data:`CLEAR_SAMPLES`, when every one of
one way's is :data:`MARGIN` below every one of the other's); if joined was faster (median), alternate joined and
grouped likewise; then the faster, with one block in :data:`EXPLORE_EVERY` a way next to it, so that a
change of the job's load is noticed: the calls move to a way whose recent blocks (median of the last
:data:`SAMPLES`) took :data:`MARGIN` less. Every worker of a sync job makes its calls in step, so a worker's block
of one way is the others' too; whatever each chooses, no two workers can wait on each other (a paced worker
holds a piece back only behind pieces before it, in an order all workers share, whose rounds can close; the
others hold nothing back). ``ClientConfig.pacing`` (``PSRT_PACING``) can fix one way instead, timing nothing.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Hashable, Optional

from psrt.config import PACING

__all__ = ["Pacing", "PACED", "JOINED", "GROUPED", "BLOCK", "FIRST_SAMPLES", "CLEAR_SAMPLES", "SAMPLES",
           "EXPLORE_EVERY", "WARM_UP_CALLS", "MARGIN"]

#: The ways, finest first (:meth:`psrt.worker.sender.ShardSender.push`).
PACED, JOINED, GROUPED = 0, 1, 2
WAYS = 3
#: A set of tensors' first calls, joined and not timed (the shards make their tensors and the sockets their
#: buffers).
WARM_UP_CALLS = 2
#: Consecutive calls of one way timed together, as one sample of it: from the end of the call before them to the
#: end of their last, over BLOCK. The calls of a job's workers end as the shards' answers reach each of them, one
#: after another in an order that changes from round to round (at 10 Gbit/s, W=4, some 6 ms from the first to the
#: last of a 20 ms step): timed one by one the ways of one job differ by less than that jitter, timed four by four
#: the jitter is a quarter, and only at the block's two ends.
BLOCK = 4
#: Samples (blocks) of a way before it is compared (the blocks of two ways alternate).
FIRST_SAMPLES = 4
#: Samples of each of two ways after which their trial ends early, when every one of the one way's took MARGIN less
#: than every one of the other's: a difference that plain (paced against joined, either way round, at 1 and at
#: 10 Gbit/s) needs no more calls in the slower way.
CLEAR_SAMPLES = 2
#: Samples kept of each way: the newest.
SAMPLES = 8
#: Then one block in this many goes a way next to the chosen one (at a cost of its difference, once in so many).
EXPLORE_EVERY = 32
#: How much faster (a fraction of the chosen way's median) an explored way must be for the calls to move to it.
MARGIN = 0.1
#: The ways :attr:`psrt.config.ClientConfig.pacing` names (its other value, ``auto``, times them).
_NAMED = dict(zip(PACING[1:], (PACED, JOINED, GROUPED)))
#: Sets of tensors timed apart (a training loop repeats a few; one that pushes each tensor apart, that many).
MAX_SETS = 4096


class _Set:
    __slots__ = ("calls", "times", "current", "climbing", "last_end", "block_start")

    def __init__(self) -> None:
        self.calls = 0
        self.last_end: Optional[float] = None  # when the set's last call ended (Pacing.ended)
        self.block_start = 0.0  # when the call before the block under way ended
        self.times: tuple[deque[float], ...] = tuple(deque(maxlen=SAMPLES) for _ in range(WAYS))
        self.current: Optional[int] = None  # the chosen way; None until the first trial ends
        self.climbing = False  # joined beat paced: grouped is tried next

    def timed(self, way: int) -> bool:
        return len(self.times[way]) >= FIRST_SAMPLES

    def median(self, way: int) -> float:
        return statistics.median(self.times[way])

    def faster(self, a: int, b: int, tie: int) -> Optional[int]:
        """The faster of the ways ``a`` and ``b`` when their trial is over, else None; ``tie``: the one of the two
        that equal medians choose."""
        ta, tb = self.times[a], self.times[b]
        if len(ta) >= CLEAR_SAMPLES and len(tb) >= CLEAR_SAMPLES:
            if max(ta) < (1 - MARGIN) * min(tb):
                return a
            if max(tb) < (1 - MARGIN) * min(ta):
                return b
        if not (self.timed(a) and self.timed(b)):
            return None
        ma, mb = self.median(a), self.median(b)
        return a if ma < mb or (ma == mb and a == tie) else b


class Pacing:
    """Chooses, per set of tensors, how a blocking sync call's pieces go (see the module).

    Parameters
    ----------
    fixed : int, optional
        One way for every call (:attr:`psrt.config.ClientConfig.pacing` other than ``"auto"``): nothing is timed.
    """

    def __init__(self, fixed: Optional[int] = None) -> None:
        self._sets: dict[Hashable, _Set] = {}
        self.fixed = fixed

    @classmethod
    def named(cls, pacing: str) -> Pacing:
        """The chooser :attr:`psrt.config.ClientConfig.pacing` names (its values are :data:`psrt.config.PACING`)."""
        return cls(None if pacing == "auto" else _NAMED[pacing])

    def way(self, key: Hashable) -> int:
        """The way of the next call on the set ``key`` (:data:`PACED`, :data:`JOINED` or :data:`GROUPED`);
        :meth:`ended` follows when it ends."""
        if self.fixed is not None:
            return self.fixed
        state = self._sets.get(key)
        if state is None:
            if len(self._sets) >= MAX_SETS:
                return JOINED
            state = self._sets[key] = _Set()
        n = state.calls
        if n < WARM_UP_CALLS:
            return JOINED
        block = (n - WARM_UP_CALLS) // BLOCK  # (the ways change only from one block to the next)
        turn = block % 2 == 0
        current = state.current
        if current is None:
            return PACED if turn else JOINED
        if state.climbing:
            return GROUPED if turn else JOINED
        if block % EXPLORE_EVERY:
            return current
        near = [w for w in (current - 1, current + 1) if 0 <= w < WAYS]
        return near[(block // EXPLORE_EVERY) % len(near)]

    def ended(self, key: Hashable, way: int, now: float) -> None:
        """The call on ``key`` (``way`` as :meth:`way` said) ended at ``now`` (:func:`time.perf_counter`); the last
        call of a block makes a sample of its way (:data:`BLOCK`)."""
        state = self._sets.get(key)
        if state is None:
            return
        last, state.last_end = state.last_end, now
        n = state.calls
        state.calls += 1
        if n < WARM_UP_CALLS or last is None:
            return
        k = (n - WARM_UP_CALLS) % BLOCK
        if k == 0:
            state.block_start = last
        if k == BLOCK - 1:
            self._sample(state, way, (now - state.block_start) / BLOCK)

    @staticmethod
    def _sample(state: _Set, way: int, seconds: float) -> None:
        """A block of ``way`` took ``seconds`` a call: the choice moves as the module says."""
        state.times[way].append(seconds)
        if state.current is None:
            faster = state.faster(PACED, JOINED, PACED)
            if faster is not None:
                state.current, state.climbing = faster, faster == JOINED
        elif state.climbing:
            faster = state.faster(GROUPED, JOINED, JOINED)
            if faster is not None:
                state.current, state.climbing = faster, False
        elif way != state.current and state.timed(way) and \
                state.median(way) < (1 - MARGIN) * state.median(state.current):
            state.current = way  # (a way is left only for one clearly faster: noise must not flip it)

    def chosen(self, key: Hashable) -> Optional[int]:
        """The way chosen for ``key`` (None: its first trial is not over)."""
        state = self._sets.get(key)
        return None if state is None else state.current
