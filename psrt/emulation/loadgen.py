"""The load generator, a synthetic worker: ``psrt worker --model SIZE_OR_NAME --compute-ms MS --steps N``.

It trains nothing: each step it "computes" for ``compute_ms`` (sleeping, or doing real NumPy work with
``--compute numpy``), then pushes a gradient of the model's shape and pulls the parameters back
(``push_pull``). The model is a size (``"4MB"``: float32 tensors of at most the partition size) or the trainable
tensors of a real network (``resnet50``, ``vgg16``, ``bert-base``, shipped with psrt).

Workers first meet at a barrier, take ``warmup`` untimed steps, meet again, and then time ``steps`` steps. Each
prints one line ``psrt-worker-result {json}`` with its own steps/s (:func:`psrt.control.process.result_line`; read it
back with :func:`psrt.control.process.parse_results`); the job's throughput is their sum. The line's ``param0`` is
the first element of the model's first tensor after the worker's last step: in a sync job every worker's is the
same, to the bit.

``clients = N`` (``psrt worker --clients N``, ``PSRT_CLIENTS``) runs N workers in this process, each a full peer
on a thread of its own: its own :class:`psrt.Client` (rank, session, sequence numbers, heartbeat), its own push
of the model's gradient bytes every step (the N share one source array; the bytes travel once per worker), its own
result line. Nothing is aggregated before the shard, which sees N peers. They register together, so the job forms
with all of them; their emulated compute (``sleep``) overlaps as it would on N machines, while ``--compute
numpy`` shares this process's core. When one of them raises, its client tells the scheduler, the job ends, and
the process exits with the first error.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

import psrt
from psrt.config import ClusterConfig
from psrt.control.process import result_line
from psrt.emulation.models import model_bytes, model_tensors
from psrt.errors import ConfigError

__all__ = ["run_worker"]


def _busy(seconds: float, scratch: np.ndarray) -> None:
    """Real NumPy work for about ``seconds`` (a stand-in for a forward/backward pass)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        np.multiply(scratch, 1.0000001, out=scratch)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_worker(model: str, compute_ms: float, steps: int, warmup: int = 2, compute: str = "sleep",
               servers: Optional[Sequence[str]] = None, rank: Optional[int] = None,
               num_workers: Optional[int] = None, lr: float = 1e-3, clients: int = 1) -> list[dict[str, Any]]:
    """Run the load-test loop of ``clients`` workers; returns (and prints) each worker's result.

    Parameters
    ----------
    model : str
        A size such as ``"4MB"`` or a shipped network name.
    compute_ms : float
        Emulated compute per step, in milliseconds.
    steps, warmup : int
        Timed and untimed steps.
    compute : str
        ``"sleep"`` or ``"numpy"``.
    servers, rank, num_workers : optional
        Explicit shards; by default the scheduler from the environment is used. ``rank`` is the first worker's
        (the others take the ranks after it); by default the environment's ``PSRT_WORKER_ID``, or the scheduler's
        choice.
    lr : float
        SGD learning rate on the shards.
    clients : int
        Workers to run in this process, each a full peer (module docstring).

    Raises
    ------
    ConfigError
        On a bad argument, before any worker starts.
    Exception
        The first error a worker met (the others have then been ended by the job's end).
    """
    if compute not in ("sleep", "numpy"):
        raise ConfigError(f"--compute must be sleep or numpy, got {compute!r}")
    if steps < 1 or warmup < 0 or compute_ms < 0:
        raise ConfigError("--steps must be >= 1, --warmup >= 0 and --compute-ms >= 0")
    if isinstance(clients, bool) or not isinstance(clients, int) or clients < 1:
        raise ConfigError(f"--clients must be a whole number of workers >= 1, got {clients!r}")
    if rank is None:
        rank = 0 if servers is not None else ClusterConfig.from_env().worker_id
    if servers is not None and num_workers is not None and rank + clients > num_workers:
        raise ConfigError(f"--rank {rank} and --clients {clients} need --workers >= {rank + clients}, "
                          f"got {num_workers}")
    shapes = model_tensors(model)
    params = {name: np.zeros(shape, np.float32) for name, shape in shapes}
    grads = {name: np.full(shape, 1e-3, np.float32) for name, shape in shapes}  # shared: read, never written
    loop = _Loop(model, shapes, params, grads, compute_ms, steps, warmup, compute, lr, barriers=servers is None)
    ranks = [None if rank is None else rank + i for i in range(clients)]
    if clients == 1:
        return [loop.run(servers, ranks[0], num_workers)]
    return _run_together([lambda r=r: loop.run(servers, r, num_workers) for r in ranks])


