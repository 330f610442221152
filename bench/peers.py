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

Across hosts (``--emulated``)
-----------------------------
``sudo python bench/peers.py --emulated [--link RATE]`` runs plain psrt, torch.distributed.rpc and Ray on an
emulated cluster (:class:`psrt.emulation.netns.VirtualCluster`): every process on a host of its own, a network
namespace joined by a veth pair to a bridge, every host's link shaped with ``tc ... tbf`` to RATE in each
direction (default 1gbit), and each host with its own /dev/shm. Hosts ``s0..s{S-1}`` hold the shards, ``w0..w{W-1}``
the workers; each system gets fresh hosts, removed again on success, error and Ctrl-C (or SIGTERM). Default
workloads: 1M float32 (50 timed steps) and 10M (20), both W = 4, S = 2, sync; the workload, timing and
correctness check are those above.

psrt
    The scheduler-less layout of the table above: ``psrt server --bind tcp://<host ip>:29500 --workers W --mode
    sync`` on each shard host, and on each worker host one process running the README's loop
    (``psrt.Client(servers=[...], rank=r, num_workers=W)``, ``client.init``, ``params = client.push_pull({"w":
    grad})`` every step; no knobs, no environment variables).
psrt-whole
    The same with ``PSRT_PIPELINE=off`` on every worker host: tensors are not cut for the network (a 4 MB tensor
    on 2 shards is 2 chunks, one message each), as before psrt pipelined by default. Beside the plain row it
    shows what pipelining gains on a link and costs in messages where the CPUs are the bottleneck; it is never
    the headline.
