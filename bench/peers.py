"""Compare psrt with the parameter servers a Python user would write instead with Ray or torch.distributed.rpc.

Every system trains the same workload, one system after the other in one invocation: a single float32 tensor of
``--elements`` values (10M, 40 MB, by default), ``--workers`` worker processes (4) and ``--servers``
parameter-server shards (2), synchronous (BSP) training with SGD applied on the servers. Every step each worker
pushes its gradient and gets back the updated parameters (a push_pull); a step's update is the mean of the W
workers' gradients. Gradients are constant: worker ``r`` always pushes ``(r + 1) * g`` for one fixed random
``g`` whose values are multiples of 1/64, so their sum and mean are exact in float32.

The metric is worker-steps/s: ``W * steps`` divided by the time from the end of a warm-up step (which also
absorbs connection set-up, first-touch allocations and actor start-up) to the end of the last step. psrt and
torch workers take their own timestamps and the rate uses the earliest start and the latest end; Ray's steps are
driven by the driver (as in its docs), which times them. The target is psrt at >= 1.5x the faster of Ray and
torch.

On one host the systems do not move bytes the same way, and each uses what it does by default on one machine:
psrt's shards listen on Unix-socket (ipc://) endpoints, as ``psrt launch`` sets them up for a local job
(``--psrt-transport tcp`` for loopback TCP), torch's TensorPipe uses shared memory, and Ray passes objects
through its shared-memory object store.

Every run is checked: after the warm-up step and ``steps`` more with constant gradients, the weights must equal
``w0 - (steps + 1) * lr * mean_r((r + 1) * g)``, computed in float64, within a float32 rounding bound that grows
with the number of steps (at the default step count, a gradient lost or counted twice in any one step moves
some weights by more than 10x that bound). Each psrt and torch worker checks the parameters it received last;
for Ray the driver checks the weights the last step returned.

Notes
-----
psrt
    S ``psrt server --workers W --mode sync`` child processes bound to ipc:// endpoints in a private temporary
    directory (or ephemeral loopback TCP ports; the endpoint is read from the server's first stdout line),
    and W spawned worker processes, each running
    ``psrt.Client(servers=[...], rank=r, num_workers=W)``, ``client.init({"w": w0}, optimizer=psrt.SGD(lr=lr))``
    and then ``params = client.push_pull({"w": grad}, out=params)`` every step (receiving into the arrays it
    already holds, as psrt's docs show for a training loop); workers and servers call ``psrt.tune_allocator()``
    as the README advises. psrt splits the tensor into 4 MiB chunks spread over
    the shards.
Ray
    The synchronous example of the "Parameter Server" page of the Ray documentation: ``@ray.remote class
    ParameterServer`` actors whose ``apply_gradients(*gradients)`` stacks the workers' gradients with NumPy,
    applies SGD and returns the weights; ``@ray.remote class DataWorker`` actors whose
    ``compute_gradients(weights)`` takes the current weights and returns gradients; and the driver loop
    ``gradients = [worker.compute_gradients.remote(current_weights) ...]``,
    ``current_weights = ps.apply_gradients.remote(*gradients)``, so every step is a barrier over all workers,
    which is the docs' BSP pattern (chosen over actors with a hand-written barrier because it is what the docs
    show). Changes for the workload: there is one ParameterServer actor per half of the tensor and
    ``compute_gradients`` returns one gradient half per server (``num_returns``); the server averages (the
    docs sum); weights are NumPy arrays updated with ``w -= lr * mean`` instead of a torch model and
    ``torch.optim.SGD`` (NumPy arrays travel zero-copy through Ray's object store, so this only helps Ray);
    ``compute_gradients`` copies the received weights into the worker's own arrays, as the docs'
    ``model.set_weights(weights)`` does (and as a psrt worker receives them into its own array).
    ``ray.init(num_cpus=W + S, include_dashboard=False)`` with a modest object store (16x the tensor size,
    at least 256 MiB); the driver submits all steps at once as in the docs and waits once at the end.
torch.distributed.rpc
    The ``BatchUpdateParameterServer`` of the PyTorch tutorial "Implementing Batch RPC Processing Using
    Asynchronous Executions", on top of the RRef pattern of "Implementing a Parameter Server Using Distributed
    RPC Framework" (see ``bench/_torch_ps.py``): S parameter-server ranks each hold half the tensor in an
    ``nn.Parameter`` with ``torch.optim.SGD``; ``@rpc.functions.async_execution`` ``update_and_fetch_model``
    adds a trainer's gradient into ``.grad`` under a lock and returns a future that the W-th trainer of the
    step completes after dividing by W and stepping the optimizer. W trainer ranks call it on both halves with
    ``rpc_async`` and wait for both. Rank 0 starts the trainers, as in the tutorial. The processes are spawned
    with ``torch.multiprocessing``; TensorPipe rendezvouses on a free port of 127.0.0.1 and, by default
    (``--torch-transport auto``), uses its own defaults, shared memory between processes of one host;
    ``--torch-transport tcp`` limits it to TCP.

All waits have a deadline (``--timeout`` seconds per system); child processes are terminated, Ray is shut down
and RPC ranks are shut down or terminated on errors and on Ctrl-C. A system whose package is not installed is
skipped with a message.

References
----------
.. [1] Ray documentation, "Parameter Server",
   https://docs.ray.io/en/latest/ray-core/examples/plot_parameter_server.html
.. [2] PyTorch tutorials, "Implementing a Parameter Server Using Distributed RPC Framework",
   https://pytorch.org/tutorials/intermediate/rpc_param_server_tutorial.html
.. [3] PyTorch tutorials, "Implementing Batch RPC Processing Using Asynchronous Executions",
   https://pytorch.org/tutorials/intermediate/rpc_async_execution.html

Examples
--------
Run from the repository root::

    python bench/peers.py                                  # all systems, default workload
    python bench/peers.py --systems psrt,torch --steps 10 --json peers.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import multiprocessing
import os
import queue
import re
import shutil
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import numpy as np

SYSTEMS = ("psrt", "ray", "torch")
TARGET = 1.5
DEFAULT_STEPS = 50
STOPPED = re.compile(r"psrt-server stopped .*")
HERE = os.path.dirname(os.path.abspath(__file__))


class BenchError(RuntimeError):
    """A system failed to run (start-up, timeout, a worker's exception); the message says which and why."""


# ---------------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Workload:
    """The benchmark's workload; picklable, so every process rebuilds the same arrays from the seed.

    Parameters
    ----------
    elements : int
        Number of float32 values of the single tensor.
    workers : int
        W, the number of worker processes.
    servers : int
        S, the number of parameter-server shards.
    steps : int
        Timed steps per worker, after one warm-up step.
    lr : float
        SGD learning rate.
    timeout : float
        Seconds one system may take in all; also the limit of every single wait.
    seed : int
        Seed of the initial values and the gradient.
    """

    elements: int
    workers: int
    servers: int
    steps: int
    lr: float = 0.01
    timeout: float = 600.0
    seed: int = 1234

    def initial(self) -> np.ndarray:
        """The initial weights ``w0``: standard normal float32."""
        return np.random.default_rng(self.seed).standard_normal(self.elements, dtype=np.float32)

    def _base(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed + 1)
        return rng.integers(-64, 65, self.elements).astype(np.float32) / np.float32(64)

    def gradient(self, rank: int) -> np.ndarray:
        """Worker ``rank``'s constant gradient ``(rank + 1) * g`` (exact in float32)."""
        return self._base() * np.float32(rank + 1)

    def bounds(self) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` slice of the tensor each of the S baseline shards holds (near-equal halves)."""
        n, s = self.elements, self.servers
        return [(k * n // s, (k + 1) * n // s) for k in range(s)]

    def check(self, weights: np.ndarray) -> dict[str, Any]:
        """Compare final weights with ``w0 - (steps + 1) * lr * mean gradient``.

        Returns
        -------
        dict
            ``ok`` (bool), ``max_err`` (largest absolute difference) and ``tol`` (the bound it must not exceed).
        """
        w = np.asarray(weights).reshape(-1)
        if w.size != self.elements:
            return {"ok": False, "max_err": float("inf"), "tol": 0.0}
        n = self.steps + 1
        w0 = self.initial().astype(np.float64)
        mean_grad = self._base().astype(np.float64) * ((self.workers + 1) / 2)
        expected = w0 - n * self.lr * mean_grad
        err = float(np.max(np.abs(w.astype(np.float64) - expected))) if w.size else 0.0
        # Each float32 update rounds by at most about one ulp of the largest weight.
        scale = float(np.max(np.abs(w0))) + n * self.lr * float(np.max(np.abs(mean_grad))) + 1.0
        tol = 2.0 * n * float(np.finfo(np.float32).eps) * scale
        return {"ok": bool(np.isfinite(err) and err <= tol), "max_err": err, "tol": tol}


@dataclass
class Outcome:
    """What one system produced."""

    system: str
    status: str = "ok"  # ok | skipped | failed
    message: str = ""
    rate: float = 0.0
    timed_s: float = 0.0
    wall_s: float = 0.0
    check_ok: Optional[bool] = None
    max_err: float = 0.0
    tol: float = 0.0
    detail: str = ""


def _rate(workload: Workload, results: list[dict[str, Any]]) -> tuple[float, float]:
    """Worker-steps/s and the timed span from per-worker ``t0``/``t1`` (CLOCK_MONOTONIC is system-wide)."""
    span = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    return workload.workers * workload.steps / span, span


def _merge_checks(outcome: Outcome, results: list[dict[str, Any]]) -> None:
    outcome.check_ok = all(r["ok"] for r in results)
    outcome.max_err = max(r["max_err"] for r in results)
    outcome.tol = min(r["tol"] for r in results)


def _log(system: str, message: str) -> None:
    print(f"[{system}] {message}", flush=True)


# ---------------------------------------------------------------------------------------------------- processes
def _collect(results: Any, procs: list[Any], expected: int, deadline: float, what: str) -> list[dict[str, Any]]:
    """Gather ``expected`` result dicts from ``results``; raise on a reported error, a dead process or the deadline."""
    got: list[dict[str, Any]] = []
    while len(got) < expected:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BenchError(f"{what}: {len(got)} of {expected} workers reported before the deadline "
                             "(--timeout per system)")
        try:
            msg = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise BenchError(f"{what}: process {dead[0].name} exited with code {dead[0].exitcode}") from None
            if all(p.exitcode is not None for p in procs):
                try:
                    msg = results.get(timeout=1.0)
                except queue.Empty:
                    raise BenchError(f"{what}: all processes exited but only {len(got)} of {expected} "
                                     "results arrived") from None
            else:
                continue
        if "error" in msg:
            raise BenchError(f"{what}: rank {msg['rank']} failed:\n{msg['error']}")
        got.append(msg)
    return got


def _stop_processes(procs: list[Any], grace: float) -> None:
    """Join processes for up to ``grace`` seconds, then terminate, then kill what is left."""
    deadline = time.monotonic() + grace
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(ctx: Any, target: Callable[..., None], argsets: list[tuple], name: str) -> list[Any]:
    """Start one daemon process per argument tuple, named ``name-i``."""
    procs = []
    for i, args in enumerate(argsets):
        p = ctx.Process(target=target, args=args, name=f"{name}-{i}", daemon=True)
        p.start()
        procs.append(p)
    return procs


# ---------------------------------------------------------------------------------------------------- psrt
def _psrt_worker(workload: Workload, endpoints: list[str], rank: int, results: Any) -> None:
    """One psrt worker process: init, one warm-up push_pull, ``steps`` timed push_pulls, check the weights."""
    try:
        import psrt
        from psrt.config import ClientConfig

        psrt.tune_allocator()  # as psrt's README advises for workers moving large tensors
        grad = workload.gradient(rank)
        config = ClientConfig(timeout=workload.timeout)
        with psrt.Client(servers=endpoints, rank=rank, num_workers=workload.workers, config=config) as client:
            client.init({"w": workload.initial()}, optimizer=psrt.SGD(lr=workload.lr))
            params = client.push_pull({"w": grad})  # warm-up
            t0 = time.monotonic()
            for _ in range(workload.steps):
                # The training loop overwrites its parameters: they are received straight into the same array.
                params = client.push_pull({"w": grad}, out=params)
            t1 = time.monotonic()
        results.put({"rank": rank, "t0": t0, "t1": t1, **workload.check(params["w"])})
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})


def run_psrt(workload: Workload, options: argparse.Namespace) -> Outcome:
    """psrt: S ``psrt server`` children and W spawned workers using ``psrt.Client.push_pull``."""
    from _common import start_server

    from psrt.errors import PsrtError
    from psrt.process import Child, stop_children

    deadline = time.monotonic() + workload.timeout
    outcome = Outcome("psrt")
    servers: list[Child] = []
    procs: list[Any] = []
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    sockdir = tempfile.mkdtemp(prefix="psrt-peers-") if options.psrt_transport == "ipc" else None
    try:
        for i in range(workload.servers):
            bind = f"ipc://{sockdir}/server-{i}.sock" if sockdir else "tcp://127.0.0.1:*"
            try:
                servers.append(start_server(workload.workers, max(1.0, min(60.0, deadline - time.monotonic())),
                                            bind, label=f"psrt server {i}"))
            except PsrtError as exc:  # did not start: its own words say why
                raise BenchError(f"psrt: {exc}") from None
        endpoints = [s.endpoint for s in servers]
        _log("psrt", f"servers at {', '.join(endpoints)}; starting {workload.workers} workers")
        procs += _spawn(ctx, _psrt_worker, [(workload, endpoints, rank, results) for rank in range(workload.workers)],
                        "psrt-worker")
        got = _collect(results, procs, workload.workers, deadline, "psrt")
        outcome.rate, outcome.timed_s = _rate(workload, got)
        _merge_checks(outcome, got)
    finally:
        _stop_processes(procs, 10.0)
        stop_children(servers, grace=10.0)
        results.close()
        if sockdir:
            shutil.rmtree(sockdir, ignore_errors=True)
    # Each server's last line sums up what it served.
    outcome.detail = "; ".join(m.group(0) for m in (STOPPED.search(s.output) for s in servers) if m)
    return outcome


# ---------------------------------------------------------------------------------------------------- Ray
def run_ray(workload: Workload, _options: argparse.Namespace) -> Outcome:
    """Ray: the docs' synchronous parameter server, one ParameterServer actor per half of the tensor."""
    import ray

    deadline = time.monotonic() + workload.timeout
    outcome = Outcome("ray")
    num_servers = workload.servers
    store_bytes = max(256 << 20, 16 * 4 * workload.elements)

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError(f"ray: not done within --timeout {workload.timeout:g}s")
        return left

    ray.init(num_cpus=workload.workers + num_servers, include_dashboard=False, object_store_memory=store_bytes,
             logging_level=logging.WARNING)
    try:
        @ray.remote
        class ParameterServer:
            def __init__(self, workload: Workload, shard: int) -> None:
                lo, hi = workload.bounds()[shard]
                self.weights = workload.initial()[lo:hi].copy()
                self.lr = workload.lr

            def apply_gradients(self, *gradients: np.ndarray) -> np.ndarray:
                mean_gradient = np.stack(gradients).mean(axis=0)
                self.weights -= self.lr * mean_gradient
                return self.weights

            def get_weights(self) -> np.ndarray:
                return self.weights

        @ray.remote
        class DataWorker:
            def __init__(self, workload: Workload, rank: int) -> None:
                grad = workload.gradient(rank)
                self.gradients = [grad[lo:hi].copy() for lo, hi in workload.bounds()]
                self.weights = [np.empty(hi - lo, np.float32) for lo, hi in workload.bounds()]  # the "model"

            @ray.method(num_returns=num_servers)
            def compute_gradients(self, *weights: np.ndarray) -> Any:
                for mine, received in zip(self.weights, weights):  # the docs' self.model.set_weights(weights)
                    np.copyto(mine, received)
                return tuple(self.gradients) if num_servers > 1 else self.gradients[0]

        servers = [ParameterServer.remote(workload, k) for k in range(num_servers)]
        workers = [DataWorker.remote(workload, r) for r in range(workload.workers)]

        def step(current_weights: list[Any]) -> list[Any]:
            gradients = [worker.compute_gradients.remote(*current_weights) for worker in workers]
            if num_servers == 1:
                gradients = [[g] for g in gradients]
            # Calculate the update after all gradients are available.
            return [ps.apply_gradients.remote(*[g[k] for g in gradients]) for k, ps in enumerate(servers)]

        current_weights = [ps.get_weights.remote() for ps in servers]
        current_weights = step(current_weights)  # warm-up (also waits for the actors to start)
        _log("ray", "actors up; warm-up step")
        ray.get(current_weights, timeout=remaining())
        t0 = time.monotonic()
        for _ in range(workload.steps):
            current_weights = step(current_weights)
        final = ray.get(current_weights, timeout=remaining())
        t1 = time.monotonic()
        outcome.timed_s = t1 - t0
        outcome.rate = workload.workers * workload.steps / outcome.timed_s
        _merge_checks(outcome, [workload.check(np.concatenate(final))])
        del final, current_weights
    except ray.exceptions.GetTimeoutError:
        raise BenchError(f"ray: the steps did not finish within --timeout {workload.timeout:g}s") from None
    finally:
        ray.shutdown()
    return outcome


# ---------------------------------------------------------------------------------------------------- torch
def run_torch(workload: Workload, options: argparse.Namespace) -> Outcome:
    """torch.distributed.rpc: the tutorials' batch-update parameter server, S server ranks and W trainer ranks."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)  # spawned ranks inherit sys.path and import _torch_ps by name
    import _torch_ps
    import torch.multiprocessing as tmp

    deadline = time.monotonic() + workload.timeout
    outcome = Outcome("torch")
    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    tcp_only = options.torch_transport == "tcp"
    world = workload.servers + workload.workers
    procs: list[Any] = []
    try:
        _log("torch", f"spawning {world} RPC ranks (rendezvous 127.0.0.1:{port}, "
                      f"transport {'TCP only' if tcp_only else 'TensorPipe default'})")
        procs += _spawn(ctx, _torch_ps.run_rank, [(rank, workload, port, tcp_only, results) for rank in range(world)],
                        "torch-rank")
        got = _collect(results, procs, workload.workers, deadline, "torch")
        outcome.rate, outcome.timed_s = _rate(workload, got)
        _merge_checks(outcome, got)
    finally:
        # Ranks leave by a graceful rpc.shutdown(); terminate any that do not.
        _stop_processes(procs, max(1.0, min(30.0, deadline - time.monotonic())))
        results.close()
    outcome.detail = f"transport={'tcp' if tcp_only else 'auto'}"
    return outcome


RUNNERS: dict[str, Callable[[Workload, argparse.Namespace], Outcome]] = {
    "psrt": run_psrt, "ray": run_ray, "torch": run_torch,
}


# ---------------------------------------------------------------------------------------------------- report
def _target(outcomes: dict[str, Outcome]) -> dict[str, Any]:
    psrt = outcomes.get("psrt")
    peers = [o for name, o in outcomes.items() if name != "psrt" and o.status == "ok" and o.rate > 0]
    if psrt is None or psrt.status != "ok" or not peers:
        return {"verdict": "n/a", "ratio": None, "against": None,
                "reason": "needs psrt and at least one of ray/torch to have run"}
    best = max(peers, key=lambda o: o.rate)
    ratio = psrt.rate / best.rate
    correct = psrt.check_ok and best.check_ok
    verdict = "PASS" if ratio >= TARGET and correct else "MISS"
    return {"verdict": verdict, "ratio": ratio, "against": best.system, "required": TARGET,
            "reason": "" if correct else "a correctness check failed"}


def _print_table(outcomes: dict[str, Outcome], target: dict[str, Any]) -> None:
    psrt = outcomes.get("psrt")
    psrt_rate = psrt.rate if psrt is not None and psrt.status == "ok" else 0.0
    print()
    print(f"{'system':<8} {'worker-steps/s':>15} {'psrt/system':>12}  {'timed s':>8}  correctness")
    print("-" * 80)
    for name, o in outcomes.items():
        if o.status != "ok":
            print(f"{name:<8} {'-':>15} {'-':>12}  {'-':>8}  {o.status}: {o.message.splitlines()[0]}")
            continue
        ratio = f"{psrt_rate / o.rate:.2f}x" if psrt_rate and o.rate else "-"
        check = (f"{'OK' if o.check_ok else 'WRONG'} (max |w - expected| = {o.max_err:.2e}, "
                 f"bound {o.tol:.2e})")
        print(f"{name:<8} {o.rate:>15.2f} {ratio:>12}  {o.timed_s:>8.2f}  {check}")
    print("-" * 80)
    if target["verdict"] == "n/a":
        print(f"target psrt >= {TARGET}x the faster of ray and torch: n/a ({target['reason']})")
    else:
        note = f" ({target['reason']})" if target["reason"] else ""
        print(f"target psrt >= {TARGET}x the faster of ray and torch: {target['verdict']} "
              f"(measured {target['ratio']:.2f}x against {target['against']}){note}")


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(description="Throughput of psrt against a Ray and a torch.distributed.rpc "
                                            "parameter server on the same BSP workload (worker-steps/s).")
    p.add_argument("--elements", type=int, default=10_000_000, help="float32 values in the tensor (%(default)s)")
    p.add_argument("--workers", type=int, default=4, help="worker processes W (%(default)s)")
    p.add_argument("--servers", type=int, default=2, help="parameter-server shards S (%(default)s)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help="timed steps per worker after one warm-up step (%(default)s)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of psrt,ray,torch, "
                                                                 "run in this order (%(default)s)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (%(default)s)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one system may take, start-up included (%(default)s)")
    p.add_argument("--torch-transport", choices=("tcp", "auto"), default="auto",
                   help="TensorPipe transport: auto (its defaults: shared memory between processes of one host) "
                        "or tcp (loopback TCP only) (%(default)s)")
    p.add_argument("--psrt-transport", choices=("ipc", "tcp"), default="ipc",
                   help="psrt shard endpoints: ipc (Unix sockets, what `psrt launch` uses on one host) or tcp "
                        "(loopback TCP) (%(default)s)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """Run the selected systems one after the other, print the table and the target line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or not systems or len(set(systems)) != len(systems):
        parser.error(f"--systems takes a comma-separated subset of {','.join(SYSTEMS)}, got {args.systems!r}")
    if args.workers < 1 or args.servers < 1 or args.steps < 1 or args.elements < args.servers:
        parser.error("--workers, --servers and --steps must be >= 1 and --elements >= --servers")
    if not args.timeout > 0 or not args.lr > 0:
        parser.error("--timeout and --lr must be > 0")
    workload = Workload(elements=args.elements, workers=args.workers, servers=args.servers, steps=args.steps,
                        lr=args.lr, timeout=args.timeout)
    print(f"workload: {workload.elements:,} float32 ({4 * workload.elements / 1e6:.3g} MB), W={workload.workers} "
          f"workers, S={workload.servers} shards, BSP, SGD lr={workload.lr}, 1 warm-up + {workload.steps} "
          f"timed push_pull steps per worker; systems: {', '.join(systems)}", flush=True)

    started = time.monotonic()
    outcomes: dict[str, Outcome] = {}
    for name in systems:
        if importlib.util.find_spec(name) is None:  # the package has the system's name
            outcomes[name] = Outcome(name, status="skipped",
                                     message=f"package {name!r} is not installed (pip install {name})")
            _log(name, f"skipped: {outcomes[name].message}")
            continue
        t = time.monotonic()
        try:
            outcome = RUNNERS[name](workload, args)
        except KeyboardInterrupt:
            print(f"\n[{name}] interrupted; children stopped", file=sys.stderr)
            return 130
        except Exception as exc:  # one broken system must not hide the others' results
            message = str(exc) if isinstance(exc, BenchError) else traceback.format_exc()
            outcome = Outcome(name, status="failed", message=message)
            print(f"[{name}] FAILED: {message}", file=sys.stderr, flush=True)
        outcome.wall_s = time.monotonic() - t
        outcomes[name] = outcome
        if outcome.status == "ok":
            _log(name, f"{outcome.rate:.2f} worker-steps/s over {outcome.timed_s:.2f}s; check "
                       f"{'OK' if outcome.check_ok else 'WRONG'}: max |w - (w0 - N*lr*mean(g))| = "
                       f"{outcome.max_err:.2e} <= {outcome.tol:.2e} is {outcome.check_ok} "
                       f"(N={workload.steps + 1}); {outcome.wall_s:.1f}s with start-up"
                       + (f"; {outcome.detail}" if outcome.detail else ""))

    target = _target(outcomes)
    _print_table(outcomes, target)
    elapsed = time.monotonic() - started
    print(f"total {elapsed:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": asdict(workload), "systems": {n: asdict(o) for n, o in outcomes.items()},
                       "target": target, "elapsed_s": elapsed, "argv": sys.argv[1:]}, f, indent=2)
            f.write("\n")
    failed = any(o.status == "failed" or o.check_ok is False for o in outcomes.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
