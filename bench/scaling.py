"""Reproduce the single-server bottleneck and show how sharding removes it, against the performance model.

Every server, worker and the scheduler run in their own network namespace with their own address, joined by
veth pairs to a bridge, and every host's link is shaped in both directions with ``tc ... tbf`` to ``--link``
(default 50 Mbit/s). The sweep runs W workers x S servers; each run is a real job (``psrt scheduler``,
``psrt server``, ``psrt worker`` processes) whose workers report their steps/s. Each point is compared with
:func:`psrt.emulation.perfmodel.predict` (calibrated on this machine first).

The default scenario is the seed paper's shape: a 256 KB model in 16 KiB partitions (16 chunks, so S=4 shards
hold 4 each), 50 Mbit/s links and 140 ms of compute per step. One worker's communication is then a small part of
its step, so S=1 throughput first grows with W, and the single server's link caps it from W ~ 2-4 (the model's
saturation point is W ~ 2.2); S=4 lifts that cap and keeps growing to W ~ 8-16. The traffic stays under
~50 MB/s, so two CPU cores are not the bottleneck: the script reports the machine's CPU use during each run's
timed window and flags any run above 85 %.

``--quick`` uses the overlapped load generator (``psrt worker --overlap``: each of the model's 16 layers pushed
from an emulated backward, its parameters awaited in the next forward), and the model predicts the overlapped step
(:mod:`psrt.emulation.pipesim`); ``--overlap`` does the same for any sweep.

``--paper`` is the seed paper's shape at its scale: one server that saturates at W ~ 16, as CNTK's did, swept to
W = 256 virtual workers (``psrt worker --clients``, up to 16 per emulated host) for S = 1, 4 and 16, each point a
real sync job on the emulated cluster. Only the shards' links are narrow: each shard host's link is shaped to 20
Mbit/s, the scheduler's and the worker hosts' not at all, so a worker host's 16 workers never wait for their own
link. The shaped links are a lossless network (``htb``: TCP's bare acknowledgements first, a deep queue that
loses nothing, in-order delivery, TCP windows of 64 kB; see :class:`VirtualCluster`). The model is sized from the
link so that a shard's link at its full rate carries 18 workers' pushes in one compute time, ``18 * M * h = C *
B_s`` (:func:`size_model`; at the ~80 % of the rate that many workers' connections get, one server saturates at W ~
15), in 8 layers of 4 chunks each; the workers overlap communication with compute (``--overlap``, a window of 2
layers); and the model predicts each point's own timed window, its one network figure (the share of a shard link's
rate many connections get) measured by a job that is not a point of the grid. Targets: S=1 grows near-linearly to
the knee (W=16 >= 10x W=1), then plateaus (W=64 and W=256 each <= 1.25x W=16); shards move the knee (W=64: S=4 >=
3.5x S=1; W=256: S=16 >= 12x S=1); the model is within 10 % of the points at the median and 25 % at worst.
``--workers`` and ``--servers`` pick a part of its grid.

Usage::

    python bench/scaling.py --paper --json docs/scaling-paper.json --plot docs/scaling-paper.png   # ~15 min
    python bench/scaling.py --paper --workers 1,16,64 --servers 1                                   # a part of it
    python bench/scaling.py --quick --json scaling.json --csv scaling.csv --plot scaling.png
    python bench/scaling.py --modes sync,async          # the full sweep: W 1,2,4,8,16 x S 1,2,4
    python bench/scaling.py --loopback --quick          # no namespaces, no shaping (no root needed)

Targets (sync, on shaped links; each printed as a PASS or MISS line, and any MISS makes the exit status 1):
S=1 grows first (W=2 >= 1.5x W=1), then plateaus (W=16 < 1.5x W=4); at W=16, S=4 gives >= 3.2x S=1; the model
is within 15 % of the points at the median and within 30 % at worst. ``--loopback`` does not evaluate them:
with no shaped link, loopback runs measure the CPUs, not links, so those targets do not apply.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from psrt.control.process import Child, parse_results, psrt_command, stop_children
from psrt.emulation import models, perfmodel, trace
from psrt.emulation.models import model_tensors
from psrt.emulation.netns import VirtualCluster, burst_for, check_available, parse_rate


class CpuSampler:
    """Samples the machine's busy CPU fraction from /proc/stat every 0.1 s in a background thread."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields), idle

    def _run(self) -> None:
        while not self._stop.is_set():
            total, idle = self._read()
            self.samples.append((time.time(), total, idle))
            time.sleep(0.1)

    def busy_percent(self, start: float, end: float) -> float:
        """Machine CPU use (% of all cores) between two wall-clock times."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return float("nan")
        (_, t0, i0), (_, t1, i1) = inside[0], inside[-1]
        return 100.0 * (1 - (i1 - i0) / max(1, t1 - t0))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


def job_results(workers: list[Child], others: list[Child], timeout: float, grace: float) -> list[dict]:
    """The result records of a job's worker processes, each waited for within ``timeout`` seconds in all; then
    the scheduler and servers (``others``), which end with the job, within ``grace`` seconds each."""
    results: list[dict] = []
    deadline = time.monotonic() + timeout
    for p in workers:
        out = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        if p.returncode != 0:
            raise RuntimeError(f"a worker process failed ({p.returncode}):\n{out[-2000:]}")
        results += parse_results(out)
    for p in others:
        p.wait(grace)
    return results


def run_point(vc: Optional[VirtualCluster], port: int, mode: str, servers: int, workers: int, model: str,
              compute_ms: float, steps: int, partition: int, timeout: float = 180.0,
              overlap: Optional[tuple[int, int]] = None) -> list[dict]:
    """One job; returns the workers' result records. ``overlap = (layers, window bytes)`` runs the overlapped
    load generator."""
    extra_args = ["--overlap", "--layers", str(overlap[0]), "--window", str(overlap[1])] if overlap else []
    env = {"PSRT_PARTITION_BYTES": str(partition), "PSRT_START_TIMEOUT": "60"}
    host = vc.address("sched") if vc else "127.0.0.1"
    endpoint = f"tcp://{host}:{port}"
    procs: list[Child] = []

    def spawn(name: str, cmd: list[str], extra: Optional[dict] = None) -> Child:
        kwargs: dict = dict(env={**env, **(extra or {})}, label=name)
        procs.append(vc.spawn(name, cmd, **kwargs) if vc else Child(cmd, **kwargs))
        return procs[-1]

    try:
        spawn("sched", psrt_command("scheduler", "--bind", endpoint, "--servers", str(servers), "--workers",
                                    str(workers), "--mode", mode, "--timeout", "60"))
        for i in range(servers):
            spawn(f"s{i}", psrt_command("server", "--scheduler", endpoint))
        wprocs = [spawn(f"w{i}", psrt_command("worker", "--model", model, "--compute-ms", str(compute_ms),
                                              "--steps", str(steps), "--warmup", "2", *extra_args),
                        {"PSRT_SCHEDULER": endpoint})
                  for i in range(workers)]
        return job_results(wprocs, procs[:servers + 1], timeout, grace=30.0)
    finally:
        stop_children(procs)


def plan_steps(predicted_per_worker: float, seconds: float) -> int:
    """Steps that take about ``seconds`` at the predicted per-worker rate (5 to 60)."""
    return int(min(60, max(5, round(predicted_per_worker * seconds))))


def plot(records: list[dict], curves: dict, path: str, title: str) -> None:
    """Throughput vs W, one panel per mode, one colour per S: measured points, the model's curve, plateau and knee."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in records}, key=lambda m: m != "sync")
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for i, servers in enumerate(sorted({r["servers"] for r in records if r["mode"] == mode})):
            rows = sorted((r for r in records if r["mode"] == mode and r["servers"] == servers),
                          key=lambda r: r["workers"])
            color = f"C{i}"
            ax.plot([r["workers"] for r in rows], [r["steps_per_s"] for r in rows], "o", color=color,
                    label=f"S={servers} measured")
            ws, preds = zip(*curves[(mode, servers)])
            knee, plateau = rows[0]["saturation_w"], rows[0]["plateau_steps_per_s"]
            ax.plot(ws, preds, "-", color=color, alpha=0.6, label=f"S={servers} model, saturates at W~{knee:.1f}")
            ax.axhline(plateau, color=color, ls=":", alpha=0.5)
            # The knee: where the model's linear growth would meet its plateau.
            if ws[0] <= knee <= ws[-1]:
                ax.vlines(knee, 0, plateau, color=color, ls="--", alpha=0.4)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["workers"] for r in records if r["mode"] == mode})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("workers W")
        ax.set_ylabel("throughput (worker-steps/s)")
        ax.set_title(mode, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


#: The issue tracker's targets for a run on shaped links (see the module docstring).
GROWTH_MIN = 1.5      # S=1: W=2 gives at least this times W=1 ...
PLATEAU_MAX = 1.5     # ... but W=16 less than this times W=4
SHARDING_MIN = 3.2    # at W=16, S=4 gives at least this times S=1
MEDIAN_ERROR_MAX = 15.0
WORST_ERROR_MAX = 30.0


def check_targets(records: list[dict]) -> list[tuple[str, bool, str]]:
    """Evaluate the shaped-link targets on a run's records.

    Parameters
    ----------
    records : list of dict
        One record per measured point, with at least ``mode``, ``servers``, ``workers``, ``steps_per_s`` and
        ``error_percent``.

    Returns
    -------
    list of (str, bool, str)
        ``(target, met, measured detail)`` for every target whose points are in ``records``; a target whose
        points were not measured (a custom ``--workers`` or ``--servers``) is left out.
    """
    verdicts = []
    if records:
        errors = sorted(abs(r["error_percent"]) for r in records)
        median, worst = statistics.median(errors), errors[-1]
        verdicts.append((f"model error, median of the {len(errors)} points <= {MEDIAN_ERROR_MAX:g}%",
                         median <= MEDIAN_ERROR_MAX, f"{median:.1f}%"))
        verdicts.append((f"model error, worst point <= {WORST_ERROR_MAX:g}%", worst <= WORST_ERROR_MAX,
                         f"{worst:.1f}%"))
    # The knee and the sharding gain are sync targets: the seed paper's finding is about synchronous training,
    # and async workers on their own clocks do not share a round (the full sweep shows async for comparison).
    by = {(r["servers"], r["workers"]): r["steps_per_s"] for r in records if r["mode"] == "sync"}
    if (1, 1) in by and (1, 2) in by:
        growth = by[(1, 2)] / by[(1, 1)]
        verdicts.append((f"sync: S=1 grows first, W=2 >= {GROWTH_MIN:g}x W=1", growth >= GROWTH_MIN,
                         f"x{growth:.2f} ({by[(1, 1)]:.1f} -> {by[(1, 2)]:.1f} steps/s)"))
    if (1, 4) in by and (1, 16) in by:
        growth = by[(1, 16)] / by[(1, 4)]
        verdicts.append((f"sync: S=1 then plateaus, W=16 < {PLATEAU_MAX:g}x W=4", growth < PLATEAU_MAX,
                         f"x{growth:.2f} ({by[(1, 4)]:.1f} -> {by[(1, 16)]:.1f} steps/s)"))
    if (1, 16) in by and (4, 16) in by:
        ratio = by[(4, 16)] / by[(1, 16)]
        verdicts.append((f"sync: at W=16, S=4 >= {SHARDING_MIN:g}x S=1", ratio >= SHARDING_MIN, f"{ratio:.2f}x"))
    return verdicts


def target_report(records: list[dict], loopback: bool) -> tuple[list[str], int]:
    """The lines that close a run's output, and the script's exit status.

    On shaped links every target is a PASS or MISS line, and any MISS makes the status 1. On loopback the
    targets are not evaluated: they describe jobs limited by shaped links, while unshaped loopback moves data
    as fast as the CPUs copy it, so loopback runs measure the CPUs; a loopback run whose jobs all succeeded
    exits 0.

    Parameters
    ----------
    records : list of dict
        The run's records (see :func:`check_targets`).
    loopback : bool
        Whether the run was on plain loopback (``--loopback``).

    Returns
    -------
    (list of str, int)
        Lines to print and the exit status.
    """
    if loopback:
        return ["targets not evaluated: they apply only to shaped links (the emulated cluster). On loopback no "
                "link limits the jobs, so these runs measure the CPUs, not links, and the model's predictions "
                "(made for a nominal 8 Gbit/s link) are only indicative."], 0
    verdicts = check_targets(records)
    lines = [f"{'PASS' if ok else 'MISS'}  {name}: {detail}" for name, ok, detail in verdicts]
    return lines, 0 if all(ok for _, ok, _ in verdicts) else 1


# ----------------------------------------------------------------------------------------------- the paper's scale

#: The --paper grid: W for S = 1 and 4, and the S = 16 points.
PAPER_WORKERS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PAPER_GRID = tuple((s, w) for s in (1, 4) for w in PAPER_WORKERS) + tuple((16, w) for w in (16, 64, 128, 256))
#: The paper's targets (module docstring).
PAPER_GROWTH_MIN = 10.0      # S=1: W=16 at least this times W=1 ...
PAPER_PLATEAU_MAX = 1.25     # ... and W=64, W=256 at most this times W=16
PAPER_S4_MIN = 3.5           # at W=64, S=4 at least this times S=1
PAPER_S16_MIN = 12.0         # at W=256, S=16 at least this times S=1
#: The job that calibrates the links' efficiency with many workers (S, W): saturated, and not a point of the grid.
PAPER_CALIBRATION = (2, 48)
#: The TCP window every emulated host advertises (VirtualCluster's tcp_window): 26 ms of a 20 Mbit/s link.
PAPER_TCP_WINDOW = 64 << 10
PAPER_MEDIAN_ERROR_MAX = 10.0
PAPER_WORST_ERROR_MAX = 25.0


@dataclasses.dataclass(frozen=True)
class PaperSetup:
    """The --paper scenario: what is chosen, and what follows from it.

    Parameters
    ----------
    compute_ms : float
        Emulated compute per step (sleep): long, so that 256 workers' messages stay far below what two cores
        handle.
    shard_link : str
        Each shard host's link, per direction; nothing else is shaped.
    knee : int
        The W at which one shard's link, at its full rate, carries the workers' pushes in exactly one compute
        time. Many workers' connections get ~80 % of a link's rate (the calibration job measures it), so one
        server saturates at W ~ 0.8 x 18 ~ 15.
    layers : int
        Tensors of the model, pushed one by one from the emulated backward.
    window_layers : int
        Layers' bytes a worker keeps in flight (``psrt worker --window``): a window smaller than the model lets the
        first layers, needed first by the next forward, overtake the later ones.
    chunks_per_layer : int
        Each layer is cut into this many equal chunks (``PSRT_PARTITION_BYTES``), each its own message: S = 4
        shards share every layer's traffic (ps-lite splits each key over the servers), and a round's replies
        start while the rest of the layer still arrives.
    per_host : int
        Virtual workers per emulated worker host (``psrt worker --clients``).
    """

    compute_ms: float = 3000.0
    shard_link: str = "20mbit"
    knee: int = 18
    layers: int = 8
    window_layers: int = 2
    chunks_per_layer: int = 4
    per_host: int = 16

    @property
    def link_bits(self) -> int:
        return parse_rate(self.shard_link)

    @property
    def model_bytes(self) -> int:
        return size_model(self.link_bits, self.compute_ms / 1000, self.knee, self.layers * self.chunks_per_layer)

    @property
    def model(self) -> str:
        return f"{self.model_bytes}B"

    @property
    def layer_bytes(self) -> int:
        return self.model_bytes // self.layers

    @property
    def window(self) -> int:
        return self.window_layers * self.layer_bytes

    @property
    def partition_bytes(self) -> int:
        """Chunks of at most this size cut each layer into ``chunks_per_layer`` equal pieces."""
        return self.layer_bytes // self.chunks_per_layer


def size_model(link_bits: float, compute_s: float, knee: int, pieces: int) -> int:
    """Model bytes whose pushes from ``knee`` workers take a shard link of ``link_bits`` one compute time.

    ``knee * M * h = C * B_s``, with ``h`` the wire bytes per payload byte (:data:`perfmodel.TCP_OVERHEAD`); rounded
    down to whole float32 values in ``pieces`` equal parts (layers times the chunks of each), so that every chunk
    has the same size and the partition map gives each shard the same share of every layer.
    """
    nbytes = compute_s * link_bits / 8 / (knee * perfmodel.TCP_OVERHEAD)
    per_piece = int(nbytes // (4 * pieces))
    if per_piece < 1:
        raise ValueError(f"a {link_bits / 1e6:g} Mbit/s link and {compute_s:g} s of compute leave no model bytes")
    return 4 * pieces * per_piece


def worker_groups(workers: int, per_host: int) -> list[int]:
    """The virtual workers of each emulated worker host: ``per_host`` each, the last host the rest."""
    full, rest = divmod(workers, per_host)
    return [per_host] * full + ([rest] if rest else [])


def paper_hosts(grid: list[tuple[int, int]], per_host: int) -> tuple[list[str], set[str]]:
    """``(hosts, shaped)``: the scheduler, the shards and the worker hosts a grid needs, and the shard hosts, whose
    links alone are shaped."""
    servers = max(s for s, _ in grid)
    worker_hosts = max(len(worker_groups(w, per_host)) for _, w in grid)
    shards = [f"s{i}" for i in range(servers)]
    return ["sched", *shards, *(f"h{i}" for i in range(worker_hosts))], set(shards)


def paper_jobs(grid: list[tuple[int, int]], calibrate: bool) -> list[tuple[int, int]]:
    """The ``(S, W)`` of every job a --paper run starts: its grid and, with ``calibrate``, the calibration job
    (:data:`PAPER_CALIBRATION`, not a point of the grid), whose shards and worker hosts the cluster needs too."""
    return [*grid, PAPER_CALIBRATION] if calibrate else list(grid)


def paper_points(workers: Optional[str], servers: Optional[str]) -> list[tuple[int, int]]:
    """The --paper grid's ``(S, W)`` points, S = 1 first, kept to the given W and S (comma lists) if any."""
    ws = None if workers is None else {int(v) for v in workers.split(",")}
    ss = None if servers is None else {int(v) for v in servers.split(",")}
    points = [(s, w) for s, w in PAPER_GRID if (ws is None or w in ws) and (ss is None or s in ss)]
    if not points:
        raise ValueError(f"no point of the --paper grid has W in {workers} and S in {servers}: its W are "
                         f"{', '.join(map(str, PAPER_WORKERS))}, its S 1, 4 and 16 (S=16 at W=16, 64, 128, 256)")
    return points


def paper_steps(step_s: float, budget_s: float = 12.0) -> tuple[int, int]:
    """``(timed steps, warmup steps)`` for a point whose predicted step takes ``step_s``: about ``budget_s`` timed
    (1 to 4 steps), one warmup step unless a step alone takes longer than ``budget_s``."""
    steps = int(min(4, max(1, round(budget_s / step_s))))
    return steps, (1 if step_s <= budget_s else 0)


def paper_scenario(setup: PaperSetup, servers: int, workers: int, steps: int) -> perfmodel.Scenario:
    """The model's view of one --paper job (``steps = 0``: the steady state)."""
    tensors = model_tensors(setup.model, layers=setup.layers)
    return perfmodel.scenario_for(workers, servers, tensors, math.inf, setup.compute_ms / 1000, "sync",
                                  setup.partition_bytes, server_link_bits=setup.link_bits,
                                  burst_bytes=burst_for(setup.link_bits), overlap=True, window=setup.window,
                                  hosted=min(workers, setup.per_host), worker_burst_bytes=0.0, steps=steps)


class JobCpu:
    """The CPU seconds of the processes a run started, sampled every 0.25 s (from /proc), so a timed window's share
    of two cores can be told from what else the machine runs."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _cpu(pid: int) -> float:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0  # gone: its last sample stays in the earlier totals

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), sum(self._cpu(p) for p in list(self.pids))))
            time.sleep(0.25)

    def percent(self, start: float, end: float) -> float:
        """The run's processes' CPU use between two wall-clock times, in % of all cores."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return float("nan")
        (t0, c0), (t1, c1) = inside[0], inside[-1]
        return 100.0 * max(0.0, c1 - c0) / max(1e-9, t1 - t0) / (os.cpu_count() or 1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


def run_paper_point(vc: VirtualCluster, port: int, setup: PaperSetup, servers: int, workers: int, steps: int,
                    warmup: int, job_cpu: JobCpu, timeout: float = 900.0,
                    trace_dir: Optional[Path] = None) -> list[dict]:
    """One --paper job: the scheduler, S shards on the shaped hosts, ``ceil(W / per_host)`` worker processes of
    virtual workers on the worker hosts; returns the workers' result records. ``trace_dir``: a folder where each
    worker process writes its pipeline's events (``psrt worker --trace``), ``S{S}-W{W}-h{i}.json``."""
    # A loaded 2-core machine running ~35 processes: heartbeats get a longer grace than a real cluster's.
    env = {"PSRT_PARTITION_BYTES": str(setup.partition_bytes), "PSRT_START_TIMEOUT": "120",
           "PSRT_HEARTBEAT_TIMEOUT": "30", "PSRT_TIMEOUT": "600"}
    endpoint = f"tcp://{vc.address('sched')}:{port}"
    procs: list[Child] = []

    def spawn(host: str, cmd: list[str], extra: Optional[dict] = None) -> Child:
        procs.append(vc.spawn(host, cmd, env={**env, **(extra or {})}, label=host))
        job_cpu.pids.append(procs[-1].proc.pid)
        return procs[-1]

    try:
        spawn("sched", psrt_command("scheduler", "--bind", endpoint, "--servers", str(servers), "--workers",
                                    str(workers), "--mode", "sync", "--timeout", "120"))
        for i in range(servers):
            spawn(f"s{i}", psrt_command("server", "--scheduler", endpoint))
        wprocs = [spawn(f"h{i}", psrt_command("worker", "--clients", str(n), "--model", setup.model, "--layers",
                                              str(setup.layers), "--overlap", "--window", str(setup.window),
                                              "--compute-ms", str(setup.compute_ms), "--steps", str(steps),
                                              "--warmup", str(warmup),
                                              *(() if trace_dir is None else
                                                ("--trace", str(trace_dir / f"S{servers}-W{workers}-h{i}.json")))),
                        {"PSRT_SCHEDULER": endpoint})
                  for i, n in enumerate(worker_groups(workers, setup.per_host))]
        results = job_results(wprocs, procs[:servers + 1], timeout, grace=60.0)
        if len(results) != workers:
            raise RuntimeError(f"{len(results)} result lines from {workers} workers")
        return results
    finally:
        stop_children(procs)
        job_cpu.pids.clear()


def check_paper_targets(records: list[dict]) -> list[tuple[str, bool, str]]:
    """Evaluate the --paper targets on a run's records (as :func:`check_targets` does for the others).

    Parameters
    ----------
    records : list of dict
        One record per point, with at least ``servers``, ``workers``, ``steps_per_s`` and ``error_percent``.

    Returns
    -------
    list of (str, bool, str)
        ``(target, met, measured detail)`` for every target whose points are in ``records``.
    """
    verdicts = []
    if records:
        errors = sorted(abs(r["error_percent"]) for r in records)
        median, worst = statistics.median(errors), errors[-1]
        verdicts.append((f"model error, median of the {len(errors)} points <= {PAPER_MEDIAN_ERROR_MAX:g}%",
                         median <= PAPER_MEDIAN_ERROR_MAX, f"{median:.1f}%"))
        verdicts.append((f"model error, worst point <= {PAPER_WORST_ERROR_MAX:g}%", worst <= PAPER_WORST_ERROR_MAX,
                         f"{worst:.1f}%"))
    by = {(r["servers"], r["workers"]): r["steps_per_s"] for r in records}

    def ratio(a: tuple[int, int], b: tuple[int, int]) -> float:
        return by[a] / by[b]

    if (1, 1) in by and (1, 16) in by:
        x = ratio((1, 16), (1, 1))
        verdicts.append((f"S=1 grows near-linearly to the knee, W=16 >= {PAPER_GROWTH_MIN:g}x W=1",
                         x >= PAPER_GROWTH_MIN, f"x{x:.2f} ({by[(1, 1)]:.2f} -> {by[(1, 16)]:.2f} steps/s)"))
    for w in (64, 256):
        if (1, 16) in by and (1, w) in by:
            x = ratio((1, w), (1, 16))
            verdicts.append((f"S=1 then plateaus, W={w} <= {PAPER_PLATEAU_MAX:g}x W=16", x <= PAPER_PLATEAU_MAX,
                             f"x{x:.2f} ({by[(1, 16)]:.2f} -> {by[(1, w)]:.2f} steps/s)"))
    for s, w, least in ((4, 64, PAPER_S4_MIN), (16, 256, PAPER_S16_MIN)):
        if (1, w) in by and (s, w) in by:
            x = ratio((s, w), (1, w))
            verdicts.append((f"shards move the knee, at W={w} S={s} >= {least:g}x S=1", x >= least,
                             f"{x:.2f}x ({by[(1, w)]:.2f} -> {by[(s, w)]:.2f} steps/s)"))
    return verdicts


def plot_paper(records: list[dict], curves: dict[int, list[tuple[int, float]]], path: str, title: str) -> None:
    """Log-log throughput against W: the measured points over the model's lines, one colour per S."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    for i, servers in enumerate(sorted(curves)):
        color = f"C{i}"
        ws, preds = zip(*curves[servers])
        ax.plot(ws, preds, "-", color=color, alpha=0.6, label=f"S={servers} model (steady state)")
        rows = sorted((r for r in records if r["servers"] == servers), key=lambda r: r["workers"])
        if rows:
            ax.plot([r["workers"] for r in rows], [r["steps_per_s"] for r in rows], "o", color=color,
                    label=f"S={servers} measured")
            ax.plot([r["workers"] for r in rows], [r["predicted_steps_per_s"] for r in rows], "x", color=color,
                    alpha=0.7, ms=5)
    ws = sorted({w for s in curves for w, _ in curves[s]})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ticks = [w for w in PAPER_WORKERS if ws[0] <= w <= ws[-1]]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("workers W (virtual workers, up to 16 per emulated host)")
    ax.set_ylabel("throughput (worker-steps/s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def paper_main(args: argparse.Namespace) -> int:
    """``--paper``: the sweep at the paper's scale (module docstring)."""
    setup = PaperSetup()
    try:
        grid = paper_points(args.workers, args.servers)
    except ValueError as exc:
        print(f"scaling.py: error: {exc}", file=sys.stderr)
        return 2
    check_available()
    print(f"--paper: shard links {setup.shard_link} each way (the only shaped links); model {setup.model_bytes} B in "
          f"{setup.layers} layers ({setup.layer_bytes} B each; a shard's link carries {setup.knee} workers' pushes "
          f"in one compute time); compute {setup.compute_ms:g} ms; overlapped, window {setup.window} B; up to "
          f"{setup.per_host} virtual workers per host", flush=True)
    print("calibrating on this machine (aggregation rate, message overhead) ...", flush=True)
    cal = perfmodel.calibrate()
    print(f"  aggregation {cal.agg_bytes_per_s / 1e9:.2f} GB/s, message overhead {cal.msg_overhead_s * 1e6:.0f} us, "
          f"round trip {cal.rtt_s * 1e6:.0f} us", flush=True)
    hosts, shaped = paper_hosts(paper_jobs(grid, calibrate=not args.ideal_pipelining), setup.per_host)
    links = {h: (setup.shard_link if h in shaped else None) for h in hosts}
    from tqdm import tqdm

    vc = VirtualCluster(hosts, links=links, queueing="fifo", lossless=True, tcp_window=PAPER_TCP_WINDOW)
    trace_dir = None if args.trace is None else Path(args.trace)
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
    sampler, job_cpu = CpuSampler(), JobCpu()
    records: list[dict] = []
    started = time.monotonic()
    try:
        if not args.ideal_pipelining:
            # One job that is not a point of the grid measures the share of a shard link's rate that many
            # workers' connections get; every grid point is then a prediction.
            s_cal, w_cal = PAPER_CALIBRATION
            steps, warmup = paper_steps(perfmodel.predict(paper_scenario(setup, s_cal, w_cal, 0), cal).step_s)
            res = run_paper_point(vc, 5799, setup, s_cal, w_cal, steps, warmup, job_cpu)
            span = max(r["ended_at"] for r in res) - min(r["started_at"] for r in res)
            eff = perfmodel.efficiency_from_run(paper_scenario(setup, s_cal, w_cal, steps), cal,
                                                sum(r["steps"] for r in res) / span)
            cal = dataclasses.replace(cal, link_efficiency=eff)
            tqdm.write(f"  link efficiency with many workers (calibration job S={s_cal}, W={w_cal}, not a point of "
                       f"the grid): {eff:.2f} of the rate")
        for index, (servers, workers) in enumerate(tqdm(grid, desc="runs", unit="run")):
            steady = perfmodel.predict(paper_scenario(setup, servers, workers, 0), cal)
            steps, warmup = paper_steps(steady.step_s, 12.0 if args.seconds is None else args.seconds)
            sc = paper_scenario(setup, servers, workers, steps)
            pred = perfmodel.predict(sc, cal)
            t0 = time.monotonic()
            drops0 = sum(vc.dropped(f"s{i}") for i in range(servers))
            resent0 = sum(vc.retransmitted(h) for h in hosts)
            results = run_paper_point(vc, 5800 + index, setup, servers, workers, steps, warmup, job_cpu,
                                      trace_dir=trace_dir)
            drops = sum(vc.dropped(f"s{i}") for i in range(servers)) - drops0
            resent = sum(vc.retransmitted(h) for h in hosts) - resent0
            window = (max(r["started_at"] for r in results), min(r["ended_at"] for r in results))
            span = max(r["ended_at"] for r in results) - min(r["started_at"] for r in results)
            measured = sum(r["steps"] for r in results) / span
            params = {r["param0"] for r in results}
            records.append({
                "workers": workers, "servers": servers, "mode": "sync",
                "steps_per_s": measured, "predicted_steps_per_s": pred.steps_per_s,
                "error_percent": 100.0 * (measured - pred.steps_per_s) / pred.steps_per_s,
                "steady_steps_per_s": steady.steps_per_s,
                "steps": steps, "warmup": warmup, "hosts": len(worker_groups(workers, setup.per_host)),
                "clients_per_host": min(workers, setup.per_host),
                "model_bytes": setup.model_bytes, "layers": setup.layers, "window": setup.window,
                "partition_bytes": setup.partition_bytes,
                "messages_per_step": 2 * sum(len(m) for m in sc.layout),
                "compute_ms": setup.compute_ms, "shard_link_mbit": setup.link_bits / 1e6,
                "cpu_percent": sampler.busy_percent(*window), "job_cpu_percent": job_cpu.percent(*window),
                "bottleneck": pred.bottleneck, "params_equal": len(params) == 1, "dropped_packets": drops,
                "retransmitted_segments": resent,
                "seconds": time.monotonic() - t0,
            })
            r = records[-1]
            tqdm.write(f"S={servers:>2} W={workers:>3}: {measured:7.2f} steps/s (model {pred.steps_per_s:7.2f}, "
                       f"{r['error_percent']:+5.1f}%), {steps}+{warmup} steps, CPU {r['cpu_percent']:3.0f}% "
                       f"(the job's {r['job_cpu_percent']:3.0f}%), {drops} drops, {resent} TCP retransmits, "
                       f"{r['seconds']:.0f} s")
            if trace_dir is not None:  # what the timed steps' forwards waited for, and the drain after them
                files = trace_dir.glob(f"S{servers}-W{workers}-h*.json")
                summary = trace.summarize(*trace.load(str(f) for f in files))
                r["forward_wait_s"] = [w for w, _ in summary.forward_wait]
                r["drain_s"] = summary.drain_s[0]
                tqdm.write("  " + trace.render(summary).replace("\n", "\n  "))
    finally:
        sampler.stop()
        job_cpu.stop()
        vc.close()
    elapsed = time.monotonic() - started

    print(f"\nemulated cluster: shard links {setup.shard_link} each way, other links unshaped; model "
          f"{setup.model_bytes / 1e3:.0f} kB in {setup.layers} layers, compute {setup.compute_ms:g} ms, overlapped "
          f"(window {setup.window} B); {elapsed:.0f} s in all")
    print(f"{'S':>3} {'W':>4} {'measured':>9} {'predicted':>9} {'error':>7} {'CPU%':>5} {'job%':>5}  bottleneck")
    for r in records:
        flag = "  <- CPU-bound?" if r["cpu_percent"] > 85 else ""
        print(f"{r['servers']:>3} {r['workers']:>4} {r['steps_per_s']:>9.2f} {r['predicted_steps_per_s']:>9.2f} "
              f"{r['error_percent']:>+6.1f}% {r['cpu_percent']:>5.0f} {r['job_cpu_percent']:>5.0f}  "
              f"{r['bottleneck']}{flag}")
    unequal = [r for r in records if not r["params_equal"]]
    print("every worker ended with the same parameters (param0) in every job" if not unequal else
          f"MISMATCH: workers ended with different parameters in {len(unequal)} jobs")
    verdicts = check_paper_targets(records)
    for name, ok, detail in verdicts:
        print(f"{'PASS' if ok else 'MISS'}  {name}: {detail}")
    if elapsed > 20 * 60:
        print(f"note: the sweep took {elapsed / 60:.1f} min, over its 20 min budget")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calibration": cal.__dict__, "setup": dataclasses.asdict(setup), "elapsed_s": elapsed,
                       "records": records}, f, indent=1)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(records[0]))
            w.writeheader()
            w.writerows(records)
    if args.plot:
        curve_w = sorted({round(2 ** (i / 2)) for i in range(17)})  # half octaves, 1 to 256
        curves = {s: [(w, perfmodel.predict(paper_scenario(setup, s, w, 0), cal).steps_per_s) for w in curve_w]
                  for s in sorted({s for s, _ in grid})}
        plot_paper(records, curves, args.plot,
                   f"psrt at the paper's scale: sync, overlapped, {setup.compute_ms / 1000:g} s compute, "
                   f"{setup.model_bytes / 1e3:.0f} kB model;\nshard links {setup.shard_link}, workers' unshaped. "
                   "o measured, x the model for that run, lines the model's steady state")
        print(f"plot written to {args.plot}")
    return 0 if all(ok for _, ok, _ in verdicts) and not unequal else 1