torch.distributed.rpc
    The same ranks as above, each a process on its own host: ``ps{k}`` on ``s{k}`` (rank 0 rendezvouses at
    ``tcp://<s0's address>:29500``), ``trainer{r}`` on ``w{r}``. The emulated hosts share this machine's boot id,
    so TensorPipe would move tensors between them through shared memory and cross-memory attach; every rank
    therefore uses ``TensorPipeRpcBackendOptions(_transports=["uv"], _channels=["basic"])`` and has
    ``TP_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` set to its host's interface.
zmq
    Not a parameter server: the transport alone, as a ceiling. On each shard host a bare pyzmq ROUTER sends every
    message straight back (zero-copy), and on each worker host one process sends each shard its even part of the
    gradient (zero-copy, a DEALER per shard) and copies each echo into an array of its own, every step: the bytes
    a step moves over each link, with no sum, no round, no optimizer and no waiting for the other workers. Both
    run ``psrt.tune_allocator()``. Its row says what ZeroMQ itself carries over these links on this machine.
Ray
    A Ray cluster over the hosts: ``ray start --head --node-ip-address=<ip> --num-cpus=0`` on an extra host
    ``head``, which also runs the driver, and ``ray start --address=... --num-cpus=1 --resources='{"host_NAME":
    1}'`` on every shard and worker host (its own temporary directory, so no other Ray on the machine joins it);
    each ParameterServer and DataWorker actor is placed on its host by that custom resource, and objects move
    between the hosts' object stores over the links. The nodes start one after the other (started at once, they
    overload the GCS on a small machine and a node gives up), so Ray's start-up takes most of a minute. Ray's
    object manager may fetch a shard's parameters from a worker host that already holds a copy, so fewer bytes
    than the floor assumes may leave a shard host.

The report gives worker-steps/s, plain psrt's ratio to the faster peer and each row's ratio to the link floor.
The shard links are the narrow ones: every host's link has the same RATE, and all W workers share each
shard's link. A step moves ``W * (tensor bytes / S)`` into each shard host and as much out of it; with in and
out overlapping (full duplex) the fastest step takes ``W * (bytes / S) * TCP_OVERHEAD * 8 / RATE`` seconds
(:data:`psrt.emulation.perfmodel.TCP_OVERHEAD`: TCP/IP and Ethernet framing), so the floor is W divided by that
in worker-steps/s; a step whose pushes must all be in before its parameters go out (serialized) takes twice
that. As evidence that each system's bytes crossed the links, each row shows the byte counters of the shard
hosts' tbf qdiscs (``tc -s qdisc``) over the system's run, in and out, beside what an even split of the pushes
and pulls puts on each shard link. ``--json`` adds the link rate, the floors, each row's ratios to them and
these byte counts.

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
    python bench/peers.py --systems psrt,psrt-tuned,torch --elements 1000000 --workers 2 --servers 2 --json peers.json
    sudo python bench/peers.py --emulated --link 1gbit   # across emulated hosts: 1M and 10M, W=4, S=2
    sudo python bench/peers.py --emulated --link 10gbit --elements 1000000 --json emulated.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import multiprocessing
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import _common
import numpy as np
from _common import VARIANTS, BenchError, Variant, Workload

from psrt.control.process import (
    SERVER_READY,
    Child,
    describe_exit,
    parse_results,
    psrt_command,
    result_line,
    stop_children,
)
from psrt.emulation import perfmodel
from psrt.emulation.netns import check_available, parse_rate
from psrt.errors import PsrtError

SYSTEMS = (*VARIANTS, "ray", "torch")
#: The default workloads: (elements, W, S, timed steps).
WORKLOADS = ((10_000_000, 4, 2, 50), (1_000_000, 2, 2, 200))
TARGET = 1.5
STOPPED = re.compile(r"psrt-server stopped .*")
HERE = os.path.dirname(os.path.abspath(__file__))
#: ``--emulated``: its systems, its default workloads (elements, W, S, timed steps) and its default link.
EMULATED_SYSTEMS = ("psrt", "psrt-whole", "torch", "ray", "zmq")
EMULATED_WORKLOADS = ((1_000_000, 4, 2, 50), (10_000_000, 4, 2, 20))
EMULATED_LINK = "1gbit"
#: The port every emulated host's shard, rendezvous or Ray head listens on (each system gets fresh hosts).
PORT = 29500
#: The name VirtualCluster gives each host's end of its veth pair, inside the host's namespace.
IFNAME = "eth0"
RAY_STARTED = re.compile(r"Ray runtime started")
ECHO_READY = re.compile(r"zmq-echo ready at (\S+)")


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
def _ray_ps(workload: Workload, remaining: Callable[[], float],
            place: Callable[[str, int], dict[str, Any]] = lambda role, index: {}) -> dict[str, Any]:
    """The docs' synchronous parameter server on the Ray cluster this process is connected to.

    One ParameterServer actor per shard's slice of the tensor and one DataWorker actor per worker; ``place(role,
    index)`` gives each actor's ``.options()`` (``role`` is ``"server"`` or ``"worker"``; nothing on one host,
    a custom resource per host on the emulated cluster). Returns the driver's timing ``t0``/``t1`` and the check
    of the weights the last step returned.
    """
    import ray

    num_servers = workload.servers

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

    servers = [ParameterServer.options(**place("server", k)).remote(workload, k) for k in range(num_servers)]
    workers = [DataWorker.options(**place("worker", r)).remote(workload, r) for r in range(workload.workers)]

    def step(current_weights: list[Any]) -> list[Any]:
        gradients = [worker.compute_gradients.remote(*current_weights) for worker in workers]
        if num_servers == 1:
            gradients = [[g] for g in gradients]
        # Calculate the update after all gradients are available.
        return [ps.apply_gradients.remote(*[g[k] for g in gradients]) for k, ps in enumerate(servers)]

    try:
        current_weights = [ps.get_weights.remote() for ps in servers]
        current_weights = step(current_weights)  # warm-up (also waits for the actors to start)
        _log("ray", "actors up; warm-up step")
        ray.get(current_weights, timeout=remaining())
        t0 = time.monotonic()
        for _ in range(workload.steps):
            current_weights = step(current_weights)
        final = ray.get(current_weights, timeout=remaining())
        t1 = time.monotonic()
    except ray.exceptions.GetTimeoutError:
        raise BenchError(f"ray: the steps did not finish within --timeout {workload.timeout:g}s") from None
    return {"t0": t0, "t1": t1, **workload.check(np.concatenate(final))}


def _remaining(deadline: float, what: str, timeout: float) -> Callable[[], float]:
    """Seconds left until ``deadline``; raises :class:`BenchError` once it has passed."""
    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError(f"{what}: not done within --timeout {timeout:g}s")
        return left
    return remaining


def run_ray(workload: Workload, _options: argparse.Namespace) -> Outcome:
    """Ray: the docs' synchronous parameter server, one ParameterServer actor per half of the tensor."""
    import ray

    remaining = _remaining(time.monotonic() + workload.timeout, "ray", workload.timeout)
    store_bytes = max(256 << 20, 16 * 4 * workload.elements)
    # "local": a new Ray instance of this process's own, never a cluster some `ray start` left running.
    ray.init(address="local", num_cpus=workload.workers + workload.servers, include_dashboard=False,
             object_store_memory=store_bytes, logging_level=logging.WARNING)
    try:
        result = _ray_ps(workload, remaining)
    finally:
        ray.shutdown()
    outcome = Outcome("ray", timed_s=result["t1"] - result["t0"])
    outcome.rate = workload.workers * workload.steps / outcome.timed_s
    _merge_checks(outcome, [result])
    return outcome


# ---------------------------------------------------------------------------------------------------- torch
def run_torch(workload: Workload, options: argparse.Namespace) -> Outcome:
    """torch.distributed.rpc: the tutorials' batch-update parameter server, S server ranks and W trainer ranks."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)  # spawned ranks inherit sys.path and import _torch_ps by name
    import _torch_ps

    outcome = Outcome("torch")
    tcp_only = options.torch_transport == "tcp"  # None: auto
    got = _torch_ps.run(workload, tcp_only, time.monotonic() + workload.timeout, lambda m: _log("torch", m))
    outcome.rate, outcome.timed_s = _rate(workload, got)
    _merge_checks(outcome, got)
    outcome.detail = f"transport={'tcp' if tcp_only else 'auto'}"
    return outcome


# ---------------------------------------------------------------------------------------------------- emulated
def link_floor(elements: int, workers: int, servers: int, link_bits: float) -> dict[str, float]:
    """The fastest BSP step the shard links allow: a step moves W * (tensor bytes / S) over each shard's link in
    each direction (pushes in, parameters out), on TCP frames.

    Parameters
    ----------
    elements : int
        float32 values of the tensor.
    workers, servers : int
        W and S.
    link_bits : float
        Bits per second of every link in each direction.

    Returns
    -------
    dict
        ``shard_bytes_per_step`` (payload one way over one shard link), ``step_s`` and ``rate`` (worker-steps/s)
        with in and out overlapping (full duplex), and ``serialized_step_s``/``serialized_rate`` with the
        pushes of a step all in before its parameters go out (twice the time, half the rate).
    """
    shard_bytes = workers * 4 * elements / servers
    step_s = shard_bytes * perfmodel.TCP_OVERHEAD * 8 / link_bits
    return {"shard_bytes_per_step": shard_bytes, "step_s": step_s, "rate": workers / step_s,
            "serialized_step_s": 2 * step_s, "serialized_rate": workers / (2 * step_s)}


class _Printer:
    """What a process on an emulated host reports through: each result is one line on stdout."""

    @staticmethod
    def put(result: dict[str, Any]) -> None:
        print(result_line(result), flush=True)


def _role_command(role: str, **fields: Any) -> list[str]:
    """This script as the process ``role`` of an emulated host, with its arguments as one JSON object."""
    return [sys.executable, os.path.abspath(__file__), "--role", role, "--role-args", json.dumps(fields)]


def run_role(role: str, fields: dict[str, Any]) -> int:
    """Run one process of an emulated host (``--role``); results and errors go to stdout as result lines."""
    workload = Workload(**fields["workload"])
    if role == "psrt-worker":
        _psrt_worker(workload, VARIANTS["psrt"], fields["endpoints"], fields["rank"], _Printer())
        return 0
    if role == "torch-rank":
        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        import _torch_ps

        _torch_ps.run_rank(fields["rank"], workload, fields["port"], True, _Printer(), host=fields["host"])
        return 0
    if role == "zmq-echo":
        _zmq_echo(fields["bind"])
        return 0
    if role == "zmq-worker":
        try:
            _Printer.put(_zmq_worker(workload, fields["endpoints"], fields["rank"], fields["start_at"]))
        except BaseException:
            _Printer.put({"rank": fields["rank"], "error": traceback.format_exc()})
        return 0
    if role == "ray-driver":
        try:
            _Printer.put(_ray_driver(workload, fields["address"], fields["nodes"]))
        except BaseException:
            _Printer.put({"rank": "driver", "error": traceback.format_exc()})
        return 0
    raise BenchError(f"unknown role {role!r}")


def _zmq_echo(bind: str) -> None:
    """The transport alone, a shard host's side: a bare ROUTER sending every message straight back, zero-copy,
    until its parent stops it."""
    import zmq

    from psrt import tune_allocator

    tune_allocator()
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(bind)
    print(f"zmq-echo ready at {bind}", flush=True)
    while True:
        if sock.poll(1000):
            sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


def _zmq_worker(workload: Workload, endpoints: list[str], rank: int, start_at: float) -> dict[str, Any]:
    """The transport alone, a worker host's side: each step, each shard's even part of the gradient out
    (zero-copy) and its echo copied into an array of this process's, as a client's push_pull moves them; the
    timed steps start at ``start_at`` (wall clock) on every worker at once. The check: every echo is what was
    sent."""
    import zmq

    from psrt import tune_allocator

    tune_allocator()
    context = zmq.Context()
    socks = []
    for endpoint in endpoints:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        socks.append(sock)
    parts = np.array_split(workload.gradient(rank), len(endpoints))
    echoes = [np.empty_like(p) for p in parts]
    wait_ms = int(workload.timeout * 1000)

    def step() -> None:
        for sock, part in zip(socks, parts):
            sock.send(part, copy=False)
        for sock, echo in zip(socks, echoes):
            if not sock.poll(wait_ms):
                raise BenchError(f"no echo within {workload.timeout:g}s")
            echo[:] = np.frombuffer(sock.recv(copy=False), echo.dtype)

    step()  # warm-up (and every connection made)
    time.sleep(max(0.0, start_at - time.time()))
    t0 = time.monotonic()
    for _ in range(workload.steps):
        step()
    t1 = time.monotonic()
    ok = all(np.array_equal(e, p) for e, p in zip(echoes, parts))
    context.destroy(linger=0)
    return {"rank": rank, "t0": t0, "t1": t1, "ok": ok, "max_err": 0.0, "tol": 0.0}


def _ray_driver(workload: Workload, address: str, nodes: int) -> dict[str, Any]:
    """The Ray driver on the head host: wait for every node, then run the docs' PS with one actor per host."""
    import ray

    remaining = _remaining(time.monotonic() + workload.timeout, "ray", workload.timeout)
    ray.init(address=address, logging_level=logging.WARNING)
    try:
        while len([n for n in ray.nodes() if n["Alive"]]) < nodes:
            remaining()
            time.sleep(0.2)
        hosts = {"server": "s", "worker": "w"}
        return _ray_ps(workload, remaining, lambda role, index: {"resources": {f"host_{hosts[role]}{index}": 1}})
    finally:
        ray.shutdown()


def _gather(children: list[Child], expected: int, deadline: float, what: str) -> list[dict[str, Any]]:
    """``expected`` result lines from the output of ``children`` before ``deadline``; a reported error, a child
    that exits with a non-zero code or dies before its results, or the deadline raise :class:`BenchError`."""
    while True:
        results = [r for c in children for r in parse_results(c.output)]
        errors = [r for r in results if "error" in r]
        if errors:
            raise BenchError(f"{what}: rank {errors[0].get('rank')} failed:\n{errors[0]['error']}")
        if len(results) >= expected:
            return results
        ended = [c for c in children if c.poll() is not None]
        for c in ended:
            c.wait(5.0)  # its last lines
        if any(c.returncode != 0 for c in ended) or len(ended) == len(children):
            if any("error" in r for c in ended for r in parse_results(c.output)):
                continue  # report the child's own words
            c = next((c for c in ended if c.returncode != 0), ended[0])
            raise BenchError(f"{what}: {c.label} {describe_exit(c.returncode)} with {len(results)} of {expected} "
                             f"results:\n{c.tail()}")
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: {len(results)} of {expected} results arrived before the deadline (--timeout)")
        time.sleep(0.05)


def _ready(child: Child, deadline: float, what: str) -> None:
    try:
        child.wait_ready(max(1.0, deadline - time.monotonic()))
    except PsrtError as exc:
        raise BenchError(f"{what}: {exc}") from None


def _sent_bytes(cmd: list[str]) -> int:
    """The ``Sent N bytes`` of the tbf qdisc ``tc -s qdisc show`` lists."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    m = re.search(r"qdisc tbf .*\n\s*Sent (\d+) bytes", proc.stdout)
    if proc.returncode or not m:
        raise BenchError(f"`{' '.join(cmd)}` gave no tbf byte count: {proc.stdout.strip()} {proc.stderr.strip()}")
    return int(m.group(1))


def link_bytes(vc: Any, host: str) -> tuple[int, int]:
    """Bytes ``host``'s shaped link has carried so far: (into the host, out of it), from the byte counters of
    its two tbf qdiscs (the bridge's end of its veth pair sends into the host, the host's end sends out)."""
    return (_sent_bytes(["tc", "-s", "qdisc", "show", "dev", vc.veth(host)]),
            _sent_bytes(["ip", "netns", "exec", vc.namespace(host), "tc", "-s", "qdisc", "show", "dev", IFNAME]))


def run_psrt_hosts(vc: Any, workload: Workload, name: str = "psrt") -> Outcome:
    """psrt, one process per host: ``psrt server --bind tcp://IP:PORT`` on each shard host (no scheduler) and
    on each worker host the README's loop against them (``psrt-whole``: with ``PSRT_PIPELINE=off``)."""
    deadline = time.monotonic() + workload.timeout
    outcome = Outcome(name)
    env = {"PSRT_PIPELINE": "off"} if name == "psrt-whole" else None
    servers: list[Child] = []
    workers: list[Child] = []
    try:
        for k in range(workload.servers):
            bind = f"tcp://{vc.address(f's{k}')}:{PORT}"
            servers.append(vc.spawn(f"s{k}", psrt_command("server", "--bind", bind, "--workers",
                                                          str(workload.workers), "--mode", "sync"),
                                    ready=SERVER_READY, label=f"psrt server {k}"))
        for server in servers:
            _ready(server, deadline, "psrt")
        endpoints = [s.endpoint for s in servers]
        _log("psrt", f"servers at {', '.join(endpoints)}; starting {workload.workers} workers on their hosts")
        workers += [vc.spawn(f"w{r}", _role_command("psrt-worker", workload=asdict(workload), endpoints=endpoints,
                                                      rank=r), env=env, label=f"psrt worker {r}")
                    for r in range(workload.workers)]
        got = _gather(workers, workload.workers, deadline, "psrt")
    finally:
        stop_children(workers, grace=10.0)
        stop_children(servers, grace=10.0)  # each says what it served
    outcome.rate, outcome.timed_s = _rate(workload, got)
    _merge_checks(outcome, got)
    outcome.detail = "; ".join(m.group(0) for m in (STOPPED.search(s.output) for s in servers) if m)
    return outcome


def run_torch_hosts(vc: Any, workload: Workload) -> Outcome:
    """torch.distributed.rpc, one rank per host: ``ps{k}`` on host ``s{k}``, ``trainer{r}`` on ``w{r}``;
    TensorPipe limited to TCP (``uv``) and the ``basic`` channel, listening on the host's own interface."""
    deadline = time.monotonic() + workload.timeout
    outcome = Outcome("torch")
    hosts = [f"s{k}" for k in range(workload.servers)] + [f"w{r}" for r in range(workload.workers)]
    master = vc.address("s0")
    # The emulated hosts share this machine's boot id, so TensorPipe would take its shared-memory and
    # cross-memory-attach paths between them; uv + basic and the host's interface keep every byte on the links.
    env = {"TP_SOCKET_IFNAME": IFNAME, "GLOO_SOCKET_IFNAME": IFNAME}
    _log("torch", f"{len(hosts)} RPC ranks, one per host (rendezvous tcp://{master}:{PORT}, transport uv, "
                  f"channel basic, interface {IFNAME})")
    ranks: list[Child] = []
    try:
        ranks += [vc.spawn(host, _role_command("torch-rank", workload=asdict(workload), rank=rank, host=master,
                                               port=PORT), env=env, label=f"torch rank {rank}")
                  for rank, host in enumerate(hosts)]
        got = _gather(ranks, workload.workers, deadline, "torch")
        for rank in ranks:  # a graceful rpc.shutdown() on every rank
            rank.wait(max(1.0, min(30.0, deadline - time.monotonic())))
    except PsrtError as exc:
        raise BenchError(f"torch: {exc}") from None
    finally:
        stop_children(ranks, grace=5.0)
    outcome.rate, outcome.timed_s = _rate(workload, got)
    _merge_checks(outcome, got)
    outcome.detail = f"transport=uv, channel=basic, interface={IFNAME}"
    return outcome


def run_zmq_hosts(vc: Any, workload: Workload) -> Outcome:
    """The transport alone (not a parameter server): a bare pyzmq echo on each shard host, and on each worker
    host a process sending each shard its part of the gradient and copying the echoes in, every step."""
    deadline = time.monotonic() + workload.timeout
    outcome = Outcome("zmq")
    echoes: list[Child] = []
    workers: list[Child] = []
    try:
        for k in range(workload.servers):
            bind = f"tcp://{vc.address(f's{k}')}:{PORT}"
            echoes.append(vc.spawn(f"s{k}", _role_command("zmq-echo", workload=asdict(workload), bind=bind),
                                   ready=ECHO_READY, label=f"zmq echo {k}"))
        for echo in echoes:
            _ready(echo, deadline, "zmq")
        endpoints = [e.endpoint for e in echoes]
        start_at = time.time() + 5.0  # every worker process started and connected by then
        workers += [vc.spawn(f"w{r}", _role_command("zmq-worker", workload=asdict(workload), endpoints=endpoints,
                                                      rank=r, start_at=start_at), label=f"zmq worker {r}")
                    for r in range(workload.workers)]
        got = _gather(workers, workload.workers, deadline, "zmq")
    finally:
        stop_children(workers, grace=10.0)
        stop_children(echoes, grace=2.0)
    outcome.rate, outcome.timed_s = _rate(workload, got)
    _merge_checks(outcome, got)
    outcome.detail = "the transport alone: echoes, no sum, no round, no optimizer"
    return outcome


def run_ray_hosts(vc: Any, workload: Workload) -> Outcome:
    """Ray, one node per host: ``ray start --head`` and the driver on host ``head``, a node on every shard and
    worker host, each offering a custom resource ``host_NAME`` that places one actor there."""
    import shutil
    import tempfile

    deadline = time.monotonic() + workload.timeout
    outcome = Outcome("ray")
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    if not os.path.exists(ray_cli):
        ray_cli = shutil.which("ray") or ray_cli
    # A temporary directory of its own: no other Ray on this machine finds (and joins) this cluster.
    tmp = tempfile.mkdtemp(prefix="psrt-ray-")
    store = str(max(256 << 20, 8 * 4 * workload.elements))
    head = vc.address("head")
    common = ["--disable-usage-stats", "--block", "--object-store-memory", store]
    # Ray's token authentication, with a token of this cluster's own for every node and the driver: left to
    # itself, Ray turns it on for a head whenever ~/.ray/auth_token exists (any local ray.init() writes one) but
    # not for the nodes joining it, which the head then refuses.
    token = os.path.join(tmp, "auth_token")
    with open(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(secrets.token_hex(32))
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token}
    nodes: list[Child] = []
    driver: Optional[Child] = None
    try:
        nodes.append(vc.spawn("head", [ray_cli, "start", "--head", f"--node-ip-address={head}", f"--port={PORT}",
                                       "--num-cpus=0", "--include-dashboard=false", f"--temp-dir={tmp}", *common],
                              ready=RAY_STARTED, label="ray head", env=env))
        _ready(nodes[0], deadline, "ray")
        hosts = [f"s{k}" for k in range(workload.servers)] + [f"w{r}" for r in range(workload.workers)]
        _log("ray", f"head on {head}; starting {len(hosts)} nodes, one after the other")
        for h in hosts:  # all at once, they overload the GCS of a small machine, and a node gives up starting
            nodes.append(vc.spawn(h, [ray_cli, "start", f"--address={head}:{PORT}",
                                      f"--node-ip-address={vc.address(h)}", "--num-cpus=1",
                                      f"--resources={json.dumps({f'host_{h}': 1})}", *common],
                                  ready=RAY_STARTED, label=f"ray node {h}", env=env))
            _ready(nodes[-1], deadline, "ray")
        driver = vc.spawn("head", _role_command("ray-driver", workload=asdict(workload), address=f"{head}:{PORT}",
                                                nodes=1 + len(hosts)), label="ray driver", env=env)
        (got,) = _gather([driver, *nodes], 1, deadline, "ray")
    finally:
        stop_children([driver, *nodes] if driver else nodes, grace=10.0)
        shutil.rmtree(tmp, ignore_errors=True)
    outcome.timed_s = got["t1"] - got["t0"]
    outcome.rate = workload.workers * workload.steps / outcome.timed_s
    _merge_checks(outcome, [got])
    return outcome


EMULATED_RUNNERS: dict[str, Callable[[Any, Workload], Outcome]] = {
    "psrt": run_psrt_hosts, "psrt-whole": lambda vc, workload: run_psrt_hosts(vc, workload, "psrt-whole"),
    "torch": run_torch_hosts, "ray": run_ray_hosts, "zmq": run_zmq_hosts}


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _run_emulated_workload(workload: Workload, systems: list[str], link: str) -> dict[str, Any]:
    """Every system on the workload, each on a fresh emulated cluster; print the table; the workload's record."""
    from psrt.emulation.netns import VirtualCluster

    link_bits = parse_rate(link)
    floor = link_floor(workload.elements, workload.workers, workload.servers, link_bits)
    shard_hosts = [f"s{k}" for k in range(workload.servers)]
    worker_hosts = [f"w{r}" for r in range(workload.workers)]
    # What a step's pushes and pulls put on each shard link, each way, if the tensor is split evenly.
    payload = (workload.steps + 1) * floor["shard_bytes_per_step"]
    print(f"\n=== emulated cluster, every host's link {link} each way (tc tbf): {workload.elements:,} float32 "
          f"({4 * workload.elements / 1e6:.3g} MB), W={workload.workers} workers on hosts "
          f"{worker_hosts[0]}..{worker_hosts[-1]}, S={workload.servers} shards on {shard_hosts[0]}..{shard_hosts[-1]}, "
          f"BSP, SGD lr={workload.lr}, 1 warm-up + {workload.steps} timed steps; rows: {', '.join(systems)}",
          flush=True)
    print(f"link floor: a step moves W*(bytes/S) = {_mb(floor['shard_bytes_per_step'])} over each shard link in "
          f"and as much out; full duplex {floor['step_s'] * 1e3:.1f} ms/step = {floor['rate']:.2f} worker-steps/s, "
          f"serialized {floor['serialized_rate']:.2f}", flush=True)
    outcomes: dict[str, Outcome] = {}
    traffic: dict[str, dict[str, dict[str, int]]] = {}
    for name in systems:
        if importlib.util.find_spec(name.split("-")[0]) is None:
            outcomes[name] = Outcome(name, status="skipped",
                                     message=f"package {name!r} is not installed (pip install {name})")
            _log(name, f"skipped: {outcomes[name].message}")
            continue
        hosts = shard_hosts + worker_hosts + (["head"] if name == "ray" else [])

        def run(name: str = name, hosts: list[str] = hosts) -> Outcome:
            with VirtualCluster(hosts, link=link) as vc:
                before = {h: link_bytes(vc, h) for h in shard_hosts}
                outcome = EMULATED_RUNNERS[name](vc, workload)
                after = {h: link_bytes(vc, h) for h in shard_hosts}
            traffic[name] = {h: {"in": after[h][0] - before[h][0], "out": after[h][1] - before[h][1]}
                             for h in shard_hosts}
            return outcome

        outcome = _attempt(name, workload, run)
        if outcome.status == "ok":
            _log(name, f"{outcome.rate:.2f} worker-steps/s = {outcome.rate / floor['rate']:.2f}x the full-duplex "
                       f"floor, over {outcome.timed_s:.2f}s; check {'OK' if outcome.check_ok else 'WRONG'}: "
                       f"max |w - (w0 - N*lr*mean(g))| = {outcome.max_err:.2e} <= {outcome.tol:.2e} is "
                       f"{outcome.check_ok} (N={workload.steps + 1}); {outcome.wall_s:.1f}s with start-up"
                       + (f"; {outcome.detail}" if outcome.detail else ""))
            # The evidence that the bytes crossed the shaped links: the shard links' tbf byte counters.
            _log(name, "shard links carried (tbf byte counters, in / out): " + ", ".join(
                f"{h} {_mb(c['in'])} / {_mb(c['out'])}" for h, c in traffic[name].items())
                 + f"; an even split of the pushes and pulls is {_mb(payload)} each way per shard link")
        outcomes[name] = outcome
    best = max((o for n, o in outcomes.items() if n in ("ray", "torch") and o.status == "ok" and o.rate > 0),
               key=lambda o: o.rate, default=None)
    psrt = outcomes.get("psrt")
    ratio = psrt.rate / best.rate if best and psrt is not None and psrt.status == "ok" else None
    _print_emulated_table(outcomes, floor, traffic, payload)
    if ratio is not None:
        print(f"plain psrt / the faster peer ({best.system}): {ratio:.2f}x")
    echo = outcomes.get("zmq")
    if psrt is not None and psrt.status == "ok" and echo is not None and echo.status == "ok" and echo.rate > 0:
        print(f"plain psrt / the transport alone (zmq): {psrt.rate / echo.rate:.2f}x")
    return {"workload": asdict(workload), "link": link, "link_bits": link_bits, "floor": floor,
            "payload_bytes_per_shard_link": payload,
            "systems": {n: {**asdict(o), "to_floor": o.rate / floor["rate"] if o.status == "ok" else None,
                            "to_serialized_floor": o.rate / floor["serialized_rate"] if o.status == "ok" else None,
                            "shard_link_bytes": traffic.get(n)}
                        for n, o in outcomes.items()},
            "psrt_to_best_peer": ratio, "best_peer": best.system if best else None}


def _print_emulated_table(outcomes: dict[str, Outcome], floor: dict[str, float],
                          traffic: dict[str, dict[str, dict[str, int]]], payload: float) -> None:
    psrt = outcomes.get("psrt")
    psrt_rate = psrt.rate if psrt is not None and psrt.status == "ok" else 0.0
    print()
    print(f"{'system':<10} {'worker-steps/s':>14} {'psrt/row':>9} {'/floor':>7} {'timed s':>8} "
          f"{'shard links in/out, x even payload':>36}  correctness")
    print("-" * 110)
    for name, o in outcomes.items():
        if o.status != "ok":
            print(f"{name:<10} {'-':>14} {'-':>9} {'-':>7} {'-':>8} {'-':>36}  {o.status}: {o.message.splitlines()[0]}")
            continue
        ratio = f"{psrt_rate / o.rate:.2f}x" if psrt_rate and o.rate else "-"
        links = " ".join(f"{c['in'] / payload:.2f}/{c['out'] / payload:.2f}" for c in traffic[name].values())
        check = f"{'OK' if o.check_ok else 'WRONG'} (max err {o.max_err:.2e}, bound {o.tol:.2e})"
        print(f"{name:<10} {o.rate:>14.2f} {ratio:>9} {o.rate / floor['rate']:>6.2f}x {o.timed_s:>8.2f} "
              f"{links:>36}  {check}")
    print("-" * 110)
    print(f"link floor (W*(bytes/S) in and out of each shard link per step, TCP framing): full duplex "
          f"{floor['rate']:.2f} worker-steps/s, serialized {floor['serialized_rate']:.2f}")


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
                                            "10M/W=4/S=2 and 1M/W=2/S=2; with --emulated every process on a host "
                                            "of its own, over shaped links.")
    p.add_argument("--elements", type=_common.parse_size,
                   help="float32 values in the tensor, e.g. 1000000 or 64K (K, M: binary multiples): run this one "
                        "workload instead of the default two (default 10000000)")
    p.add_argument("--workers", type=int, help="worker processes W of the one workload (default 4)")
    p.add_argument("--servers", type=int, help="parameter-server shards S of the one workload (default 2)")
    p.add_argument("--steps", type=int, help="timed steps per worker after one warm-up step (default 50 for "
                                             "10M, 200 for 1M; 50 for a workload of your own; with --emulated "
                                             "50 for 1M, 20 for 10M and for a workload of your own)")
    p.add_argument("--systems",
                   help=f"comma-separated subset of the rows, run in this order (default {','.join(SYSTEMS)}; "
                        f"with --emulated a subset of {','.join(EMULATED_SYSTEMS)}, all by default)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (%(default)s)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one system may take, start-up included (%(default)s)")
    p.add_argument("--torch-transport", choices=("tcp", "auto"),
                   help="TensorPipe transport on one host: auto (its defaults: shared memory between processes of "
                        "one host) or tcp (loopback TCP only) (default auto; --emulated always uses TCP)")
    p.add_argument("--emulated", action="store_true",
                   help="run psrt, torch and Ray on an emulated cluster (needs root): every process on a host of "
                        "its own (a network namespace), every host's link shaped to --link each way; default "
                        "workloads 1M and 10M float32, W=4, S=2")
    p.add_argument("--link", metavar="RATE",
                   help=f"with --emulated: every host's link, each way, e.g. 1gbit or 500mbit "
                        f"(default {EMULATED_LINK})")
    p.add_argument("--role", choices=("psrt-worker", "torch-rank", "ray-driver", "zmq-echo", "zmq-worker"),
                   help=argparse.SUPPRESS)
    p.add_argument("--role-args", default="{}", help=argparse.SUPPRESS)
    return p


def _attempt(name: str, workload: Workload, run: Callable[[], Outcome]) -> Outcome:
    """Run one system's ``run()``, timed with its start-up; a failure becomes a failed row (one broken system must
    not hide the others' results), Ctrl-C stops the bench."""
    t = time.monotonic()
    try:
        outcome = run()
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        message = str(exc) if isinstance(exc, (BenchError, PsrtError)) else traceback.format_exc()
        outcome = Outcome(name, status="failed", message=message)
        print(f"[{name}] FAILED: {message}", file=sys.stderr, flush=True)
    outcome.wall_s = time.monotonic() - t
    if outcome.status == "ok":
        outcome.gbps = workload.workers * workload.steps * 2 * 4 * workload.elements / outcome.timed_s / 1e9
    return outcome


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
        outcome = _attempt(name, workload, lambda name=name: _runner(name)(workload, args))
        if outcome.status == "ok":
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


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # the same clean-up as Ctrl-C: children stopped, namespaces removed


def main(argv: Optional[list[str]] = None) -> int:
    """Run the workloads, each with the selected systems one after the other; print the tables and targets."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.role:
        return run_role(args.role, json.loads(args.role_args))
    allowed = EMULATED_SYSTEMS if args.emulated else SYSTEMS
    systems = [s.strip() for s in (args.systems or ",".join(allowed)).split(",") if s.strip()]
    unknown = sorted(set(systems) - set(allowed))
    if unknown or not systems or len(set(systems)) != len(systems):
        where = " with --emulated" if args.emulated else ""
        parser.error(f"--systems takes a comma-separated subset of {','.join(allowed)}{where}, got {args.systems!r}")
    if args.emulated:
        if args.torch_transport is not None:
            parser.error("--torch-transport applies to one host only: --emulated always limits TensorPipe to TCP")
        args.link = args.link or EMULATED_LINK
        try:
            parse_rate(args.link)
            check_available()
        except PsrtError as exc:
            parser.error(str(exc))
    elif args.link is not None:
        parser.error("--link applies only with --emulated")
    custom = (args.elements, args.workers, args.servers) != (None, None, None)
    if custom:
        shapes = [(args.elements or 10_000_000, args.workers or 4, args.servers or 2, 20 if args.emulated else 50)]
    else:
        shapes = list(EMULATED_WORKLOADS if args.emulated else WORKLOADS)
    if any(w < 1 or s < 1 or e < s for e, w, s, _ in shapes) or (args.steps is not None and args.steps < 1):
        parser.error("--workers, --servers and --steps must be >= 1 and --elements >= --servers")
    if not args.timeout > 0 or not args.lr > 0:
        parser.error("--timeout and --lr must be > 0")
    workloads = [Workload(elements=e, workers=w, servers=s, steps=args.steps or steps, lr=args.lr,
                          timeout=args.timeout) for e, w, s, steps in shapes]
    started = time.monotonic()
    reports = []
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        for workload in workloads:
            if args.emulated:
                reports.append(_run_emulated_workload(workload, systems, args.link))
            else:
                reports.append(_run_workload(workload, systems, args))
    except KeyboardInterrupt:
        print("\ninterrupted; children stopped" + (", emulated hosts removed" if args.emulated else ""),
              file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    elapsed = time.monotonic() - started
    print()
    for r in reports:
        w = r["workload"]
        shape = f"{w['elements']:,} float32, W={w['workers']}, S={w['servers']}"
        if args.emulated:
            rates = ", ".join(f"{n} {o['rate']:.2f} ({o['to_floor']:.2f}x floor)" if o["status"] == "ok" else
                              f"{n} {o['status']}" for n, o in r["systems"].items())
            ratio = f"; psrt / {r['best_peer']} {r['psrt_to_best_peer']:.2f}x" if r["psrt_to_best_peer"] else ""
            print(f"{shape}, links {r['link']}: worker-steps/s {rates}; floor {r['floor']['rate']:.2f}{ratio}")
        else:
            print(f"{shape}: {_target_line(r['target'])}")
    print(f"total {elapsed:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            record: dict[str, Any] = {"workloads": reports, "elapsed_s": elapsed,
                                      "argv": sys.argv[1:] if argv is None else argv}
            if args.emulated:
                record.update(mode="emulated", link=args.link, link_bits=parse_rate(args.link))
            json.dump(record, f, indent=2)
            f.write("\n")
    failed = any(o["status"] == "failed" or o["check_ok"] is False for r in reports for o in r["systems"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
