"""The load generator, a synthetic worker: ``psrt worker --model SIZE_OR_NAME --compute-ms MS --steps N``.

It trains nothing: each step it "computes" for ``compute_ms`` (sleeping, or doing real NumPy work with
``--compute numpy``), then pushes a gradient of the model's shape and pulls the parameters back
(``push_pull``). The model is a size (``"4MB"``: float32 tensors of at most the partition size) or the trainable
tensors of a real network (``resnet50``, ``vgg16``, ``bert-base``, shipped with psrt).

Workers first meet at a barrier, take ``warmup`` untimed steps, meet again, and then time ``steps`` steps. Each
prints one line ``psrt-worker-result {json}`` with its own steps/s (:func:`psrt.control.process.result_line`; read it
back with :func:`psrt.control.process.parse_results`); the job's throughput is their sum.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any, Optional, Sequence

import numpy as np

import psrt
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
               num_workers: Optional[int] = None, lr: float = 1e-3) -> dict[str, Any]:
    """Run the load-test loop; returns (and prints) this worker's result.

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
        Explicit shards; by default the scheduler from the environment is used.
    lr : float
        SGD learning rate on the shards.
    """
    if compute not in ("sleep", "numpy"):
        raise ConfigError(f"--compute must be sleep or numpy, got {compute!r}")
    if steps < 1 or warmup < 0 or compute_ms < 0:
        raise ConfigError("--steps must be >= 1, --warmup >= 0 and --compute-ms >= 0")
    shapes = model_tensors(model)
    params = {name: np.zeros(shape, np.float32) for name, shape in shapes}
    grads = {name: np.full(shape, 1e-3, np.float32) for name, shape in shapes}
    nbytes = model_bytes(shapes)
    scratch = np.ones(1 << 16, np.float32)
    seconds = compute_ms / 1000.0

    def step(client: psrt.Client) -> None:
        if compute == "sleep":
            time.sleep(seconds)
        else:
            _busy(seconds, scratch)
        client.push_pull(grads)

    def barrier(client: psrt.Client) -> None:
        if servers is None:  # with explicit shards there is no scheduler to meet at; sync rounds keep step
            client.barrier()

    with psrt.Client(servers, rank=rank, num_workers=num_workers) as client:
        client.init(params, optimizer=psrt.SGD(lr=lr))
        barrier(client)
        for _ in range(warmup):
            step(client)
        barrier(client)
        cpu0, t0, started_at = _cpu_seconds(), time.perf_counter(), time.time()
        for _ in range(steps):
            step(client)
        elapsed = time.perf_counter() - t0
        cpu = _cpu_seconds() - cpu0
        result = {
            "rank": client.rank,
            "num_workers": client.num_workers,
            "num_servers": len(client.servers),
            "model": model,
            "model_bytes": nbytes,
            "compute_ms": compute_ms,
            "steps": steps,
            "seconds": elapsed,
            "steps_per_s": steps / elapsed,
            "cpu_percent": 100.0 * cpu / elapsed,
            "started_at": started_at,
            "ended_at": started_at + elapsed,
            "pid": os.getpid(),
        }
        barrier(client)  # nobody leaves (and ends the job) while others are still timing
    print(result_line(result), flush=True)
    return result
