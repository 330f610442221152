"""An analytical model of a training step's time and a job's throughput (see docs/perfmodel.md).

The model follows one step of data-parallel training through psrt: compute, push to S shards, the shards'
aggregation and optimizer step, pull back. Its inputs are the job's shape (W, S, model bytes and how they split
over shards), the links' bandwidth, the compute time, and two figures calibrated on the machine at hand: the
shard's aggregation rate (bytes of gradient it sums and applies per second) and the per-message overhead.

Its central prediction is the CNTK/BytePS observation: with one server, throughput grows with W only until the
server's link carries W times a worker's traffic, then flattens at ``B_s / (2 M_s)`` steps per second; S shards
lift that plateau S-fold, as long as the model splits into at least S chunks. Turned around, it is a capacity
planner: :func:`smallest_servers` finds the fewest shards (and the shard link) that keep W workers at a given
fraction of linear scaling (:func:`efficiency`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Sequence

import numpy as np

from psrt.emulation import models
from psrt.errors import ConfigError
from psrt.partition import PartitionMap, busiest_shard, joined

__all__ = ["Calibration", "Scenario", "Prediction", "predict", "saturation_point", "calibrate", "shard_split",
           "tail_from_run", "efficiency_from_run", "scenario_for", "tensor_layout", "TCP_OVERHEAD", "Plan",
           "efficiency", "smallest_servers", "plot_efficiency", "PLAN_MAX_WORKERS", "PLAN_MAX_SERVERS"]

#: Bytes on the wire per payload byte for TCP/IPv4 over Ethernet with timestamps: (1448 + 66) / 1448.
TCP_OVERHEAD = (1448 + 66) / 1448


@dataclass(frozen=True)
class Calibration:
    """Machine figures the model needs.

    Parameters
    ----------
    agg_bytes_per_s : float
        Gradient bytes a shard sums into its accumulator and applies per second (kernels + loop overhead).
    msg_overhead_s : float
        Fixed cost of one request/reply at a shard (decode, dispatch, reply), in seconds.
    rtt_s : float
        Latency of one small push_pull round trip with nothing else going on, in seconds.
    contended_tail : float, optional
        When W >= 2 workers share a shard's link, the fraction of a round's replies still to be sent when the
        round's last push arrives is ``contended_tail * (W-1)/W`` (at least the ideal 1/k); measured on the
        network at hand (:func:`tail_from_run`). None assumes ideal pipelining.
    link_efficiency : float, optional
        For overlapped steps: the share of a shard link's rate that W >= 2 workers' connections get, ``1 - (1 -
        link_efficiency) * (W-1)/W`` (one connection gets it all; many, competing for one link and each sync round
        waiting for the slowest, less); measured on the network at hand by a job outside the sweep
        (:func:`efficiency_from_run`). None: all of it.
    """

    agg_bytes_per_s: float = 2e9
    msg_overhead_s: float = 100e-6
    rtt_s: float = 300e-6
    contended_tail: Optional[float] = None
    link_efficiency: Optional[float] = None


@dataclass(frozen=True)
class Scenario:
    """One job to predict.

    Parameters
    ----------
    workers, servers : int
        W and S.
    model_bytes : int
        Bytes of parameters (= bytes of gradient pushed per worker per step).
    shard_bytes : int
        Bytes held by the busiest shard (``model_bytes / servers`` if perfectly balanced).
    messages : int
        Requests a worker sends to the busiest shard per step.
    worker_link, server_link : float
        Link bandwidth of a worker and of a server host, bytes/s per direction (full duplex).
    compute_s : float
        Compute time per step.
    mode : str
        ``"sync"`` or ``"async"``.
    burst_bytes : float
        Token-bucket burst of a shaped link (0 for a real NIC): bytes that pass at once after an idle spell.
    wire_overhead : float
        Wire bytes per payload byte (:data:`TCP_OVERHEAD`).
    overlap : bool
        The step overlaps communication with compute as ``psrt worker --overlap`` (and :mod:`psrt.torch`) does:
        each tensor pushed as the backward produces it, its parameters awaited just before its share of the next
        forward. :func:`predict` then follows the step event by event (:mod:`psrt.emulation.pipesim`); sync only.
    layout : tuple
        With ``overlap``: per tensor in forward order, its messages as ``(shard, payload bytes)`` pairs
        (:func:`scenario_for` fills it in from psrt's partition map).
    window : int
        With ``overlap``: gradient bytes a worker keeps in flight (``psrt worker --window``).
    hosted : int
        Workers that share one worker host's link (``psrt worker --clients``).
    worker_burst_bytes : float, optional
        The worker links' token-bucket burst (default: ``burst_bytes``).
    steps : int
        With ``overlap``: predict the load generator's timed window of this many steps, which starts with nothing
        in flight and ends when the last step's parameters are all in; 0 (default): the steady state.
    """

    workers: int
    servers: int
    model_bytes: int
    shard_bytes: int
    messages: int
    worker_link: float
    server_link: float
    compute_s: float
    mode: str = "sync"
    burst_bytes: float = 0.0
    wire_overhead: float = TCP_OVERHEAD
    overlap: bool = False
    layout: tuple = ()
    window: int = 4 << 20  # psrt.worker.overlap.DEFAULT_WINDOW
    hosted: int = 1
    worker_burst_bytes: Optional[float] = None
    steps: int = 0

    def __post_init__(self) -> None:
        if self.workers < 1 or self.servers < 1 or self.model_bytes <= 0:
            raise ConfigError("workers, servers and model_bytes must be positive")
        if self.worker_link <= 0 or self.server_link <= 0:
            raise ConfigError("link bandwidths must be positive")
        if self.mode not in ("sync", "async"):
            raise ConfigError(f"mode must be sync or async, got {self.mode!r}")
        if self.overlap and self.mode != "sync":
            raise ConfigError("the overlapped step is modelled for sync jobs: use mode='sync', or overlap=False")
        if self.overlap and not self.layout:
            raise ConfigError("an overlapped scenario needs its tensors' layout (scenario_for(..., overlap=True) "
                              "builds it)")
        if self.window < 1 or self.hosted < 1 or self.steps < 0:
            raise ConfigError("window and hosted must be positive, steps at least 0")


@dataclass(frozen=True)
class Prediction:
    """The model's answer for one :class:`Scenario`; times in seconds."""

    step_s: float
    steps_per_s: float
    t_compute: float
    t_push: float
    t_pull: float
    t_server_cpu: float
    t_latency: float
    bottleneck: str
    terms: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """The prediction as a plain dict."""
        return asdict(self)


def shard_split(tensors: Sequence[tuple[str, tuple[int, ...]]], servers: int, partition_bytes: int,
                itemsize: int = 4) -> tuple[int, int]:
    """``(bytes on the busiest shard, messages a worker sends it per step)`` under psrt's partition map."""
    chunks = busiest_shard({name: (shape, np.dtype(f"f{itemsize}")) for name, shape in tensors}, servers,
                           partition_bytes)
    msgs = PartitionMap(servers, partition_bytes).messages(chunks)
    # (A call that is not paced sends a split tensor's pieces joined: psrt.partition.joined.)
    return sum(c.nbytes for c in chunks), max(1, sum(len(joined(m, partition_bytes)) for m in msgs.values()))


def _xfer(nbytes: float, link: float, sc: Scenario) -> float:
    """Seconds to move ``nbytes`` of payload through a link that was idle (its bucket full)."""
    return max(0.0, nbytes * sc.wire_overhead - sc.burst_bytes) / link


def _tail_fraction(sc: Scenario, cal: Calibration) -> float:
    """Fraction of a round's replies not hidden behind its pushes at the busiest shard's link.

    Ideally 1/k. On FIFO links the reply streams stall while the shard's incoming queue is deep, and that queue
    holds (W-1)/W of a round when W workers push at once into a link no faster than each of theirs; the
    calibrated ``contended_tail`` is the stall per unit of that share.
    """
    ideal = 1.0 / sc.messages
    if sc.workers < 2 or cal.contended_tail is None:
        return ideal
    return min(1.0, max(ideal, cal.contended_tail * (sc.workers - 1) / sc.workers))


def tail_from_run(sc: Scenario, cal: Calibration, measured_steps_per_s: float) -> float:
    """Solve a measured sync run (W >= 2, shard link the bottleneck) for :attr:`Calibration.contended_tail`."""
    step = sc.workers / measured_steps_per_s
    t_cpu = sc.workers * (sc.messages * cal.msg_overhead_s + sc.shard_bytes / cal.agg_bytes_per_s)
    t_push = max(_xfer(sc.model_bytes, sc.worker_link, sc), _xfer(sc.workers * sc.shard_bytes, sc.server_link, sc))
    tail_s = step - sc.compute_s - cal.rtt_s - max(t_push, t_cpu)
    wire_bytes = (tail_s * sc.server_link + sc.burst_bytes) / sc.wire_overhead
    share = (sc.workers - 1) / sc.workers
    return min(1.0, max(0.0, wire_bytes / (sc.workers * sc.shard_bytes) / share))


def predict(sc: Scenario, cal: Calibration) -> Prediction:
    """Predict the step time and throughput (worker-steps/s summed over workers) of a scenario.

    Sync (BSP)::

        t_push   = max(xfer(M, B_w), xfer(W*M_s, B_s))        # the slower of a worker's uplink and the shard's
        t_cpu    = W * (k * o + M_s / R)                       # shard CPU for one round (k messages per worker)
        t_pull   = max(xfer(M_s/k, B_w), xfer(W*M_s*f, B_s))  # f = 1/k: only the last message's replies remain
        step     = C + rtt + max(t_push, t_cpu) + t_pull
        X        = W / step

    Async (each worker on its own clock; push and pull share a shard's link in opposite directions)::

        X = min(W / (C + rtt + xfer(M, B_w) + xfer(M_s/k, B_w)),  B_s / (M_s * overhead),  1 / (k*o + M_s / R))
    """
    if sc.overlap:
        return _predict_overlapped(sc, cal)
    W, k = sc.workers, sc.messages
    t_latency = cal.rtt_s
    t_cpu = W * (k * cal.msg_overhead_s + sc.shard_bytes / cal.agg_bytes_per_s)
    worker_x = _xfer(sc.model_bytes, sc.worker_link, sc)
    server_x = _xfer(W * sc.shard_bytes, sc.server_link, sc)
    # Pipelining: a shard answers message i while message i+1 is still arriving, so only the last of the k
    # messages' replies is not hidden behind the push. A worker's own link has one message's reply left, M_s/k:
    # its messages to the other shards go out in between, and those shards answer while it is still pushing.
    worker_tail = _xfer(sc.shard_bytes / k, sc.worker_link, sc)
    server_tail = _xfer(W * sc.shard_bytes * _tail_fraction(sc, cal), sc.server_link, sc)
    terms = {"worker_xfer_s": worker_x, "server_xfer_s": server_x, "worker_tail_s": worker_tail,
             "server_tail_s": server_tail}
    if sc.mode == "sync":
        t_push = max(worker_x, server_x)
        t_pull = max(worker_tail, server_tail)
        step = sc.compute_s + t_latency + max(t_push, t_cpu) + t_pull
        rate = W / step
        if t_cpu > t_push and t_cpu > sc.compute_s:
            bottleneck = "server CPU"
        elif server_x > worker_x and 2 * server_x > sc.compute_s:
            bottleneck = "server link"
        elif 2 * worker_x > sc.compute_s:
            bottleneck = "worker link"
        else:
            bottleneck = "compute"
    else:
        worker_cycle = sc.compute_s + t_latency + worker_x + worker_tail
        link_cap = sc.server_link / (sc.shard_bytes * sc.wire_overhead)
        cpu_cap = 1.0 / (sc.messages * cal.msg_overhead_s + sc.shard_bytes / cal.agg_bytes_per_s)
        caps = {"worker": W / worker_cycle, "server link": link_cap, "server CPU": cpu_cap}
        bottleneck = min(caps, key=caps.get)
        rate = caps[bottleneck]
        step = W / rate
        t_push, t_pull = worker_x, worker_tail
        terms.update({f"cap_{k.replace(' ', '_')}": v for k, v in caps.items()})
    return Prediction(step_s=step, steps_per_s=rate, t_compute=sc.compute_s, t_push=t_push, t_pull=t_pull,
                      t_server_cpu=t_cpu, t_latency=t_latency, bottleneck=bottleneck, terms=terms)


def _predict_overlapped(sc: Scenario, cal: Calibration) -> Prediction:
    """:func:`predict` for an overlapped sync step: :func:`psrt.emulation.pipesim.simulate` on the scenario."""
    from psrt.emulation.loadgen import FORWARD_SHARE
    from psrt.emulation.pipesim import simulate

    worker_burst = sc.burst_bytes if sc.worker_burst_bytes is None else sc.worker_burst_bytes
    server_link = sc.server_link * _link_share(sc, cal)
    out = simulate(sc.layout, sc.servers, sc.workers, sc.compute_s, server_link, sc.worker_link,
                   server_burst=sc.burst_bytes, worker_burst=worker_burst, hosted=sc.hosted, window=sc.window,
                   forward_share=FORWARD_SHARE, steps=sc.steps, latency_s=cal.rtt_s,
                   msg_overhead_s=cal.msg_overhead_s, agg_bytes_per_s=cal.agg_bytes_per_s,
                   wire_overhead=sc.wire_overhead)
    busy = {"compute": sc.compute_s, "server link": max(out.server_in_s, out.server_out_s),
            "server CPU": out.server_cpu_s, "worker link": out.worker_link_s}
    bottleneck = max(busy, key=busy.get)
    terms = {"server_in_s": out.server_in_s, "server_out_s": out.server_out_s, "worker_link_s": out.worker_link_s,
             "window_s": out.seconds}
    return Prediction(step_s=out.step_s, steps_per_s=sc.workers / out.step_s, t_compute=sc.compute_s,
                      t_push=out.server_in_s, t_pull=out.server_out_s, t_server_cpu=out.server_cpu_s,
                      t_latency=cal.rtt_s, bottleneck=bottleneck, terms=terms)


def _link_share(sc: Scenario, cal: Calibration) -> float:
    """The share of a shard link's rate an overlapped scenario's workers get (:attr:`Calibration.link_efficiency`)."""
    if cal.link_efficiency is None or sc.workers < 2:
        return 1.0
    return 1.0 - (1.0 - cal.link_efficiency) * (sc.workers - 1) / sc.workers


def efficiency_from_run(sc: Scenario, cal: Calibration, measured_steps_per_s: float) -> float:
    """Solve a measured overlapped run (W >= 2, shard links busy) for :attr:`Calibration.link_efficiency`.

    The efficiency in [0.2, 1] whose prediction of ``sc`` comes nearest ``measured_steps_per_s`` (a run faster than
    the model with the links' full rate gives 1).
    """
    if not sc.overlap or sc.workers < 2:
        raise ConfigError("the link efficiency is measured on an overlapped run of W >= 2 workers")

    def rate(eff: float) -> float:
        return predict(sc, replace(cal, link_efficiency=eff)).steps_per_s

    lo, hi = 0.2, 1.0
    if rate(hi) <= measured_steps_per_s:
        return hi
    if rate(lo) >= measured_steps_per_s:
        return lo
    for _ in range(30):  # the prediction grows with the efficiency
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) < measured_steps_per_s else (lo, mid)
    return (lo + hi) / 2


