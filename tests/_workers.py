"""The worker programs the tests run as processes of their own, one role each.

``python tests/_workers.py ROLE JSON_ARGS`` runs the role's function with the JSON object's fields as keyword
arguments. A role may print progress lines first (``training`` once its first step is done, ``done N`` at a normal
end); its result comes last, as one ``psrt-worker-result {json}`` line (:func:`psrt.control.process.result_line`,
read back with :func:`psrt.control.process.parse_results`, also behind ``psrt launch``'s ``[worker N]`` prefix). A
result holding an ``error`` exits 1. Under ``psrt launch`` every worker gets the same arguments: a role that treats
one rank apart (``how``, ``die_at``) reads its rank from its client.

Roles that join a job through its scheduler take ``psrt.Client()`` from the environment (``PSRT_SCHEDULER``,
``PSRT_WORKER_ID``); the others take the shards' endpoints as ``servers``. ``tests/_helpers.py`` builds the command
lines (:func:`_helpers.worker_command`) and collects the results. The pairwise combination suite keeps its own
worker (``tests/_combo_worker.py``), which designs its gradients for its oracle.

torch is imported only by the roles and functions that use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import sys
import time
from typing import Any, Callable, Optional

import numpy as np

import psrt
from psrt.cluster.launch import THREAD_VARIABLES
from psrt.config import ClientConfig
from psrt.control.process import result_line

#: Clients a script leaves open (``crash``'s ``return`` and ``raise``): kept here, as a script's module scope
#: would keep them, so that they stay open until the interpreter exits and its exit hook closes them.
LEFT_OPEN: list[psrt.Client] = []


# ---------------------------------------------------------------------------------------------- exact sums
def async_pusher(servers: list[str], rank: int, workers: int, steps: int, size: int, partition_bytes: int) -> dict:
    """Push ``steps`` integer-valued gradients (rank+1+step mod 7) of ``size`` float32; SGD lr=1."""
    config = ClientConfig(partition_bytes=partition_bytes, timeout=60)
    with psrt.Client(servers, rank=rank, num_workers=workers, config=config) as client:
        client.init({"w": np.zeros(size, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        for step in range(steps):
            grad = np.full(size, float((rank + 1 + step) % 7), np.float32)
            grad[::3] = -1.0
            if step % 2:
                client.push({"w": grad})
            else:
                client.push_pull({"w": grad})
    return {"rank": rank}


def async_pusher_expected(workers: int, steps: int, size: int) -> np.ndarray:
    """The parameters after every :func:`async_pusher` of W workers ran (from zeros, SGD lr=1): exact in float32."""
    expected = np.zeros(size, np.float64)
    for r in range(workers):
        for step in range(steps):
            g = np.full(size, float((r + 1 + step) % 7))
            g[::3] = -1.0
            expected -= g
    return expected.astype(np.float32)


def sync_slice(servers: list[str], rank: int, workers: int, steps: int, seed: int, optimizer: dict) -> dict:
    """Least squares on this worker's slice of a fixed batch; returns the final parameters."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((workers * 16, 40))
    y = rng.standard_normal(workers * 16)
    xs, ys = x[rank::workers], y[rank::workers]
    opt = psrt.optim.from_wire(optimizer)
    with psrt.Client(servers, rank=rank, num_workers=workers, config=ClientConfig(partition_bytes=128)) as client:
        p = client.init({"w": np.zeros(40), "b": np.zeros(1)}, optimizer=opt)
        for _ in range(steps):
            r = xs @ p["w"] + p["b"][0] - ys
            p = client.push_pull({"w": xs.T @ r / len(ys), "b": np.array([r.mean()])})
        stats = client.stats()
    return {"w": p["w"].tolist(), "b": p["b"].tolist(), "stats": stats}


