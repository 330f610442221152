"""Async replication's cost: pushes per second of an async job with R = 0 and R = 1, side by side in one run.

A job of S = 2 shards and W workers (``--workers``, 4) runs under ``psrt launch`` on this machine, ``--mode async``:
each worker pushes one tensor of ``--size`` float32 entries split over both shards, back to back (a push waits for
its ack), for ``--seconds``. With R = 1 every push is held twice before its ack: the shard copies what a batch of
queued pushes changed once, at the batch's end (docs/architecture.md, "Replication"), so the table gives the
pushes per second of both jobs, their ratio, and the copies each shard sent per push it took (1.0: a copy per
push; below: pushes that shared one).

Usage::

    python bench/replication_async.py                 # W = 4, 64 KiB a push, 5 s a job
    python bench/replication_async.py --pairs 2 --seconds 8 --json out.json

The worker role (``--worker``) is this script run by ``psrt launch``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from psrt.control.process import parse_results, psrt_command, result_line


def worker(seconds: float, size: int) -> None:
    """One worker: push for ``seconds`` after the barrier; rank 0 also reports the shards' copy counters."""
    import psrt

    client = psrt.Client()
    try:
        client.init({"w": np.zeros(size, np.float32)}, optimizer=psrt.SGD(lr=0.01))
        client.barrier()
        g = np.ones(size, np.float32)
        pushes, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            client.push({"w": g})
            pushes += 1
        elapsed = time.perf_counter() - start
        client.barrier()
        stats = client.stats()
        print(result_line({"rank": client.rank, "pushes": pushes, "seconds": elapsed,
                           "copies": sum(s.get("copies_sent", 0) for s in stats),
                           "taken": sum(s.get("pushes", 0) for s in stats)}), flush=True)
    finally:
        client.close()


def run(replicas: int, workers: int, seconds: float, size: int) -> dict:
    """One job under ``psrt launch``: its pushes per second and copies per push taken."""
    cmd = psrt_command("launch", "-s", "2", "-w", str(workers), "--mode", "async", "--replicas", str(replicas), "--",
                       sys.executable, __file__, "--worker", "--seconds", str(seconds), "--size", str(size))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    results = parse_results(done.stdout)
    if done.returncode != 0 or len(results) != workers:
        raise RuntimeError(f"the R={replicas} job failed (exit {done.returncode}):\n{done.stdout[-3000:]}"
                           f"{done.stderr[-2000:]}")
    rate = sum(r["pushes"] / r["seconds"] for r in results)
    first = min(results, key=lambda r: r["rank"])
    return {"replicas": replicas, "pushes_per_s": rate, "copies_per_push": first["copies"] / max(1, first["taken"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=4, help="W (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=5.0, help="each job's pushing time (default %(default)s)")
    parser.add_argument("--size", type=int, default=1 << 14, help="float32 entries a push (default %(default)s)")
    parser.add_argument("--pairs", type=int, default=1, help="alternated R=0, R=1 jobs (default %(default)s)")
    parser.add_argument("--json", help="write the runs here too")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.seconds, args.size)
        return 0
    if args.workers < 1 or args.pairs < 1 or args.seconds <= 0 or args.size < 2:
        parser.error("--workers and --pairs must be at least 1, --seconds positive, --size at least 2")
    runs = []
    for _ in range(args.pairs):
        for replicas in (0, 1):
            runs.append(run(replicas, args.workers, args.seconds, args.size))
            print(f"R={replicas}: {runs[-1]['pushes_per_s']:8.0f} pushes/s  copies per push "
                  f"{runs[-1]['copies_per_push']:.3f}", flush=True)
    mean = {r: float(np.mean([x["pushes_per_s"] for x in runs if x["replicas"] == r])) for r in (0, 1)}
    copies = float(np.mean([x["copies_per_push"] for x in runs if x["replicas"] == 1]))
    print(f"\nasync S=2 W={args.workers}, {args.size * 4 // 1024} KiB a push, {args.seconds:g} s a job, "
          f"mean of {args.pairs}\n")
    print("| R=0 pushes/s | R=1 pushes/s | R=1 / R=0 | R=1 copies per push |")
    print("|---|---|---|---|")
    print(f"| {mean[0]:.0f} | {mean[1]:.0f} | {mean[1] / mean[0]:.2f} | {copies:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workers": args.workers, "size": args.size, "seconds": args.seconds, "runs": runs}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