def main() -> int:
    """Run the sweep; print the table; write JSON, CSV and the plot."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default=None, help="comma-separated W values (default 1,2,4,8,16; with "
                        "--paper: keep only these W of its grid)")
    parser.add_argument("--servers", default=None, help="comma-separated S values (default 1,2,4; with --paper: "
                        "keep only these S of its grid)")
    parser.add_argument("--modes", default="sync", help="sync, async or sync,async")
    parser.add_argument("--quick", action="store_true",
                        help="W 1,2,4,8,16 x S 1,4, sync, overlapped, short runs (< 5 min)")
    parser.add_argument("--paper", action="store_true",
                        help="the paper's shape at its scale: W up to 256 virtual workers, S 1, 4 and 16, only the "
                             "shards' links shaped (module docstring; ~15 min)")
    parser.add_argument("--overlap", action="store_true",
                        help="run the overlapped load generator (psrt worker --overlap; on with --quick)")
    parser.add_argument("--layers", type=int, default=4,
                        help="with --overlap: the model's tensors (default %(default)s: 64 kB each, 4 partitions, so "
                             "every layer spreads over S=4 shards)")
    parser.add_argument("--link", default="50mbit", help="every host's link, each direction (default %(default)s)")
    parser.add_argument("--model", default="256KB", help="model size or network name (default %(default)s)")
    parser.add_argument("--partition-bytes", type=int, default=16 * 1024,
                        help="partition size, so the model splits over the shards (default 16 KiB)")
    parser.add_argument("--compute-ms", type=float, default=140.0,
                        help="emulated compute per step (default %(default)g): sets where S=1 saturates")
    parser.add_argument("--seconds", type=float, default=None,
                        help="target timed seconds per run (default 4; with --paper 12)")
    parser.add_argument("--loopback", action="store_true", help="plain loopback: no namespaces, no shaping")
    parser.add_argument("--ideal-pipelining", action="store_true",
                        help="skip the calibration job (the reply tail; overlapped or --paper: the links' efficiency "
                             "with many workers) and predict with the ideal")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="with --paper: each worker process writes its pipeline's events here (psrt worker "
                             "--trace), and each point prints what its forwards waited for and its drain")
    parser.add_argument("--json", default=None, help="write one record per run to this file")
    parser.add_argument("--csv", default=None, help="write the same records as CSV")
    parser.add_argument("--plot", default=None, help="write a PNG plot of throughput vs W")
    args = parser.parse_args()

    if args.paper:
        return paper_main(args)
    args.seconds = 4.0 if args.seconds is None else args.seconds
    if args.quick:
        args.workers, args.servers, args.modes, args.seconds = "1,2,4,8,16", "1,4", "sync", min(args.seconds, 3.0)
        args.overlap = True
    args.workers = args.workers or "1,2,4,8,16"
    args.servers = args.servers or "1,2,4"
    if args.overlap and args.modes != "sync":
        print("scaling.py: error: --overlap sweeps are sync (the model's overlapped step is a sync step): use "
              "--modes sync", file=sys.stderr)
        return 2
    wlist = [int(v) for v in args.workers.split(",")]
    slist = [int(v) for v in args.servers.split(",")]
    modes = args.modes.split(",")
    if not args.loopback:
        check_available()
    link_bits = parse_rate(args.link)
    # A shipped network or a size (anything else is refused here); overlapped, a size in --layers tensors.
    tensors = model_tensors(args.model, layers=args.layers if args.overlap and args.model not in models.MODELS
                            else None)
    model_bytes = models.model_bytes(tensors)
    # Overlapped: each worker keeps its two largest tensors' bytes in flight (psrt worker --window), so the first
    # layers' gradients overtake the queued later ones (see PaperSetup.window_layers).
    window_bytes = sum(sorted((models.model_bytes([t]) for t in tensors), reverse=True)[:2])
    overlap = (len(tensors), window_bytes) if args.overlap else None

    def scenario(workers: int, servers: int, mode: str, steps: int = 0) -> perfmodel.Scenario:
        return perfmodel.scenario_for(workers, servers, tensors, link_bits, args.compute_ms / 1000, mode,
                                      args.partition_bytes, burst_bytes=burst, overlap=args.overlap,
                                      window=window_bytes,
                                      steps=steps)

    print("calibrating on this machine (aggregation rate, message overhead) ...", flush=True)
    cal = perfmodel.calibrate()
    print(f"  aggregation {cal.agg_bytes_per_s / 1e9:.2f} GB/s, message overhead {cal.msg_overhead_s * 1e6:.0f} us, "
          f"round trip {cal.rtt_s * 1e6:.0f} us", flush=True)
    if args.loopback:
        link_bits = 8 * 1e9  # nominal; loopback is CPU-bound, so predictions there are only indicative

    from tqdm import tqdm

    # The calibration job sits in the middle of the swept range, and is not itself a sweep point; overlapped, it
    # must keep its shards' links busy (S=2, W=12: past the knee S=2 has at W ~ 6).
    calib_s, calib_w = (2, 12) if args.overlap else (2, 6)
    hosts = ["sched"] + [f"s{i}" for i in range(max(max(slist), calib_s))] + [
        f"w{i}" for i in range(max(max(wlist), calib_w))]
    # Overlapped steps keep both directions of a link busy at once: bare TCP acknowledgements then go first
    # (VirtualCluster's queueing="fifo"), or they would queue behind the data they acknowledge; a lossless network
    # and bounded TCP windows, as --paper has (see PaperSetup).
    vc = None if args.loopback else VirtualCluster(
        hosts, link=args.link, queueing="fifo" if args.overlap else "tbf", lossless=args.overlap,
        tcp_window=PAPER_TCP_WINDOW if args.overlap else None)
    burst = vc.burst_bytes if vc else 0
    sampler = CpuSampler()
    records: list[dict] = []
    runs = [(m, s, w) for m in modes for s in slist for w in wlist]
    started = time.monotonic()
    try:
        if not args.ideal_pipelining:
            # One job that is not a sweep point measures how much of a round's replies a shared shard
            # link still has to send when the round's last push lands (overlapped: the share of a shard link's
            # rate that several workers' connections get); every sweep point is then a prediction.
            sc = scenario(calib_w, calib_s, "sync")
            steps = plan_steps(perfmodel.predict(sc, cal).steps_per_s / calib_w, args.seconds)
            res = run_point(vc, 5699, "sync", calib_s, calib_w, args.model, args.compute_ms, steps,
                            args.partition_bytes, overlap=overlap)
            if args.overlap:
                span = max(r["ended_at"] for r in res) - min(r["started_at"] for r in res)
                eff = perfmodel.efficiency_from_run(scenario(calib_w, calib_s, "sync", steps), cal,
                                                    sum(r["steps"] for r in res) / span)
                cal = dataclasses.replace(cal, link_efficiency=eff)
                print(f"  link efficiency with several workers (calibration job S={calib_s}, W={calib_w}): "
                      f"{eff:.2f} of the rate", flush=True)
            else:
                tail = perfmodel.tail_from_run(sc, cal, sum(r["steps_per_s"] for r in res))
                cal = dataclasses.replace(cal, contended_tail=tail)
                print(f"  reply tail on a shared shard link (calibration job S={calib_s}, W={calib_w}): {tail:.2f} "
                      f"of a round (ideal pipelining: {1 / sc.messages:.2f})", flush=True)
        for index, (mode, servers, workers) in enumerate(tqdm(runs, desc="runs", unit="run")):
            sc = scenario(workers, servers, mode)
            pred = perfmodel.predict(sc, cal)
            knee, plateau = perfmodel.saturation_point(sc, cal)
            steps = plan_steps(pred.steps_per_s / workers, args.seconds)
            if args.overlap:  # the model follows the load generator's own timed window of `steps` steps
                sc = scenario(workers, servers, mode, steps)
                pred = perfmodel.predict(sc, cal)
            results = run_point(vc, 5700 + index, mode, servers, workers, args.model, args.compute_ms, steps,
                                args.partition_bytes, overlap=overlap)
            window = (max(r["started_at"] for r in results), min(r["ended_at"] for r in results))
            # The job's throughput: all steps over the span from the first worker's start to the last one's end
            # (summing per-worker rates would overstate async runs, whose workers finish at different times).
            span = max(r["ended_at"] for r in results) - min(r["started_at"] for r in results)
            measured = sum(r["steps"] for r in results) / span
            records.append({
                "workers": workers, "servers": servers, "mode": mode,
                "link_mbit": link_bits / 1e6 if not args.loopback else None,
                "model": args.model, "model_bytes": model_bytes, "compute_ms": args.compute_ms, "steps": steps,
                "steps_per_s": measured,
                "predicted_steps_per_s": pred.steps_per_s,
                "error_percent": 100.0 * (measured - pred.steps_per_s) / pred.steps_per_s,
                "cpu_percent": sampler.busy_percent(*window),
                "worker_cpu_percent": sum(r["cpu_percent"] for r in results) / len(results),
                "bottleneck": pred.bottleneck,
                "saturation_w": knee, "plateau_steps_per_s": plateau,
                "shard_bytes": sc.shard_bytes,
            })
    finally:
        sampler.stop()
        if vc is not None:
            vc.close()
    elapsed = time.monotonic() - started

    shaping = "htb, acknowledgements first" if args.overlap else "tbf"
    where = "loopback (unshaped)" if args.loopback else f"emulated cluster, every link {args.link} each way ({shaping})"
    how = f"overlapped in {len(tensors)} tensors, window {window_bytes} B" if args.overlap else \
        "compute, then push_pull"
    print(f"\n{where}; model {args.model} ({model_bytes / 1e6:.2f} MB, partitions of {args.partition_bytes} B); "
          f"compute {args.compute_ms:g} ms/step, {how}; {elapsed:.0f} s in all")
    print(f"{'mode':>5} {'S':>3} {'W':>3} {'measured':>10} {'predicted':>10} {'error':>8} {'CPU%':>6}  bottleneck")
    for r in records:
        flag = "  <- CPU-bound?" if r["cpu_percent"] > 85 else ""
        print(f"{r['mode']:>5} {r['servers']:>3} {r['workers']:>3} {r['steps_per_s']:>10.2f} "
              f"{r['predicted_steps_per_s']:>10.2f} {r['error_percent']:>+7.1f}% {r['cpu_percent']:>6.0f}  "
              f"{r['bottleneck']}{flag}")
    # A run shorter than two 0.1 s CPU samples has no reading (nan); max() would then depend on the order.
    worst_cpu = max((r["cpu_percent"] for r in records if not math.isnan(r["cpu_percent"])), default=float("nan"))
    print(f"machine CPU use during the timed windows: at most {worst_cpu:.0f}% of {os.cpu_count()} cores"
          + (" -- the CPUs, not the links, may limit some runs" if worst_cpu > 85 else
             " -- the CPUs are not the bottleneck"))

    lines, status = target_report(records, args.loopback)
    for line in lines:
        print(line)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calibration": cal.__dict__, "link": args.link, "records": records}, f, indent=1)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(records[0]))
            w.writeheader()
            w.writerows(records)
    if args.plot:
        curves = {}
        for mode, servers in {(r["mode"], r["servers"]) for r in records}:
            curves[(mode, servers)] = [
                (w, perfmodel.predict(scenario(w, servers, mode), cal).steps_per_s) for w in range(1, max(wlist) + 1)]
        plot(records, curves, args.plot, f"psrt throughput, {where}\nmodel {args.model}, compute "
             f"{args.compute_ms:g} ms, {how}\npoints: measured; lines: model"
             f"{' (steady state)' if args.overlap else ''}; dotted: its plateaus; dashed: its saturation points")
        print(f"plot written to {args.plot}")
    return status


if __name__ == "__main__":
    sys.exit(main())