def saturation_point(sc: Scenario, cal: Calibration) -> tuple[float, float]:
    """``(W_knee, plateau)``: where the shards' links saturate, and the throughput they cap the job at.

    Below the knee throughput grows linearly, ``W / (C + rtt + xfer(M, B_w) + xfer(M_s/k, B_w))``; above it, it
    approaches the plateau ``B_s / ((1 + 1/k) * M_s * overhead)`` (sync; ``B_s / (M_s * overhead)`` async).
    The knee is where the two lines cross. Overlapped (``sc.overlap``), the plateau is ``B_s / (M_s * overhead)``
    (pushes in and pulls out at once) and the linear growth a lone worker's overlapped step.
    """
    if sc.overlap:
        # Overlapped, a shard's link carries pushes in and pulls out at once: its plateau is one direction's.
        plateau = sc.server_link * _link_share(replace(sc, workers=1 << 30), cal) / (sc.shard_bytes * sc.wire_overhead)
        alone = predict(Scenario(**{**asdict(sc), "workers": 1, "steps": 0}), cal)
        return plateau * alone.step_s, plateau
    k = sc.messages
    single = sc.compute_s + cal.rtt_s + _xfer(sc.model_bytes, sc.worker_link, sc) + _xfer(
        sc.shard_bytes / k, sc.worker_link, sc)
    many = Scenario(**{**asdict(sc), "workers": 1 << 30})  # the plateau is the limit W -> infinity
    factor = 1.0 + _tail_fraction(many, cal) if sc.mode == "sync" else 1.0
    plateau = sc.server_link / (factor * sc.shard_bytes * sc.wire_overhead)
    return plateau * single, plateau