def ride(servers: Optional[list[str]], rank: int, workers: int, steps: int, step_s: float,
         settle: bool = False, plain: bool = False) -> dict:
    """A worker whose every push is recognisable: push (rank, step) adds W at index rank*T + step of ``w``.

    With SGD lr=1 in sync mode over W workers, each applied push moves its own index of ``w`` by exactly -1: after
    training, an index at 0 is a push lost, -1 applied once, -2 applied twice. Returns the counts, the longest
    step, and per rank the steps whose push was lost. ``servers`` None: join the job of the scheduler in
    ``PSRT_SCHEDULER``. ``settle`` (async mode, under a scheduler): every worker's pushes are in before the final
    pull (a barrier first). ``plain``: each step a ``push`` then a ``pull`` (acknowledged as it arrives, the push
    leaves the pull to wait for its round) instead of one ``push_pull``.
    """
    size = workers * steps
    gaps, last = [], None
    with psrt.Client(servers, rank=rank, num_workers=workers, config=ClientConfig(timeout=60)) as client:
        client.init({"w": np.zeros(size, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        grad = np.zeros(size, np.float32)
        for step in range(steps):
            grad[:] = 0
            grad[rank * steps + step] = workers
            if plain:
                client.push({"w": grad})
                client.pull(["w"])
            else:
                client.push_pull({"w": grad})
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            if step == 0:
                print("training", flush=True)
            time.sleep(step_s)
        if settle:
            client.barrier()
        final = client.pull()["w"]
        if servers is None:
            client.barrier()  # nobody says done (ending the job) before everyone has pulled
    values, counts = np.unique(final, return_counts=True)
    lost = {r: [int(s) for s in np.flatnonzero(final[r * steps:(r + 1) * steps] == 0)] for r in range(workers)}
    return {"rank": rank, "counts": {str(float(v)): int(c) for v, c in zip(values, counts)}, "max_gap": max(gaps),
            "lost": lost}


# ---------------------------------------------------------------------------------------------- under a scheduler
def scheduled(steps: int = 3, exit_code: int = 0) -> dict:
    """Finds everything through the scheduler (``psrt.Client()`` with no arguments) and trains ``steps`` sync
    rounds; worker 1 exits with ``exit_code`` at once when it is not 0 (the launcher must stop everything)."""
    with psrt.Client() as client:
        if exit_code and client.rank == 1:
            sys.exit(exit_code)
        params = client.init({"w": np.zeros(100_000, np.float32), "b": np.zeros(3, np.float32)},
                             optimizer=psrt.SGD(lr=1.0))
        client.barrier()
        for _ in range(steps):
            grads = {"w": np.full(100_000, client.rank + 1, np.float32), "b": np.ones(3, np.float32)}
            params = client.push_pull(grads)
        client.barrier()
    return {"rank": client.rank, "num_workers": client.num_workers, "servers": client.servers,
            "w0": float(params["w"][0]), "b0": float(params["b"][0]),
            "threads": {name: os.environ.get(name) for name in THREAD_VARIABLES}}


def liveness(steps: int, step_s: float, die_at: str = "") -> dict:
    """Trains until told otherwise, then reports how its job ended.

    Prints ``training`` once its first step is done, then pushes and pulls every ``step_s`` seconds until ``steps``
    steps are done or psrt raises: ``error`` (the exception's type), ``message`` and ``at`` (``time.time()``) say
    which. ``die_at="RANK:STEP"``: that worker kills itself (SIGKILL) after that step, as a crash would.
    """
    result = {"error": None, "message": "", "at": 0.0, "steps": 0, "max_gap": 0.0, "rank": -1}
    die = die_at.split(":")
    try:
        with psrt.Client() as client:
            result["rank"] = client.rank
            start = client.init({"w": np.zeros(1000, np.float32)}, optimizer=psrt.SGD(lr=0.1))
            result["init_w0"] = float(start["w"][0])
            last = None
            for step in range(steps):
                params = client.push_pull({"w": np.ones(1000, np.float32)})
                now = time.monotonic()
                if last is not None:  # the longest wait for one step: a stall shows here
                    result["max_gap"] = max(result["max_gap"], now - last)
                last = now
                result["steps"] = step + 1
                result["w0"] = float(params["w"][0])
                if step == 0:
                    print("training", flush=True)
                if len(die) == 2 and int(die[0]) == client.rank and int(die[1]) == step:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(step_s)
    except psrt.PsrtError as exc:
        result.update(error=type(exc).__name__, message=str(exc), at=time.time())
    return result


def crash(steps: int, how: str = "-1:0:none", tensors: str = "dense") -> dict:
    """Trains with push_pull while one rank misbehaves as ``how`` says: ``RANK:STEP:WHAT``.

    Worker RANK, after STEP steps, does WHAT: ``raise`` (an uncaught RuntimeError, client left open), ``raise-with``
    (the same inside ``with psrt.Client()``), ``raise-with-torch`` (the same inside ``with
    psrt.torch.DistributedOptimizer(...)``, which made the client), ``exit-N`` (``sys.exit(N)``, client left open),
    ``return`` (the script simply ends, client left open), ``finish`` (close the client and end, as a worker with
    fewer steps would). ``tensors="rows"`` adds an embedding table to every step. Prints ``training`` after the
    first step, and ``done STEPS`` at a normal end.
    """
    rank_s, step_s, what = (how.split(":") + [""])[:3]
    bad_rank, bad_step = int(rank_s), int(step_s)
    rows = tensors == "rows"
    opt = None
    if what == "raise-with-torch":
        import torch

        from psrt.torch import DistributedOptimizer

        opt = DistributedOptimizer(torch.nn.Linear(2, 1).named_parameters(), optimizer=psrt.SGD(lr=0.1))
        client = opt.client
    else:
        client = psrt.Client()
    LEFT_OPEN.append(client)
    if client.rank == bad_rank and what.startswith("raise-with"):
        scope = client if opt is None else opt
    else:
        scope = client if client.rank != bad_rank else contextlib.nullcontext()
    with scope:
        client.init({"w": np.zeros(1000, np.float32)}, optimizer=psrt.SGD(lr=0.1))
        if rows:
            client.init_embedding("t", dim=4, optimizer=psrt.SGD(lr=0.1), init="zeros")
        for step in range(steps):
            if client.rank == bad_rank and step == bad_step:
                if what.startswith("raise"):
                    raise RuntimeError("user bug in the training script")
                if what.startswith("exit-"):
                    sys.exit(int(what.split("-")[1]))
                if what == "finish":
                    client.close()
                break
            client.push_pull({"w": np.ones(1000, np.float32)})
            if rows:
                client.push_rows("t", np.array([1, 2]), np.ones((2, 4), np.float32))
                client.pull_rows("t", np.array([1, 2]))
            if step == 0:
                print("training", flush=True)
        else:
            print(f"done {steps}", flush=True)
    return {"rank": client.rank}


def secure() -> dict:
    """Trains 3 sync rounds in a job with keys (``PSRT_KEYS``), and tries the job's shards without them."""
    keys = os.environ["PSRT_KEYS"]
    mode = stat.S_IMODE(os.stat(keys).st_mode)
    with psrt.Client() as client:
        params = client.init({"w": np.zeros(4, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        for _ in range(3):
            params = client.push_pull({"w": np.full(4, client.rank + 1, np.float32)})
        try:  # the job's shards must refuse a client without the keys
            with psrt.Client(client.servers, config=ClientConfig(timeout=5.0, keys="")) as intruder:
                intruder.stats()
            refused = False
        except psrt.AuthenticationError:
            refused = True
        client.barrier()
    return {"rank": client.rank, "keys": keys, "mode": mode, "w0": float(params["w"][0]), "refused": refused}


def momentum(steps: int) -> dict:
    """``steps`` SGD-momentum steps on two tensors; per tensor: its first value at init, at the end, and whether
    every entry ended equal."""
    with psrt.Client() as c:
        zeros = {"a": np.zeros(1000, np.float32), "b": np.zeros(1000, np.float32)}
        start = c.init(zeros, optimizer=psrt.SGD(lr=0.5, momentum=0.5))
        for _ in range(steps):
            c.push_pull({"a": np.ones(1000, np.float32), "b": np.full(1000, 2.0, np.float32)})
        end = c.pull()
    return {n: [float(start[n][0]), float(end[n][0]), bool((end[n] == end[n][0]).all())] for n in ("a", "b")}


def split_steps(servers: list[str], rank: int, workers: int, size: int, steps: int, calls: str) -> dict:
    """``steps`` steps of worker ``rank`` on a tensor of ``size`` float32 (cut into pieces over a network) and a
    small one, SGD lr=1, gradient ``rank + 1`` everywhere: ``push_pull``, or ``push`` then ``pull``. Each read's
    first and last value of both tensors and whether it was uniform, and the shards' counts of pushes."""
    grads = {"big": np.full(size, rank + 1.0, np.float32), "small": np.full(1000, rank + 1.0, np.float32)}
    reads = []
    with psrt.Client(servers, rank=rank, num_workers=workers, config=ClientConfig(timeout=60)) as c:
        c.init({n: np.zeros(g.size, np.float32) for n, g in grads.items()}, optimizer=psrt.SGD(lr=1.0))
        for _ in range(steps):
            if calls == "push_pull":
                p = c.push_pull(grads)
            else:
                c.push(grads)
                p = c.pull()
            reads.append({n: [float(a[0]), float(a[-1]), bool((a == a[0]).all())] for n, a in p.items()})
        pushes = sum(s["pushes"] for s in c.stats())
    return {"rank": rank, "reads": reads, "pushes": pushes}


# ---------------------------------------------------------------------------------------------- shared memory
def lane_probe(servers: list[str], size: int = 300_000, steps: int = 1, value: float = 1.0,
               keys: bool = False) -> dict:
    """``steps`` push_pulls of ``value`` (SGD lr=1) on a tensor above the lane threshold: the first and last
    parameter, and the shard's count of bytes that came through shared memory and of pushes (``keys``: and of the
    keys it holds)."""
    with psrt.Client(servers, config=ClientConfig(timeout=30)) as c:
        c.init({"w": np.zeros(size, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        for _ in range(steps):
            p = c.push_pull({"w": np.full(size, value, np.float32)})
        s = c.stats()[0]
    return {"first": float(p["w"][0]), "last": float(p["w"][-1]), "shm_bytes_in": s["shm_bytes_in"],
            "pushes": s["pushes"], **({"keys": s["keys"]} if keys else {})}


def slow_link(servers: list[str], size: int) -> dict:
    """Initialize a tensor of ``size`` float32 values, one message each way (run it with ``PSRT_PIPELINE=off``:
    the shard answers ``init`` with the parameters it holds); how long it took, and whether they came back exact."""
    w = np.arange(size, dtype=np.float32)
    with psrt.Client(servers, config=ClientConfig(timeout=120)) as c:
        t0 = time.monotonic()
        got = c.init({"w": w}, optimizer=psrt.SGD(lr=1.0))["w"]
        took = time.monotonic() - t0
    return {"exact": bool(np.array_equal(got, w)), "init_s": took}


# ---------------------------------------------------------------------------------------------- bounded staleness
def ssp(servers: list[str], rank: int, workers: int, steps: int, step_s: float, pattern: str = "dense") -> dict:
    """``steps`` steps, each pushing the gradient rank+1 and pulling, sleeping ``step_s`` after each, in one of
    several push patterns.

    Patterns: ``dense`` (one push_pull of tensor "a"), ``rows`` (push_rows then pull_rows of a table), and, over two
    tensors "a" and "b": ``apart`` (push a, push b, then pull both), ``backward`` (push b, then a, as a framework's
    backward does, then pull), ``subset`` (push a every step, b every other step, then pull both), ``async``
    (non-blocking pushes of a and b overlapped, then a non-blocking pull). Returns per step the wall-clock time
    before the step's first push was sent and after its pull returned, and the final values.
    """
    ids = np.array([3, 7], np.int64)
    before, after = [], []

    def g() -> np.ndarray:
        return np.full(8, rank + 1, np.float32)

    with psrt.Client(servers, rank=rank, num_workers=workers) as client:
        if pattern == "rows":
            client.init_embedding("t", dim=4, optimizer=psrt.SGD(lr=1.0), init="zeros")
        else:
            client.init({"a": np.zeros(8, np.float32), "b": np.zeros(8, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        for step in range(steps):
            before.append(time.time())
            if pattern == "rows":
                client.push_rows("t", ids, np.full((2, 4), rank + 1, np.float32))
                client.pull_rows("t", ids)
            elif pattern == "dense":
                client.push_pull({"a": g()})
            elif pattern in ("apart", "backward"):
                for name in ("a", "b") if pattern == "apart" else ("b", "a"):
                    client.push({name: g()})
                client.pull(["a", "b"])
            elif pattern == "subset":
                client.push({"a": g()})
                if step % 2 == 0:
                    client.push({"b": g()})
                client.pull(["a", "b"])
            else:  # async
                handles = [client.push_async({"a": g()}), client.push_async({"b": g()})]
                for h in handles:
                    h.wait()
                client.pull_async(["a", "b"]).wait()
            after.append(time.time())
            time.sleep(step_s)
        if pattern == "rows":
            final = {"a": client.pull_rows("t", ids).reshape(-1)[:8].tolist()}
        else:
            final = {k: v.tolist() for k, v in client.pull().items()}
    return {"rank": rank, "before": before, "after": after, "w": final}


# ---------------------------------------------------------------------------------------------- with torch
def make_cnn(seed: int) -> Any:
    """A small float64 CNN on 8x8 single-channel images, 10 classes."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(8 * 4 * 4, 10),
    ).double()


def batches(steps: int, size: int = 32) -> list[tuple[Any, Any]]:
    """The same ``steps`` batches of (images, labels) in every process."""
    import torch

    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(size, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (size,), generator=g))
            for _ in range(steps)]


def torch_cnn(servers: list[str], rank: int, workers: int, steps: int, out: str, lr: float, momentum: float,
              weight_decay: float, overlap: bool = True, overlap_forward: bool = False,
              synchronize: bool = False) -> dict:
    """Trains :func:`make_cnn` with :class:`psrt.torch.DistributedOptimizer` on its half of every batch and saves
    its initial and final parameters to the ``.npz`` file ``out``, read right after the loop (after
    ``opt.synchronize()`` only if ``synchronize`` is true)."""
    import torch

    import psrt.torch

    model = make_cnn(100 + rank)  # a different start per worker: the first init wins
    opt = psrt.torch.DistributedOptimizer(
        model.named_parameters(), optimizer=psrt.SGD(lr=lr, momentum=momentum, weight_decay=weight_decay),
        client=psrt.Client(servers, rank=rank, num_workers=workers), overlap=overlap,
        overlap_forward=overlap_forward)
    initial = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in batches(steps):
        opt.zero_grad()
        loss_fn(model(x[rank::workers]), y[rank::workers]).backward()
        opt.step()
    if synchronize:
        opt.synchronize()
    final = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    np.savez(out, **{f"initial/{k}": v for k, v in initial.items()}, **{f"final/{k}": v for k, v in final.items()})
    opt.close()
    opt.client.close()
    return {"rank": rank}


def click_batch(step: int, size: int, bag: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The click model's whole batch at ``step``: ``(size, bag)`` ids with hot ids repeating, and 0/1 labels."""
    rng = np.random.default_rng(1000 + step)
    ids = (rng.zipf(1.3, (size, bag)) - 1) % vocab
    return ids.astype(np.int64), rng.integers(0, 2, size).astype(np.float32)


def click_loss(rows: Any, w: Any, b: Any, labels: Any, bag: int) -> Any:
    """Mean-pooled bags, a linear head, binary cross-entropy (the mean over the samples given)."""
    import torch

    pooled = rows.view(-1, bag, rows.shape[-1]).mean(1)
    return torch.nn.functional.binary_cross_entropy_with_logits(pooled @ w + b, labels)


def embedding_clicks(servers: list[str], rank: int, workers: int, bag: int, size: int, vocab: int, steps: int,
                     lr: float, init: str, out: str) -> dict:
    """An EmbeddingBag-style click model, rows and dense head on psrt: worker ``rank`` of W trains on its slice of
    every batch (:func:`click_batch`), from the ``.npz`` file ``init``; rank 0 writes the final rows and dense
    weights to ``out``."""
    import torch

    start = np.load(init)
    opt = psrt.AdaGrad(lr=lr)
    with psrt.Client(servers, rank=rank, num_workers=workers, config=ClientConfig(timeout=60)) as c:
        c.init_embedding("items", dim=start["emb"].shape[1], optimizer=opt, initial=start["emb"])
        dense = c.init({"w": start["w"], "b": start["b"]}, optimizer=opt)
        per = size // workers
        for step in range(steps):
            ids, labels = click_batch(step, size, bag, vocab)
            ids, labels = ids[rank * per:(rank + 1) * per].reshape(-1), labels[rank * per:(rank + 1) * per]
            rows = torch.from_numpy(c.pull_rows("items", ids)).requires_grad_()
            w, b = (torch.from_numpy(dense[k]).requires_grad_() for k in ("w", "b"))
            click_loss(rows, w, b, torch.from_numpy(labels), bag).backward()
            pushed = c.push_rows_async("items", ids, rows.grad.numpy())
            dense = c.push_pull({"w": w.grad.numpy(), "b": b.grad.numpy()})
            pushed.wait()
        if rank == 0:
            final = c.pull_rows("items", np.arange(vocab))
            np.savez(out, emb=final, w=dense["w"], b=dense["b"])
    return {"rank": rank}


def virtual_crash(fail_rank: int, steps: int = 1000) -> dict:
    """``PSRT_CLIENTS`` workers on threads of this process, as ``psrt worker --clients`` runs them
    (:func:`psrt.emulation.loadgen._run_together`), ranks from ``PSRT_WORKER_ID`` on; the worker of rank
    ``fail_rank`` raises at its fourth step, the others push_pull until the job's end reaches them."""
    from psrt.config import ClusterConfig
    from psrt.emulation.loadgen import _run_together

    cluster = ClusterConfig.from_env()
    first = cluster.worker_id or 0

    def worker(rank: int) -> Callable[[], dict]:
        def run() -> dict:
            with psrt.Client(rank=rank) as c:
                c.init({"w": np.zeros(8, np.float32)}, optimizer=psrt.SGD(lr=0.1))
                for step in range(steps):
                    if rank == fail_rank and step == 3:
                        raise RuntimeError(f"worker {rank} fails on purpose")
                    c.push_pull({"w": np.ones(8, np.float32)})
            return {"rank": rank}
        return run

    _run_together([worker(first + i) for i in range(cluster.clients)])  # raises the first worker's error
    return {"rank": first}


def virtual_vanish(vanish_rank: int, steps: int = 100_000, step_s: float = 0.01) -> dict:
    """``PSRT_CLIENTS`` workers on threads of this process; at its fifth step the worker of rank ``vanish_rank``
    goes silent (its heartbeat stops, its thread hangs) while the process lives on, as a virtual worker that died
    inside a healthy process would. It prints ``vanished AT`` (``time.time()``); every other worker trains until psrt
    raises and prints its own result line (``error``, ``message``, ``at``). Returns once the others have ended."""
    import threading

    from psrt.config import ClusterConfig

    cluster = ClusterConfig.from_env()
    first = cluster.worker_id or 0
    lock = threading.Lock()

    def run(rank: int) -> None:
        result = {"rank": rank, "error": None, "message": "", "at": 0.0}
        try:
            c = psrt.Client(rank=rank)
            LEFT_OPEN.append(c)  # the vanished one is closed only by the interpreter's exit
            c.init({"w": np.zeros(8, np.float32)}, optimizer=psrt.SGD(lr=0.1))
            for step in range(steps):
                if rank == vanish_rank and step == 5:
                    c._heartbeat.stop()
                    print(f"vanished {time.time()}", flush=True)
                    time.sleep(60)
                    return
                c.push_pull({"w": np.ones(8, np.float32)})
                time.sleep(step_s)
        except psrt.PsrtError as exc:
            result.update(error=type(exc).__name__, message=str(exc), at=time.time())
        with lock:
            print(result_line(result), flush=True)

    threads = [threading.Thread(target=run, args=(first + i,), daemon=True) for i in range(cluster.clients)]
    for t in threads:
        t.start()
    for i, t in enumerate(threads):
        if first + i != vanish_rank:  # the vanished one hangs: the process ends without it
            t.join()
    return {"rank": -1, "error": "the workers ended"}  # the process's own line: its exit code is 1


def replicated(steps: int, step_s: float, out: str) -> dict:
    """Sync training under a scheduler with SGD and momentum and deterministic gradients (a function of the rank
    and the step alone), over tensors that both of two shards hold parts of; prints ``step N`` after each step,
    saves the final parameters in ``out`` (an .npz) and returns the longest step."""
    gaps, last = [], None
    with psrt.Client(config=ClientConfig(timeout=60)) as client:
        rank = client.rank
        shapes = {"big": (600_000,), "small": (1000,), "mid": (70_000,)}
        client.init({n: np.linspace(-1, 1, s[0], dtype=np.float32) for n, s in shapes.items()},
                    optimizer=psrt.SGD(lr=0.05, momentum=0.9))
        grads = {n: np.empty(s, np.float32) for n, s in shapes.items()}
        base = {n: np.sin(np.arange(s[0], dtype=np.float32) * 0.001) for n, s in shapes.items()}
        for step in range(steps):
            for n, g in grads.items():
                np.multiply(base[n], np.float32((rank + 1) * np.cos(step * 0.1)), out=g)
            client.push_pull(grads)
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            print(f"step {step}", flush=True)
            time.sleep(step_s)
        final = client.pull()
        client.barrier()
    np.savez(out, **final)
    return {"rank": rank, "max_gap": max(gaps), "steps": steps}


def replicated_rows(steps: int, step_s: float, out: str, admit_after: int = 1, capacity: Optional[int] = None,
                    vocab: int = 600, pause: float = 0.0) -> dict:
    """Sync training of an embedding table under a scheduler (AdaGrad), rows spread over every shard: each step
    pulls and pushes the same ids on every worker (a function of the step), with gradients a function of the
    rank, the step and the id (of the step and the id alone with ``admit_after`` or ``capacity``, whose choices
    then do not depend on which worker's push came first). Prints ``step N`` after each step (and waits ``step_s``
    + ``pause``); saves the final rows of every id in ``out`` (an .npz)."""
    gaps, last = [], None
    with psrt.Client(config=ClientConfig(timeout=60)) as client:
        rank = client.rank
        client.init_embedding("emb", 8, psrt.AdaGrad(lr=0.1), seed=3, admit_after=admit_after, capacity=capacity)
        by_rank = admit_after == 1 and capacity is None
        for step in range(steps):
            ids = np.random.default_rng(step).integers(0, vocab, 96)
            rows = client.pull_rows("emb", ids)
            scale = np.float32((rank + 1 if by_rank else 1) * np.cos(step * 0.1))
            grads = (np.sin(ids[:, None] * 0.01 + np.arange(8)) * scale).astype(np.float32) + rows * np.float32(0.1)
            client.push_rows("emb", ids, grads)
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            print(f"step {step}", flush=True)
            time.sleep(step_s + pause)
        client.barrier()
        final = client.pull_rows("emb", np.arange(vocab))
        client.barrier()
    np.savez(out, emb=final)
    return {"rank": rank, "max_gap": max(gaps), "steps": steps}


def ride_rows(steps: int, step_s: float, workers: int) -> dict:
    """Async pushes of an embedding table under a scheduler, each recognisable: push (rank, step) gives the row of
    id rank*T + step a gradient of ones (SGD lr=1, rows start at 0), so after training a row at 0 is a push lost,
    -1 applied once, -2 twice. Prints ``training`` after the first push; returns the counts of the final values."""
    with psrt.Client(config=ClientConfig(timeout=60)) as client:
        rank = client.rank
        client.init_embedding("emb", 2, psrt.SGD(lr=1.0), init="zeros")
        for step in range(steps):
            client.push_rows("emb", np.array([rank * steps + step]), np.ones((1, 2), np.float32))
            if step == 0:
                print("training", flush=True)
            time.sleep(step_s)
        client.barrier()
        final = client.pull_rows("emb", np.arange(workers * steps))
        client.barrier()
    values, counts = np.unique(final, return_counts=True)
    return {"rank": rank, "counts": {str(float(v)): int(c) for v, c in zip(values, counts)}}


def backup_rounds(rounds: int, step_s: float, slow_s: float) -> dict:
    """Sync training under a scheduler by the job's round (``while client.round < rounds``) with identical
    gradients g on every worker and plain SGD, over tensors spread on every shard; the last rank sleeps a further
    ``slow_s`` a step (a straggler). Prints ``step N`` after each step; returns whether every answer held
    -lr x v x g for each tensor's version v (the exact rule of backup workers), the round, steps, dropped
    pushes and the b each shard serving a range says it runs with (from the shards' stats)."""
    from psrt.control.metrics import per_worker

    lr = 0.125  # a power of two: -lr * v * g is exact in float32
    names = [f"t{i}" for i in range(8)]
    with psrt.Client(config=ClientConfig(timeout=60)) as client:
        rank = client.rank
        g = {n: np.full(64, 1.0 + i, np.float32) for i, n in enumerate(names)}
        client.init({n: np.zeros(64, np.float32) for n in names}, optimizer=psrt.SGD(lr=lr))
        client.barrier()
        slow = rank == client.num_workers - 1
        steps, exact, versions = 0, True, {}
        while client.round < rounds:
            time.sleep(step_s + (slow_s if slow else 0.0))
            got = client.push_pull(g)
            versions = {key[0]: v for held in client._calls.versions.held for key, v in held.items()}
            exact = exact and all(np.array_equal(got[n], np.float32(-lr * versions[n]) * g[n]) for n in names)
            steps += 1
            print(f"step {steps}", flush=True)
        stats = client.stats()
        dropped = sum(per_worker(s).get(rank, {}).get("dropped", 0) for s in stats)
        backup = ["auto" if s.get("backup_auto") else str(s.get("backup_workers")) for s in stats]
        final = client.round
        client.barrier()
    return {"rank": rank, "round": final, "steps": steps, "exact": bool(exact), "dropped": dropped,
            "backup": backup, "versions": sorted(set(versions.values()))}


ROLES: dict[str, Callable[..., dict]] = {f.__name__: f for f in (
    async_pusher, sync_slice, ride, scheduled, liveness, crash, secure, momentum, split_steps, lane_probe,
    slow_link, ssp, torch_cnn, embedding_clicks, virtual_crash, virtual_vanish, replicated, replicated_rows,
    ride_rows, backup_rounds)}


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or argv[1] not in ROLES:
        print(f"usage: python {argv[0]} ROLE [JSON_ARGS]; ROLE is one of {', '.join(ROLES)}", file=sys.stderr)
        return 2
    result = ROLES[argv[1]](**(json.loads(argv[2]) if len(argv) == 3 else {}))
    print(result_line(result), flush=True)
    return 1 if result.get("error") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
