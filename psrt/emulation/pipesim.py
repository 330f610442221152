"""The overlapped step, event by event: what :mod:`psrt.worker.overlap` does on links shared by W workers.

The performance model's closed forms (:func:`psrt.emulation.perfmodel.predict`) describe a step that computes, then
communicates. A step overlapped as ``psrt worker --overlap`` (and :mod:`psrt.torch`) runs it has no closed form
worth the name: each tensor's push leaves when the emulated backward has produced it and the pipeline's byte window
lets it, its pull is asked for when the push is acknowledged and answered when the shard's round for it is
complete, and the next forward waits for each tensor just before its share of the compute. Which of those waits
show depends on the order the tensors meet on the links. :func:`simulate` follows them, for one worker whose W-1
peers do exactly the same at the same time (a sync job keeps its workers in step), with a fluid view of the links:
W equal transfers that share a link at once all end when the link has carried all of them.

Each link is a token bucket of ``rate`` bytes/s and ``burst`` bytes (``tc tbf``): bytes that meet a full bucket pass
at once, the rest at the rate, first in first out. A worker's link carries what the workers of its host send at
once (``hosted``), a shard's what all W send it. Requests and acknowledgements are small; they take the one-way
latency (half the round trip) and are not queued behind bulk data (the emulated cluster sends small packets first,
as a data-centre network's priority for control traffic does). A shard's CPU serves each of the W messages in
``msg_overhead_s`` plus its bytes at ``agg_bytes_per_s``, one at a time.

The pipeline's window is followed as it is; its pace (:class:`psrt.worker.overlap.Pace`, which keeps no more in
flight than a shard's measured rate needs) is not: here requests and acknowledgements never wait behind bulk
data, so bytes in flight beyond that cost nothing but the order the links carry them in.

Nothing here is fitted: the inputs are the job's shape, the links, the compute, and the calibrated machine figures
the rest of the model uses.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

__all__ = ["Link", "simulate", "Outcome"]

# A tensor's place in a step, as in psrt.worker.overlap.
_IDLE, _QUEUED, _PUSHING, _PULLING = range(4)


class Link:
    """One direction of a shaped link: a token bucket, first in first out.

    Parameters
    ----------
    rate : float
        Bytes per second (``math.inf``: unshaped).
    burst : float
        The bucket's size in bytes.
    """

    def __init__(self, rate: float, burst: float = 0.0) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = -math.inf  # when the last byte handed to the link leaves, were the bucket always empty
        self.busy = 0.0  # seconds of transfer at the rate, in all

    def send(self, t: float, nbytes: float) -> float:
        """Hand ``nbytes`` to the link at time ``t``; returns when the last of them has left."""
        if math.isinf(self.rate):
            return t
        # A bucket filled since the link went idle lets up to `burst` bytes through at once.
        self.clock = max(self.clock, t - self.burst / self.rate) + nbytes / self.rate
        self.busy += nbytes / self.rate
        return max(t, self.clock)


@dataclass(frozen=True)
class Outcome:
    """What :func:`simulate` found.

    Attributes
    ----------
    seconds : float
        The timed window (``steps`` steps), or, for ``steps = 0``, one step in the steady state.
    step_s : float
        Seconds per step (``seconds / steps``, or the steady state's period).
    server_in_s, server_out_s : float
        Per step, the busiest shard link's seconds of transfer into and out of its shard (at the rate).
    server_cpu_s : float
        Per step, the busiest shard's CPU seconds.
    worker_link_s : float
        Per step, a worker host link's seconds of transfer in its busier direction.
    """

    seconds: float
    step_s: float
    server_in_s: float
    server_out_s: float
    server_cpu_s: float
    worker_link_s: float


def simulate(layout: Sequence[Sequence[tuple[int, int]]], servers: int, workers: int, compute_s: float,
             server_link: float, worker_link: float, server_burst: float = 0.0, worker_burst: float = 0.0,
             hosted: int = 1, window: int = 4 << 20, forward_share: float = 1 / 3, steps: int = 0,
             latency_s: float = 0.0, msg_overhead_s: float = 0.0, agg_bytes_per_s: float = math.inf,
             wire_overhead: float = 1.0) -> Outcome:
    """Follow overlapped sync steps of ``workers`` workers in step with each other.

    Parameters
    ----------
    layout : sequence of sequence of (int, int)
        Per tensor, in forward order (the first layer first), its messages: ``(shard, payload bytes)``.
    servers, workers : int
        S and W.
    compute_s : float
        Compute per step: a forward of ``forward_share`` of it, then a backward of the rest, each spread over the
        tensors in proportion to their bytes (as :mod:`psrt.emulation.loadgen` does).
    server_link, worker_link : float
        Bytes/s per direction of a shard's link and of a worker host's link (``math.inf``: unshaped).
    server_burst, worker_burst : float
        Their token buckets, in bytes.
    hosted : int
        Workers on one worker host, sharing its link.
    window : int
        Gradient bytes a worker keeps in flight, shared out over the shards by their bytes (at least one tensor
        to each), as :class:`psrt.worker.overlap.Pipeline`.
    steps : int
        Timed steps, from a start with nothing in flight to the last step's parameters all in (what the load
        generator measures); 0: the steady state's period.
    latency_s : float
        A small request's round trip with nothing queued.
    msg_overhead_s, agg_bytes_per_s : float
        A shard's CPU per message and its aggregation rate.
    wire_overhead : float
        Wire bytes per payload byte.

    Returns
    -------
    Outcome
    """
    sim = _Sim(layout, servers, workers, compute_s, server_link, worker_link, server_burst, worker_burst, hosted,
               window, forward_share, latency_s, msg_overhead_s, agg_bytes_per_s, wire_overhead)
    if steps > 0:
        end = sim.run(steps)
        n = steps
        seconds, step_s = end, end / steps
    else:
        # The steady state: the period between step starts, once the start-up has passed.
        first, n = 4, 8
        sim.run(first + n)
        step_s = (sim.step_starts[first + n - 1] - sim.step_starts[first - 1]) / n
        seconds = step_s
        n = first + n
    # Per step, as the links and CPUs were busy over the whole run.
    return Outcome(seconds=seconds, step_s=step_s,
                   server_in_s=max(link.busy for link in sim.shard_in) / n,
                   server_out_s=max(link.busy for link in sim.shard_out) / n,
                   server_cpu_s=max(sim.cpu_busy) / n,
                   worker_link_s=max(sim.up.busy, sim.down.busy) / n)


class _Sim:
    """The event loop: one representative worker, the links it shares, the shards' CPUs."""

    def __init__(self, layout: Sequence[Sequence[tuple[int, int]]], servers: int, workers: int, compute_s: float,
                 server_link: float, worker_link: float, server_burst: float, worker_burst: float, hosted: int,
                 window: int, forward_share: float, latency_s: float, msg_overhead_s: float,
                 agg_bytes_per_s: float, wire_overhead: float) -> None:
        self.layout = [list(msgs) for msgs in layout]
        self.sizes = [sum(b for _, b in msgs) for msgs in self.layout]
        total = max(1, sum(self.sizes))
        self.shares = [b / total for b in self.sizes]
        self.W = workers
        self.hosted = max(1, min(hosted, workers))
        self.forward = compute_s * forward_share
        self.backward = compute_s - self.forward
        self.window = window
        # The window shared out over the shards by their bytes, as Pipeline does (psrt.worker.overlap).
        self.shard_bytes = [{} for _ in self.layout]  # per tensor: shard -> its payload bytes there
        per_shard: dict[int, int] = {}
        for i, msgs in enumerate(self.layout):
            for shard, nbytes in msgs:
                self.shard_bytes[i][shard] = self.shard_bytes[i].get(shard, 0) + nbytes
                per_shard[shard] = per_shard.get(shard, 0) + nbytes
        self.credit = {shard: window * b / total for shard, b in per_shard.items()}
        self.load = dict.fromkeys(per_shard, 0)
        self.half = latency_s / 2
        self.o = msg_overhead_s
        self.agg = agg_bytes_per_s
        self.h = wire_overhead
        self.shard_in = [Link(server_link, server_burst) for _ in range(servers)]
        self.shard_out = [Link(server_link, server_burst) for _ in range(servers)]
        self.cpu_free = [0.0] * servers
        self.cpu_busy = [0.0] * servers
        self.up, self.down = Link(worker_link, worker_burst), Link(worker_link, worker_burst)
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self.seq = 0
        n = len(self.layout)
        self.state = [_IDLE] * n
        self.acks_left = [0] * n  # a push's messages not yet acknowledged
        self.acked_at = [math.inf] * n  # when the worker has every acknowledgement of its push
        self.pulls_left = [0] * n
        self.pulled_at = [0.0] * n  # when its new values are all in (0: in from the start)
        self.round_done: dict[tuple[int, int], float] = {}
        self.queue: list[int] = []  # tensors queued (sent first layers first)
        self.sending: list[int] = []  # pushes in flight, in send order
        self.inflight = 0
        self.step_starts: list[float] = []

    # ------------------------------------------------------------------ events
    def at(self, t: float, fn: Callable[[float], None]) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn))

    def advance(self, until: float, responsive: bool, done: Optional[Callable[[], bool]] = None) -> float:
        """Run the network's events up to ``until``, or until ``done()``; returns the time reached. A responsive
        worker pumps after each event, as :meth:`Pipeline.idle` does on each reply."""
        while self.events and self.events[0][0] <= until:
            t, _, fn = heapq.heappop(self.events)
            fn(t)
            if responsive:
                self.pump(t)
            if done is not None and done():
                return t
        if math.isinf(until):
            raise RuntimeError("the simulated pipeline stalled: a wait with nothing in flight")
        return until

    # ------------------------------------------------------------------ the worker's pipeline
    def pump(self, t: float) -> None:
        for i in [i for i in self.sending if self.acked_at[i] <= t]:
            self.sending.remove(i)
            self.inflight -= self.sizes[i]
            for shard, nbytes in self.shard_bytes[i].items():
                self.load[shard] -= nbytes
            self.request_pulls(t, i)
        kept: set[int] = set()
        for i in sorted(self.queue):
            shards = self.shard_bytes[i]
            if any(sh in kept or (self.load[sh] and self.load[sh] + b > self.credit[sh]) for sh, b in shards.items()):
                kept.update(shards)
                continue
            self.queue.remove(i)
            self.state[i] = _PUSHING
            self.sending.append(i)
            self.inflight += self.sizes[i]
            for shard, nbytes in shards.items():
                self.load[shard] += nbytes
            self.push(t, i)

    def push(self, t: float, i: int) -> None:
        self.acks_left[i] = len(self.layout[i])
        self.acked_at[i] = math.inf
        for shard, nbytes in self.layout[i]:
            wire = nbytes * self.h
            sent = self.up.send(t, self.hosted * wire)
            link = self.shard_in[shard]
            landed = max(sent, link.send(t, self.W * wire)) + self.half
            # The W pushes land over the link's time for all of them; the shard sums each as it lands.
            first = landed if math.isinf(link.rate) else max(t + self.half, landed - self.W * wire / link.rate)
            self.at(landed, lambda t, i=i, s=shard, b=nbytes, f=first: self.land(t, i, s, b, f))

    def land(self, t: float, i: int, shard: int, nbytes: int, first: float) -> None:
        """The last of the W pushes of tensor ``i`` to ``shard`` has landed (the first at ``first``)."""
        work = self.o + nbytes / self.agg
        done = max(t + work, max(self.cpu_free[shard], first) + self.W * work)
        self.cpu_free[shard] = done
        self.cpu_busy[shard] += self.W * work
        self.round_done[(i, shard)] = done
        self.at(done, lambda t, i=i, s=shard: self.ack(t, i, s))

    def ack(self, t: float, i: int, shard: int) -> None:
        """The shard acknowledges a push: on the connection's stream, behind the replies it still carries."""
        leaves = max(t, self.shard_out[shard].clock, self.down.clock)
        self.at(leaves + self.half, lambda t, i=i: self.acked(t, i))

    def acked(self, t: float, i: int) -> None:
        self.acks_left[i] -= 1
        if self.acks_left[i] == 0:
            self.acked_at[i] = t

    def request_pulls(self, t: float, i: int) -> None:
        self.state[i] = _PULLING
        self.pulls_left[i] = len(self.layout[i])
        self.pulled_at[i] = math.inf
        for shard, nbytes in self.layout[i]:
            # The request follows the pushes still on the connection's stream.
            asked = max(t, self.up.clock, self.shard_in[shard].clock) + self.half
            self.at(max(asked, self.round_done[(i, shard)]), lambda t, s=shard, b=nbytes, i=i: self.answer(t, i, s, b))

    def answer(self, t: float, i: int, shard: int, nbytes: int) -> None:
        """The shard answers the W pulls of its round (in order of time, so the links stay first in first out):
        its CPU one reply after another, the link sending each as it is made."""
        start = max(self.cpu_free[shard], t)
        self.cpu_free[shard] = start + self.W * self.o
        self.cpu_busy[shard] += self.W * self.o
        wire = nbytes * self.h
        out = self.shard_out[shard].send(t, self.W * wire)
        down = self.down.send(t, self.hosted * wire)
        self.at(max(out, down, self.cpu_free[shard]) + self.half, lambda t, i=i: self.pulled(t, i))

    def pulled(self, t: float, i: int) -> None:
        self.pulls_left[i] -= 1
        if self.pulls_left[i] == 0:
            self.pulled_at[i] = t

    # ------------------------------------------------------------------ the worker's program
    def wait_for(self, t: float, i: int) -> float:
        """:meth:`Pipeline.wait_for`: pumping after each reply until the tensor's new values are in."""
        self.pump(t)
        if self.state[i] != _IDLE:
            if not (self.state[i] == _PULLING and self.pulled_at[i] <= t):
                t = self.advance(math.inf, True, lambda: self.state[i] == _PULLING and self.pulled_at[i] < math.inf)
            self.state[i] = _IDLE
        return t

    def compute(self, t: float, seconds: float) -> float:
        end = t + seconds
        self.advance(end, True)
        self.pump(end)
        return end

    def run(self, steps: int) -> float:
        """``steps`` steps from a quiet start; returns when the last one's parameters are all in."""
        t = 0.0
        n = len(self.layout)
        for _ in range(steps):
            self.step_starts.append(t)
            due = t
            for i in range(n):
                t = self.wait_for(t, i)
                due = max(due, t)
                due = self.compute(due, self.forward * self.shares[i])
                t = due
            for i in reversed(range(n)):
                due = self.compute(due, self.backward * self.shares[i])
                t = due
                self.state[i] = _QUEUED
                self.queue.append(i)
                self.pump(t)
        for i in range(n):
            t = self.wait_for(t, i)
        return t