def calibrate(repeats: int = 200, nbytes: int = 4 << 20) -> Calibration:
    """Measure this machine: the shard's aggregation rate and the small-message overhead.

    The aggregation rate times the kernels a sync round runs per pushed byte (accumulate, then the optimizer
    step on 1/W of the rounds); the message overhead and round trip come from 4 KiB push_pulls through a real
    shard server process on loopback.
    """
    from psrt import SGD, Client, kernels
    from psrt.cluster.local import LocalShards

    n = nbytes // 4
    acc, grad, param = np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.float32)
    times = []
    for _ in range(20):
        t = time.perf_counter()
        kernels.accumulate(acc, grad)
        kernels.sgd_step(param, acc, 0.01, 0.25)
        times.append(time.perf_counter() - t)
    agg = nbytes / statistics.median(times)
    with LocalShards(1, 1) as shards, Client(shards.endpoints) as client:
        small = {"w": np.zeros(1024, np.float32)}
        client.init(small, optimizer=SGD(lr=0.0))
        for _ in range(20):
            client.push_pull(small)
        rtts = []
        for _ in range(repeats):
            t = time.perf_counter()
            client.push_pull(small)
            rtts.append(time.perf_counter() - t)
        # Pipelined small requests: the shard's per-message cost without the round trip.
        batch = 200
        t = time.perf_counter()
        handles = [client.push_async(small) for _ in range(batch)]
        for h in handles:
            h.wait()
        per_msg = (time.perf_counter() - t) / batch
    return Calibration(agg_bytes_per_s=agg, msg_overhead_s=per_msg, rtt_s=statistics.median(rtts))


