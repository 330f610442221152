"""Embedding-table throughput: rows/s pulled and pushed, against a dense push_pull of the same bytes.

For each S (shards) and dim, one worker pulls and pushes batches of ids drawn Zipf-distributed over a table of
``--rows`` rows (prefilled, so the shards hold them all), with AdaGrad on the shards; the dense baseline is a
``push_pull`` of one tensor of ``batch * dim`` float32, the same bytes. It also reads each shard's memory per row
(rows + optimizer slots + id index, from the shard's stats) and the ratio to the raw bytes of rows + slots.

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


def timed(fn, seconds: float) -> float:
    """Seconds per call of ``fn``, over at least ``seconds`` (after two warm-up calls)."""
    fn()
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and n >= 5:
            return elapsed / n


def _table_memory(client: psrt.Client) -> tuple[int, int]:
    """Rows held and bytes of rows + optimizer slots + id index, over every table of every shard."""
    stats = client.stats()
    return (sum(st["table_rows"] for st in stats),
            sum(st["table_row_bytes"] + st["table_slot_bytes"] + st["table_index_bytes"] for st in stats))


def run(rows: int, dims: list[int], shards: list[int], batch: int, zipf: float, seconds: float) -> list[dict]:
    results = []
    rng = np.random.default_rng(0)
    for s in shards:
        with LocalShards(s, 1, "async") as group, psrt.Client(group.endpoints,
                                                              config=ClientConfig(timeout=300)) as c:
            for dim in dims:
                name = f"t{dim}"
                before = _table_memory(c)  # the shards' other tables, subtracted below
                c.init_embedding(name, dim=dim, optimizer=psrt.AdaGrad(lr=0.01), std=0.01)
                for lo in range(0, rows, 1 << 20):  # prefill: every row exists
                    c.pull_rows(name, np.arange(lo, min(rows, lo + (1 << 20))))
                ids = (rng.zipf(zipf, batch) - 1) % rows
                grads = np.full((batch, dim), 1e-3, np.float32)
                out = np.empty((batch, dim), np.float32)
                pull = timed(lambda n=name, i=ids, o=out: c.pull_rows(n, i, out=o), seconds)
                push = timed(lambda n=name, i=ids, g=grads: c.push_rows(n, i, g), seconds)
                c.init({f"d{dim}": np.zeros(batch * dim, np.float32)}, optimizer=psrt.SGD(lr=0.0))
                dense_grad = {f"d{dim}": np.zeros(batch * dim, np.float32)}
                dense_out = {f"d{dim}": np.empty(batch * dim, np.float32)}
                dense = timed(lambda g=dense_grad, o=dense_out: c.push_pull(g, out=o), seconds)
                after = _table_memory(c)
                held, mem = after[0] - before[0], after[1] - before[1]
                per_table = mem / held if held else 0.0
                raw = 2 * dim * 4  # a row and its AdaGrad sum
                results.append({
                    "shards": s, "dim": dim, "rows": rows, "batch": batch, "zipf": zipf,
                    "unique_ids": int(len(np.unique(ids))),
                    "pull_ms": pull * 1e3, "push_ms": push * 1e3, "dense_push_pull_ms": dense * 1e3,
                    "pull_rows_per_s": batch / pull, "push_rows_per_s": batch / push,
                    "pull_vs_dense": pull / dense, "push_vs_dense": push / dense,
                    "shard_bytes_per_row": per_table, "memory_vs_raw": per_table / raw,
                })
                r = results[-1]
                print(f"S={s} dim={dim:4d}: pull {r['pull_ms']:.2f} ms ({r['pull_rows_per_s'] / 1e6:.2f} M rows/s), "
                      f"push {r['push_ms']:.2f} ms ({r['push_rows_per_s'] / 1e6:.2f} M rows/s), dense push_pull of "
                      f"the same bytes {r['dense_push_pull_ms']:.2f} ms -> pull {r['pull_vs_dense']:.2f}x, push "
                      f"{r['push_vs_dense']:.2f}x; shard memory {per_table:.0f} B/row "
                      f"({r['memory_vs_raw']:.3f}x rows + slots)", file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run, print a table (stderr) and, with ``--json``, a JSON list (stdout)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=parse_size, default=1 << 20, help="rows per table (default 1M)")
    p.add_argument("--dims", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, default=8192, help="ids per call (default 8192)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids (default 1.1)")
    p.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    a = p.parse_args(argv)
    results = run(a.rows, a.dims, a.shards, a.batch, a.zipf, a.seconds)
    if a.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
