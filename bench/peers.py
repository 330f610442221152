"""Compare psrt with the parameter servers a Python user would write instead with Ray or torch.distributed.rpc.

Every system trains the same workload, one system after the other in one invocation. By default one invocation
runs two workloads, each with every system: 10M float32 (40 MB) with W = 4 workers and S = 2 shards (50 timed
steps), then 1M float32 (4 MB) with W = 2 and S = 2 (200 timed steps), where torch.distributed.rpc is
strongest. ``--elements``/``--workers``/``--servers`` run one workload of their own instead. A workload is a
single float32 tensor, synchronous (BSP) training with SGD applied on the servers: every step each worker pushes
its gradient and gets back the updated parameters (a push_pull); a step's update is the mean of the W workers'
gradients. Gradients are constant: worker ``r`` always pushes ``(r + 1) * g`` for one fixed random ``g`` whose
values are multiples of 1/64, so their sum and mean are exact in float32.

The metric is worker-steps/s: ``W * steps`` divided by the time from the end of a warm-up step (which also
absorbs connection set-up, first-touch allocations and actor start-up) to the end of the last step. psrt and
torch workers take their own timestamps and the rate uses the earliest start and the latest end; Ray's steps are
driven by the driver (as in its docs), which times them. The target, judged per workload on the headline row
(plain psrt), is >= 1.5x the faster of Ray and torch with every correctness check passing.

Each row also says how many bytes it moves: GB/s = ``W * steps * 2 * 4 * elements`` (bytes pushed plus bytes
pulled, over all workers) / timed seconds, 1 GB = 1e9 bytes. Beside it stands the machine's memory-copy
bandwidth measured in the same run just before the workload's systems: ``np.copyto`` between two 256 MiB arrays,
the best of 5, counted as bytes read plus bytes written; the ratio of the two is printed for plain psrt.

Every run is checked: after the warm-up step and ``steps`` more with constant gradients, the weights must equal
``w0 - (steps + 1) * lr * mean_r((r + 1) * g)``, computed in float64, within a float32 rounding bound that grows
with the number of steps (at the default step counts, a gradient lost or counted twice in any one step moves
some weights by more than 5x that bound). Each psrt and torch worker checks the parameters it received last;
for Ray the driver checks the weights the last step returned.

Notes
-----
psrt (the headline row: plain usage, no knobs)
    S ``psrt server --bind tcp://127.0.0.1:* --workers W --mode sync`` child processes started by hand (the
    endpoint is read from each server's first stdout line) and W spawned worker processes, each running the
    README's loop: ``psrt.Client(servers=[...], rank=r, num_workers=W)``,
    ``client.init({"w": w0}, optimizer=psrt.SGD(lr=lr))`` and then ``params = client.push_pull({"w": grad})``
    every step: no ``out=``, no ``psrt.tune_allocator()``, no environment variables. psrt splits the tensor
    into 4 MiB chunks spread over the shards.
psrt-tuned (beside it: the knobs psrt's docs offer)
    The same, with the shards on Unix-socket endpoints (``ipc://`` in a private temporary directory, as
    ``psrt launch`` sets them up for a local job), workers calling ``psrt.tune_allocator()`` and receiving into
    the arrays they already hold, ``params = client.push_pull({"w": grad}, out=params)``.
psrt-sockets
    Plain usage with ``PSRT_SHM=0`` in the environment of the servers and the workers: it turns off the
    shared-memory data path between a worker and a shard of one host where psrt has one (a psrt without one
    ignores the variable, and this row then measures the same as the headline).
Ray
    The synchronous example of the "Parameter Server" page of the Ray documentation: ``ParameterServer``
    actors whose ``apply_gradients(*gradients)`` stacks the workers' gradients with NumPy, applies SGD and
    returns the weights; ``DataWorker`` actors whose ``compute_gradients(weights)`` takes the current weights
    and returns gradients; the driver loop ``gradients = [worker.compute_gradients.remote(current_weights)
    ...]``, ``current_weights = ps.apply_gradients.remote(*gradients)``: every step is a barrier over all
    workers, the docs' BSP pattern. Objects travel through Ray's shared-memory object store. Changes for the
    workload: one ParameterServer actor per shard's slice of the tensor, ``compute_gradients`` returns one
    gradient slice per server (``num_returns``); the server averages (the docs sum); weights are NumPy arrays
    updated with ``w -= lr * mean`` instead of a torch model and ``torch.optim.SGD`` (NumPy arrays travel
    zero-copy through the object store, so this only helps Ray); ``compute_gradients`` copies the received
    weights into the worker's own arrays, as the docs' ``model.set_weights(weights)`` does.
    ``ray.init(num_cpus=W + S, include_dashboard=False)``, object store 16x the tensor (>= 256 MiB); the driver
    submits all steps at once and waits once at the end.
torch.distributed.rpc
    The ``BatchUpdateParameterServer`` of the PyTorch tutorial "Implementing Batch RPC Processing Using
    Asynchronous Executions", on top of the RRef pattern of "Implementing a Parameter Server Using Distributed
    RPC Framework" (see ``bench/_torch_ps.py``): S parameter-server ranks each hold a slice of the tensor in an
    ``nn.Parameter`` with ``torch.optim.SGD``; ``@rpc.functions.async_execution`` ``update_and_fetch_model``
    adds a trainer's gradient into ``.grad`` under a lock and returns a future that the W-th trainer of the
    step completes after dividing by W and stepping the optimizer. W trainer ranks call it on every slice with
    ``rpc_async`` and wait for all. Rank 0 starts the trainers, as in the tutorial. The processes are spawned
    with ``torch.multiprocessing``; TensorPipe rendezvouses on a free port of 127.0.0.1 and, by default
    (``--torch-transport auto``), uses its own defaults, shared memory between processes of one host;
    ``--torch-transport tcp`` limits it to TCP.

All waits have a deadline (``--timeout`` seconds per system); child processes are terminated, Ray is shut down
and RPC ranks are shut down or terminated on errors and on Ctrl-C. A system whose package is not installed is
skipped. ``--json FILE`` writes every workload's rows, targets and bandwidths.

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

    python bench/peers.py                              # both workloads, every system and psrt row
    python bench/peers.py --systems psrt,psrt-tuned,torch --elements 1M --workers 2 --servers 2 --json peers.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import multiprocessing
import os
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import _common
import numpy as np
from _common import VARIANTS, BenchError, Variant, Workload

SYSTEMS = (*VARIANTS, "ray", "torch")
#: The default workloads: (elements, W, S, timed steps).
WORKLOADS = ((10_000_000, 4, 2, 50), (1_000_000, 2, 2, 200))
TARGET = 1.5
STOPPED = re.compile(r"psrt-server stopped .*")
HERE = os.path.dirname(os.path.abspath(__file__))


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
    gbps: float = 0.0


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


# ---------------------------------------------------------------------------------------------------- psrt
def _psrt_worker(workload: Workload, variant: Variant, endpoints: list[str], rank: int, results: Any) -> None:
    """One psrt worker process: init, one warm-up push_pull, ``steps`` timed push_pulls, check the weights."""
    try:
        import psrt
        from psrt.config import ClientConfig

        if variant.tune:
            psrt.tune_allocator()
        grad = workload.gradient(rank)
        config = ClientConfig(timeout=workload.timeout)
        with psrt.Client(servers=endpoints, rank=rank, num_workers=workload.workers, config=config) as client:
            client.init({"w": workload.initial()}, optimizer=psrt.SGD(lr=workload.lr))
            params = client.push_pull({"w": grad})  # warm-up
            t0 = time.monotonic()
            if variant.out:
                for _ in range(workload.steps):
                    params = client.push_pull({"w": grad}, out=params)  # received into the same array
            else:
                for _ in range(workload.steps):
                    params = client.push_pull({"w": grad})  # the README's loop
            t1 = time.monotonic()
        results.put({"rank": rank, "t0": t0, "t1": t1, **workload.check(params["w"])})
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})


def run_psrt(workload: Workload, options: argparse.Namespace, variant: Variant) -> Outcome:
    """psrt: S ``psrt server`` children and W spawned workers using ``psrt.Client.push_pull``, as ``variant``."""
    deadline = time.monotonic() + workload.timeout
    outcome = Outcome(variant.name)
    procs: list[Any] = []
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    try:
        with _common.shards(workload.servers, workload.workers, "sync", variant, deadline) as servers:
            endpoints = [s.endpoint for s in servers]
            _log(variant.name, f"servers at {', '.join(endpoints)}; starting {workload.workers} workers"
                               + (f" (environment {dict(variant.env)})" if variant.env else ""))
            try:
                with _common.environ(variant.env):
                    procs += _common.spawn(ctx, _psrt_worker, [(workload, variant, endpoints, rank, results)
                                                       for rank in range(workload.workers)], "psrt-worker")
                got = _common.collect(results, procs, workload.workers, deadline, variant.name)
            finally:
                _common.join_or_kill(procs, 10.0)
        outcome.rate, outcome.timed_s = _rate(workload, got)
        _merge_checks(outcome, got)
    finally:
        results.close()
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

    outcome = Outcome("torch")
    tcp_only = options.torch_transport == "tcp"
    got = _torch_ps.run(workload, tcp_only, time.monotonic() + workload.timeout, lambda m: _log("torch", m))
    outcome.rate, outcome.timed_s = _rate(workload, got)
    _merge_checks(outcome, got)
    outcome.detail = f"transport={'tcp' if tcp_only else 'auto'}"
    return outcome


def _runner(name: str) -> Callable[[Workload, argparse.Namespace], Outcome]:
    if name in VARIANTS:
        return lambda workload, options: run_psrt(workload, options, VARIANTS[name])
    return {"ray": run_ray, "torch": run_torch}[name]


# ---------------------------------------------------------------------------------------------------- report
def _target(outcomes: dict[str, Outcome]) -> dict[str, Any]:
    psrt = outcomes.get("psrt")
    peers = [o for name, o in outcomes.items() if name in ("ray", "torch") and o.status == "ok" and o.rate > 0]
    if psrt is None or psrt.status != "ok" or not peers:
        return {"verdict": "n/a", "ratio": None, "against": None, "required": TARGET,
                "reason": "needs plain psrt and at least one of ray/torch to have run"}
    best = max(peers, key=lambda o: o.rate)
    ratio = psrt.rate / best.rate
    correct = bool(psrt.check_ok and best.check_ok)
    verdict = "PASS" if ratio >= TARGET and correct else "MISS"
    return {"verdict": verdict, "ratio": ratio, "against": best.system, "required": TARGET,
            "reason": "" if correct else "a correctness check failed"}


def _target_line(target: dict[str, Any]) -> str:
    head = f"target plain psrt >= {TARGET}x the faster of ray and torch, checks passing:"
    if target["verdict"] == "n/a":
        return f"{head} n/a ({target['reason']})"
    note = f" ({target['reason']})" if target["reason"] else ""
    return f"{head} {target['verdict']} (measured {target['ratio']:.2f}x against {target['against']}){note}"


def _print_table(outcomes: dict[str, Outcome], target: dict[str, Any], copy_gbps: float) -> None:
    psrt = outcomes.get("psrt")
    psrt_rate = psrt.rate if psrt is not None and psrt.status == "ok" else 0.0
    print()
    print(f"{'system':<13} {'worker-steps/s':>14} {'psrt/row':>9} {'GB/s':>7} {'timed s':>8}  correctness")
    print("-" * 100)
    for name, o in outcomes.items():
        if o.status != "ok":
            print(f"{name:<13} {'-':>14} {'-':>9} {'-':>7} {'-':>8}  {o.status}: {o.message.splitlines()[0]}")
            continue
        ratio = f"{psrt_rate / o.rate:.2f}x" if psrt_rate and o.rate else "-"
        check = (f"{'OK' if o.check_ok else 'WRONG'} (max |w - expected| = {o.max_err:.2e}, "
                 f"bound {o.tol:.2e})")
        print(f"{name:<13} {o.rate:>14.2f} {ratio:>9} {o.gbps:>7.2f} {o.timed_s:>8.2f}  {check}")
    print("-" * 100)
    print(f"memory copy (np.copyto, read + write): {copy_gbps:.1f} GB/s", end="")
    if psrt_rate:
        print(f"; plain psrt moves {psrt.gbps:.2f} GB/s (pushed + pulled) = {psrt.gbps / copy_gbps:.3f}x of it")
    else:
        print()
    print(_target_line(target))


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(description="Throughput of psrt (plain usage, and tuned beside it) against a Ray "
                                            "and a torch.distributed.rpc parameter server on the same BSP "
                                            "workload (worker-steps/s). By default two workloads: "
                                            "10M/W=4/S=2 and 1M/W=2/S=2.")
    p.add_argument("--elements", type=int, help="float32 values in the tensor, e.g. 1000000: run this one "
                                                 "workload instead of the default two (default 10000000)")
    p.add_argument("--workers", type=int, help="worker processes W of the one workload (default 4)")
    p.add_argument("--servers", type=int, help="parameter-server shards S of the one workload (default 2)")
    p.add_argument("--steps", type=int, help="timed steps per worker after one warm-up step (default 50 for "
                                             "10M, 200 for 1M; 50 for a workload of your own)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="comma-separated subset of the rows, run in this order (%(default)s)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (%(default)s)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one system may take, start-up included (%(default)s)")
    p.add_argument("--torch-transport", choices=("tcp", "auto"), default="auto",
                   help="TensorPipe transport: auto (its defaults: shared memory between processes of one host) "
                        "or tcp (loopback TCP only) (%(default)s)")
    return p


def _run_workload(workload: Workload, systems: list[str], args: argparse.Namespace) -> dict[str, Any]:
    print(f"\n=== workload: {workload.elements:,} float32 ({4 * workload.elements / 1e6:.3g} MB), "
          f"W={workload.workers} workers, S={workload.servers} shards, BSP, SGD lr={workload.lr}, 1 warm-up + "
          f"{workload.steps} timed push_pull steps per worker; rows: {', '.join(systems)}", flush=True)
    copy_gbps = _common.copy_bandwidth()
    outcomes: dict[str, Outcome] = {}
    for name in systems:
        package = "psrt" if name in VARIANTS else name
        if importlib.util.find_spec(package) is None:
            outcomes[name] = Outcome(name, status="skipped",
                                     message=f"package {package!r} is not installed (pip install {package})")
            _log(name, f"skipped: {outcomes[name].message}")
            continue
        t = time.monotonic()
        try:
            outcome = _runner(name)(workload, args)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # one broken system must not hide the others' results
            message = str(exc) if isinstance(exc, BenchError) else traceback.format_exc()
            outcome = Outcome(name, status="failed", message=message)
            print(f"[{name}] FAILED: {message}", file=sys.stderr, flush=True)
        outcome.wall_s = time.monotonic() - t
        if outcome.status == "ok":
            outcome.gbps = workload.workers * workload.steps * 2 * 4 * workload.elements / outcome.timed_s / 1e9
            _log(name, f"{outcome.rate:.2f} worker-steps/s ({outcome.gbps:.2f} GB/s) over {outcome.timed_s:.2f}s; "
                       f"check {'OK' if outcome.check_ok else 'WRONG'}: max |w - (w0 - N*lr*mean(g))| = "
                       f"{outcome.max_err:.2e} <= {outcome.tol:.2e} is {outcome.check_ok} "
                       f"(N={workload.steps + 1}); {outcome.wall_s:.1f}s with start-up"
                       + (f"; {outcome.detail}" if outcome.detail else ""))
        outcomes[name] = outcome
    target = _target(outcomes)
    _print_table(outcomes, target, copy_gbps)
    psrt = outcomes.get("psrt")
    psrt_gbps = psrt.gbps if psrt is not None and psrt.status == "ok" else None
    return {"workload": asdict(workload), "memcopy_gbps": copy_gbps, "psrt_gbps": psrt_gbps,
            "psrt_to_memcopy": psrt_gbps / copy_gbps if psrt_gbps else None,
            "systems": {n: asdict(o) for n, o in outcomes.items()}, "target": target}


def main(argv: Optional[list[str]] = None) -> int:
    """Run the workloads, each with the selected systems one after the other; print the tables and targets."""
    parser = build_parser()
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or not systems or len(set(systems)) != len(systems):
        parser.error(f"--systems takes a comma-separated subset of {','.join(SYSTEMS)}, got {args.systems!r}")
    custom = (args.elements, args.workers, args.servers) != (None, None, None)
    shapes = [(args.elements or 10_000_000, args.workers or 4, args.servers or 2, 50)] if custom else WORKLOADS
    if any(w < 1 or s < 1 or e < s for e, w, s, _ in shapes) or (args.steps is not None and args.steps < 1):
        parser.error("--workers, --servers and --steps must be >= 1 and --elements >= --servers")
    if not args.timeout > 0 or not args.lr > 0:
        parser.error("--timeout and --lr must be > 0")
    workloads = [Workload(elements=e, workers=w, servers=s, steps=args.steps or steps, lr=args.lr,
                          timeout=args.timeout) for e, w, s, steps in shapes]
    started = time.monotonic()
    reports = []
    try:
        for workload in workloads:
            reports.append(_run_workload(workload, systems, args))
    except KeyboardInterrupt:
        print("\ninterrupted; children stopped", file=sys.stderr)
        return 130
    elapsed = time.monotonic() - started
    print()
    for r in reports:
        w = r["workload"]
        print(f"{w['elements']:,} float32, W={w['workers']}, S={w['servers']}: {_target_line(r['target'])}")
    print(f"total {elapsed:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workloads": reports, "elapsed_s": elapsed, "argv": sys.argv[1:] if argv is None else argv},
                      f, indent=2)
            f.write("\n")
    failed = any(o["status"] == "failed" or o["check_ok"] is False for r in reports for o in r["systems"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