def scenario_for(workers: int, servers: int, tensors: Sequence[tuple[str, tuple[int, ...]]], link_bits: float,
                 compute_s: float, mode: str = "sync", partition_bytes: int = 4 << 20,
                 server_link_bits: Optional[float] = None, burst_bytes: float = 0.0, overlap: bool = False,
                 window: int = 4 << 20, hosted: int = 1, worker_burst_bytes: Optional[float] = None,
                 steps: int = 0) -> Scenario:
    """Build a :class:`Scenario` from a model's tensors and link speeds in bits/s (``math.inf``: unshaped).

    With ``overlap``, the tensors are taken in forward order (the first layer first, as ``psrt worker --layers``
    names them) and each one's messages come from psrt's partition map, as the load generator pushes them.
    """
    model_bytes = models.model_bytes(tensors)
    shard_bytes, messages = _split(_key(tensors), servers, partition_bytes, model_bytes)
    return Scenario(workers=workers, servers=servers, model_bytes=model_bytes, shard_bytes=shard_bytes,
                    messages=messages, worker_link=link_bits / 8,
                    server_link=(server_link_bits or link_bits) / 8, compute_s=compute_s, mode=mode,
                    burst_bytes=burst_bytes, overlap=overlap,
                    layout=tensor_layout(tensors, servers, partition_bytes) if overlap else (), window=window,
                    hosted=hosted, worker_burst_bytes=worker_burst_bytes, steps=steps)


