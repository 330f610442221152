"""Pairwise combinations of psrt's features, each case a real job checked against a NumPy oracle.

Every case runs a scheduler, two shard servers and two workers (``tests/_combo_worker.py``) on loopback: two
worker processes (``processes=separate``), or one process running both workers on threads, each its own
``psrt.Client`` with its own rank, as ``psrt worker --clients 2`` does (``processes=shared``: virtual workers,
which share their process's heartbeat thread and ZeroMQ context).
The cases are generated with allpairspy so that every pair of values of any two factors meets in at least one
case (:data:`FACTORS`; ``pytest --collect-only -q tests/test_combinations.py`` lists them, ids name each value).
A capability added later adds its factor, or a value of one, to :data:`FACTORS`.

What each case checks, from the documented semantics (README, docs/architecture.md, docs/elastic.md), against
``tests/_combo_oracle.py``:

- **sync**: every read (what a step's call returned; with psrt.torch, the parameters once ``step()`` returned)
  is exactly the parameters after that round: the mean of the round's pushes (of those who pushed it, once a
  worker left an elastic job);
- **sync_b1** (sync, ``--backup-workers 1``): a round closes on its first push; worker 1 waits for worker 0's
  step before each of its own (and worker 0 for worker 1's before the next, and before its first until worker 1
  holds the initial parameters: a worker that joins later holds a later round's, and its first push rightly
  makes the next round), so every round is worker 0's push alone and every push of worker 1 is late, dropped
  (counted, never applied) and answered with the newest parameters: every read is the parameters after that
  round of worker 0's pushes;
- **async / ssp**: every push is applied once, on arrival, with scale 1, so every read is the sum of a prefix of
  each worker's pushes, and the workers' counter entries say which prefix: the read must equal that sum exactly,
  a worker must see all of its own pushes, and in ssp (s = 2) a worker that has pushed a tensor c times reads it
  only once every worker (still in the job) has pushed it at least c - s times. Worker 1 waits after its first
  step until worker 0 has done 1 + s steps, so the run-ahead the bound allows happens in every case (a shard
  stricter than the bound stalls the job, which fails it);
- the final parameters (after a barrier and a pull) are exactly the oracle's: all pushes, each applied once;
- compression: fp16 carries these small integers exactly; top-k's choice is simulated with its documented rule
  (per chunk, the ``ceil(RATIO * count)`` largest magnitudes of gradient + residual; a restarted shard's
  residuals start from zero once the client learns of the restart), so its results are exact too;
- the cut: one tensor (1.25 MiB) is cut into a piece per shard on this host, or with ``PSRT_PIPELINE=on`` into
  10 pieces of 128 KiB as for shards across a network (lanes still carry them together); in async and ssp each
  piece is applied apart, so each holds its own prefix of the pushes (every piece a network cut makes begins with
  the workers' counters). Cut for a network, the small tensors after it share messages of at most 256 KiB, two a
  shard (``_combo_worker.SIZES``), each applied apart in async and ssp. Over sockets a blocking sync call's pieces
  go the way the client times fastest
  (``pipeline=on``: paced, joined or grouped, ``psrt.worker.pacing``), or (``pipeline=paced``) always paced, one
  piece in flight per shard (``PSRT_PACING=paced``, ``PSRT_IN_FLIGHT=1``): every call holds pieces back and the
  waits send them, across restarts and failovers too;
- ``calls=torch_held``: psrt.torch with a window of one byte, so one push in flight to each shard and the rest
  held in the pipeline's priority queue, sent first layers first as acks free credit (taken in while ``step()``
  waits): what a shard's pace does where its measured rate needs less than a tensor in flight
  (``psrt.worker.overlap.Pace``); the same reads, exactly. A replicated sync shard, which holds each ack until
  every worker pushed its round, gets every push at once whatever the window (two workers each holding back the
  push the other's held ack waits for would wait for ever);
- ``calls=pipelined``: a worker that sends each step's call before waiting for the last one's (never a moment with
  nothing in flight, so on one host it moves onto its local connection by waiting once) reads exactly what a
  ``push_pull`` each step reads (it waits at once where the case needs nothing in flight: ``_combo_worker.py``);
- the data path (shared memory exactly where lanes can be used), CURVE really on with keys, the workers in one
  process or two as the case says, no internal error in any shard, and every process exiting in time with code 0
  but the one whose worker's script raised;
- an evicting table (``tensors=evicting``: ``admit_after=2`` and a capacity, ``tests/_combo_worker.py``) reads
  the same rows as a plain one, and each shard's ``table_stats`` counters (rows, admitted, evicted, pending) are
  exactly what the pushes imply: admission and eviction keep every mode's, event's and path's guarantees;
- events: worker 1 leaves an elastic job after 3 steps, by closing its client or by a script that raises; or a
  shard is killed with SIGKILL once the workers paused and a checkpoint was written, the workers go on (their
  calls to it wait), and it is restarted with ``--restore`` under the scheduler, which gives it another port:
  it must take back its rank, and every push must be applied exactly once across the restart. A script that
  raises in a shared process ends its own worker only: the job is elastic, so worker 0, on the other thread,
  trains to the end and prints its result; then the process exits non-zero with worker 1's error, as ``psrt worker
  --clients`` does (the first error of its workers, once all of them ended): one of the scripts it ran failed.

- replicas: with ``--replicas 1`` (each shard's range also held by the other shard) the same reads, exactly;
  the shard killed in the restore event is then not restarted from its checkpoint but failed over: the scheduler
  names its range's replica the primary, the workers follow it there and send again what was not answered, and a
  server started afterwards (plain ``psrt server --scheduler``) takes the dead one's place as a replica, by state
  transfer. Every push is still applied exactly once, and top-k's residuals of the dead shard's chunks carry on
  unchanged (the replica holds all its primary answered, so what they owe is still owed; a shard restored from a
  checkpoint may be behind, and they start from zero there).

Pairs psrt cannot run together are left out (:data:`INVALID`, :func:`valid`) and tested apart, each refused up
front with a clear error: a replicated job is not elastic. The refusals at the other factors' edges are tested
at the end, with separate and with shared processes, and under a scheduler a refusing worker must end the job
promptly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from itertools import combinations, product
from pathlib import Path
from typing import Any, NamedTuple, Optional

import numpy as np
import pytest
from allpairspy import AllPairs

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _combo_worker as cw  # noqa: E402
from _combo_oracle import BACKUP, LEAVE_AFTER, SERVERS, STALENESS, STEPS, WORKERS, Oracle  # noqa: E402

import psrt  # noqa: E402
from psrt.config import ClientConfig, ClusterConfig  # noqa: E402
from psrt.control.metrics import per_worker  # noqa: E402
from psrt.control.process import SCHEDULER_READY, SERVER_READY, Child, psrt_command, stop_children  # noqa: E402
from psrt.worker import pacing  # noqa: E402

pytestmark = pytest.mark.integration

WORKER = str(Path(__file__).with_name("_combo_worker.py"))
#: The restore event: the shard is killed while both workers wait after this many steps.
PAUSE_AFTER = 3
#: Generous deadline of a whole job ("does not hang"), and of one process's exit once its job ended.
JOB_S, EXIT_S = 60.0, 20.0
TOPK = "topk:0.1"
#: The events where worker 1 leaves an elastic job after LEAVE_AFTER steps: it closes its client, or its script
#: raises.
LEAVING = ("leave", "crash")

#: Each factor and its values, in the order of a case's id.
FACTORS: dict[str, list[str]] = {
    "mode": ["sync", "async", "ssp", "sync_b1"],
    "path": ["sockets", "shm"],
    "calls": ["push_pull", "one_by_one", "overlapped", "torch", "torch_held", "pipelined"],
    "compression": ["none", "fp16", "topk"],
    "tensors": ["dense", "table", "evicting"],
    "event": ["none", "leave", "crash", "restore"],
    "security": ["off", "keys"],
    "processes": ["separate", "shared"],
    "pipeline": ["auto", "on", "paced"],
    "replicas": ["0", "1"],
}


class Case(NamedTuple):
    mode: str
    path: str
    calls: str
    compression: str
    tensors: str
    event: str
    security: str
    processes: str
    pipeline: str = "auto"
    replicas: str = "0"

    @property
    def id(self) -> str:
        return "-".join(self)


#: Pairs psrt cannot run together, each with a refusal test: {(factor, value), (factor, value)}. None today:
#: psrt.torch uses its client's compression (it pushes and pulls through the client); an embedding table's rows
#: travel uncompressed beside top-k or fp16 gradients, as compressed gradients leave shared memory unused; ssp's
#: bound counts the members of an elastic job. A torch ``nn.Embedding(sparse=True)`` is refused (tested below);
#: the suite's tables are psrt's own, used beside the torch model through its client. Virtual workers combine with
#: every value: each has its own client (and its own torch model and optimizer: autograd runs one graph per thread).
INVALID: set[frozenset[tuple[str, str]]] = {
    # A replicated job is not elastic: ``--replicas`` with ``--elastic`` is refused up front
    # (tests/test_replication.py, test_replication_is_refused_with_elastic).
    frozenset({("replicas", "1"), ("event", "leave")}),
    frozenset({("replicas", "1"), ("event", "crash")}),
}


def valid(row: list[str]) -> bool:
    """allpairspy's filter: False for a (partial) row holding a pair in :data:`INVALID`."""
    named = list(zip(FACTORS, row))
    return not any(frozenset(pair) in INVALID for pair in combinations(named, 2))


