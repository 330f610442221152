"""An analytical model of a training step's time and a job's throughput (see docs/perfmodel.md).

The model follows one step of data-parallel training through psrt: compute, push to S shards, the shards'
aggregation and optimizer step, pull back. Its inputs are the job's shape (W, S, model bytes and how they split
over shards), the links' bandwidth, the compute time, and two figures calibrated on the machine at hand: the
shard's aggregation rate (bytes of gradient it sums and applies per second) and the per-message overhead.

Its central prediction is the CNTK/BytePS observation: with one server, throughput grows with W only until the
server's link carries W times a worker's traffic, then flattens at ``B_s / (2 M_s)`` steps per second; S shards
lift that plateau S-fold, as long as the model splits into at least S chunks.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np

from psrt.emulation import models
from psrt.errors import ConfigError
from psrt.partition import PartitionMap

__all__ = ["Calibration", "Scenario", "Prediction", "predict", "saturation_point", "calibrate", "shard_split",
           "tail_from_run", "scenario_for", "TCP_OVERHEAD"]

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
    """

    agg_bytes_per_s: float = 2e9
    msg_overhead_s: float = 100e-6
    rtt_s: float = 300e-6
    contended_tail: Optional[float] = None


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

    def __post_init__(self) -> None:
        if self.workers < 1 or self.servers < 1 or self.model_bytes <= 0:
            raise ConfigError("workers, servers and model_bytes must be positive")
        if self.worker_link <= 0 or self.server_link <= 0:
            raise ConfigError("link bandwidths must be positive")
        if self.mode not in ("sync", "async"):
            raise ConfigError(f"mode must be sync or async, got {self.mode!r}")


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
    pmap = PartitionMap(servers, partition_bytes)
    chunks = pmap.add({name: (shape, np.dtype(f"f{itemsize}")) for name, shape in tensors})
    msgs = pmap.messages(sorted(chunks, key=lambda c: (c.name, c.part)))
    busiest = max(range(servers), key=lambda s: pmap.shard_bytes[s])
    return pmap.shard_bytes[busiest], max(1, len(msgs.get(busiest, [])))


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
        t_pull   = max(xfer(M/k, B_w), xfer(W*M_s*f, B_s))    # f = 1/k: only the last message's replies remain
        step     = C + rtt + max(t_push, t_cpu) + t_pull
        X        = W / step

    Async (each worker on its own clock; push and pull share a shard's link in opposite directions)::

        X = min(W / (C + rtt + xfer(M, B_w) + xfer(M/k, B_w)),  B_s / (M_s * overhead),  1 / (k*o + M_s / R))
    """
    W, k = sc.workers, sc.messages
    t_latency = cal.rtt_s
    t_cpu = W * (k * cal.msg_overhead_s + sc.shard_bytes / cal.agg_bytes_per_s)
    worker_x = _xfer(sc.model_bytes, sc.worker_link, sc)
    server_x = _xfer(W * sc.shard_bytes, sc.server_link, sc)
    # Pipelining: a shard answers message i while message i+1 is still arriving, so only the last of the k
    # messages' replies is not hidden behind the push.
    worker_tail = _xfer(sc.model_bytes / k, sc.worker_link, sc)
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


def saturation_point(sc: Scenario, cal: Calibration) -> tuple[float, float]:
    """``(W_knee, plateau)``: where the shards' links saturate, and the throughput they cap the job at.

    Below the knee throughput grows linearly, ``W / (C + rtt + xfer(M, B_w) + xfer(M/k, B_w))``; above it, it
    approaches the plateau ``B_s / ((1 + 1/k) * M_s * overhead)`` (sync; ``B_s / (M_s * overhead)`` async).
    The knee is where the two lines cross.
    """
    k = sc.messages
    single = sc.compute_s + cal.rtt_s + _xfer(sc.model_bytes, sc.worker_link, sc) + _xfer(
        sc.model_bytes / k, sc.worker_link, sc)
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
                 server_link_bits: Optional[float] = None, burst_bytes: float = 0.0) -> Scenario:
    """Build a :class:`Scenario` from a model's tensors and link speeds in bits/s."""
    model_bytes = models.model_bytes(tensors)
    if len(tensors) > 2000 or model_bytes / partition_bytes > 20000:
        # Very large models: assume the partition map balances to within one chunk.
        chunk = min(partition_bytes, model_bytes)
        shard_bytes = max(math.ceil(model_bytes / servers), chunk)
        messages = max(1, math.ceil(shard_bytes / partition_bytes))
    else:
        shard_bytes, messages = shard_split(tensors, servers, partition_bytes)
    return Scenario(workers=workers, servers=servers, model_bytes=model_bytes, shard_bytes=shard_bytes,
                    messages=messages, worker_link=link_bits / 8,
                    server_link=(server_link_bits or link_bits) / 8, compute_s=compute_s, mode=mode,
                    burst_bytes=burst_bytes)
