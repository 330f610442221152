"""Embedding-table throughput: rows/s pulled and pushed, against a dense push_pull of the same bytes.

For each S (shards) and dim, one worker pulls and pushes batches of ids drawn Zipf-distributed over a table of
``--rows`` rows (prefilled, so the shards hold them all); the dense baseline is a ``push_pull`` of one tensor of
``batch * dim`` float32, the bytes the caller hands a push and gets back from a pull (the partition map cuts it
over as many shards as its pieces of at least 256 KiB allow: each line says how many). Both sides run the same
optimizer (``--optimizer``, AdaGrad by default) on the same gradient values. What differs is what rows are: a
row pull gathers (a push updates) rows scattered through the whole table, a repeated id travelling once, while
the dense tensor is contiguous; that is the cost the targets bound. The three calls are timed side by side:
after three untimed rounds, each round times one pull, one push and one dense push_pull, in an order that
rotates from round to round, for at least ``--seconds`` and 15 rounds; a ratio is the median of the rounds' own
ratios, given with its quartiles, so a slow moment of a loaded machine, which slows a round's calls alike,
cancels out. The machine's noise is stated: its load average before and after, and how far apart the dense
call's quartiles are. Worker and shards share this host, so every call of 64 KiB or more to a shard goes through
its shared-memory lane (``--no-shm``: sockets). Targets (issue "Embedding tables at production shape"): pull <=
1.5x and push <= 2x the dense push_pull; each line says ok or MISS. Rows/s are also given per shard core (each
shard is one single-threaded process). It also reads each shard's memory per row (rows + optimizer slots + id
index, from the shard's stats) and the ratio to the raw bytes of rows + slots.

    python bench/embedding.py                       # 1M rows, dim 16/64/256, S = 1, 2, 4
    python bench/embedding.py --rows 100K --dims 64 --shards 1 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from _common import parse_size

import psrt
from psrt.cluster.local import LocalShards
from psrt.config import ClientConfig

#: The issue's targets: a pull and a push of rows against a dense push_pull of the same bytes.
PULL_TARGET, PUSH_TARGET = 1.5, 2.0


def side_by_side(fns: list, seconds: float, warmup: int = 3, min_rounds: int = 15) -> list[list[float]]:
    """Seconds of each call of each of ``fns`` per round: a call of each per round, in an order that rotates
    from round to round (so that no call always follows the same one), for at least ``seconds`` in all and at
    least ``min_rounds`` rounds, after ``warmup`` rounds that are not timed."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    rounds = 0
    while time.perf_counter() - start < seconds or rounds < min_rounds:
        for k in range(len(fns)):
            i = (rounds + k) % len(fns)
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
        rounds += 1
    return times


def ratio_stats(calls: list[float], dense: list[float]) -> tuple[float, float, float]:
    """Median and quartiles of the per-round ratios ``calls[r] / dense[r]``: the round's two calls ran one right
    after the other, so a slow moment of a loaded machine slows both and cancels out of the ratio."""
    r = np.asarray(calls) / np.asarray(dense)
    q1, med, q3 = np.percentile(r, [25, 50, 75])
    return float(med), float(q1), float(q3)


OPTIMIZERS = {"adagrad": lambda: psrt.AdaGrad(lr=0.01), "sgd": lambda: psrt.SGD(lr=0.01)}


def _table_memory(client: psrt.Client) -> tuple[int, int]:
    """Rows held and bytes of rows + optimizer slots + id index, over every table of every shard."""
    stats = client.stats()
    return (sum(st["table_rows"] for st in stats),
            sum(st["table_row_bytes"] + st["table_slot_bytes"] + st["table_index_bytes"] for st in stats))


