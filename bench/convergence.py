"""Convergence of the update modes and gradient compressions: test accuracy against wall time and against steps.

W = 4 workers train the PyTorch CNN of :mod:`psrt.examples.torch_digits` on scikit-learn's digits through one
shard server, each worker and the server on its own emulated host (network namespaces,
:class:`psrt.emulation.netns.VirtualCluster`) whose link is shaped with ``tc ... tbf`` to ``--link`` in each direction.
The default rate makes the job link-bound: a step's gradients and parameters (4 x 153 KB each way through the
server's link) take several times the compute of a step. Every step is ``client.push_pull`` of all gradients
(SGD with momentum 0.9 on the shard, ``--lr`` in sync mode, where the shard steps once per W pushes with their
mean; ``--lr / W`` in async and ssp, where it steps once per push: the same step size per W pushes). The runs, one
after the other on the same emulated cluster:

- ``sync``, ``async``, ``ssp`` (staleness 2): float32 gradients;
- ``sync fp16`` and ``sync topk:0.01``: compressed pushes (parameters always travel as float32).

Rank 0 evaluates test accuracy every ``--eval-every`` steps (its evaluation time is left out of its clock); every
worker records when each of its steps ended, from which the largest lead of one worker over another (in steps)
is read: sync keeps it at most 1, ssp lets it reach s + 1. Bytes per push are the shard's ``bytes_in`` over its
pushes. It writes ``convergence.csv`` (one row per evaluation), ``convergence.png`` and ``convergence.json``
(the summary) under ``--out``, prints the table and judges the targets (PASS or MISS).

Usage (root: namespaces, veth, tc)::

    python bench/convergence.py --quick          # under 5 minutes
    python bench/convergence.py --out results/

Needs ``pip install -e ".[bench,torch]"`` (torch, scikit-learn, matplotlib).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from typing import Any, Optional

import numpy as np

import psrt
from psrt.control.process import SERVER_READY, first_results, psrt_command, result_line
from psrt.emulation.netns import VirtualCluster, check_available

try:  # optional: `--help` works without it, and main() says what to install
    import torch

    from psrt.examples.digits import load_data
    from psrt.examples.torch_digits import make_model
except ImportError:
    torch = None

W = 4
#: name -> (mode, compression)
RUNS = {
    "sync": ("sync", None),
    "async": ("async", None),
    "ssp s=2": ("ssp", None),
    "sync fp16": ("sync", "fp16"),
    "sync topk:0.01": ("sync", "topk:0.01"),
}
STALENESS = 2


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One worker (inside its host's namespace): train, and return the curve (rank 0) and step end times."""
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in load_data(args.seed))
    x_train, x_test = x_train.reshape(-1, 1, 8, 8), x_test.reshape(-1, 1, 8, 8)
    model = make_model(args.seed)
    params = {n: p.detach().numpy() for n, p in model.named_parameters()}  # the model's own memory
    mine = np.arange(args.rank, len(x_train), W)
    per_epoch = len(mine) // args.batch
    steps = per_epoch * args.epochs
    rng = np.random.default_rng(args.seed + 1000 + args.rank)
    loss_fn = torch.nn.CrossEntropyLoss()

    def accuracy() -> float:
        with torch.no_grad():
            return float((model(x_test).argmax(dim=1) == y_test).float().mean())

    curve: list[tuple[int, float, float]] = []
    ends: list[float] = []  # time.perf_counter(): CLOCK_MONOTONIC, one clock for every process of this machine
    client = psrt.Client([args.server], rank=args.rank, num_workers=W, compression=args.compression or None)
    try:
        client.init(params, optimizer=psrt.SGD(lr=args.lr, momentum=0.9))
        before = client.stats()[0]
        while before["inits"] < W:  # every worker's init is in (not counted as push bytes below)
            time.sleep(0.05)
            before = client.stats()[0]
        start = time.perf_counter()
        off = 0.0  # rank 0's evaluation time, left out of its clock
        if args.rank == 0:
            curve.append((0, 0.0, accuracy()))
        order = rng.permutation(mine)
        for step in range(1, steps + 1):
            i = (step - 1) % per_epoch
            if i == 0:
                order = rng.permutation(mine)
            idx = torch.from_numpy(order[i * args.batch:(i + 1) * args.batch])
            model.zero_grad()
            loss_fn(model(x_train[idx]), y_train[idx]).backward()
            client.push_pull({n: p.grad.numpy() for n, p in model.named_parameters()}, out=params)
            ends.append(time.perf_counter())
            if args.rank == 0 and (step % args.eval_every == 0 or step == steps):
                t = time.perf_counter()
                curve.append((step, t - start - off, accuracy()))
                off += time.perf_counter() - t
        elapsed = ends[-1] - start - off
        after = client.stats()[0]
        client.pull(out=params)
        final = accuracy()
    finally:
        client.close()
    pushes = after["pushes"] - before["pushes"]
    return {"rank": args.rank, "steps": steps, "elapsed_s": elapsed, "final_acc": final, "curve": curve,
            "ends": ends, "bytes_per_push": (after["bytes_in"] + after.get("shm_bytes_in", 0) - before["bytes_in"]
                                             - before.get("shm_bytes_in", 0)) / pushes}


