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

``overlap = True`` (``psrt worker --overlap``) emulates what a framework's step overlaps, with the pipeline
:mod:`psrt.torch` uses (:class:`psrt.worker.overlap.Pipeline`). A step's compute is a forward pass of
:data:`FORWARD_SHARE` (1/3) of ``compute_ms`` and a backward pass of the rest (a backward computes the gradients of
both a layer's inputs and its weights: about twice a forward's work), and each pass is spread over the model's
tensors in proportion to their bytes (a dense layer's work grows with its weights). Backward goes last layer first:
after each tensor's share of backward its gradient is handed to the pipeline, which pushes it at once (at most
:data:`~psrt.worker.overlap.DEFAULT_WINDOW` bytes in flight, the first layers' first when several wait) and asks
for its pull the moment the push is acknowledged. The next forward goes first layer first and waits for each
tensor's new parameters just before its share of forward: the last layers' pulls still travel while the first
layers compute. With ``--compute sleep`` the pipeline keeps moving while the compute sleeps (as a framework's
communication thread would, a GPU computing meanwhile); with ``--compute numpy`` it moves between the tensors'
shares only (as :mod:`psrt.torch`'s hooks do, on the one training thread). The timed steps end once the last
step's parameters are all in. A step then costs about max(compute, communication) instead of their sum, when the
model has several tensors (``layers = N``, ``psrt worker --layers N``, splits a sized model into N). Each tensor is
still pushed once a step, so a sync job takes the same rounds, to the same parameters, as without overlap.
"""

from __future__ import annotations

import json
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
from psrt.worker.overlap import DEFAULT_WINDOW, Pipeline, Slot

__all__ = ["run_worker", "FORWARD_SHARE"]

#: The part of a step's compute that is the forward pass, with ``overlap``; backward takes the rest.
FORWARD_SHARE = 1 / 3


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
               num_workers: Optional[int] = None, lr: float = 1e-3, clients: int = 1, overlap: bool = False,
               layers: Optional[int] = None, window: Optional[int] = None,
               trace: Optional[str] = None) -> list[dict[str, Any]]:
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
    overlap : bool
        Push each tensor from an emulated backward and wait for each one's parameters in the next forward,
        first layers first (module docstring); False: compute, then one ``push_pull`` of every tensor.
    layers : int, optional
        Split a sized model into this many tensors of equal size (default: one per 4 MiB).
    window : int, optional
        With ``overlap``: at most this many gradient bytes in flight at a time (at least one tensor; default
        :data:`~psrt.worker.overlap.DEFAULT_WINDOW`). A window smaller than the model keeps the later gradients
        queued, so the first layers' (needed first by the next forward) overtake them, as a framework's priority
        scheduling of its communication does.
    trace : str, optional
        With ``overlap``: write every worker's pipeline events (:attr:`psrt.worker.overlap.Pipeline.trace`, and
        each step's start) to this JSON file at the end, for :mod:`psrt.emulation.trace` to read; to
        ``trace-PID.json`` in it when it is a folder (the copies ``psrt launch`` starts share their arguments).

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
    if not isinstance(overlap, bool):
        raise ConfigError(f"overlap must be True or False, got {overlap!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"--window must be a positive number of bytes, got {window!r}")
    if window is not None and not overlap:
        raise ConfigError("--window sets the bytes --overlap keeps in flight: give --overlap too, or leave --window "
                          "out")
    if trace is not None and not overlap:
        raise ConfigError("--trace notes the events of --overlap's pipeline: give --overlap too, or leave --trace out")
    shapes = model_tensors(model, layers=layers)
    params = {name: np.zeros(shape, np.float32) for name, shape in shapes}
    grads = {name: np.full(shape, 1e-3, np.float32) for name, shape in shapes}  # shared: read, never written
    loop = _Loop(model, shapes, params, grads, compute_ms, steps, warmup, compute, lr, barriers=servers is None,
                 overlap=overlap, window=window, traced=trace is not None)
    ranks = [None if rank is None else rank + i for i in range(clients)]
    if clients == 1:
        results = [loop.run(servers, ranks[0], num_workers)]
    else:
        _allow_open_files()
        results = _run_together([lambda r=r: loop.run(servers, r, num_workers) for r in ranks])
    if trace is not None:
        if os.path.isdir(trace):  # several processes (psrt launch's copies) given one folder: a file each
            trace = os.path.join(trace, f"trace-{os.getpid()}.json")
        with open(trace, "w") as f:
            json.dump({"pid": os.getpid(), "model": model, "compute_ms": compute_ms, "tensors": loop.names,
                       "workers": sorted(loop.traces, key=lambda w: w["rank"])}, f)
    return results


def _allow_open_files() -> None:
    """Raise this process's open-file limit to its hard limit: each client holds a few sockets per shard (each
    socket a file descriptor, its connections more), so hundreds of workers pass a common soft limit of 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass  # an infinite hard limit the kernel caps lower: the soft limit stays, and so may fit


class _Loop:
    """One worker's load-test loop (several run at once on threads with ``clients > 1``; they share only what
    they read)."""

    def __init__(self, model: str, shapes: list[tuple[str, tuple[int, ...]]], params: dict[str, np.ndarray],
                 grads: dict[str, np.ndarray], compute_ms: float, steps: int, warmup: int, compute: str, lr: float,
                 barriers: bool, overlap: bool = False, window: Optional[int] = None, traced: bool = False) -> None:
        self.model, self.params, self.grads = model, params, grads
        self.names = [name for name, _ in shapes]  # forward order
        self.first = shapes[0][0]
        self.nbytes = model_bytes(shapes)
        self.overlap = overlap
        self.window = DEFAULT_WINDOW if window is None else window
        # Each tensor's part of a pass's compute: its part of the model's bytes.
        self.shares = [params[name].nbytes / max(1, self.nbytes) for name in self.names]
        self.compute_ms, self.steps, self.warmup, self.compute, self.lr = compute_ms, steps, warmup, compute, lr
        # With explicit shards there is no scheduler to meet at; sync rounds keep step.
        self.barriers = barriers
        self.print_lock = threading.Lock()
        self.traced = traced
        self.traces: list[dict[str, Any]] = []  # with traced: each worker's rank and pipeline events

    def _step(self, client: psrt.Client, scratch: np.ndarray) -> dict[str, np.ndarray]:
        if self.compute == "sleep":
            time.sleep(self.compute_ms / 1000.0)
        else:
            _busy(self.compute_ms / 1000.0, scratch)
        return client.push_pull(self.grads)

    def _overlapped_step(self, pipe: Pipeline, scratch: np.ndarray) -> None:
        """A forward that waits for each tensor's parameters just before its share, then a backward that hands
        each tensor's gradient to the pipeline once its share is computed, last layer first."""
        if pipe.trace is not None:
            pipe.trace.append((time.time(), "step", ""))
        compute_s = self.compute_ms / 1000.0
        forward = compute_s * FORWARD_SHARE
        backward = compute_s - forward
        due = time.perf_counter()  # when the compute so far is done
        for s in pipe.slots:
            blocked = not pipe.ready(s)
            pipe.wait_for(s)
            if blocked:  # the compute waited for these parameters: it goes on from now
                due = max(due, time.perf_counter())
            due = self._compute(due, forward * self.shares[s.index], pipe, scratch)
        for s in reversed(pipe.slots):
            due = self._compute(due, backward * self.shares[s.index], pipe, scratch)
            pipe.enqueue(s, self.grads[s.name])
            pipe.pump()
        pipe.end_step()

    def _compute(self, due: float, seconds: float, pipe: Pipeline, scratch: np.ndarray) -> float:
        """``seconds`` more of compute after ``due``; returns when it is done. Sleeping, it ends on a deadline
        (the pipeline moving meanwhile, and a late wake-up taken from the next share); NumPy work takes its
        full time from now, whatever moving the bytes cost at the boundary."""
        if self.compute == "sleep":
            due += seconds
            pipe.idle(due)
            return due
        _busy(seconds, scratch)
        return time.perf_counter()

    def _run_step(self, client: psrt.Client, pipe: Optional[Pipeline],
                  scratch: np.ndarray) -> Optional[dict[str, np.ndarray]]:
        """One step: the parameters it pulled, or None when overlapped (they land in the pipeline's arrays)."""
        if pipe is None:
            return self._step(client, scratch)
        self._overlapped_step(pipe, scratch)
        return None

    def run(self, servers: Optional[Sequence[str]], rank: Optional[int], num_workers: Optional[int]) -> dict[str, Any]:
        """One worker, start to end: its result, printed."""
        scratch = np.ones(1 << 16, np.float32)
        with psrt.Client(servers, rank=rank, num_workers=num_workers) as client:
            stored = client.init(self.params, optimizer=psrt.SGD(lr=self.lr))
            # Overlapped, each worker's pulls land in its own arrays (init's, fresh for this client).
            pipe = Pipeline(client, [Slot(n, i, stored[n]) for i, n in enumerate(self.names)],
                            window=self.window) if self.overlap else None
            if pipe is not None and self.traced:
                pipe.trace = []
            if self.barriers:
                client.barrier()
            for _ in range(self.warmup):
                self._run_step(client, pipe, scratch)
            if pipe is not None:
                pipe.synchronize()  # the timed steps start with nothing in flight
            if self.barriers:
                client.barrier()
            if pipe is not None and pipe.trace is not None:
                pipe.trace.append((time.time(), "timed", ""))
            cpu0, t0, started_at = _cpu_seconds(), time.perf_counter(), time.time()
            for _ in range(self.steps):
                latest = self._run_step(client, pipe, scratch)
            if pipe is not None:
                pipe.synchronize()  # the last step ends when its parameters are in
                latest = stored
                if pipe.trace is not None:
                    pipe.trace.append((time.time(), "end", ""))
                    with self.print_lock:
                        self.traces.append({"rank": client.rank, "events": pipe.trace})
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
                "overlap": self.overlap,
                "tensors": len(self.names),
                "window": self.window if self.overlap else None,
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