def _uncovered(rows: list[list[str]]) -> list[frozenset[tuple[str, str]]]:
    """The valid pairs of values no row has, in the order of :data:`FACTORS`."""
    covered = {frozenset(pair) for row in rows for pair in combinations(zip(FACTORS, row), 2)}
    return [pair for (fa, va), (fb, vb) in combinations(FACTORS.items(), 2) for pair in
            (frozenset({(fa, a), (fb, b)}) for a, b in product(va, vb))
            if pair not in covered and pair not in INVALID]


def _complete(rows: list[list[str]]) -> list[list[str]]:
    """``rows`` and, for each valid pair they miss, one more row: that pair, each other factor given the value
    (valid with those before it) that meets the most pairs still missing. allpairspy's greedy search leaves some
    pairs out when :data:`INVALID` forbids others."""
    rows = [list(row) for row in rows]
    missing = _uncovered(rows)
    while missing:
        fixed = dict(missing[0])
        row: list[str] = []
        for factor, values in FACTORS.items():
            options = [fixed[factor]] if factor in fixed else values
            best = max((v for v in options if valid(row + [v])),
                       key=lambda v: sum(frozenset({(factor, v), (f, x)}) in missing
                                         for f, x in zip(FACTORS, row)))
            row.append(best)
        rows.append(row)
        missing = _uncovered(rows)
    return rows


