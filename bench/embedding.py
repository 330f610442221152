"""Embedding-table throughput: rows/s pulled and pushed, against a dense push_pull of the same bytes.

For each S (shards) and dim, one worker pulls and pushes batches of ids drawn Zipf-distributed over a table of
``--rows`` rows (prefilled, so the shards hold them all), with AdaGrad on the shards; the dense baseline is a
``push_pull`` of one tensor of ``batch * dim`` float32, the same bytes. The three are timed side by side: each
round times one pull, one push and one dense push_pull, and the medians over the rounds are compared, so a
noisy machine slows all three alike. Worker and shards share this host, so every call of 64 KiB or more to a
shard goes through its shared-memory lane (``--no-shm``: sockets). Targets (issue "Embedding tables at production
shape"): pull <= 1.5x and push <= 2x the dense push_pull; each line says ok or MISS. Rows/s are also given per
shard core (each shard is one single-threaded process). It also reads each shard's memory per row (rows +
optimizer slots + id index, from the shard's stats) and the ratio to the raw bytes of rows + slots.

    python bench/embedding.py                       # 1M rows, dim 16/64/256, S = 1, 2, 4
    python bench/embedding.py --rows 100K --dims 64 --shards 1 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from _common import parse_size

import psrt
from psrt.cluster.local import LocalShards
from psrt.config import ClientConfig

#: The issue's targets: a pull and a push of rows against a dense push_pull of the same bytes.
PULL_TARGET, PUSH_TARGET = 1.5, 2.0


def side_by_side(fns: list, seconds: float) -> list[float]:
    """Median seconds per call of each of ``fns``, timed in turn, a call of each per round, for at least
    ``seconds`` in all (after two warm-up rounds; at least 9 rounds)."""
    for _ in range(2):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(times[0]) < 9:
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [float(np.median(ts)) for ts in times]


def _table_memory(client: psrt.Client) -> tuple[int, int]:
    """Rows held and bytes of rows + optimizer slots + id index, over every table of every shard."""
    stats = client.stats()
    return (sum(st["table_rows"] for st in stats),
            sum(st["table_row_bytes"] + st["table_slot_bytes"] + st["table_index_bytes"] for st in stats))


def run(rows: int, dims: list[int], shards: list[int], batch: int, zipf: float, seconds: float,
        shm: bool = True) -> list[dict]:
    results = []
    rng = np.random.default_rng(0)
    for s in shards:
        with LocalShards(s, 1, "async") as group, psrt.Client(group.endpoints,
                                                              config=ClientConfig(timeout=300, shm=shm)) as c:
            for dim in dims:
                name = f"t{dim}"
                before = _table_memory(c)  # the shards' other tables, subtracted below
                c.init_embedding(name, dim=dim, optimizer=psrt.AdaGrad(lr=0.01), std=0.01)
                for lo in range(0, rows, 1 << 20):  # prefill: every row exists
                    c.pull_rows(name, np.arange(lo, min(rows, lo + (1 << 20))))
                ids = (rng.zipf(zipf, batch) - 1) % rows
                grads = np.full((batch, dim), 1e-3, np.float32)
                out = np.empty((batch, dim), np.float32)
                c.init({f"d{dim}": np.zeros(batch * dim, np.float32)}, optimizer=psrt.SGD(lr=0.0))
                dense_grad = {f"d{dim}": np.zeros(batch * dim, np.float32)}
                dense_out = {f"d{dim}": np.empty(batch * dim, np.float32)}
                pull, push, dense = side_by_side([
                    lambda n=name, i=ids, o=out: c.pull_rows(n, i, out=o),
                    lambda n=name, i=ids, g=grads: c.push_rows(n, i, g),
                    lambda g=dense_grad, o=dense_out: c.push_pull(g, out=o)], seconds)
                after = _table_memory(c)
                held, mem = after[0] - before[0], after[1] - before[1]
                per_table = mem / held if held else 0.0
                raw = 2 * dim * 4  # a row and its AdaGrad sum
                results.append({
                    "shards": s, "dim": dim, "rows": rows, "batch": batch, "zipf": zipf, "shm": shm,
                    "unique_ids": int(len(np.unique(ids))),
                    "pull_ms": pull * 1e3, "push_ms": push * 1e3, "dense_push_pull_ms": dense * 1e3,
                    "pull_rows_per_s": batch / pull, "push_rows_per_s": batch / push,
                    "pull_rows_per_s_per_shard_core": batch / pull / s,
                    "push_rows_per_s_per_shard_core": batch / push / s,
                    "pull_vs_dense": pull / dense, "push_vs_dense": push / dense,
                    "pull_ok": pull / dense <= PULL_TARGET, "push_ok": push / dense <= PUSH_TARGET,
                    "shard_bytes_per_row": per_table, "memory_vs_raw": per_table / raw,
                })
                r = results[-1]
                print(f"S={s} dim={dim:4d}: pull {r['pull_ms']:.2f} ms ({r['pull_rows_per_s'] / 1e6:.2f} M rows/s, "
                      f"{r['pull_rows_per_s_per_shard_core'] / 1e6:.2f} M per shard core), push {r['push_ms']:.2f} ms "
                      f"({r['push_rows_per_s'] / 1e6:.2f} M rows/s, {r['push_rows_per_s_per_shard_core'] / 1e6:.2f} "
                      f"M per shard core), dense push_pull of the same bytes {r['dense_push_pull_ms']:.2f} ms -> "
                      f"pull {r['pull_vs_dense']:.2f}x ({'ok' if r['pull_ok'] else 'MISS'}: <= {PULL_TARGET}x), "
                      f"push {r['push_vs_dense']:.2f}x ({'ok' if r['push_ok'] else 'MISS'}: <= {PUSH_TARGET}x); "
                      f"shard memory {per_table:.0f} B/row ({r['memory_vs_raw']:.3f}x rows + slots)",
                      file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run, print a table (stderr) and, with ``--json``, a JSON list (stdout)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=parse_size, default=1 << 20, help="rows per table (default 1M)")
    p.add_argument("--dims", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, default=8192, help="ids per call (default 8192)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids (default 1.1)")
    p.add_argument("--seconds", type=float, default=1.0, help="time per (S, dim), the three calls side by side")
    p.add_argument("--no-shm", action="store_true", help="keep every call on sockets (no shared-memory lanes)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    a = p.parse_args(argv)
    results = run(a.rows, a.dims, a.shards, a.batch, a.zipf, a.seconds, shm=not a.no_shm)
    if a.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