def _key(tensors: Sequence[tuple[str, tuple[int, ...]]]) -> tuple:
    """A model's tensors as a hashable key (the splits are cached by it)."""
    return tuple((name, tuple(shape)) for name, shape in tensors)


@functools.lru_cache(maxsize=8192)
def _split(key: tuple, servers: int, partition_bytes: int, model_bytes: int) -> tuple[int, int]:
    """``(bytes on the busiest shard, messages to it)``, cached: the planner asks for every S up to 1,000."""
    if len(key) > 2000 or model_bytes / partition_bytes > 20000:
        # Very large models: assume the partition map balances to within one chunk.
        chunk = min(partition_bytes, model_bytes)
        shard_bytes = max(math.ceil(model_bytes / servers), chunk)
        return shard_bytes, max(1, math.ceil(shard_bytes / partition_bytes))
    return shard_split(key, servers, partition_bytes)


def tensor_layout(tensors: Sequence[tuple[str, tuple[int, ...]]], servers: int, partition_bytes: int,
                  itemsize: int = 4) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per tensor, in the order given, the messages a push of that tensor alone sends: ``((shard, bytes), ...)``.

    The same partition map and message grouping a client uses (:class:`psrt.partition.PartitionMap`), so an
    overlapped step's pushes, one tensor at a time, are modelled message by message.
    """
    pmap = PartitionMap(servers, partition_bytes)
    pmap.add({name: (shape, np.dtype(f"f{itemsize}")) for name, shape in tensors})
    layout = []
    for name, _ in tensors:
        msgs = pmap.messages(pmap.chunks_of([name]))
        layout.append(tuple((shard, sum(c.nbytes for c in msg)) for shard in sorted(msgs)
                            for msg in joined(msgs[shard], partition_bytes)))
    return tuple(layout)


# ----------------------------------------------------------------------------------------------------------------
# The capacity planner (docs/perfmodel.md, "The capacity planner").

#: The planner's range: any W up to this many workers ...
PLAN_MAX_WORKERS = 10_000
#: ... and S up to this many servers.
PLAN_MAX_SERVERS = 1_000
#: A calibration whose shards cost no CPU at all: it tells whether the shards' CPU is what stops a job (an
#: infinite rate would divide by zero in the async equations).
_FREE_CPU = {"agg_bytes_per_s": 1e300, "msg_overhead_s": 0.0}
#: Shard links are searched to this relative precision, between these bounds (bytes/s).
_LINK_PRECISION = 1e-4
_LINK_FLOOR, _LINK_CEILING = 1.0, 1e30


@dataclass(frozen=True)
class Plan:
    """What the capacity planner found for one W (:func:`smallest_servers`).

    Attributes
    ----------
    workers : int
        W.
    target : float
        The efficiency asked for.
    alone_steps_per_s : float
        Steps/s of one worker with one server at the given links: linear scaling is W times this.
    servers : int
        The smallest S that reaches the target at the given links; when none of S <= ``max_servers`` does
        (``reached`` false), the S of the highest efficiency there (the smallest of equals).
    efficiency : float
        The efficiency of ``servers`` at the given links.
    reached : bool
        Whether ``efficiency >= target``.
    server_link : float or None
        Bytes/s per shard link, each direction. When reached: the least at which ``servers`` still reaches the
        target (no smaller S does at any link that low, so ``servers`` stays the smallest). When not: the least at
        which some S <= ``max_servers`` reaches it, or None when no shard link does.
    link_servers : int or None
        The smallest S that reaches the target with shard links of ``server_link`` (``servers`` when reached).
    limit : str
        ``""`` when reached; otherwise what stops the job: ``"shard link"`` (a faster one reaches the target),
        ``"shard CPU"`` (no shard link does, shards without CPU cost would) or ``"worker link"`` (neither does).
    bottleneck : str
        :func:`predict`'s bottleneck for ``servers`` at the given links.
    matched_servers : int
        The S that gives the shards as much bandwidth as the workers, ``ceil(W * B_w / B_s)``: the rule BytePS
        derives for a bandwidth-bound job.
    max_servers : int
        The largest S tried.
    """

    workers: int
    target: float
    alone_steps_per_s: float
    servers: int
    efficiency: float
    reached: bool
    server_link: Optional[float]
    link_servers: Optional[int]
    limit: str
    bottleneck: str
    matched_servers: int
    max_servers: int


class _Planner:
    """One job's scenarios at every W, S and shard link: one :func:`scenario_for`, then the cached splits."""

    def __init__(self, tensors: Sequence[tuple[str, tuple[int, ...]]], cal: Calibration, link_bits: float,
                 compute_s: float, mode: str, partition_bytes: int, server_link_bits: Optional[float],
                 burst_bytes: float) -> None:
        self.base = scenario_for(1, 1, tensors, link_bits, compute_s, mode, partition_bytes, server_link_bits,
                                 burst_bytes)
        self.key = _key(tensors)
        self.cal = cal
        self.partition_bytes = partition_bytes
        self.alone = predict(self.base, cal).steps_per_s

    def scenario(self, workers: int, servers: int, server_link: Optional[float] = None) -> Scenario:
        shard_bytes, messages = _split(self.key, servers, self.partition_bytes, self.base.model_bytes)
        return dataclasses.replace(self.base, workers=workers, servers=servers, shard_bytes=shard_bytes,
                                   messages=messages,
                                   server_link=self.base.server_link if server_link is None else server_link)

    def efficiency(self, workers: int, servers: int, server_link: Optional[float] = None,
                   cal: Optional[Calibration] = None) -> float:
        rate = predict(self.scenario(workers, servers, server_link), cal or self.cal).steps_per_s
        return rate / (workers * self.alone)

    def least_link(self, workers: int, servers: int, target: float, lo: float, hi: float) -> float:
        """The least shard link (bytes/s) at which ``servers`` reach ``target``, given that ``hi`` does and ``lo``
        does not (0: find a ``lo``). Throughput never falls as a shard's link grows, so bisection finds it."""
        if lo <= 0:
            lo = hi / 2
            while self.efficiency(workers, servers, lo) >= target:
                if lo <= _LINK_FLOOR:
                    return lo  # a burst larger than the round: the shard's link does not matter
                hi, lo = lo, lo / 2
        while hi > lo * (1 + _LINK_PRECISION):
            mid = math.sqrt(lo * hi)
            if self.efficiency(workers, servers, mid) >= target:
                hi = mid
            else:
                lo = mid
        return hi

    def plan(self, workers: int, target: float, max_servers: int) -> Plan:
        base = self.base
        found, best, best_eff = None, 1, -1.0
        for servers in range(1, max_servers + 1):
            eff = self.efficiency(workers, servers)
            if eff > best_eff:
                best, best_eff = servers, eff
            if eff >= target:
                found = servers
                break
        # The first S to reach the target is also the best so far: every S before it fell short.
        common = dict(workers=workers, target=target, max_servers=max_servers, alone_steps_per_s=self.alone,
                      servers=best, efficiency=best_eff,
                      bottleneck=predict(self.scenario(workers, best), self.cal).bottleneck,
                      matched_servers=max(1, math.ceil(workers * base.worker_link / base.server_link - 1e-9)))
        if found is not None:
            link = self.least_link(workers, found, target, 0.0, base.server_link)
            return Plan(reached=True, server_link=link, link_servers=found, limit="", **common)
        # No S at the given links. With faster shard links? predict() sees S only through the busiest shard's
        # bytes and messages, so only the first S of each split needs trying.
        splits: dict[tuple[int, int], int] = {}
        for servers in range(1, max_servers + 1):
            splits.setdefault(_split(self.key, servers, self.partition_bytes, base.model_bytes), servers)
        link: Optional[float] = None
        # The largest S first: the least busy shards need the least link, and a link found prunes the rest.
        for servers in sorted(splits.values(), reverse=True):
            if link is not None:
                if self.efficiency(workers, servers, link) < target:
                    continue
                link = self.least_link(workers, servers, target, base.server_link, link)
                continue
            if self.efficiency(workers, servers, _LINK_CEILING) < target:
                continue  # no shard link takes this S there
            hi = base.server_link * 2
            while self.efficiency(workers, servers, hi) < target:
                hi *= 4
            link = self.least_link(workers, servers, target, base.server_link, hi)
        if link is not None:
            at = next(s for s in range(1, max_servers + 1) if self.efficiency(workers, s, link) >= target)
            return Plan(reached=False, server_link=link, link_servers=at, limit="shard link", **common)
        free = dataclasses.replace(self.cal, **_FREE_CPU)
        cpu = any(self.efficiency(workers, s, _LINK_CEILING, free) >= target for s in splits.values())
        return Plan(reached=False, server_link=None, link_servers=None, limit="shard CPU" if cpu else "worker link",
                    **common)