def _pairwise() -> list[list[str]]:
    """allpairspy's rows, generated with the factors of most values first (its greedy search then needs fewer
    rows: 20 cases here against 25 in :data:`FACTORS`' order), in :data:`FACTORS`' order."""
    order = sorted(FACTORS, key=lambda f: -len(FACTORS[f]))

    def ordered_valid(row: list[str]) -> bool:
        named = list(zip(order, row))
        return not any(frozenset(pair) in INVALID for pair in combinations(named, 2))

    rows = [dict(zip(order, row)) for row in AllPairs([FACTORS[f] for f in order], filter_func=ordered_valid)]
    return [[row[f] for f in FACTORS] for row in rows]


#: Triples no pair can stand for: pacing acts only on blocking calls (push_pull, one_by_one) to sync shards over
#: sockets, so these hold back pieces across a restore, a failover and backup workers' dropped pushes.
PACED: list[list[str]] = [
    ["sync", "sockets", "push_pull", "topk", "dense", "restore", "keys", "separate", "paced", "0"],
    ["sync", "sockets", "one_by_one", "none", "table", "restore", "off", "shared", "paced", "1"],
    ["sync_b1", "sockets", "push_pull", "fp16", "evicting", "none", "off", "separate", "paced", "0"],
]

CASES = [Case(*row) for row in _complete(_pairwise()) + PACED]


def test_the_cases_cover_every_valid_pair_of_values():
    covered = {frozenset(pair) for case in CASES for pair in combinations(zip(FACTORS, case), 2)}
    for (fa, va), (fb, vb) in combinations([(f, vs) for f, vs in FACTORS.items()], 2):
        for a, b in product(va, vb):
            pair = frozenset({(fa, a), (fb, b)})
            assert pair in covered or pair in INVALID, f"no case has {fa}={a} with {fb}={b}"
    assert all(valid(list(case)) for case in CASES)
    print(f"{len(CASES)} cases:\n" + "\n".join(case.id for case in CASES))