def max_lead(ends: list[list[float]]) -> int:
    """The largest number of steps one worker had finished beyond another at any moment."""
    events = sorted((t, r) for r, e in enumerate(ends) for t in e)
    done = [0] * len(ends)
    lead = 0
    for _, r in events:
        done[r] += 1
        lead = max(lead, max(done) - min(done))
    return lead


def run_one(vc: VirtualCluster, name: str, args: argparse.Namespace) -> dict[str, Any]:
    mode, codec = RUNS[name]
    cmd = psrt_command("server", "--bind", f"tcp://{vc.address('server')}:*", "--workers", str(W), "--mode", mode,
                       *(["--staleness", str(STALENESS)] if mode == "ssp" else []))
    procs = [vc.spawn("server", cmd, ready=SERVER_READY, label=f"server {name}")]
    try:
        endpoint = procs[0].wait_ready(30).group(1)
        for r in range(W):
            wcmd = [sys.executable, os.path.abspath(__file__), "--role", "worker", "--server", endpoint,
                    "--rank", str(r), "--compression", codec or "", "--epochs", str(args.epochs),
                    "--lr", str(args.lr / W if mode != "sync" else args.lr), "--batch", str(args.batch),
                    "--eval-every", str(args.eval_every), "--seed", str(args.seed)]
            procs.append(vc.spawn(f"w{r}", wcmd, label=f"w{r} {name}"))
        records = first_results(procs[1:], 900, name)
    finally:
        for p in procs:
            p.stop()
    records.sort(key=lambda r: r["rank"])
    r0 = records[0]
    reached = [t for _, t, acc in r0["curve"] if acc >= 0.95]
    return {"name": name, "mode": mode, "compression": codec, "steps": r0["steps"],
            "steps_per_s": r0["steps"] / r0["elapsed_s"], "elapsed_s": r0["elapsed_s"],
            "time_to_95_s": reached[0] if reached else None, "final_acc": r0["final_acc"],
            "bytes_per_push": r0["bytes_per_push"], "max_lead": max_lead([r["ends"] for r in records]),
            "curve": r0["curve"]}