def _check_plan(workers: int, target: float, max_servers: int) -> None:
    if not 0 < target <= 1:
        raise ConfigError(f"the target efficiency must be in (0, 1] (a fraction of linear scaling), got {target}")
    if not 1 <= workers <= PLAN_MAX_WORKERS:
        raise ConfigError(f"the capacity planner takes 1 to {PLAN_MAX_WORKERS:,} workers, got {workers:,}")
    if not 1 <= max_servers <= PLAN_MAX_SERVERS:
        raise ConfigError(f"the capacity planner tries 1 to {PLAN_MAX_SERVERS:,} servers, got {max_servers:,}")


def efficiency(workers: int, servers: int, tensors: Sequence[tuple[str, tuple[int, ...]]], cal: Calibration,
               link_bits: float, compute_s: float, mode: str = "sync", partition_bytes: int = 4 << 20,
               server_link_bits: Optional[float] = None, burst_bytes: float = 0.0) -> float:
    """The fraction of linear scaling a job reaches: ``X(W, S) / (W * X(1, 1))``.

    ``X`` is :func:`predict`'s throughput (worker-steps/s) with the given links, compute, mode and calibration;
    ``X(1, 1)`` is one worker's with one server, so ``W * X(1, 1)`` is linear scaling. It can exceed 1 where
    one server costs a lone worker time that S servers do not (shard CPU, a shard link slower than a worker's).

    Parameters
    ----------
    workers, servers : int
        W and S.
    tensors : sequence of (name, shape)
        The model (:func:`psrt.emulation.models.model_tensors`); psrt's partition map splits it over S.
    cal : Calibration
        The machine's figures.
    link_bits, compute_s, mode, partition_bytes, server_link_bits, burst_bytes
        As :func:`scenario_for` takes them.

    Returns
    -------
    float
        The efficiency, 1.0 for linear scaling.
    """
    job = _Planner(tensors, cal, link_bits, compute_s, mode, partition_bytes, server_link_bits, burst_bytes)
    return job.efficiency(workers, servers)