class _Loop:
    """One worker's load-test loop (several run at once on threads with ``clients > 1``; they share only what
    they read)."""

    def __init__(self, model: str, shapes: list[tuple[str, tuple[int, ...]]], params: dict[str, np.ndarray],
                 grads: dict[str, np.ndarray], compute_ms: float, steps: int, warmup: int, compute: str, lr: float,
                 barriers: bool) -> None:
        self.model, self.params, self.grads = model, params, grads
        self.first = shapes[0][0]
        self.nbytes = model_bytes(shapes)
        self.compute_ms, self.steps, self.warmup, self.compute, self.lr = compute_ms, steps, warmup, compute, lr
        # With explicit shards there is no scheduler to meet at; sync rounds keep step.
        self.barriers = barriers
        self.print_lock = threading.Lock()

    def _step(self, client: psrt.Client, scratch: np.ndarray) -> dict[str, np.ndarray]:
        if self.compute == "sleep":
            time.sleep(self.compute_ms / 1000.0)
        else:
            _busy(self.compute_ms / 1000.0, scratch)
        return client.push_pull(self.grads)

    def run(self, servers: Optional[Sequence[str]], rank: Optional[int], num_workers: Optional[int]) -> dict[str, Any]:
        """One worker, start to end: its result, printed."""
        scratch = np.ones(1 << 16, np.float32)
        with psrt.Client(servers, rank=rank, num_workers=num_workers) as client:
            client.init(self.params, optimizer=psrt.SGD(lr=self.lr))
            if self.barriers:
                client.barrier()
            for _ in range(self.warmup):
                self._step(client, scratch)
            if self.barriers:
                client.barrier()
            cpu0, t0, started_at = _cpu_seconds(), time.perf_counter(), time.time()
            for _ in range(self.steps):
                latest = self._step(client, scratch)
            elapsed = time.perf_counter() - t0
            cpu = _cpu_seconds() - cpu0
            result = {
                "rank": client.rank,
                "num_workers": client.num_workers,
                "num_servers": len(client.servers),
                "model": self.model,
                "model_bytes": self.nbytes,
                "compute_ms": self.compute_ms,
                "steps": self.steps,
                "seconds": elapsed,
                "steps_per_s": self.steps / elapsed,
                "cpu_percent": 100.0 * cpu / elapsed,  # the process's: shared by the workers it runs
                "started_at": started_at,
                "ended_at": started_at + elapsed,
                "pid": os.getpid(),
                "param0": float(latest[self.first].reshape(-1)[0]),
            }
            if self.barriers:
                client.barrier()  # nobody leaves (and ends the job) while others are still timing
        with self.print_lock:  # one whole line per worker, never two interleaved
            print(result_line(result), flush=True)
        return result


def _run_together(workers: list[Callable[[], dict[str, Any]]]) -> list[dict[str, Any]]:
    """Run each worker on a thread of its own; their results in order, or the first error any of them met."""
    results: list[Optional[dict[str, Any]]] = [None] * len(workers)
    errors: list[tuple[float, int, BaseException]] = []

    def body(i: int) -> None:
        try:
            results[i] = workers[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            errors.append((time.monotonic(), i, exc))

    # Daemon threads: an interrupted process does not wait for them (their clients are closed at exit).
    threads = [threading.Thread(target=body, args=(i,), name=f"psrt-worker-{i}", daemon=True)
               for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise min(errors, key=lambda e: (e[0], e[1]))[2]
    return [r for r in results if r is not None]
