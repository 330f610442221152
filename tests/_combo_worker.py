"""The worker of the pairwise combination suite (tests/test_combinations.py), and the gradients it pushes.

``python tests/_combo_worker.py JSON`` joins the job of the scheduler in ``PSRT_SCHEDULER`` (rank
``PSRT_WORKER_ID``, compression ``PSRT_COMPRESSION``) and trains four dense float32 tensors, and optionally an
embedding table, for ``steps`` steps with one call pattern:

- ``push_pull``: one ``push_pull`` of every tensor per step;
- ``one_by_one``: one ``push`` per tensor, then a ``pull`` of all;
- ``overlapped``: one ``push_pull_async`` per tensor, all in flight together with the table's calls, then waited;
- ``pipelined``: one ``push_pull_async`` of every tensor per step, the next step's sent before this one's is
  waited for (a pipelined loop: from its first call on, no moment has nothing in flight), the table's calls
  between; it waits at once where the step must leave nothing in flight (a pause, a lead or lockstep's turn, the
  last step, ssp: see :func:`_keeps_in_flight`);
- ``torch``: :class:`psrt.torch.DistributedOptimizer` on a model whose loss is ``sum(param * G)``, so that each
  parameter's gradient is exactly the designed ``G``; ``torch_held``: the same with ``window=1`` (one push in
  flight to each shard, the rest held in the pipeline's priority queue).

After each step it records what it read (the parameters the step returned, the table's rows), and at the end,
after a barrier, the final parameters; all of it goes to the ``.npz`` file ``out``, and a JSON line with the
shards' stats (and the process id) to stdout. The JSON arguments also say when to leave the job
(``leave_after``, ``leave_by``: ``close`` or ``raise``), when to pause for the test (``pause_after``, until the
file ``go`` exists), when to let worker 0 run ahead (``lead``) and, with backup workers, to take turns with the
other worker step by step (``lockstep``). ``calls: torch_embedding`` runs a torch
``nn.Embedding`` instead.

``python tests/_combo_worker.py '[JSON, JSON, ...]'`` runs one such worker per object on threads of this one
process, as ``psrt worker --clients N`` does (:func:`psrt.emulation.loadgen._run_together`): each object names its
worker's ``rank``, and each worker has its own client, rank, session and result line (its process's workers share
the process's heartbeat thread and ZeroMQ context). A worker's script that raises ends its thread, not the
interpreter, so there it closes its client as ``with psrt.Client()`` does, telling the scheduler ``failed`` (in a
process of its own, psrt closes the client still open at interpreter exit, :mod:`psrt.worker.exits`); once every
worker's thread has ended, the process exits with the first error any of them raised.

Gradients are functions of (worker, step, tensor) only (:func:`dense_grad`, :func:`row_push`), so the test
computes in NumPy what every read must hold (SGD, lr = 1, from zeros). Entry ``w`` of every tensor is worker
w's counter: ``COUNT`` per push, the largest magnitude of its gradient, so top-k always sends it; entries
``0..MAX_WORKERS-1`` are zero otherwise. One tensor is large enough to be cut into pieces, 2 (one per shard), or
4 when cut for a network (``PSRT_PIPELINE=on``), and every piece a network cut makes begins with such counters
(:func:`counter_starts`): its pieces are applied apart, each at its own prefix of the pushes in async and ssp.
The other entries are small integers (exact in fp16, also as sync means), or for top-k dyadic numbers that do not
tie at top-k's boundary, so the entries top-k picks are known. The table has, per
worker and shard, a counter row on that shard, and shared data rows pushed with repeats.

``evicting`` makes the table one whose rows come and go (``admit_after=2`` and a capacity, :func:`init_table`),
with the same reads: before training each worker pushes zeros to every row a read pulls (the *hot* rows), so
every real push of a hot id is its second count or later, and applied; and each push also carries zeros for
every hot row (so they are always the most recently pushed) and *cold* ids, negative (so ties evict them first),
new each step and pushed again the step after, which admits them: the capacity, :func:`capacity`, leaves room
for the hot rows and one push's cold rows, so eviction takes cold rows only, and always does.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

# Each above the 64 KiB a call needs to take the shared-memory path; at least four, so that ssp with s = 2 meets
# pushes of one step that are further apart in a per-worker count of pushes than the staleness bound. t2 (1.25 MiB)
# is cut into pieces: a piece per shard, or 10 pieces of 128 KiB when cut for a network. Cut for a network, small
# tensors share messages of at most 256 KiB (psrt.partition.MIN_PIECE_BYTES), so that a shard answers one while the
# next is on the wire: t3 to t8 make a shard two such messages (t3, t4 and t6, then t7), as a model of many small
# layers does (tests/test_combinations.py checks they still do).
SIZES = (17_000, 20_000, 327_680, 18_000, 19_000, 21_000, 22_000, 23_000, 24_000)
#: The job's shards (S), as the shard map that places the pieces sees them.
SHARDS = 2
COUNT = 64.0
MAX_WORKERS = 4
SEED = 20_240_617
FINE_BASE = 1 << 18  # top-k's magnitudes: (FINE_BASE + i) / 2**16, i < n; exact in float32 as sums of 12
TABLE, DIM = "emb", 4
DATA_IDS = np.arange(10, 22, dtype=np.int64)
ROWS_PER_PUSH = 8
#: One whole line at a time on stdout, from whichever worker's thread.
_PRINT = threading.Lock()


def say(line: str) -> None:
    """Print ``line`` whole: the workers of a shared process print from their threads."""
    with _PRINT:
        print(line, flush=True)


def grad_kind(compression: Optional[str]) -> str:
    """``"fine"`` gradients for top-k (ties would make its choice of entries arbitrary), else ``"int"``."""
    return "fine" if compression and compression.startswith("topk") else "int"


@functools.cache
def counter_starts(tensor: int) -> tuple[int, ...]:
    """Where tensor ``tensor``'s pieces begin when it is cut for a network, each with the workers' counters (the
    pieces of a cut for a host, fewer, begin at some of these)."""
    from psrt.config import ClientConfig
    from psrt.partition import PartitionMap

    pmap = PartitionMap(SHARDS, ClientConfig().partition_bytes, network=True)
    pmap.add({f"t{t}": ((n,), np.dtype(np.float32)) for t, n in enumerate(SIZES)})
    return tuple(sorted(c.start for c in pmap.chunks[f"t{tensor}"]))


def dense_grad(kind: str, worker: int, step: int, tensor: int) -> np.ndarray:
    """Worker ``worker``'s gradient of tensor ``tensor`` at step ``step`` (0-based)."""
    n = SIZES[tensor]
    rng = np.random.default_rng([SEED, worker, step, tensor])
    if kind == "fine":
        # Per (worker, tensor) every entry keeps one magnitude, all distinct and, in the small tensors, within a
        # ratio of 1.1 of each other; only signs change from step to step. An entry's gradient + residual is then
        # a*m with a <= the steps so far, and a*m = b*m' has no solution for a != b <= 6 (m/m' < 7/6) nor for
        # m != m': no ties. t2's magnitudes span a ratio of 2.25 (kept below 2**20 / 65536, so that sums of 12
        # stay exact in float32): a tie is possible there, and the oracle checks none falls on top-k's boundary.
        magnitude = (FINE_BASE + np.random.default_rng([SEED, worker, tensor]).permutation(n)) / 65536.0
        g = magnitude * rng.choice([-1.0, 1.0], n)
    else:
        g = rng.integers(-8, 9, n).astype(np.float64)
    for start in counter_starts(tensor):
        g[start:start + MAX_WORKERS] = 0.0
        g[start + worker] = COUNT
    return g.astype(np.float32)


