"""A sync round's memory on the shard: one accumulator per key, whatever W is.

For each W (default 2, 4, 16) this starts one fresh ``psrt server --workers W --mode sync`` process, has W
clients push a 16 MiB gradient each (one round, then a pull), and reads the shard's own counters
(``accumulators``, ``accumulator_bytes``, ``param_bytes``) and its peak resident memory (``VmHWM`` from
/proc). The target: accumulator bytes equal parameter bytes at every W (no per-worker copies), and the shard's
peak memory at the largest W is within 1.5x of the smallest W's (it would grow ~W-fold with per-worker copies).

Usage::

    python bench/memory.py [--workers 2,4,16] [--mib 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import psrt
from psrt.cluster.local import LocalShards


def peak_rss(pid: int) -> int:
    """Peak resident set size of a process, in bytes (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found")


def one(workers: int, mib: int) -> dict:
    """One fresh shard, W clients, one round; the shard's counters and peak memory."""
    n = mib * (1 << 20) // 4
    with LocalShards(1, workers) as shards:
        clients = [psrt.Client(shards.endpoints, rank=r, num_workers=workers) for r in range(workers)]
        try:
            for c in clients:
                c.init({"w": np.zeros(n, np.float32)}, optimizer=psrt.SGD(lr=1.0))
            for r, c in enumerate(clients):  # each push is summed on arrival; the last one completes the round
                c.push({"w": np.full(n, r + 1, np.float32)})
            params = clients[0].pull()["w"]
            expected = -np.float32(sum(range(1, workers + 1)) / workers)
            if not np.all(params == expected):
                raise RuntimeError(f"wrong parameters after the round: {params[:3]} != {expected}")
            stats = clients[0].stats()[0]
        finally:
            for c in clients:
                c.close()
        rss = peak_rss(shards.procs[0].pid)
    return {"workers": workers, "param_bytes": stats["param_bytes"], "accumulators": stats["accumulators"],
            "accumulator_bytes": stats["accumulator_bytes"], "keys": stats["keys"], "peak_rss_bytes": rss}


def main() -> int:
    """Measure every W and print the table and the verdict."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="2,4,16", help="comma-separated W values")
    parser.add_argument("--mib", type=int, default=16, help="tensor size in MiB (float32)")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    rows = [one(int(w), args.mib) for w in args.workers.split(",")]
    print(f"{'W':>4} {'keys':>5} {'params MiB':>11} {'accumulators':>13} {'acc MiB':>8} {'shard peak RSS MiB':>19}")
    for r in rows:
        print(f"{r['workers']:>4} {r['keys']:>5} {r['param_bytes'] / 2**20:>11.1f} {r['accumulators']:>13} "
              f"{r['accumulator_bytes'] / 2**20:>8.1f} {r['peak_rss_bytes'] / 2**20:>19.1f}")
    one_per_key = all(r["accumulators"] <= r["keys"] and r["accumulator_bytes"] <= r["param_bytes"] for r in rows)
    growth = rows[-1]["peak_rss_bytes"] / rows[0]["peak_rss_bytes"]
    ok = one_per_key and growth <= 1.5
    ratios = ", ".join(f"{r['accumulator_bytes'] / r['param_bytes']:.2f}" for r in rows)
    print(f"{'PASS' if one_per_key else 'MISS'}  at most one accumulator per key at every W "
          f"(accumulator bytes / parameter bytes: {ratios})")
    w_lo, w_hi = rows[0]["workers"], rows[-1]["workers"]
    print(f"{'PASS' if growth <= 1.5 else 'MISS'}  shard peak memory at W={w_hi} is {growth:.2f}x W={w_lo}'s "
          f"(target <= 1.5x; per-worker copies would multiply the gradient part by ~{w_hi / w_lo:.0f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
