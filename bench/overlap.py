"""Step time of a PyTorch model with and without overlapping communication and compute (psrt.torch).

One shard server and one worker run on two emulated hosts (network namespaces,
:class:`psrt.emulation.netns.VirtualCluster`) whose links are shaped with ``tc ... tbf``. The link rate is chosen so
that the serial step's communication (push every gradient, pull every parameter) takes about as long as the model's
forward and backward on this machine: the script first times the compute here, then sets ``rate = model bytes /
compute time`` (``--link`` overrides it). Once, not twice the bytes: across hosts a ``push_pull`` sends its pieces
and receives the answers to the first ones at once (:mod:`psrt.partition`, ``ClientConfig.pipeline``), so the
model's bytes cross each direction of the link side by side (with ``PSRT_PIPELINE=off``, one after the other:
twice the time). The printed ``comm / compute`` says how close the calibration came. The worker then measures,
each as the median of its steps (the four take turns, ``--rounds`` times ``--steps`` steps, so a change in the
machine's load touches all of them alike):

- ``compute``: forward + backward of the model alone, no psrt;
- ``comm``: ``client.push_pull`` of every gradient alone, no compute;
- ``serial``: a training step with ``DistributedOptimizer(overlap=False)`` (backward, then push and pull all);
- ``overlap``: a training step with ``DistributedOptimizer()``, the default: pushes from the backward hooks, each
  pull asked for as soon as its push is acknowledged, first layers first (at most ``--window`` bytes in flight,
  the library's default unless given, and no more than keeps the link busy: :class:`psrt.worker.overlap.Pace`);
  ``step()`` returns when every parameter holds its new value;
- ``overlap_forward``: the same with ``overlap_forward=True``: ``step()`` returns at once and the next forward
  waits, module by module, for the pulls still in flight.

It prints the step times, the ratios ``overlap / (compute + comm)`` and ``overlap / serial`` of the default
(target: both <= 0.8, PASS or MISS; the serial step is compute + comm measured back to back, so on a loaded
machine the stricter of the two is judged), the same ratios for ``overlap_forward`` beside it (not judged), and
each step's time split (forward including its waits for parameters, backward including its pushes, step).

Usage (root: namespaces, veth, tc)::

    python bench/overlap.py                  # calibrated link
    python bench/overlap.py --json overlap.json
    python bench/overlap.py --loopback       # no root, no shaping: communication is then far below compute

Needs torch: ``pip install -e ".[bench,torch]"``.

``--loadgen`` measures the load generator's overlap instead (``psrt worker --overlap``, no torch needed): the same
two hosts, a sized model split into ``--layers`` tensors, ``--compute-ms`` of emulated (sleeping) compute, and the
link calibrated the same way, so that one ``push_pull`` of the model takes about the compute time. It times, as the
median of ``--rounds`` turns, a ``psrt worker`` of each kind: ``comm`` (``--compute-ms 0``: push_pull alone),
``serial`` (compute, then push_pull) and ``overlap`` (``--overlap``), and prints the overlapped step against
``max(compute, comm)`` (target: <= 1.25x) and against ``compute + comm``::

    python bench/overlap.py --loadgen                       # 2MB in 16 layers, 100 ms of compute
    python bench/overlap.py --loadgen --loopback            # unshaped: communication far below compute
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from typing import Any, Callable, Iterator, Optional

import psrt
from psrt.control.process import SERVER_READY, Child, parse_results, psrt_command, result_line
from psrt.emulation.models import model_bytes as tensors_bytes
from psrt.emulation.models import model_tensors
from psrt.emulation.netns import VirtualCluster, check_available
from psrt.worker.overlap import DEFAULT_WINDOW

try:  # optional: `--help` works without it, and main() says what to install
    import torch

    import psrt.torch
except ImportError:
    torch = None

TARGET = 0.8
#: The load generator's overlapped step, at most this many times max(compute, comm).
LOADGEN_TARGET = 1.25


def make_model(depth: int, width: int) -> Any:  # a torch.nn.Module
    """An MLP of ``depth`` ``width``-wide layers: many equal layers, so the pipeline has stages to overlap."""
    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def model_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def time_compute(model: Any, x: Any, y: Any, steps: int) -> float:
    """Median seconds of forward + backward."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """The measuring worker (inside the worker host's namespace); returns the result record.

    The four measurements take turns, ``--rounds`` times ``--steps`` steps each (the first step of every turn is
    not counted), so that a change in the machine's load during the run touches all of them alike.
    """
    torch.set_num_threads(1)
    model = make_model(args.depth, args.width)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    grads = {n: torch.zeros_like(p).numpy() for n, p in model.named_parameters()}
    out = {n: p.detach().numpy() for n, p in model.named_parameters()}
    modes = ("serial", "overlap", "overlap_forward")
    times: dict[str, list[float]] = {"compute": [], "comm": [], **{m: [] for m in modes}}
    split: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    with psrt.Client([args.server], rank=0, num_workers=1) as client:
        client.init(out, optimizer=psrt.SGD(lr=1e-4))
    for _ in range(args.rounds):
        times["compute"] += [time_compute(model, x, y, 1) for _ in range(args.steps)][1:]
        with psrt.Client([args.server], rank=0, num_workers=1) as client:
            client.init(out, optimizer=psrt.SGD(lr=1e-4))  # registers the tensors with this client
            for i in range(args.steps):
                t = time.perf_counter()
                client.push_pull(grads, out=out)
                if i:
                    times["comm"].append(time.perf_counter() - t)
        for mode in modes:
            # A client per turn: the shard keeps the tensors (the first init won); only the schedule changes.
            with psrt.Client([args.server], rank=0, num_workers=1) as client, psrt.torch.DistributedOptimizer(
                    model.named_parameters(), optimizer=psrt.SGD(lr=1e-4), client=client,
                    overlap=mode != "serial", overlap_forward=mode == "overlap_forward", window=args.window) as opt:
                for i in range(args.steps):
                    t0 = time.perf_counter()
                    opt.zero_grad()
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    t1 = time.perf_counter()
                    loss.backward()
                    t2 = time.perf_counter()
                    opt.step()
                    t3 = time.perf_counter()
                    if i:
                        times[mode].append(t3 - t0)
                        split[mode].append((t1 - t0, t2 - t1, t3 - t2))
                opt.synchronize()
    result: dict[str, Any] = {"model_bytes": model_bytes(model)}
    for k, v in times.items():
        result[f"{k}_s"] = statistics.median(v)
    for mode, s in split.items():
        result[f"{mode}_split_s"] = {k: statistics.median(row[i] for row in s)
                                     for i, k in enumerate(("forward", "backward", "step"))}
    return result


@contextlib.contextmanager
def one_shard(loopback: bool, link: Optional[str]) -> Iterator[tuple[str, Callable[[list[str]], Child]]]:
    """A sync shard for one worker, on its own emulated host linked at ``link`` (or on loopback); yields its
    endpoint and ``start(cmd)``, which runs a command on the worker's host. Everything stops on the way out."""
    vc: Optional[VirtualCluster] = None
    procs: list[Child] = []
    try:
        if not loopback:
            check_available()
            vc = VirtualCluster(["server", "worker"], link=link)
        host = vc.address("server") if vc else "127.0.0.1"
        cmd = psrt_command("server", "--bind", f"tcp://{host}:*", "--workers", "1", "--mode", "sync")
        server = vc.spawn("server", cmd, ready=SERVER_READY) if vc else Child(cmd, ready=SERVER_READY, label="server")
        procs.append(server)

        def start(wcmd: list[str]) -> Child:
            procs.append(vc.spawn("worker", wcmd, label="worker") if vc else Child(wcmd, label="worker"))
            return procs[-1]

        yield server.wait_ready(30).group(1), start
    finally:
        for p in procs:
            p.stop()
        if vc is not None:
            vc.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the emulated hosts, the shard and the worker; returns the worker's record plus the link."""
    torch.set_num_threads(1)
    model = make_model(args.depth, args.width)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    nbytes = model_bytes(model)
    link = args.link
    if link is None and not args.loopback:
        time_compute(model, x, y, 2)  # warm up
        compute = time_compute(model, x, y, 9)
        link = f"{int(nbytes * 8 / compute / 1e6)}mbit"  # push and pull cross the link side by side
        print(f"model {nbytes / 1e6:.2f} MB, compute {compute * 1e3:.0f} ms here: link {link}", flush=True)
    with one_shard(args.loopback, link) as (endpoint, start):
        wcmd = [sys.executable, __file__, "--role", "worker", "--server", endpoint, "--depth", str(args.depth),
                "--width", str(args.width), "--batch", str(args.batch), "--steps", str(args.steps),
                "--rounds", str(args.rounds),
                "--window", str(args.window)]
        w = start(wcmd)
        out = w.communicate(timeout=600)
        if w.returncode != 0:
            raise RuntimeError(f"the worker failed ({w.returncode}):\n{out[-3000:]}")
        record = parse_results(out)[0]
    record.update(link=link or "loopback", depth=args.depth, width=args.width, batch=args.batch,
                  window=args.window)
    record["ratio"] = record["overlap_s"] / (record["compute_s"] + record["comm_s"])
    record["serial_ratio"] = record["serial_s"] / (record["compute_s"] + record["comm_s"])
    record["overlap_vs_serial"] = record["overlap_s"] / record["serial_s"]
    record["overlap_forward_ratio"] = record["overlap_forward_s"] / (record["compute_s"] + record["comm_s"])
    record["overlap_forward_vs_serial"] = record["overlap_forward_s"] / record["serial_s"]
    # Judged against the smaller of the two measures of compute + comm: the parts timed apart, and the serial
    # step that runs them one after the other (on a loaded machine either may come out high).
    record["pass"] = bool(max(record["ratio"], record["overlap_vs_serial"]) <= TARGET)
    return record


def run_loadgen(args: argparse.Namespace) -> dict[str, Any]:
    """The load generator's steps, serial and overlapped, on the calibrated link (module docstring)."""
    nbytes = tensors_bytes(model_tensors(args.model, layers=args.layers))
    link = args.link
    if link is None and not args.loopback:
        link = f"{int(nbytes * 8 / (args.compute_ms / 1e3) / 1e6)}mbit"  # push and pull side by side ~ compute
    times: dict[str, list[float]] = {"comm": [], "serial": [], "overlap": []}
    with one_shard(args.loopback, link) as (endpoint, start):

        def step_ms(compute_ms: float, overlap: bool) -> float:
            wcmd = psrt_command("worker", "--servers", endpoint, "--rank", "0", "--workers", "1", "--model",
                                args.model, "--layers", str(args.layers), "--compute-ms", str(compute_ms),
                                "--steps", str(args.steps), "--warmup", "2", *(["--overlap"] if overlap else []))
            w = start(wcmd)
            out = w.communicate(timeout=300)
            if w.returncode != 0:
                raise RuntimeError(f"the worker failed ({w.returncode}):\n{out[-3000:]}")
            (result,) = parse_results(out)
            return 1e3 * result["seconds"] / result["steps"]

        for _ in range(args.rounds):  # turns: a change in the machine's load touches all three alike
            times["comm"].append(step_ms(0, False))
            times["serial"].append(step_ms(args.compute_ms, False))
            times["overlap"].append(step_ms(args.compute_ms, True))
    record: dict[str, Any] = {f"{k}_ms": statistics.median(v) for k, v in times.items()}
    record.update(link=link or "loopback", model=args.model, layers=args.layers, model_bytes=nbytes,
                  compute_ms=args.compute_ms)
    record["overlap_vs_max"] = record["overlap_ms"] / max(args.compute_ms, record["comm_ms"])
    record["overlap_vs_sum"] = record["overlap_ms"] / (args.compute_ms + record["comm_ms"])
    record["serial_vs_sum"] = record["serial_ms"] / (args.compute_ms + record["comm_ms"])
    record["pass"] = bool(record["overlap_vs_max"] <= LOADGEN_TARGET)
    return record


def main_loadgen(args: argparse.Namespace) -> int:
    r = run_loadgen(args)
    print(f"link {r['link']}, model {r['model']} ({r['model_bytes'] / 1e6:.2f} MB) in {r['layers']} tensors, "
          f"compute {r['compute_ms']:g} ms (sleep)")
    print(f"communication (push_pull)     {r['comm_ms']:7.1f} ms  "
          f"(comm / compute {r['comm_ms'] / r['compute_ms']:.2f})")
    print(f"serial step                   {r['serial_ms']:7.1f} ms  ({r['serial_vs_sum']:.2f} x compute + comm)")
    print(f"overlapped step (--overlap)   {r['overlap_ms']:7.1f} ms  ({r['overlap_vs_max']:.2f} x max(compute, comm), "
          f"{r['overlap_vs_sum']:.2f} x compute + comm)")
    print(f"{'PASS' if r['pass'] else 'MISS'}: overlapped step {r['overlap_vs_max']:.2f} x max(compute, comm), "
          f"target <= {LOADGEN_TARGET}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0 if r["pass"] else 1


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", default="main", choices=["main", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("--server", help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, default=8, help="hidden layers (default 8)")
    parser.add_argument("--width", type=int, default=256, help="units per layer (default 256)")
    parser.add_argument("--batch", type=int, default=4096, help="batch size (default 4096)")
    parser.add_argument("--steps", type=int, default=6, help="steps per turn of a measurement (default 6)")
    parser.add_argument("--rounds", type=int, default=4, help="turns of each measurement (default 4)")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                        help="most gradient bytes in flight (default: psrt.torch's, %(default)s)")
    parser.add_argument("--link", help="link rate, e.g. 300mbit (default: calibrated so comm ~ compute)")
    parser.add_argument("--loopback", action="store_true", help="no namespaces or shaping (no root needed)")
    parser.add_argument("--json", metavar="PATH", help="write the result record here")
    parser.add_argument("--loadgen", action="store_true",
                        help="measure psrt worker --overlap instead of psrt.torch (no torch needed)")
    parser.add_argument("--model", default="2MB", help="--loadgen: model size (default %(default)s)")
    parser.add_argument("--layers", type=int, default=16, help="--loadgen: tensors (default %(default)s)")
    parser.add_argument("--compute-ms", type=float, default=100.0,
                        help="--loadgen: emulated compute per step (default %(default)s)")
    args = parser.parse_args(argv)
    if args.loadgen:
        return main_loadgen(args)
    if torch is None:
        print('overlap: needs PyTorch: pip install -e ".[bench,torch]"', file=sys.stderr)
        return 2
    if args.role == "worker":
        print(result_line(worker(args)), flush=True)
        return 0
    r = run(args)
    ms = {k: r[k] * 1e3 for k in ("compute_s", "comm_s", "serial_s", "overlap_s", "overlap_forward_s")}
    print(f"link {r['link']}, model {r['model_bytes'] / 1e6:.2f} MB, batch {r['batch']}")
    print(f"compute (forward + backward)  {ms['compute_s']:7.1f} ms")
    print(f"communication (push_pull)     {ms['comm_s']:7.1f} ms  (comm / compute {r['comm_s'] / r['compute_s']:.2f})")
    print(f"serial step                   {ms['serial_s']:7.1f} ms  ({r['serial_ratio']:.2f} x compute + comm)")
    print(f"overlapped step               {ms['overlap_s']:7.1f} ms  ({r['ratio']:.2f} x compute + comm, "
          f"{r['overlap_vs_serial']:.2f} x the serial step)")
    print(f"  overlap_forward=True        {ms['overlap_forward_s']:7.1f} ms  ({r['overlap_forward_ratio']:.2f} x "
          f"compute + comm, {r['overlap_forward_vs_serial']:.2f} x the serial step; not judged)")
    for mode in ("serial", "overlap", "overlap_forward"):
        s = r[f"{mode}_split_s"]
        print(f"  {mode:15s} split: forward {s['forward'] * 1e3:.1f} ms, backward {s['backward'] * 1e3:.1f} ms, "
              f"step {s['step'] * 1e3:.1f} ms")
    worst = max(r["ratio"], r["overlap_vs_serial"])
    print(f"{'PASS' if r['pass'] else 'MISS'}: overlapped step (default) {worst:.2f} x (compute + comm, the larger "
          f"of the two ratios above), target <= {TARGET}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0 if r["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
