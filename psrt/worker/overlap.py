"""One worker's per-tensor pushes and pulls, overlapped with its compute: what a framework's backward pass does.

Backward produces the gradients last layer first; the next forward needs the parameters first layer first. A
:class:`Pipeline` carries one step's traffic between the two, tensor by tensor:

- a gradient handed to it (:meth:`Pipeline.enqueue`) waits in a priority queue in forward order, and at most
  ``window`` bytes of pushes are handed to the sockets at a time: when several gradients are queued, the first
  layers' leave first, as they are the first needed. The window is shared out per shard, each shard's link
  getting the part of it that its share of the pushed bytes is (at least one push in flight to each; a frozen
  tensor, never pushed, counts for nothing): a tensor leaves when every shard it lies on has credit left for its
  bytes (or nothing in flight), and one that waits keeps its shards for itself, so a later layer never overtakes
  it there. With the model on one
  shard, or every tensor spread over all shards alike, that is one window of ``window`` bytes; with tensors on
  different shards (S = 16 and layers cut in 4 chunks), a shard whose layers are not the ones in flight no longer
  stands idle while another's wait;
- the window is also held to what a shard's link (or CPU) takes in a short time (:class:`Pace`): a pull is asked
  for on the connection the pushes use, behind every byte handed to it before, and the first layers' gradients,
  queued last, leave behind those too; so bytes in flight beyond what keeps the link busy only add to the wait
  for the parameters the next forward needs first. Each shard's acks say when it took a push in, and the spacing
  of pushes taken one after another is the rate they reach it at;
- as soon as a shard acknowledges a push, the pull of that tensor is asked for, received straight into the
  tensor's own array (the ack told the client the version the push joins: in sync mode the pull waits for that
  round, in async it is answered at once, in ssp when the staleness bound allows);
- :meth:`Pipeline.wait_for` blocks until one tensor's new value is in its array, sending queued pushes (and asking
  for pulls) as acks come in meanwhile, so a forward can wait for each layer's parameters just before it uses them.

The pipeline is driven by its caller, on one thread (a client is not thread-safe): :mod:`psrt.torch` from its
backward hooks, ``step`` and forward pre-hooks, the load generator (``psrt worker --overlap``) from its emulated
layers. ZeroMQ's I/O thread moves the bytes in between; :meth:`Pipeline.pump` takes in the replies already there
and starts what they allow, :meth:`Pipeline.idle` keeps doing so until a deadline (for a caller whose compute
leaves the thread free).
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from typing import Any, Optional, Sequence

import numpy as np

from psrt.errors import ConfigError, ConnectionLostError
from psrt.worker.handles import Handle

__all__ = ["Slot", "Pipeline", "Pace", "IDLE", "QUEUED", "PUSHING", "PULLING", "DEFAULT_WINDOW", "QUEUE_S"]

#: A tensor's place in a step: no work in flight, gradient queued, push in flight, pull in flight.
IDLE, QUEUED, PUSHING, PULLING = range(4)

#: Gradient bytes handed to the sockets at a time, by default: the most, whatever the shards' rates (:class:`Pace`).
DEFAULT_WINDOW = 4 << 20

#: Seconds of a shard's rate that the pushes in flight to it may take beyond what keeps it busy (:class:`Pace`):
#: about the most a pull asked for, or a first layer's gradient, waits behind them.
QUEUE_S = 0.002

#: The pushes whose rate, delay and hold a :class:`Pace` keeps (and the caller's gaps between pumps, twice that).
PACE_SAMPLES = 16


def _finished(handle: Handle) -> bool:
    """Whether every reply of ``handle`` is in, without polling (the caller has just taken replies in)."""
    return not handle._outstanding


class Slot:
    """One tensor: the array its new values land in, and where its gradient and pull are in the current step.

    Parameters
    ----------
    name : str
        The tensor's name, as initialized on the shards.
    index : int
        Its place in forward order (the first layer's is 0): the order the queue sends in, and its position in
        the pipeline's slots.
    array : numpy.ndarray
        The C-contiguous, writable array its pulls are received into (a model's own parameter storage).
    """

    __slots__ = ("name", "index", "array", "nbytes", "state", "epoch", "grad", "push", "pull", "shards", "sent")

    def __init__(self, name: str, index: int, array: np.ndarray) -> None:
        self.name = name
        self.index = index
        self.array = array
        self.nbytes = array.nbytes
        self.state = IDLE
        self.epoch = -1  # the step whose gradient this slot last queued
        self.grad: Optional[np.ndarray] = None
        self.push: Optional[Handle] = None
        self.pull: Optional[Handle] = None
        self.shards: tuple[tuple[int, int], ...] = ()  # (shard, bytes) of its push, as the pipeline counts them
        self.sent = 0.0  # when its push was handed to the sockets (time.perf_counter)


class Pace:
    """How many bytes of pushes may be in flight to one shard: its rate times the time they must cover.

    A shard's ack says when it took the push in and how long it held the answer (:class:`psrt.wire.AckReply`, the
    shard's clock). Two pushes taken one after the other, the second handed to the sockets before the first's
    ack was seen, are spaced by the time the second took to reach the shard behind the first: its bytes over that
    spacing are the rate pushes reach the shard at (its link's or its CPU's, whichever is slower; over the last
    :data:`PACE_SAMPLES`, :meth:`rate`). The pushes in flight keep the shard busy
    while an ack comes back and the next push goes: ``rate x (delay + hold + gap)``, with ``delay`` the least of
    the recent acks' time beyond the shard's hold and the bytes' own time (the round trip, and how late the ack
    was seen), ``hold`` the most the shard held a recent ack (an early sync push's, until its round opened),
    ``gap`` the most time the caller let pass between two pumps with pushes outstanding (its compute between two
    hooks). More
    than that, by :data:`QUEUE_S`, only waits in the sockets, where the pulls asked for and the first layers'
    gradients, queued last, wait behind it. The credit is never more than ``cap`` (the ``window``'s share), and
    stays that until the acks carry times (a replicated job's never do: see :class:`psrt.wire.AckReply`).

    Parameters
    ----------
    cap : float
        The most bytes in flight to the shard (its share of the window).
    """

    def __init__(self, cap: float) -> None:
        self.cap = cap
        self.credit = cap
        self._spans: deque[tuple[int, int]] = deque(maxlen=PACE_SAMPLES)  # (bytes, ns) taken one after another
        self._trips: deque[tuple[float, int]] = deque(maxlen=PACE_SAMPLES)  # (s from sent to seen, not held; bytes)
        self._holds: deque[float] = deque(maxlen=PACE_SAMPLES)  # s
        self._taken: Optional[int] = None  # the last push's, ns of the shard's clock
        self._seen = float("-inf")  # when its ack was seen

    def rate(self) -> float:
        """Bytes/s: the median of the recent spacings' rates, each weighing its bytes (a small push's spacing is
        mostly the shard's work on the one before; a burst a token bucket let through, or a shard that stalled,
        is one push among many)."""
        spans = sorted(self._spans, key=lambda span: span[0] / span[1])
        half, total = sum(b for b, _ in spans) / 2, 0
        for nbytes, ns in spans:
            total += nbytes
            if total >= half:
                return nbytes * 1e9 / ns
        return 0.0

    def acked(self, nbytes: int, sent: float, seen: float, taken: int, held: int, gap: float) -> None:
        """A push of ``nbytes`` to the shard, handed to the sockets at ``sent``, its ack seen at ``seen``
        (:func:`time.perf_counter`), ``taken`` in and ``held`` there (ns); ``gap``: the caller's longest recent
        gap between pumps (s). Updates :attr:`credit`."""
        if self._taken is not None and sent < self._seen and taken > self._taken:  # taken behind the last one
            self._spans.append((nbytes, taken - self._taken))
        self._taken, self._seen = taken, seen
        self._holds.append(held / 1e9)
        self._trips.append((seen - sent - held / 1e9, nbytes))
        if not self._spans:
            return
        rate = self.rate()
        delay = max(0.0, min(trip - b / rate for trip, b in self._trips))
        self.credit = min(self.cap, rate * (delay + max(self._holds) + gap + QUEUE_S))


class Pipeline:
    """The pushes and pulls of a worker's tensors, one tensor at a time, first layers first (module docstring).

    Parameters
    ----------
    client : psrt.Client
        The worker's client, with every slot's tensor initialized.
    slots : sequence of Slot
        Every tensor, in forward order: ``slots[i].index == i``.
    window : int
        At most this many gradient bytes handed to the sockets at a time, shared out over the shards by their
        shares of the pushed slots' bytes (at least one tensor in flight to each shard); less to a shard whose
        measured rate keeps busy with less (:class:`Pace`); no limit to a shard that holds its acks until every
        worker pushed the round (:attr:`psrt.Client.holding_shards`).
    timeout : float, optional
        Seconds to wait for any one reply (the client's timeout by default).
    pushed : sequence of Slot, optional
        The slots whose gradients will be queued (all by default): only their bytes share the window out. A
        frozen parameter that is never pushed must not hold credit on its shards, which would leave the shards
        of the trainable ones a smaller part of the window than their traffic is.
    """

    def __init__(self, client: Any, slots: Sequence[Slot], window: int = DEFAULT_WINDOW,
                 timeout: Optional[float] = None, pushed: Optional[Sequence[Slot]] = None) -> None:
        if type(window) is not int or window < 1:
            raise ConfigError(f"window must be a positive number of bytes, got {window!r}")
        if any(s.index != i for i, s in enumerate(slots)):
            raise ConfigError("the slots must be given in forward order, slot i with index i")
        self.client = client
        self.slots = list(slots)
        self.window = window
        self.timeout = timeout
        self.busy = 0  # slots not idle
        self.epoch = 0  # steps ended
        self._queue: list[int] = []  # slot indices queued, first layers first (sorted)
        self._sending: list[Slot] = []  # pushes in flight, in send order
        self._inflight = 0  # their bytes
        # Each pushed slot's bytes per shard, from the partition map; each shard's credit, its share of the window.
        total: dict[int, int] = {}
        pushed = self.slots if pushed is None else list(pushed)
        if any(not 0 <= s.index < len(self.slots) or self.slots[s.index] is not s for s in pushed):
            raise ConfigError("every pushed slot must be one of the pipeline's slots")
        self._queueable = {s.index for s in pushed}
        for s in pushed:
            share: dict[int, int] = {}
            for chunk in client.partition.chunks_of([s.name]):
                share[chunk.shard] = share.get(chunk.shard, 0) + chunk.nbytes
            s.shards = tuple(sorted(share.items()))
            for shard, nbytes in s.shards:
                total[shard] = total.get(shard, 0) + nbytes
        model = max(1, sum(total.values()))
        # A shard that holds each ack until every worker pushed the round (a replicated sync job's) gets every push
        # at once: one held back here could be the push another worker's held ack waits for, while that worker
        # holds back the one this worker's waits for.
        holding = client.holding_shards
        self._credit = {shard: math.inf if shard in holding else window * nbytes / model
                        for shard, nbytes in total.items()}
        self._paces = {shard: Pace(credit) for shard, credit in self._credit.items()}
        self._load = dict.fromkeys(total, 0)  # bytes of the pushes in flight, per shard
        # The caller's gaps between two pumps with pushes outstanding (its compute between two hooks): the last
        # pump that left some, and the time since spent waiting in this pipeline's own calls.
        self._gaps: deque[float] = deque(maxlen=2 * PACE_SAMPLES)
        self._pumped: Optional[float] = None
        self._blocked = 0.0
        #: A list to note the step's events in, or None (the default: nothing noted). Each is ``(time.time(),
        #: event, tensor)``, the events being ``queued`` (:meth:`enqueue`), ``sent`` (its push handed to the
        #: sockets), ``acked`` (every shard acknowledged it), ``waiting`` and ``ready`` (:meth:`wait_for` began and
        #: found its new values in): :mod:`psrt.emulation.trace` reads them.
        self.trace: Optional[list[tuple[float, str, str]]] = None

    def enqueue(self, s: Slot, grad: np.ndarray) -> None:
        """Queue ``s``'s gradient for this step (sent by the next :meth:`pump`); do not modify ``grad`` until
        ``s``'s push is acknowledged."""
        if s.index not in self._queueable:
            raise ConfigError(f"{s.name!r} was not given as a pushed slot when the pipeline was made")
        s.grad = grad
        s.state = QUEUED
        s.epoch = self.epoch
        self.busy += 1
        bisect.insort(self._queue, s.index)
        if self.trace is not None:
            self.trace.append((time.time(), "queued", s.name))

    def end_step(self) -> None:
        """This step's gradients are all queued: the next ones belong to the next step."""
        self.epoch += 1
        self.pump()

    def pump(self) -> None:
        """Take in the replies that are there, turn acknowledged pushes into pulls, send queued pushes."""
        now = time.perf_counter()
        if self._pumped is not None:  # (the caller's time since the last pump, not this pipeline's own waits)
            self._gaps.append(now - self._pumped - self._blocked)
        self._blocked = 0.0
        self._poll()
        done = [s for s in self._sending if _finished(s.push)]  # type: ignore[arg-type]
        for s in done:
            self._sending.remove(s)
            self._pushed(s, now)
        self._pumped = now if self._sending or self._queue else None
        if not self._queue:
            return
        # First layers first; a tensor that must wait keeps its shards from the ones behind it.
        kept: set[int] = set()
        load, credit = self._load, self._credit
        for index in list(self._queue):
            s = self.slots[index]
            # (Within the credit with this push's bytes, or alone: a push larger than the credit goes by itself.)
            if any(shard in kept or (load[shard] and load[shard] + nbytes > credit[shard])
                   for shard, nbytes in s.shards):
                kept.update(shard for shard, _ in s.shards)
                if len(kept) == len(load):
                    break
                continue
            self._queue.remove(index)
            s.push = self.client.push_async({s.name: s.grad})
            s.sent = time.perf_counter()
            if self.trace is not None:
                self.trace.append((time.time(), "sent", s.name))
            s.state = PUSHING
            self._sending.append(s)
            self._inflight += s.nbytes
            for shard, nbytes in s.shards:
                load[shard] += nbytes

    def idle(self, deadline: float) -> None:
        """Keep the transfers moving until ``deadline`` (a :func:`time.perf_counter` value): pump as each reply
        arrives, so that a pull is asked for, and a queued push sent, the moment a shard's answer allows it."""
        while True:
            self.pump()
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            handle = self._unfinished()
            if handle is None:
                time.sleep(remaining)
                return
            if handle._calls.closed:
                raise ConnectionLostError("this client is closed")
            # Wakes on the first reply of any call in flight (short slices: a client closed meanwhile is noticed).
            start = time.perf_counter()
            handle._calls.progress(handle, min(remaining, 0.25))
            self._blocked += time.perf_counter() - start

    def ready(self, s: Slot) -> bool:
        """Whether ``s``'s new value is in (:meth:`wait_for` would not block), after taking in the replies that
        are there."""
        self.pump()
        return s.state == IDLE or (s.state == PULLING and _finished(s.pull))  # type: ignore[arg-type]

    def wait_for(self, s: Slot) -> None:
        """Block until ``s``'s new value is in its array, taking in every ack meanwhile: queued pushes go as credit
        frees, and the acknowledged ones' pulls are asked for."""
        if self.trace is not None:
            self.trace.append((time.time(), "waiting", s.name))
        deadline = None
        while s.state != IDLE:
            self.pump()
            if s.state == PULLING and _finished(s.pull):  # type: ignore[arg-type]
                s.pull.wait(0.0)  # type: ignore[union-attr]  # (raises the shard's error, if any)
                s.pull = None
                s.state = IDLE
                self.busy -= 1
                break
            # Its pull, or the first push in flight (its own, or one that must go before it leaves): woken by any
            # ack meanwhile, which may let a queued push go, or ask for a pull.
            handle = s.pull if s.state == PULLING else self._sending[0].push
            calls = handle._calls  # type: ignore[union-attr]
            if deadline is None:
                deadline = time.monotonic() + (calls.config.timeout if self.timeout is None else self.timeout)
            start = time.perf_counter()
            calls.wait(handle, max(0.0, deadline - time.monotonic()), self._acked)
            self._blocked += time.perf_counter() - start
            if handle._error is not None:  # type: ignore[union-attr]
                raise handle._error  # type: ignore[union-attr]
        if self.trace is not None:
            self.trace.append((time.time(), "ready", s.name))

    def synchronize(self) -> None:
        """Wait until every push and pull in flight is done: every slot's array holds its new value."""
        for s in self.slots:
            self.wait_for(s)

    def drain_pushes(self) -> None:
        """Wait until every queued gradient has been pushed and acknowledged (their memory may then change)."""
        while self._queue or self._sending:
            self.pump()
            if self._sending:
                start = time.perf_counter()
                self._sending[0].push.wait(self.timeout)  # type: ignore[union-attr]
                self._blocked += time.perf_counter() - start

    def finish_previous(self) -> None:
        """Finish the work of earlier steps (not the gradients this step has already queued)."""
        for s in self.slots:
            if s.state != IDLE and s.epoch < self.epoch:
                self.wait_for(s)

    # ------------------------------------------------------------------ internals
    def _unfinished(self) -> Optional[Handle]:
        """A call still waiting for a reply, if any."""
        for s in self._sending:
            if not _finished(s.push):  # type: ignore[arg-type]
                return s.push
        for s in self.slots:
            if s.state == PULLING and not _finished(s.pull):  # type: ignore[arg-type]
                return s.pull
        return None

    def _poll(self) -> None:
        """Take in every reply already queued: one poll, through any unfinished call, serves all of them."""
        handle = self._unfinished()
        if handle is not None:
            handle.done()

    def _acked(self) -> bool:
        """Whether a push in flight has been answered (:meth:`pump` has work)."""
        return any(_finished(s.push) for s in self._sending)  # type: ignore[arg-type]

    def _pushed(self, s: Slot, seen: float) -> None:
        push = s.push
        push.wait(0.0)  # type: ignore[union-attr]  # finished: raises the shard's error, if any
        if self.trace is not None:
            self.trace.append((time.time(), "acked", s.name))
        self._inflight -= s.nbytes
        timing = push._timing  # type: ignore[union-attr]
        gap = max(self._gaps, default=0.0)
        for shard, nbytes in s.shards:
            self._load[shard] -= nbytes
            if timing is not None and shard in timing:
                pace = self._paces[shard]
                pace.acked(nbytes, s.sent, seen, *timing[shard], gap)
                self._credit[shard] = pace.credit
        s.grad = None
        s.push = None
        # The ack told the client the version this push joins; the pull asks for it (sync: this round).
        s.pull = self.client.pull_async([s.name], out={s.name: s.array})
        s.state = PULLING