def judge(results: dict[str, dict[str, Any]]) -> list[tuple[bool, str]]:
    base, fp16, topk, ssp = results["sync"], results["sync fp16"], results["sync topk:0.01"], results["ssp s=2"]
    b16, bk = fp16["bytes_per_push"] / base["bytes_per_push"], topk["bytes_per_push"] / base["bytes_per_push"]
    speed = fp16["steps_per_s"] / base["steps_per_s"]
    d16 = (base["final_acc"] - fp16["final_acc"]) * 100
    dk = (base["final_acc"] - topk["final_acc"]) * 100
    return [
        (b16 <= 0.55, f"fp16 bytes per push {b16:.3f}x float32 (target <= 0.55x)"),
        (speed >= 1.6, f"fp16 steps/s {speed:.2f}x float32 on the link-bound cluster (target >= 1.6x)"),
        (d16 <= 1.0, f"fp16 final accuracy {d16:+.1f} points below float32 (target within 1)"),
        (bk <= 0.03, f"topk:0.01 bytes per push {bk:.4f}x float32 (target <= 0.03x)"),
        (dk <= 2.0, f"topk:0.01 final accuracy {dk:+.1f} points below float32 (target within 2)"),
        (ssp["max_lead"] > 1, f"ssp s={STALENESS}: a worker ran up to {ssp['max_lead']} steps ahead of another "
                              f"(sync: {base['max_lead']}; bound s + 1 = {STALENESS + 1}; target: runs ahead, > 1)"),
    ]


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| run | steps/s | time to 95 % (s) | final accuracy | bytes per push | max lead (steps) |",
             "|---|---|---|---|---|---|"]
    for r in results.values():
        t95 = f"{r['time_to_95_s']:.1f}" if r["time_to_95_s"] is not None else "not reached"
        lines.append(f"| {r['name']} | {r['steps_per_s']:.2f} | {t95} | {r['final_acc'] * 100:.1f} % | "
                     f"{r['bytes_per_push'] / 1e3:.1f} kB | {r['max_lead']} |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r, style in zip(results.values(), ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)))):
        steps, times, acc = zip(*r["curve"])
        a.plot(times, np.array(acc) * 100, marker=".", ls=style, label=r["name"])
        b.plot(steps, np.array(acc) * 100, marker=".", ls=style, label=r["name"])
    for ax, xlabel in ((a, "wall time of worker 0 (s)"), (b, "steps of worker 0")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (%)")
        ax.set_ylim(0, 100)
        ax.axhline(95, color="grey", lw=0.5, ls="--")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", default="main", choices=["main", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("--server", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--compression", default="", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="fewer epochs (the whole run under 5 minutes)")
    parser.add_argument("--epochs", type=int, help="epochs per run (default 15; --quick: 8)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9; default 0.05)")
    parser.add_argument("--batch", type=int, default=32, help="batch per worker (default 32)")
    parser.add_argument("--eval-every", type=int, default=5, help="steps between evaluations (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--link", default="20mbit", help="link rate each way (default 20mbit: link-bound)")
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated runs (default: all)")
    parser.add_argument("--out", default=".", help="directory for convergence.{csv,png,json} (default .)")
    args = parser.parse_args(argv)
    if torch is None:
        print('convergence: needs PyTorch and scikit-learn: pip install -e ".[bench,torch]"', file=sys.stderr)
        return 2
    if args.epochs is None:
        args.epochs = 8 if args.quick else 15
    if args.role == "worker":
        print(result_line(worker(args)), flush=True)
        return 0
    check_available()
    names = [n.strip() for n in args.runs.split(",")]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; known: {list(RUNS)}")
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    begun = time.perf_counter()
    with VirtualCluster(["server", *(f"w{r}" for r in range(W))], link=args.link) as vc:
        for name in names:
            t = time.perf_counter()
            results[name] = run_one(vc, name, args)
            r = results[name]
            print(f"{name:16s} {r['steps_per_s']:6.2f} steps/s  final {r['final_acc'] * 100:5.1f} %  "
                  f"{r['bytes_per_push'] / 1e3:7.1f} kB/push  lead {r['max_lead']}  ({time.perf_counter() - t:.0f} s)",
                  flush=True)
    with open(os.path.join(args.out, "convergence.csv"), "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["run", "mode", "compression", "step", "wall_s", "test_accuracy"])
        for r in results.values():
            for step, wall, acc in r["curve"]:
                out.writerow([r["name"], r["mode"], r["compression"] or "", step, f"{wall:.3f}", f"{acc:.4f}"])
    title = (f"W={W} workers, CNN on digits, link {args.link} each way, {args.epochs} epochs, "
             f"batch {args.batch}/worker")
    plot(results, os.path.join(args.out, "convergence.png"), title)
    print(f"\n{title} (total {time.perf_counter() - begun:.0f} s)\n")
    print(table(results))
    verdicts = judge(results) if set(RUNS) <= set(results) else []
    for ok, line in verdicts:
        print(f"{'PASS' if ok else 'MISS'}: {line}")
    summary = {"link": args.link, "epochs": args.epochs, "batch": args.batch, "lr": args.lr,
               "runs": {k: {f: v for f, v in r.items() if f != "curve"} for k, r in results.items()},
               "verdicts": [{"pass": ok, "what": line} for ok, line in verdicts]}
    with open(os.path.join(args.out, "convergence.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