def test_a_network_cut_sends_the_suites_small_tensors_in_more_than_one_message_a_shard():
    """The cases with ``pipeline`` on or paced over sockets must meet a shard's small tensors split into messages
    of at most 256 KiB (``PartitionMap.messages``), one after another: the suite's tensors are chosen so."""
    from psrt.partition import MIN_PIECE_BYTES, PartitionMap

    pmap = PartitionMap(cw.SHARDS, ClientConfig().partition_bytes, network=True)
    pmap.add({f"t{t}": ((n,), np.dtype(np.float32)) for t, n in enumerate(cw.SIZES)})
    chunks = sorted((c for t in range(len(cw.SIZES)) for c in pmap.chunks[f"t{t}"]), key=lambda c: (c.name, c.part))
    split = [(a, b) for msgs in pmap.messages(chunks).values() for a, b in zip(msgs, msgs[1:])
             if all(c.pieces == 1 for c in a + b)]
    assert split, "no shard gets two messages of small tensors in a row: SIZES no longer exercise the network rule"
    for a, b in split:
        assert sum(c.nbytes for c in a) <= MIN_PIECE_BYTES < sum(c.nbytes for c in a + b[:1])


# ---------------------------------------------------------------------------------------------- jobs
def _compression(case: Case) -> Optional[str]:
    """The workers' ``PSRT_COMPRESSION``."""
    return {"none": None, "topk": TOPK}.get(case.compression, case.compression)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("combo") / "keys"
    proc = subprocess.run(psrt_command("keygen", str(directory)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return str(directory)


class Job:
    """A scheduler, S servers and W combination workers on loopback; :meth:`close` stops whatever still runs.

    :attr:`workers` are the worker processes, :attr:`hosts` the ranks each runs: one each, or all in one.
    """

    def __init__(self, case: Case, tmp: Path, keys: str, extra: Optional[Any] = None) -> None:
        self.case, self.tmp, self.keys = case, tmp, keys
        self.extra = extra  # extra(rank): more (or other) arguments for that worker
        self.children: list[Child] = []
        self.restarted: Optional[Child] = None

    def run(self) -> list[dict[str, Any]]:
        """Start every process, hurt one if the case says so, and wait for the end: the workers' results."""
        self.form()
        if self.case.event == "restore":
            if self.case.replicas != "0":
                self.fail_a_shard_over()
            else:
                self.restore_a_shard()
        return self.finish()

    def form(self) -> None:
        """Start the scheduler, the servers and the workers; return once the job has formed."""
        case, keys = self.case, self.keys
        self.env = {"PSRT_TIMEOUT": "30", "PSRT_SHM": "1" if case.path == "shm" else "0",
                    "PSRT_KEYS": keys if case.security == "keys" else "", "PSRT_RESTART_GRACE": "15",
                    "PSRT_PIPELINE": "on" if case.pipeline == "paced" else case.pipeline}
        if case.pipeline == "paced":
            self.env.update(PSRT_PACING="paced", PSRT_IN_FLIGHT="1")
        mode = ["--mode", case.mode, *(["--staleness", str(STALENESS)] if case.mode == "ssp" else [])]
        if case.mode == BACKUP:
            mode = ["--mode", "sync", "--backup-workers", "1"]
        elastic = ["--elastic"] if case.event in LEAVING else []
        replicas = ["--replicas", case.replicas] if case.replicas != "0" else []
        self.scheduler = self.start("scheduler", psrt_command(
            "scheduler", "--bind", "tcp://127.0.0.1:*", "--servers", str(SERVERS), "--workers", str(WORKERS),
            "--timeout", "60", *mode, *elastic, *replicas), SCHEDULER_READY)
        self.endpoint = self.scheduler.wait_ready(30).group(1)
        if case.security == "keys":  # CURVE is really on: a process without the job's keys is refused
            with pytest.raises(psrt.AuthenticationError, match="PSRT_KEYS"):
                psrt.Client(scheduler=self.endpoint, config=ClientConfig(keys=None, timeout=10),
                            cluster=ClusterConfig(start_timeout=10))
        self.servers = [self.start(f"server {i}", self.server_command(i), SERVER_READY) for i in range(SERVERS)]
        if case.processes == "separate":
            self.hosts = [[r] for r in range(WORKERS)]
            self.workers = [self.start(f"worker {r}", [sys.executable, WORKER, json.dumps(self.worker_args(r))],
                                       env={"PSRT_WORKER_ID": str(r)}) for r in range(WORKERS)]
        else:  # one process, a thread and a client per worker, each naming its rank
            self.hosts = [list(range(WORKERS))]
            args = [{**self.worker_args(r), "rank": r} for r in range(WORKERS)]
            self.workers = [self.start(f"workers 0-{WORKERS - 1}", [sys.executable, WORKER, json.dumps(args)])]
        # A server under a scheduler reports ready once the job has formed (its rank comes from the table).
        self.ranks = [int(re.search(r"rank=(\d+)", s.wait_ready(60).string).group(1)) for s in self.servers]

    def server_command(self, index: int) -> list[str]:
        checkpoints = []
        if self.case.event == "restore" and self.case.replicas == "0":
            checkpoints = ["--checkpoint-dir", str(self.tmp / f"checkpoints-{index}"), "--checkpoint-every", "1"]
        return psrt_command("server", "--scheduler", self.endpoint, *checkpoints)

    def worker_args(self, rank: int) -> dict[str, Any]:
        args: dict[str, Any] = {"calls": self.case.calls, "mode": self.case.mode, "table": self.case.tensors != "dense",
                                "evicting": self.case.tensors == "evicting", "steps": STEPS,
                                "out": str(self.tmp / f"worker-{rank}.npz"), "sleep": 0.03 * rank}
        if self.case.event in LEAVING and rank == 1:
            args.update(leave_after=LEAVE_AFTER, leave_by="close" if self.case.event == "leave" else "raise")
        if self.case.event == "restore":
            # A failover pauses twice: once for the kill, once (a step later) while a new server joins.
            pauses = PAUSE_AFTER if self.case.replicas == "0" else [PAUSE_AFTER, PAUSE_AFTER + 1]
            args.update(pause_after=pauses, go=str(self.tmp / "go"))
        if self.case.mode in ("async", "ssp"):  # worker 1 waits after its first step until worker 0 did 1 + s
            args["lead"] = {"steps": STALENESS, "file": str(self.tmp / "lead")}
        if self.case.mode == BACKUP:  # worker 0 makes each round alone, worker 1's push comes late for it
            partner = LEAVE_AFTER if self.case.event in LEAVING else STEPS
            args["lockstep"] = {"dir": str(self.tmp), "partner_steps": partner}
        return {**args, **(self.extra(rank) if self.extra else {})}

    def start(self, label: str, cmd: list[str], ready: Any = None, env: Optional[dict[str, str]] = None) -> Child:
        extra = {"PSRT_SCHEDULER": self.endpoint} if hasattr(self, "endpoint") else {}
        compression = {"PSRT_COMPRESSION": _compression(self.case) or ""}
        child = Child(cmd, label=label, ready=ready, env={**self.env, **extra, **compression, **(env or {})})
        self.children.append(child)
        return child

    def wait_paused(self, timeout: float, times: int = 1) -> None:
        """Wait until every worker printed ``paused`` ``times`` times (a shared process prints one such line per
        worker)."""
        deadline = time.monotonic() + timeout
        for child, ranks in zip(self.workers, self.hosts):
            while sum(line.startswith("paused") for line in child.output.splitlines()) < times * len(ranks):
                assert child.poll() is None, f"{child.label} exited with {child.poll()} before it paused"
                assert time.monotonic() < deadline, f"{child.label}'s workers did not all pause within {timeout:g}s"
                time.sleep(0.05)

    def restore_a_shard(self) -> None:
        """Both workers wait after a step: checkpoint, kill -9 a shard, let the workers go on (their calls to it
        wait), and restart it with --restore; under the scheduler it binds another ephemeral port."""
        self.wait_paused(JOB_S)
        proc = subprocess.run(psrt_command("checkpoint", self.endpoint), capture_output=True, text=True,
                              timeout=60, env={**os.environ, **self.env})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        victim = self.servers[1]
        victim.signal(signal.SIGKILL)
        victim.wait(10)
        (self.tmp / "go").touch()
        deadline = time.monotonic() + 10.0
        while "stopped heartbeating" not in self.scheduler.output and time.monotonic() < deadline:
            time.sleep(0.05)  # the scheduler waits for a restorable server once it stopped heartbeating
        self.restarted = self.start("server 1 (restarted)", [*self.server_command(1), "--restore"], SERVER_READY)
        line = self.restarted.wait_ready(30).string
        assert f"rank={self.ranks[1]}" in line, f"the restarted shard did not take back rank {self.ranks[1]}: {line}"
        assert victim.endpoint not in line  # it bound another port: the case this event is about
        assert "restored" in self.restarted.output, self.restarted.output

    def fail_a_shard_over(self) -> None:
        """Both workers wait after a step: kill -9 a shard of the replicated job and let the workers go on (their
        calls to it wait, as in the restore event); the scheduler hands its range to the replica (the other shard),
        the workers follow it there and send again what was not answered. After the next step they wait again,
        while a server started then takes the dead one's place as a replica of the ranges it backs, by a full copy
        that their primary sends at once, idle as the job is; then they go on to the end."""
        self.wait_paused(JOB_S)
        victim = self.servers[1]
        victim.signal(signal.SIGKILL)
        victim.wait(10)
        (self.tmp / "go").touch()
        deadline = time.monotonic() + 20.0
        while "is served by its replica" not in self.scheduler.output and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"key range {self.ranks[1]} is served by its replica" in self.scheduler.output, self.scheduler.tail()
        self.wait_paused(JOB_S, times=2)
        self.restarted = self.start("server 1 (a new one)", self.server_command(1), SERVER_READY)
        self.restarted.wait_ready(30)
        deadline = time.monotonic() + 30.0
        while "holds range" not in self.restarted.output and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "holds range" in self.restarted.output, self.restarted.output
        (self.tmp / f"go-{PAUSE_AFTER + 1}").touch()

    def finish(self) -> list[dict[str, Any]]:
        """Wait for every worker, then for the scheduler and servers; each must exit 0 (but the process of a worker
        whose script raised). The workers' results, in rank order."""
        results = []
        deadline = time.monotonic() + JOB_S
        for w, ranks in zip(self.workers, self.hosts):
            code = w.wait(max(1.0, deadline - time.monotonic()))
            if self.case.event == "crash" and 1 in ranks:  # a script that raises fails, as it should
                assert code != 0 and "RuntimeError: worker 1's training script failed" in w.output, w.tail(4000)
            else:
                assert code == 0, f"{w.label} exited with {code}:\n{w.tail(4000)}"
            lines = [json.loads(line) for line in w.output.splitlines() if line.startswith("{")]
            for rank in ranks:
                mine = [res for res in lines if res["rank"] == rank]
                assert mine, f"{w.label} printed no result for worker {rank}:\n{w.tail(4000)}"
                results.append(mine[-1])
        # The workers ran where the case says: in one process, or each in its own.
        assert len({res["pid"] for res in results}) == len(self.workers), results
        alive = [self.scheduler, *(s for s in self.servers if s is not self.servers[1] or self.restarted is None)]
        for c in [*alive, *([self.restarted] if self.restarted else [])]:
            code = c.wait(EXIT_S)
            assert code == 0, f"{c.label} exited with {code}:\n{c.tail(4000)}"
        return results

    def close(self) -> None:
        stop_children(self.children, grace=1.0)

    def outputs(self) -> str:
        return "\n".join(f"--- {c.label}\n{c.tail(3000)}" for c in self.children)


def _ahead(case: Case, step: int) -> Optional[int]:
    """How many of a split tensor's pieces per shard a worker's call at ``step`` (0-based) sends before it waits,
    when it is paced (None: it is not, every piece goes at once). Pacing takes blocking calls to sync shards
    over sockets (compressed gradients never take a lane): always with ``pipeline=paced``; with ``pipeline=on``
    as :mod:`psrt.worker.pacing` schedules a set of tensors' calls (each step makes one call per set): joined
    for the first :data:`~psrt.worker.pacing.WARM_UP_CALLS`, then paced and joined in turn, a block of
    :data:`~psrt.worker.pacing.BLOCK` calls each, while the first trial lasts (this suite's steps end within it)."""
    if case.mode not in ("sync", BACKUP) or case.calls not in ("push_pull", "one_by_one") or case.compression == \
            "none" and case.path == "shm" or case.pipeline == "auto":
        return None
    if case.pipeline == "paced":
        return 1
    assert step < pacing.WARM_UP_CALLS + 2 * pacing.FIRST_SAMPLES * pacing.BLOCK, "the step is past the first trial"
    paced = step >= pacing.WARM_UP_CALLS and (step - pacing.WARM_UP_CALLS) // pacing.BLOCK % 2 == 0
    return ClientConfig().in_flight if paced else None


def _check(case: Case, tmp: Path, results: list[dict[str, Any]], victim: int) -> None:
    # A shard restored from its checkpoint may be behind what it answered: top-k's residuals owed to it start from
    # zero. A replica that takes a range over holds all its primary answered: what they owe is still owed there.
    restart = None
    if case.event == "restore" and case.replicas == "0":
        restart = (victim, case.calls, PAUSE_AFTER, _ahead(case, PAUSE_AFTER))
    oracle = Oracle(case.mode, _compression(case), case.event in LEAVING, restart,
                    network=case.pipeline != "auto")
    for res in results:
        w = res["rank"]
        data = np.load(tmp / f"worker-{w}.npz")
        reads = oracle.pushes[w]
        finals = 0 if res["left"] else 1
        for t in range(len(cw.SIZES)):
            values = data[f"t{t}"]
            assert len(values) == reads + finals, (w, t, len(values))
            for i, value in enumerate(values):
                final = i == reads
                what = f"worker {w}, tensor {t}, " + ("final values" if final else f"read after step {i + 1}")
                oracle.check_dense(what, w, i + 1, t, value, final)
        if case.tensors != "dense":
            rows = data["rows"]
            assert len(rows) == reads + finals
            for i, value in enumerate(rows):
                final = i == reads
                what = f"worker {w}, table, " + ("final rows" if final else f"read after step {i + 1}")
                oracle.check_rows(what, w, i + 1, value, final)
    stats = next(r["stats"] for r in results if not r["left"])
    if case.tensors == "evicting":
        _check_evictions(oracle, next(r["table_stats"] for r in results if not r["left"]))
    if case.mode == BACKUP:  # every push of worker 1 came late for a round worker 0 had closed: dropped
        dropped = {w: sum(per_worker(s).get(w, {}).get("dropped", 0) for s in stats) for w in range(WORKERS)}
        assert dropped[0] == 0 and dropped[1] > 0, dropped
    if case.event != "restore":  # (a restarted shard refuses the lanes of its predecessor: error replies too)
        errors = {s["endpoint"]: s["errors"] for s in stats if s["errors"]}
        assert not errors, f"error replies in a healthy job: {errors}"
    shm = sum(s.get("shm_bytes_in", 0) + s.get("shm_bytes_out", 0) for s in stats)
    if case.path == "sockets":
        assert shm == 0, f"PSRT_SHM=0, yet {shm} bytes went through shared memory"
    elif case.compression == "none":
        assert shm > 0, "one host, calls above 64 KiB, no compression: the tensors should go through shared memory"
    # A worker of the shards' host sends its requests over a local connection (psrt.transport.local), compressed
    # or not, lane or none; sockets only, none.
    local = sum(s.get("local_messages", 0) for s in stats)
    if case.path == "sockets":
        assert local == 0, f"PSRT_SHM=0, yet {local} messages came over local connections"
    else:
        assert local > 0, "workers of the shards' host should have sent their requests over local connections"


def _check_evictions(oracle: Oracle, stats: list[dict[str, Any]]) -> None:
    """The evicting table's counters on each shard, from the pushes alone: every hot row admitted once and never
    evicted (the reads checked that), every cold id pushed twice admitted, the rows beyond the capacity evicted,
    and the last step's cold ids still pending."""
    from psrt.kernels.rows import shard_of

    cap = cw.capacity(WORKERS, SERVERS)
    pushing = oracle.pushers(0)  # (a dropped push counts toward no admission)
    twice = np.concatenate([cw.cold_ids(w, s) for w in pushing for s in range(oracle.pushes[w] - 1)])
    once = np.concatenate([cw.cold_ids(w, oracle.pushes[w] - 1) for w in pushing])
    hot = np.bincount(oracle.row_shard, minlength=SERVERS)
    for s, st in enumerate(stats):
        admitted = int(hot[s]) + int((shard_of(twice, SERVERS) == s).sum())
        got = {k: st[k] for k in ("rows", "admitted", "evicted", "pending")}
        assert got == {"rows": min(cap, admitted), "admitted": admitted, "evicted": max(0, admitted - cap),
                       "pending": int((shard_of(once, SERVERS) == s).sum())}, f"shard {s}: {got}"
    assert sum(st["evicted"] for st in stats) > 0


def _needs_torch() -> None:
    # psrt.torch's cases run torch in their workers: the README's test command installs no torch (the ``torch``
    # extra does, and CI installs a CPU build), so without it they are skipped, as test_torch.py is.
    pytest.importorskip("torch", reason="psrt.torch's combinations need torch: pip install -e '.[torch]'")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_combination(case: Case, tmp_path: Path, keys: str):
    if case.calls in ("torch", "torch_held"):
        _needs_torch()
    started = time.monotonic()
    job = Job(case, tmp_path, keys)
    try:
        results = job.run()
    except Exception as exc:
        job.close()
        raise AssertionError(f"{type(exc).__name__}: {exc}\n{job.outputs()}") from None
    finally:
        job.close()
    try:
        for server in [*job.servers, *([job.restarted] if job.restarted else [])]:
            assert "Traceback" not in server.output, f"{server.label} logged an internal error"
        _check(case, tmp_path, results, job.ranks[1])
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{job.outputs()}") from None
    print(f"{case.id}: {time.monotonic() - started:.1f}s")


# ---------------------------------------------------------------------------------------------- refusals
def _ends(job: Job) -> dict[str, tuple[int, float]]:
    """Each process's exit code and when it exited (seconds after the job formed), worker 1's (the one that
    fails) first; a process still running :data:`EXIT_S` seconds after the job formed fails the test."""
    formed = time.monotonic()
    ends = {}
    for child in [*job.workers[::-1], job.scheduler, *job.servers]:
        try:
            ends[child.label] = (child.wait(max(1.0, formed + EXIT_S - time.monotonic())), time.monotonic() - formed)
        except Exception as exc:
            raise AssertionError(f"{child.label} still runs {EXIT_S:g}s after the job formed ({exc})\n"
                                 f"{job.outputs()}") from None
    print({label: f"code {code} after {at:.1f}s" for label, (code, at) in ends.items()})
    return ends


def _workers_failed(job: Job, ends: dict[str, tuple[int, float]]) -> None:
    """Every worker process exited non-zero (both workers' one, when they share it), and so did the scheduler."""
    assert all(ends[w.label][0] != 0 for w in job.workers), job.outputs()
    assert ends["scheduler"][0] != 0, "the scheduler reported success for a job that failed"


@pytest.mark.parametrize("processes", FACTORS["processes"])
def test_a_worker_whose_script_raises_ends_a_job_that_is_not_elastic_promptly(processes: str, tmp_path: Path,
                                                                              keys: str):
    """Worker 1's script raises after its first step; worker 0's next round can never complete. The raising
    worker exits non-zero, and the job ends promptly: its peer hears of it and fails, so does the scheduler. In a
    shared process the peer is failed at once, by its own process (the heartbeat's word), which then exits with
    worker 1's error."""
    case = Case("sync", "sockets", "push_pull", "none", "dense", "none", "off", processes)
    job = Job(case, tmp_path, keys, extra=lambda rank: {"leave_after": 1, "leave_by": "raise"} if rank == 1 else {})
    try:
        job.form()
        ends = _ends(job)
    finally:
        job.close()
    assert "RuntimeError: worker 1's training script failed" in job.workers[-1].output, job.outputs()
    _workers_failed(job, ends)


@pytest.mark.parametrize("processes", FACTORS["processes"])
def test_a_sparse_torch_embedding_is_refused_and_the_job_ends_promptly(processes: str, tmp_path: Path, keys: str):
    """psrt.torch moves dense gradients only: ``nn.Embedding(sparse=True)`` is refused when its first gradient
    arrives, before anything is pushed, saying what to do. The refusing worker's script then fails like any
    script with an uncaught exception, and the job ends promptly instead of waiting for it."""
    _needs_torch()
    case = Case("sync", "sockets", "torch", "none", "dense", "none", "off", processes)
    job = Job(case, tmp_path, keys, extra=lambda rank: {"calls": "torch_embedding", "sparse": rank == 1})
    try:
        job.form()
        ends = _ends(job)
    finally:
        job.close()
    out = job.workers[-1].output
    assert "PsrtTypeError" in out and "sparse gradient" in out and "sparse=False" in out, out
    _workers_failed(job, ends)


def test_restore_without_a_checkpoint_directory_is_refused_up_front():
    proc = subprocess.run(psrt_command("server", "--scheduler", "tcp://127.0.0.1:1", "--restore"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("psrt: error:") and "--checkpoint-dir" in lines[0], proc.stderr