def count_ids(worker: int, num_shards: int) -> np.ndarray:
    """Worker ``worker``'s counter row on each shard (in shard order): the first ids from 1000 (w + 1) on it."""
    from psrt.kernels.rows import shard_of

    candidates = np.arange(1000 * (worker + 1), 1000 * (worker + 1) + 200, dtype=np.int64)
    shards = shard_of(candidates, num_shards)
    return np.array([candidates[shards == s][0] for s in range(num_shards)], np.int64)


def all_row_ids(num_workers: int, num_shards: int) -> np.ndarray:
    """Every row a read pulls: the counters of every worker, then the data rows."""
    return np.concatenate([*(count_ids(w, num_shards) for w in range(num_workers)), DATA_IDS])


def row_push(worker: int, step: int, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids (with repeats) and gradient rows worker ``worker`` pushes to the table at step ``step``."""
    rng = np.random.default_rng([SEED, worker, step, 99])
    data = rng.choice(DATA_IDS, ROWS_PER_PUSH, replace=True)
    ids = np.concatenate([count_ids(worker, num_shards), data])
    grads = np.concatenate([np.ones((num_shards, DIM)), rng.integers(-4, 5, (ROWS_PER_PUSH, DIM))])
    return ids, grads.astype(np.float32)


#: Cold ids a push brings for the first time (and, again, the step after).
COLD_PER_PUSH = 4


def capacity(num_workers: int, num_shards: int) -> int:
    """The evicting table's capacity per shard: every hot row of the fullest shard, and one push's cold rows."""
    from psrt.kernels.rows import shard_of

    hot = shard_of(all_row_ids(num_workers, num_shards), num_shards)
    return int(np.bincount(hot, minlength=num_shards).max()) + 2 * COLD_PER_PUSH


def cold_ids(worker: int, step: int) -> np.ndarray:
    """The cold ids worker ``worker`` pushes first at ``step`` (negative: below every hot id)."""
    return -(1 + np.arange(COLD_PER_PUSH, dtype=np.int64) + COLD_PER_PUSH * (step + 100 * worker))


def init_table(client: Any, evicting: bool, args: Optional[dict[str, Any]] = None) -> None:
    """The table, and for an evicting one, the zero pushes that count every hot id once (with backup workers,
    ``lockstep``: worker 0's alone, then a pull, as a loop reads before it pushes: its first push's base; the
    caller then says it is ready, :func:`_ready`)."""
    import psrt

    workers, shards = client.num_workers, len(client.servers)
    policy = dict(admit_after=2, capacity=capacity(workers, shards)) if evicting else {}
    client.init_embedding(TABLE, dim=DIM, optimizer=psrt.SGD(lr=1.0), init="zeros", **policy)
    if evicting:
        hot = all_row_ids(workers, shards)
        lock = args is not None and args.get("lockstep") is not None
        if lock:
            _lockstep(args, client.rank, -1)
        client.push_rows(TABLE, hot, np.zeros((len(hot), DIM), np.float32))
        if lock:
            client.pull_rows(TABLE, hot)


def table_push(worker: int, step: int, num_workers: int, num_shards: int,
               evicting: bool) -> tuple[np.ndarray, np.ndarray]:
    """What a worker pushes to the table: :func:`row_push`, and for an evicting table zeros for every hot row and
    the cold ids of this step and the one before."""
    ids, grads = row_push(worker, step, num_shards)
    if not evicting:
        return ids, grads
    cold = np.concatenate([cold_ids(worker, step), cold_ids(worker, step - 1) if step else []]).astype(np.int64)
    hot = all_row_ids(num_workers, num_shards)
    extra = np.concatenate([hot, cold])
    return np.concatenate([ids, extra]), np.concatenate([grads, np.zeros((len(hot), DIM), np.float32),
                                                         np.ones((len(cold), DIM), np.float32)])


class _Recorder:
    """What a worker read, step by step; :meth:`finish` writes it to ``out`` and prints the result line."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.dense: list[list[np.ndarray]] = [[] for _ in SIZES]
        self.rows: list[np.ndarray] = []

    def finish(self, result: dict[str, Any]) -> None:
        arrays = {f"t{t}": np.stack(reads) for t, reads in enumerate(self.dense)}
        if self.rows:
            arrays["rows"] = np.stack(self.rows)
        np.savez(Path(self.out), **arrays)
        say(json.dumps({**result, "pid": os.getpid()}))

    def add(self, params: list[np.ndarray], rows: Optional[np.ndarray]) -> None:
        for t, p in enumerate(params):
            self.dense[t].append(np.array(p, np.float32, copy=True))
        if rows is not None:
            self.rows.append(np.array(rows, np.float32, copy=True))


def _wait_for(path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:g}s")
        time.sleep(0.01)


def _pauses(args: dict[str, Any]) -> list[int]:
    """The steps after which to pause (``pause_after``: one, or a list): after the first until the file ``go``
    exists, after a later one, step k, until ``go-k`` does."""
    pauses = args.get("pause_after")
    return [] if pauses is None else pauses if isinstance(pauses, list) else [pauses]


def _between_steps(args: dict[str, Any], rank: int, step: int) -> None:
    """After step ``step`` (1-based): let another worker run ahead, pause for the test's event, sleep."""
    lead = args.get("lead")
    if lead is not None:  # async and ssp: worker 0 runs lead["steps"] steps ahead of worker 1 at least once
        if rank == 0 and step == 1 + lead["steps"]:
            Path(lead["file"]).touch()
        elif rank == 1 and step == 1:
            _wait_for(lead["file"])
    if step in _pauses(args):
        say(f"paused {rank}")
        _wait_for(args["go"] if step == _pauses(args)[0] else f"{args['go']}-{step}")
    time.sleep(args.get("sleep", 0.0))


def _lockstep(args: dict[str, Any], rank: int, step: int, done: bool = False) -> None:
    """Backup workers (``lockstep``): worker 1 starts each step once worker 0 finished it, and worker 0 the next
    once worker 1 finished this one (while worker 1 still trains), so that worker 0 closes every round alone and
    worker 1's push always comes late for it. ``step`` 0-based, or ``-1``: the start, until the worker is ready
    (:func:`_ready`), which the evicting table's first zero push is part of; ``done``: this worker finished the
    step. Worker 0's first step waits for worker 1's start: a push is late only if computed from parameters older
    than its key's, and a worker that joins after a round closed holds that round's parameters from ``init`` (its
    first push then rightly makes the next round, not the one that closed)."""
    lock = args.get("lockstep")
    if lock is None:
        return
    if done:
        Path(lock["dir"], f"step-{rank}-{step}").touch()
    elif rank == 1:
        _wait_for(str(Path(lock["dir"], f"step-0-{step}")))
    elif step >= 0 and step - 1 < lock["partner_steps"]:
        _wait_for(str(Path(lock["dir"], f"step-1-{step - 1}")))


def _ready(args: dict[str, Any], rank: int) -> None:
    """With backup workers (``lockstep``): this worker holds the initial parameters (and rows, :func:`init_table`)
    and is about to take its first step."""
    _lockstep(args, rank, -1, done=True)


def _leave(rec: _Recorder, result: dict[str, Any], how: Optional[str]) -> None:
    """The end of a worker that leaves the job early: by closing its client, or by an uncaught exception."""
    rec.finish(result)
    if how == "raise":
        raise RuntimeError(f"worker {result['rank']}'s training script failed after step {result['steps']}")


def _as_script(args: dict[str, Any], client: Any) -> Any:
    """Where a worker's script that raises closes its client: on a thread of a shared process, at once, as ``with
    psrt.Client()`` does (the interpreter does not exit); in a process of its own, psrt does, at interpreter exit."""
    return client if args.get("rank") is not None else contextlib.nullcontext()


def _train_client(args: dict[str, Any], rec: _Recorder) -> None:
    import psrt

    client = psrt.Client(rank=args.get("rank"))
    with _as_script(args, client):
        _client_steps(client, args, rec)


def _keeps_in_flight(args: dict[str, Any], rank: int, step: int, last: int) -> bool:
    """``pipelined``: whether step ``step`` (0-based) may leave its call in flight into the next step: not the last
    step, nor one after which the worker pauses (a shard is killed then: a push answered after its checkpoint
    would be lost) or the first after a pause (the worker learns of the shard's return before its next push, as
    the oracle's top-k residuals have it), nor one that hands the lead over or takes turns (``lockstep``); nor in
    ssp, where a read held back by the bound may include the worker's own next push, which the oracle's bound
    check does not model."""
    lead, pauses = args.get("lead"), _pauses(args)
    handing = lead is not None and ((rank == 0 and step + 1 == 1 + lead["steps"]) or (rank == 1 and step == 0))
    return (step + 1 < last and step + 1 not in pauses and step not in pauses and not handing
            and args.get("lockstep") is None and args.get("mode") != "ssp")


def _client_steps(client: Any, args: dict[str, Any], rec: _Recorder) -> None:
    import psrt

    calls, steps, leave = args["calls"], args["steps"], args.get("leave_after")
    rank, workers, shards = client.rank, client.num_workers, len(client.servers)
    kind = grad_kind(client.config.compression)
    names = [f"t{t}" for t in range(len(SIZES))]
    client.init({n: np.zeros(size, np.float32) for n, size in zip(names, SIZES)}, optimizer=psrt.SGD(lr=1.0))
    ids_all = all_row_ids(workers, shards)
    if args["table"]:
        init_table(client, args.get("evicting", False), args)
    _ready(args, rank)
    last = steps if leave is None else leave
    in_flight = None  # pipelined: the (handle, rows) of the last step, its call still in flight
    for step in range(last):
        _lockstep(args, rank, step)
        grads = {n: dense_grad(kind, rank, step, t) for t, n in enumerate(names)}
        rows = None
        if args["table"]:
            ids, row_grads = table_push(rank, step, workers, shards, args.get("evicting", False))
        if calls == "push_pull":
            params = client.push_pull(grads)
        elif calls == "one_by_one":
            for n in names:
                client.push({n: grads[n]})
            params = client.pull()
        elif calls == "overlapped":
            handles = [client.push_pull_async({n: grads[n]}) for n in names]
            if args["table"]:
                client.push_rows_async(TABLE, ids, row_grads).wait()
                pending_rows = client.pull_rows_async(TABLE, ids_all)
            params = {}
            for h in handles:
                params.update(h.wait())
            if args["table"]:
                rows = pending_rows.wait()
        elif calls == "pipelined":
            handle = client.push_pull_async(grads)
            if args["table"]:
                client.push_rows(TABLE, ids, row_grads)
                rows = client.pull_rows(TABLE, ids_all)
            if in_flight is not None:  # the last step's read, in step order
                params_before = in_flight[0].wait()
                rec.add([params_before[n] for n in names], in_flight[1])
                in_flight = None
            if _keeps_in_flight(args, rank, step, last):
                in_flight = (handle, rows)
            else:
                params = handle.wait()
        else:
            raise ValueError(f"unknown call pattern {calls!r}")
        if args["table"] and calls not in ("overlapped", "pipelined"):
            client.push_rows(TABLE, ids, row_grads)
            rows = client.pull_rows(TABLE, ids_all)
        if in_flight is None:
            rec.add([params[n] for n in names], rows)
        _lockstep(args, rank, step, done=True)
        if step == 0:
            say(f"training {rank}")
        _between_steps(args, rank, step + 1)
    result: dict[str, Any] = {"rank": rank, "steps": last, "left": leave is not None}
    if leave is not None:
        _leave(rec, result, args.get("leave_by"))
        client.close()  # a worker of an elastic job leaves it here
        return
    client.barrier()  # every other worker has pushed everything (or left): the final values are complete
    final = client.pull()
    rec.add([final[n] for n in names], client.pull_rows(TABLE, ids_all) if args["table"] else None)
    result["stats"] = client.stats()
    if args.get("evicting"):
        result["table_stats"] = client.table_stats(TABLE)
    client.close()
    rec.finish(result)


def _train_torch(args: dict[str, Any], rec: _Recorder) -> None:
    import torch

    import psrt
    import psrt.torch

    class Leaf(torch.nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(n, dtype=torch.float32))

        def forward(self, g: torch.Tensor) -> torch.Tensor:
            return (self.weight * g).sum()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = torch.nn.ModuleList([Leaf(n) for n in SIZES])

        def forward(self, gs: list[torch.Tensor]) -> torch.Tensor:
            return sum(m(g) for m, g in zip(self.parts, gs))

    model = Model()
    # A shared process's worker brings its client (its own rank); else the optimizer makes one from the environment.
    client = psrt.Client(rank=args["rank"]) if args.get("rank") is not None else None
    # torch_held: one push in flight to each shard, the rest held in the priority queue (a shard's pace at its least)
    held = {"window": 1} if args["calls"] == "torch_held" else {}
    with _as_script(args, client):
        opt = psrt.torch.DistributedOptimizer(model.named_parameters(), optimizer=psrt.SGD(lr=1.0), client=client,
                                              **held)
        _torch_steps(model, opt, args, rec)


def _torch_steps(model: Any, opt: Any, args: dict[str, Any], rec: _Recorder) -> None:
    import torch


    steps, leave = args["steps"], args.get("leave_after")
    client = opt.client
    rank, workers, shards = client.rank, client.num_workers, len(client.servers)
    kind = grad_kind(client.config.compression)
    params = [m.weight for m in model.parts]
    names = [n for n, _ in model.named_parameters()]
    ids_all = all_row_ids(workers, shards)
    if args["table"]:
        init_table(client, args.get("evicting", False), args)
    _ready(args, rank)
    last = steps if leave is None else leave
    for step in range(last):
        _lockstep(args, rank, step)
        opt.zero_grad()
        model([torch.from_numpy(dense_grad(kind, rank, step, t)) for t in range(len(SIZES))]).backward()
        opt.step()
        # What the documentation promises: once step() returns, the parameters hold the new values.
        seen = [p.detach().numpy().copy() for p in params]
        rows = None
        if args["table"]:
            ids, row_grads = table_push(rank, step, client.num_workers, len(client.servers),
                                        args.get("evicting", False))
            client.push_rows(TABLE, ids, row_grads)
            rows = client.pull_rows(TABLE, ids_all)
        rec.add(seen, rows)
        _lockstep(args, rank, step, done=True)
        if step == 0:
            say(f"training {rank}")
        if step + 1 in _pauses(args):
            opt.synchronize()  # nothing in flight while the test hurts a shard
        _between_steps(args, rank, step + 1)
    opt.synchronize()
    result: dict[str, Any] = {"rank": rank, "steps": last, "left": leave is not None}
    if leave is not None:
        _leave(rec, result, args.get("leave_by"))
        opt.close()
        client.close()  # (opt.close() closed it if it made it): a worker of an elastic job leaves it here
        return
    client.barrier()
    final = client.pull()
    rec.add([final[n] for n in names], client.pull_rows(TABLE, ids_all) if args["table"] else None)
    result["stats"] = client.stats()
    if args.get("evicting"):
        result["table_stats"] = client.table_stats(TABLE)
    opt.close()
    client.close()
    rec.finish(result)


def _torch_embedding(args: dict[str, Any]) -> None:
    """A torch model with an ``nn.Embedding`` (``sparse`` as told), three steps; psrt.torch refuses sparse
    gradients. A psrt error of the job (a peer that failed) is printed as JSON and the exit code is 1."""
    import torch

    import psrt
    import psrt.torch

    torch.manual_seed(0)
    model = torch.nn.Embedding(10, 4, sparse=args["sparse"])
    client = psrt.Client(rank=args["rank"]) if args.get("rank") is not None else None
    with _as_script(args, client):
        opt = psrt.torch.DistributedOptimizer(model.named_parameters(), optimizer=psrt.SGD(lr=1.0), client=client)
        say(f"training {opt.client.rank}")
        try:
            for _ in range(3):
                opt.zero_grad()
                model(torch.tensor([1, 2])).sum().backward()  # a sparse gradient is refused here, as it arrives
                opt.step()
            opt.synchronize()
        except psrt.PsrtError as exc:
            if isinstance(exc, psrt.PsrtTypeError):
                raise  # the refusal itself: the script fails as any script does on an uncaught exception
            say(json.dumps({"rank": opt.client.rank, "error": type(exc).__name__, "message": str(exc)}))
            sys.exit(1)
        opt.close()
        opt.client.close()
        say(json.dumps({"rank": opt.client.rank, "error": None}))


def _worker(args: dict[str, Any]) -> None:
    if args.get("calls") == "torch_embedding":
        _torch_embedding(args)
        return
    (_train_torch if args["calls"] in ("torch", "torch_held") else _train_client)(args, _Recorder(args["out"]))


def main(spec: Any) -> None:
    """One worker (a JSON object), or one per object of a JSON list on threads of this process (module docstring)."""
    if isinstance(spec, dict):
        _worker(spec)
        return
    from psrt.emulation.loadgen import _run_together

    assert all(a.get("rank") is not None for a in spec), "each worker of a shared process names its rank"
    _run_together([lambda a=a: _worker(a) for a in spec])  # raises the first error, once every thread ended


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
