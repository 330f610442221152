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

The worker role (``--worker``) is this script run by ``psrt launch``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any, Optional

import numpy as np

from psrt.control.process import parse_results, psrt_command, result_line

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
        print(result_line({"rank": client.rank, "seconds": elapsed, "steps": steps, "round": client.round,
                           "exact": exact, "backup_workers": stats["backup_workers"],
                           "dropped": stats.get(f"worker_{client.rank}_dropped", 0),
                           "late_p50_s": stats.get(f"worker_{client.rank}_late_p50_s", 0.0)}), flush=True)
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


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20, help="rounds N each job runs (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="N = 9, for a check in seconds")
    p.add_argument("--step-ms", type=float, default=20.0, help="compute per step, ms (default %(default)s)")
    p.add_argument("--stall-s", type=float, default=1.0, help="the straggler's stall, s (default %(default)s)")
    p.add_argument("--stall-every", type=int, default=3, help="it stalls every this many steps (default 3)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
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