def smallest_servers(workers: int, target: float, tensors: Sequence[tuple[str, tuple[int, ...]]],
                     cal: Calibration, link_bits: float, compute_s: float, mode: str = "sync",
                     partition_bytes: int = 4 << 20, server_link_bits: Optional[float] = None,
                     burst_bytes: float = 0.0, max_servers: int = PLAN_MAX_SERVERS) -> Plan:
    """The smallest S that keeps W workers at ``target`` of linear scaling, and the shard link it needs.

    Efficiency is :func:`efficiency`. It need not grow with S (the partition map's pieces can leave S + 1
    shards with a busier busiest shard, or fewer messages to pipeline, than S), so every S from 1 up is tried
    until one reaches the target; the busiest shard's split for each S is cached per model. The shard link is
    searched by bisection, which is sound because no term of the model grows as a shard's link grows; the
    target throughput, ``target * W * X(1, 1)``, stays that of the given links while the shard link varies.

    Parameters
    ----------
    workers : int
        W, 1 to :data:`PLAN_MAX_WORKERS`.
    target : float
        The efficiency to keep, in (0, 1].
    tensors, cal, link_bits, compute_s, mode, partition_bytes, server_link_bits, burst_bytes
        As :func:`efficiency` takes them.
    max_servers : int
        The largest S to try, 1 to :data:`PLAN_MAX_SERVERS`.

    Returns
    -------
    Plan
        The S found (or the best S and why none reaches the target), with the shard link.

    Raises
    ------
    ConfigError
        For a target outside (0, 1], or W or ``max_servers`` outside the planner's range.
    """
    _check_plan(workers, target, max_servers)
    job = _Planner(tensors, cal, link_bits, compute_s, mode, partition_bytes, server_link_bits, burst_bytes)
    return job.plan(workers, target, max_servers)


