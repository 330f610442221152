"""Backup workers against a straggler: the time the fast workers of a sync job take to finish N rounds, with and
without ``--backup-workers``.

A job of W = 3 workers and S = 1 shard runs under ``psrt launch`` (a scheduler, a shard server and three worker
processes on this machine): each worker loops ``while client.round < N: push_pull(g)``, computing for
``--step-ms`` (20 ms) a step, except worker 2, which also stalls for ``--stall-s`` (1 s) on every third step. With
b = 0 every round waits for the straggler; with b = 1 a round closes on the first two pushes, the straggler's late
push is dropped and it rejoins from the newest parameters. The script runs both and prints the fast workers'
time to N rounds (the slower of the two), the ratio b=1 / b=0 (target: <= 0.5), each worker's steps and dropped
pushes, and checks that every worker ends holding -lr * N * g (each round the mean of identical gradients).

Usage::

    python bench/stragglers.py            # N = 20 rounds
    python bench/stragglers.py --quick    # N = 9: a few seconds a run
    python bench/stragglers.py --rounds 40 --json stragglers.json

``--digits``: time to accuracy. W = 8 workers (``--workers``) train the NumPy MLP of :mod:`psrt.examples.digits` on
scikit-learn's digits through one shard, each worker and the shard on its own emulated host (network namespaces,
:class:`psrt.emulation.netns.VirtualCluster`, ``--link`` each way; ``--loopback``: plain processes on this
machine). Each step computes for ``--step-ms`` (emulated: the MLP itself takes well under a millisecond); the last
worker also waits a heavy-tailed delay (Pareto, shape 1.5, mean ``--straggle-ms``). The runs: no straggler with
b = 0, then the straggler with b = 0, 1, 2 and ``auto``; rank 0 evaluates test accuracy every few rounds, and the
table gives each run's time to ``--target`` accuracy and final accuracy (targets: b = 1 at most 1.15x the
no-straggler run, b = 0 at least 1.8x, auto at least as fast as the best fixed b)::

    python bench/stragglers.py --digits --quick            # root: emulated hosts
    python bench/stragglers.py --digits --loopback --quick

The worker role (``--worker``) is this script run by ``psrt launch`` (or, with ``--digits``, on a host).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any, Optional

import numpy as np

from psrt.control.metrics import per_worker
from psrt.control.process import first_results, parse_results, psrt_command, result_line

LR = 0.125  # a power of two: -lr * N is exact in float32, so the check is equality
SIZE = 1 << 14  # float32 entries of the one tensor


def worker(rounds: int, step_s: float, stall_s: float, stall_every: int, straggler: int) -> None:
    """One worker of the job (its rank and the job from ``psrt launch``'s environment)."""
    import psrt

    client = psrt.Client()
    try:
        g = np.ones(SIZE, np.float32)
        client.init({"w": np.zeros(SIZE, np.float32)}, optimizer=psrt.SGD(lr=LR))
        client.barrier()
        start = time.perf_counter()
        steps = 0
        w = None
        while client.round < rounds:
            time.sleep(step_s)  # the step's compute
            if client.rank == straggler and steps % stall_every == stall_every - 1:
                time.sleep(stall_s)  # a noisy neighbour, a throttled disk, a GC pause
            w = client.push_pull({"w": g})["w"]
            steps += 1
        elapsed = time.perf_counter() - start
        exact = w is not None and bool(np.array_equal(w, np.full(SIZE, np.float32(-LR * rounds), np.float32)))
        stats = client.stats()[0]
        mine = per_worker(stats).get(client.rank, {})  # this worker's row of the shard's per-worker table
        print(result_line({"rank": client.rank, "seconds": elapsed, "steps": steps, "round": client.round,
                           "exact": exact, "backup_workers": stats["backup_workers"],
                           "dropped": mine.get("dropped", 0), "late_p50_s": mine.get("late_p50_s", 0.0)}),
              flush=True)
    finally:
        client.close()


def run(backup: int, rounds: int, step_s: float, stall_s: float, stall_every: int, timeout: float) -> list[dict]:
    """One job under ``psrt launch``; the workers' results by rank."""
    cmd = psrt_command("launch", "-s", "1", "-w", "3", "--backup-workers", str(backup), "--", sys.executable,
                       __file__, "--worker", "--rounds", str(rounds), "--step-ms", str(step_s * 1e3),
                       "--stall-s", str(stall_s), "--stall-every", str(stall_every))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    results = sorted(parse_results(done.stdout), key=lambda r: r["rank"])
    if done.returncode != 0 or len(results) != 3:
        raise RuntimeError(f"the b={backup} job failed (exit {done.returncode}):\n{done.stdout[-3000:]}"
                           f"{done.stderr[-2000:]}")
    return results


#: The ``--digits`` runs: short name (``--runs``) -> (name, with the straggler, b).
DIGITS_RUNS = {"base": ("no straggler, b=0", False, 0), "b0": ("straggler, b=0", True, 0),
               "b1": ("straggler, b=1", True, 1), "b2": ("straggler, b=2", True, 2),
               "auto": ("straggler, b=auto", True, "auto")}


def digits_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One worker of a ``--digits`` run: train until the job's round reaches ``--rounds``; rank 0 records test
    accuracy against time (its evaluations left out of its clock)."""
    import psrt
    from psrt.config import ClientConfig
    from psrt.examples.digits import MLP, load_data

    x_train, y_train, x_test, y_test = load_data(0)
    mine = np.arange(args.rank, len(x_train), args.workers)
    rng = np.random.default_rng(1000 + args.rank)
    client = psrt.Client([args.server], rank=args.rank, num_workers=args.workers, config=ClientConfig(timeout=300))
    try:
        params = client.init(MLP.init(0), optimizer=psrt.SGD(lr=args.lr, momentum=0.9))
        while client.stats()[0]["inits"] < args.workers:  # everyone is in: the clocks start together
            time.sleep(0.02)
        start, off, steps, curve = time.perf_counter(), 0.0, 0, [(0, 0.0, MLP.accuracy(params, x_test, y_test))]
        while client.round < args.rounds:
            idx = rng.choice(mine, args.batch, replace=False)
            _, grads = MLP.loss_and_grads(params, x_train[idx], y_train[idx])
            time.sleep(args.step_ms / 1e3)
            if args.straggler and args.rank == args.workers - 1:
                time.sleep(args.straggle_ms / 1e3 * float(rng.pareto(1.5)) / 2.0)  # mean straggle_ms
            params = client.push_pull(grads)
            steps += 1
            if args.rank == 0 and (client.round % args.eval_every == 0 or client.round >= args.rounds):
                t = time.perf_counter()
                curve.append((client.round, t - start - off, MLP.accuracy(params, x_test, y_test)))
                off += time.perf_counter() - t
        elapsed = time.perf_counter() - start - off
        final = MLP.accuracy(client.pull(), x_test, y_test)
    finally:
        client.close()
    return {"rank": args.rank, "steps": steps, "elapsed_s": elapsed, "final_acc": final, "curve": curve}


def digits(args: argparse.Namespace) -> int:
    """The ``--digits`` runs: the table, ``stragglers_digits.json`` (and ``.png`` with matplotlib) under ``--out``."""
    import os

    from psrt.control.process import SERVER_READY, Child
    from psrt.emulation.netns import VirtualCluster

    hosts = ["server", *(f"w{r}" for r in range(args.workers))]
    vc = None if args.loopback else VirtualCluster(hosts, link=args.link)
    results: dict[str, dict[str, Any]] = {}
    wanted = None if args.runs is None else {n.strip() for n in args.runs.split(",")}
    try:
        for short, (name, straggler, backup) in DIGITS_RUNS.items():
            if wanted is not None and short not in wanted:
                continue
            bind = "tcp://127.0.0.1:*" if vc is None else f"tcp://{vc.address('server')}:*"
            cmd = psrt_command("server", "--bind", bind, "--workers", str(args.workers), "--backup-workers",
                               str(backup))
            spawn = (lambda host, c, **kw: Child(c, **kw)) if vc is None else vc.spawn
            procs = [spawn("server", cmd, ready=SERVER_READY, label=f"server {name}")]
            try:
                endpoint = procs[0].wait_ready(30).group(1)
                for r in range(args.workers):
                    wcmd = [sys.executable, os.path.abspath(__file__), "--digits", "--worker", "--server", endpoint,
                            "--rank", str(r), "--workers", str(args.workers), "--rounds", str(args.rounds),
                            "--step-ms", str(args.step_ms), "--straggle-ms", str(args.straggle_ms),
                            "--lr", str(args.lr), "--batch", str(args.batch), "--eval-every", str(args.eval_every),
                            *(["--straggler"] if straggler else [])]
                    procs.append(spawn(f"w{r}", wcmd, label=f"w{r} {name}"))
                records = first_results(procs[1:], 1800, name)
            finally:
                for p in procs:
                    p.stop()
            r0 = min(records, key=lambda r: r["rank"])
            reached = [t for _, t, acc in r0["curve"] if acc >= args.target]
            results[name] = {"time_to_target_s": reached[0] if reached else None, "final_acc": r0["final_acc"],
                             "elapsed_s": r0["elapsed_s"], "curve": r0["curve"],
                             "steps": [r["steps"] for r in sorted(records, key=lambda r: r["rank"])]}
            print(f"{name:20s} time to {100 * args.target:.0f} %: "
                  f"{results[name]['time_to_target_s'] or float('nan'):6.2f} s  final {100 * r0['final_acc']:.1f} %"
                  f"  steps per worker {results[name]['steps']}", flush=True)
    finally:
        if vc is not None:
            vc.close()
    base, b0, b1, b2, auto = (results.get(n, {}).get("time_to_target_s") for n, _, _ in DIGITS_RUNS.values())
    print(f"\nW={args.workers}, MLP on digits, {args.step_ms:g} ms a step, the straggler +{args.straggle_ms:g} ms "
          f"(Pareto 1.5) a step, {'loopback' if vc is None else f'emulated hosts, link {args.link}'}\n")
    print(f"| run | time to {100 * args.target:.0f} % (s) | vs no straggler | final accuracy |")
    print("|---|---|---|---|")
    for name in results:
        t = results[name]["time_to_target_s"]
        ratio = f"{t / base:.2f}x" if t and base else "-"
        print(f"| {name} | {t:.2f} | {ratio} | {100 * results[name]['final_acc']:.1f} % |" if t else
              f"| {name} | not reached | - | {100 * results[name]['final_acc']:.1f} % |")
    if base and b0 and b1:
        print(f"\n{'PASS' if b1 <= 1.15 * base else 'MISS'}: b=1 at most 1.15x the no-straggler run ({b1 / base:.2f}x)")
        print(f"{'PASS' if b0 >= 1.8 * base else 'MISS'}: b=0 at least 1.8x slower ({b0 / base:.2f}x)")
    if b0 and b1 and b2 and auto:
        best = min(b0, b1, b2)
        print(f"{'PASS' if auto <= best else 'MISS'}: b=auto at least as fast as the best fixed b ({auto:.2f} s "
              f"against {best:.2f} s)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "stragglers_digits.json"), "w") as f:
        json.dump({"workers": args.workers, "step_ms": args.step_ms, "straggle_ms": args.straggle_ms,
                   "target": args.target, "runs": results}, f, indent=2)
    plot_digits(results, args.target, args.workers, os.path.join(args.out, "stragglers_digits.png"))
    return 0


def plot_digits(results: dict[str, dict[str, Any]], target: float, workers: int, path: str) -> None:
    """Test accuracy against wall time of the ``--digits`` runs, up to 3x the slowest time to the target (nothing
    without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    reached = [r["time_to_target_s"] for r in results.values() if r["time_to_target_s"]]
    for name, r in results.items():
        curve = r["curve"]
        ax.plot([t for _, t, _ in curve], [a for _, _, a in curve], label=name)
    ax.axhline(target, color="grey", lw=0.5)
    if reached:
        ax.set_xlim(0, 3 * max(reached))
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"W={workers} workers, digits MLP, one straggler")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20, help="rounds N each job runs (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="N = 9, for a check in seconds")
    p.add_argument("--step-ms", type=float, default=20.0, help="compute per step, ms (default %(default)s)")
    p.add_argument("--stall-s", type=float, default=1.0, help="the straggler's stall, s (default %(default)s)")
    p.add_argument("--stall-every", type=int, default=3, help="it stalls every this many steps (default 3)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--digits", action="store_true", help="time to accuracy of the digits MLP (see above)")
    p.add_argument("--loopback", action="store_true", help="--digits: plain processes, no emulated hosts")
    p.add_argument("--workers", type=int, default=8, help="--digits: W (default %(default)s)")
    p.add_argument("--straggle-ms", type=float, default=100.0,
                   help="--digits: the straggler's mean extra delay a step, ms (default %(default)s)")
    p.add_argument("--target", type=float, default=0.97, help="--digits: the test accuracy to reach (default 0.97)")
    p.add_argument("--lr", type=float, default=0.1, help="--digits: SGD learning rate, momentum 0.9 (default 0.1)")
    p.add_argument("--batch", type=int, default=16, help="--digits: batch per worker (default %(default)s)")
    p.add_argument("--eval-every", type=int, default=5, help="--digits: rounds between evaluations (default 5)")
    p.add_argument("--link", default="1gbit", help="--digits: emulated link rate each way (default %(default)s)")
    p.add_argument("--out", default=".", help="--digits: where stragglers_digits.{json,png} go (default .)")
    p.add_argument("--runs", default=None, help="--digits: the runs to do, of base (no straggler), b0, b1, b2 and "
                   "auto, comma-separated (default all)")
    p.add_argument("--server", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--straggler", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.digits:
        if args.rounds == 20 or args.quick:  # (the default N: digits needs more rounds)
            args.rounds = 150 if args.quick else 300
        if args.worker:
            print(result_line(digits_worker(args)), flush=True)
            return 0
        return digits(args)
    rounds = 9 if args.quick else args.rounds
    step_s = args.step_ms / 1e3
    if args.worker:
        worker(rounds, step_s, args.stall_s, args.stall_every, straggler=2)
        return 0
    timeout = 60 + 2 * rounds * (step_s + args.stall_s)
    out: dict[str, Any] = {"rounds": rounds, "step_ms": args.step_ms, "stall_s": args.stall_s}
    for backup in (0, 1):
        results = run(backup, rounds, step_s, args.stall_s, args.stall_every, timeout)
        fast = max(r["seconds"] for r in results if r["rank"] != 2)
        out[f"b{backup}"] = {"fast_seconds": fast, "workers": results}
        print(f"b={backup}: the fast workers finish {rounds} rounds in {fast:.2f} s; "
              + "; ".join(f"worker {r['rank']}: {r['steps']} steps, {r['dropped']} dropped, round {r['round']}, "
                          f"median lateness {1e3 * r['late_p50_s']:.0f} ms, {'exact' if r['exact'] else 'NOT EXACT'}"
                          for r in results), flush=True)
    ratio = out["b1"]["fast_seconds"] / out["b0"]["fast_seconds"]
    out["ratio"] = ratio
    exact = all(r["exact"] for b in ("b0", "b1") for r in out[b]["workers"])
    print(f"b=0 {out['b0']['fast_seconds']:.2f} s, b=1 {out['b1']['fast_seconds']:.2f} s, ratio b1/b0 = {ratio:.2f} "
          f"(target <= 0.5: {'PASS' if ratio <= 0.5 else 'MISS'}); every worker exact: {exact}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