def run(rows: int, dims: list[int], shards: list[int], batch: int, zipf: float, seconds: float,
        shm: bool = True, optimizer: str = "adagrad") -> list[dict]:
    results = []
    rng = np.random.default_rng(0)
    for s in shards:
        with LocalShards(s, 1, "async") as group, psrt.Client(group.endpoints,
                                                              config=ClientConfig(timeout=300, shm=shm)) as c:
            for dim in dims:
                name = f"t{dim}"
                before = _table_memory(c)  # the shards' other tables, subtracted below
                c.init_embedding(name, dim=dim, optimizer=OPTIMIZERS[optimizer](), std=0.01)
                for lo in range(0, rows, 1 << 20):  # prefill: every row exists
                    c.pull_rows(name, np.arange(lo, min(rows, lo + (1 << 20))))
                ids = (rng.zipf(zipf, batch) - 1) % rows
                grads = np.full((batch, dim), 1e-3, np.float32)
                out = np.empty((batch, dim), np.float32)
                # The baseline: the same bytes as one dense tensor, the same optimizer, the same gradient values.
                c.init({f"d{dim}": np.zeros(batch * dim, np.float32)}, optimizer=OPTIMIZERS[optimizer]())
                dense_grad = {f"d{dim}": np.full(batch * dim, 1e-3, np.float32)}
                dense_out = {f"d{dim}": np.empty(batch * dim, np.float32)}
                pulls, pushes, denses = side_by_side([
                    lambda n=name, i=ids, o=out: c.pull_rows(n, i, out=o),
                    lambda n=name, i=ids, g=grads: c.push_rows(n, i, g),
                    lambda g=dense_grad, o=dense_out: c.push_pull(g, out=o)], seconds)
                pull, push, dense = (float(np.median(t)) for t in (pulls, pushes, denses))
                # The partition map may put a small tensor on fewer shards than the rows (which spread over all S).
                dense_shards = len({ch.shard for ch in c.partition.chunks_of([f"d{dim}"])})
                pull_r, push_r = ratio_stats(pulls, denses), ratio_stats(pushes, denses)
                d25, d75 = np.percentile(denses, [25, 75])
                after = _table_memory(c)
                held, mem = after[0] - before[0], after[1] - before[1]
                per_table = mem / held if held else 0.0
                raw = (2 if optimizer == "adagrad" else 1) * dim * 4  # a row (and its AdaGrad sum)
                results.append({
                    "shards": s, "dim": dim, "rows": rows, "batch": batch, "zipf": zipf, "shm": shm,
                    "optimizer": optimizer, "rounds": len(denses), "unique_ids": int(len(np.unique(ids))),
                    "pull_ms": pull * 1e3, "push_ms": push * 1e3, "dense_push_pull_ms": dense * 1e3,
                    "dense_spread": float(d75 / d25), "dense_shards": dense_shards,
                    "pull_rows_per_s": batch / pull, "push_rows_per_s": batch / push,
                    "pull_rows_per_s_per_shard_core": batch / pull / s,
                    "push_rows_per_s_per_shard_core": batch / push / s,
                    "pull_vs_dense": pull_r[0], "push_vs_dense": push_r[0],
                    "pull_vs_dense_iqr": [pull_r[1], pull_r[2]], "push_vs_dense_iqr": [push_r[1], push_r[2]],
                    "pull_ok": pull_r[0] <= PULL_TARGET, "push_ok": push_r[0] <= PUSH_TARGET,
                    "shard_bytes_per_row": per_table, "memory_vs_raw": per_table / raw,
                })
                r = results[-1]
                print(f"S={s} dim={dim:4d}: pull {r['pull_ms']:.2f} ms ({r['pull_rows_per_s'] / 1e6:.2f} M rows/s, "
                      f"{r['pull_rows_per_s_per_shard_core'] / 1e6:.2f} M per shard core), push {r['push_ms']:.2f} ms "
                      f"({r['push_rows_per_s'] / 1e6:.2f} M rows/s, {r['push_rows_per_s_per_shard_core'] / 1e6:.2f} "
                      f"M per shard core), dense push_pull of the same bytes {r['dense_push_pull_ms']:.2f} ms "
                      f"(on {dense_shards} of {s} shards; quartiles {d75 / d25:.2f}x apart) -> pull "
                      f"{r['pull_vs_dense']:.2f}x [{pull_r[1]:.2f}, {pull_r[2]:.2f}] "
                      f"({'ok' if r['pull_ok'] else 'MISS'}: <= {PULL_TARGET}x), push "
                      f"{r['push_vs_dense']:.2f}x [{push_r[1]:.2f}, {push_r[2]:.2f}] "
                      f"({'ok' if r['push_ok'] else 'MISS'}: <= {PUSH_TARGET}x), {len(denses)} rounds; "
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
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad",
                   help="the optimizer of the table and of the dense baseline alike (default adagrad)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    a = p.parse_args(argv)
    load = os.getloadavg()
    print(f"{os.cpu_count()} cores, load average {load[0]:.2f} (1 min) before the run", file=sys.stderr, flush=True)
    results = run(a.rows, a.dims, a.shards, a.batch, a.zipf, a.seconds, shm=not a.no_shm, optimizer=a.optimizer)
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) after the run", file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
