"""The torch.distributed.rpc baseline of ``bench/peers.py``: a batch-update parameter server.

The code follows the PyTorch tutorials "Implementing a Parameter Server Using Distributed RPC Framework" (an
``RRef`` to a parameter-server object, trainers calling a static method on its owner) and "Implementing Batch RPC
Processing Using Asynchronous Executions" (``BatchUpdateParameterServer``: a ``@rpc.functions.async_execution``
static method that sums each trainer's gradient into ``.grad`` under a lock and returns a future that completes,
with the updated parameters, once all trainers of the step have reported; the last one divides by the batch
size and runs ``optimizer.step()``). The only changes are the ones the workload needs: the single tensor is split
over several parameter-server ranks, so a trainer sends each half to its owner with ``rpc_async`` and waits for
both replies, and the gradients are constants instead of a model's backward pass.

This module imports torch at the top, so ``bench/peers.py`` imports it only when the torch baseline runs. Its
functions are the spawn target and the RPC targets; they must live in an importable module (the RPC pickler
refers to functions by name).
"""

from __future__ import annotations

import threading
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.distributed.rpc as rpc

__all__ = ["BatchUpdateParameterServer", "run_trainer", "run_ps", "run_rank", "run"]


class BatchUpdateParameterServer:
    """One shard of the parameters: the tutorial's ``BatchUpdateParameterServer`` holding a slice of the tensor.

    Parameters
    ----------
    workload : Workload
        The benchmark workload (``bench/peers.py``): initial values, learning rate, W and the shard bounds.
    shard : int
        Which contiguous slice of the tensor this server holds.
    """

    def __init__(self, workload: Any, shard: int) -> None:
        lo, hi = workload.bounds()[shard]
        self.weight = torch.nn.Parameter(torch.from_numpy(workload.initial()[lo:hi].copy()))
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = workload.workers
        self.curr_update_size = 0
        self.optimizer = torch.optim.SGD([self.weight], lr=workload.lr)
        self.weight.grad = torch.zeros_like(self.weight)

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref: rpc.RRef, grad: torch.Tensor) -> torch.futures.Future:
        """Add one trainer's gradient; the returned future completes with the parameters after the step."""
        self = ps_rref.local_value()
        with self.lock:
            self.curr_update_size += 1
            self.weight.grad += grad
            # Keep the future of this step: another thread may replace self.future_model before we return.
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                self.weight.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                # Completing the future answers every request of this step.
                fut.set_result(self.weight.detach())
                self.future_model = torch.futures.Future()
        return fut


def run_trainer(workload: Any, rank: int, ps_rrefs: list[rpc.RRef]) -> dict[str, Any]:
    """A trainer: one warm-up step, then ``workload.steps`` timed steps; returns its timing and weight check."""
    grad = torch.from_numpy(workload.gradient(rank))
    # One contiguous tensor per shard: RPC then sends exactly the shard's bytes.
    grads = [grad[lo:hi].clone() for lo, hi in workload.bounds()]

    def step() -> list[torch.Tensor]:
        futs = [
            rpc.rpc_async(rref.owner(), BatchUpdateParameterServer.update_and_fetch_model, args=(rref, g))
            for rref, g in zip(ps_rrefs, grads)
        ]
        return [fut.wait() for fut in futs]

    weights = step()  # warm-up
    t0 = time.monotonic()
    for _ in range(workload.steps):
        weights = step()
    t1 = time.monotonic()
    return {"rank": rank, "t0": t0, "t1": t1, **workload.check(torch.cat(weights).numpy())}


def run_ps(workload: Any) -> list[dict[str, Any]]:
    """Rank 0: create the shards (one here, the others remotely), start every trainer and wait for them."""
    rrefs = [rpc.RRef(BatchUpdateParameterServer(workload, 0))]
    rrefs += [rpc.remote(f"ps{k}", BatchUpdateParameterServer, args=(workload, k)) for k in range(1, workload.servers)]
    futs = [rpc.rpc_async(f"trainer{r}", run_trainer, args=(workload, r, rrefs)) for r in range(workload.workers)]
    return [fut.wait() for fut in futs]


def run_rank(rank: int, workload: Any, port: int, tcp_only: bool, results: Any, host: str = "127.0.0.1") -> None:
    """Body of one rank's process: ranks ``0..S-1`` are ``ps{k}``, the others ``trainer{r}``.

    Rank 0 puts each trainer's result on ``results`` (anything with a ``put`` method); any rank that fails puts
    ``{"rank", "error"}`` there. With ``tcp_only`` TensorPipe uses only its TCP transport (``uv``) and the
    ``basic`` channel, so tensors travel over TCP as in a multi-host job; otherwise TensorPipe picks its defaults
    (shared memory and cross-memory attach between processes of one host). The ranks rendezvous at
    ``tcp://host:port``, an address of rank 0's host; where TensorPipe listens is its own choice
    (``TP_SOCKET_IFNAME`` names the interface).
    """
    # rpc.shutdown() gathers over an internal Gloo group, which warns about its own deprecated use.
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    try:
        extra: dict[str, Any] = {"_transports": ["uv"], "_channels": ["basic"]} if tcp_only else {}
        options = rpc.TensorPipeRpcBackendOptions(
            num_worker_threads=16,
            rpc_timeout=workload.timeout,
            init_method=f"tcp://{host}:{port}",
            **extra,
        )
        servers = workload.servers
        name = f"ps{rank}" if rank < servers else f"trainer{rank - servers}"
        rpc.init_rpc(name, rank=rank, world_size=servers + workload.workers, rpc_backend_options=options)
        if rank == 0:
            for result in run_ps(workload):
                results.put(result)
        rpc.shutdown(graceful=True, timeout=workload.timeout)  # waits until every rank is done
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
        raise


def run(workload: Any, tcp_only: bool, deadline: float, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Spawn the S parameter-server and W trainer ranks, return the trainers' results; ranks always stopped.

    Parameters
    ----------
    workload : Workload
        The benchmark workload (``bench/peers.py``).
    tcp_only : bool
        Limit TensorPipe to loopback TCP (see :func:`run_rank`).
    deadline : float
        ``time.monotonic()`` by which every trainer must have reported.
    log : callable
        Where progress lines go.
    """
    import torch.multiprocessing as tmp
    from _common import collect, free_port, join_or_kill, spawn

    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    world = workload.servers + workload.workers
    procs: list[Any] = []
    try:
        log(f"spawning {world} RPC ranks (rendezvous 127.0.0.1:{port}, "
            f"transport {'TCP only' if tcp_only else 'TensorPipe default'})")
        procs += spawn(ctx, run_rank, [(rank, workload, port, tcp_only, results) for rank in range(world)],
                       "torch-rank")
        return collect(results, procs, workload.workers, deadline, "torch")
    finally:
        # Ranks leave by a graceful rpc.shutdown(); terminate any that do not.
        join_or_kill(procs, max(1.0, min(30.0, deadline - time.monotonic())))
        results.close()