def plot_efficiency(path: str, workers: Sequence[int], servers: Sequence[int],
                    tensors: Sequence[tuple[str, tuple[int, ...]]], cal: Calibration, link_bits: float,
                    compute_s: float, mode: str = "sync", partition_bytes: int = 4 << 20,
                    server_link_bits: Optional[float] = None, burst_bytes: float = 0.0,
                    target: Optional[float] = None, title: Optional[str] = None) -> None:
    """Draw :func:`efficiency` against W (log axis), one line per S, and the target's line if given.

    Each line runs over 60 W spaced evenly on the log axis from the smallest to the largest of ``workers``
    (and through each of them). The format follows ``path``'s extension (``.png``, ``.svg``, ``.pdf``).

    Raises
    ------
    ConfigError
        When matplotlib is not installed (``pip install 'psrt[plot]'``) or the file cannot be written.
    """
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend or figure state in the caller
    except ImportError:
        raise ConfigError("drawing the efficiency plot needs matplotlib: pip install 'psrt[plot]'") from None
    job = _Planner(tensors, cal, link_bits, compute_s, mode, partition_bytes, server_link_bits, burst_bytes)
    lo, hi = min(workers), max(workers)
    grid = sorted({int(round(w)) for w in np.geomspace(lo, hi, 60)} | set(workers))
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for i, s in enumerate(servers):
        ax.plot(grid, [job.efficiency(w, s) for w in grid], "-", color=f"C{i % 10}", label=f"S={s}")
    if target is not None:
        ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target:g}")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("workers W")
    ax.set_ylabel("efficiency: throughput / (W x one worker's)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:  # no such directory, no permission
        raise ConfigError(f"cannot write the plot to {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a format matplotlib does not write
        raise ConfigError(f"cannot write the plot to {path}: {exc}") from None
