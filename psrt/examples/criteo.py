"""A click-through-rate model on data shaped like Criteo's: the ``--criteo-like`` mode of :mod:`psrt.examples.ctr`.

Each sample has 26 categorical features, each an id drawn Zipf-distributed over a 10M-id space (a few hot ids,
a long tail seen once), and 13 dense features; its label is a Bernoulli draw whose log-odds are a hidden score
per (feature, id) plus a hidden linear function of the dense features. The model has one embedding table per
feature, created with ``admit_after=2`` (an id seen once, most of the tail, never gets a row) and a capacity per
shard (the least recently pushed rows are evicted), and a logistic head over the concatenated rows and the dense
features. Rank 0 prints held-out log-loss and AUC as they improve, then the rows held, admitted, evicted and
pending over all tables and shards, and, when the shards write checkpoints (``--checkpoint-dir``), the bytes of
each checkpoint it asks for: the first full, the later ones deltas of the rows changed since.

    psrt launch -s 2 -w 2 -- python -m psrt.examples.ctr --criteo-like
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

import psrt
from psrt.examples.metrics import auc
from psrt.kernels.rows import init_rows

__all__ = ["FEATURES", "DENSE", "SPACE", "make_batch", "train"]

FEATURES, DENSE, SPACE, DIM = 26, 13, 10_000_000, 8
#: Rows each table holds per shard at most; an id gets one on its second push to its shard.
CAPACITY, ADMIT_AFTER = 2048, 2
_SEED = 2014


def _hidden_scores(feature: int, ids: np.ndarray) -> np.ndarray:
    """The planted score of each id of a feature: a pure function of (feature, id), no 10M-entry array."""
    out = np.empty((len(ids), 1), np.float64)
    init_rows(out, 0, np.ascontiguousarray(ids, np.int64), _SEED + feature, "normal", 0.0, 0.5)
    return out[:, 0]


def make_batch(step: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids (size, 26), dense (size, 13), labels)`` of one batch, the same on every worker."""
    rng = np.random.default_rng([_SEED, step])
    ids = ((rng.zipf(1.2, (size, FEATURES)) - 1) % SPACE).astype(np.int64)
    dense = rng.standard_normal((size, DENSE)).astype(np.float32)
    weights = np.random.default_rng(_SEED).normal(0, 0.3, DENSE)
    logit = sum(_hidden_scores(f, ids[:, f]) for f in range(FEATURES)) + dense @ weights - 1.0
    labels = (rng.random(size) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return ids, dense, labels


def _tables() -> list[str]:
    return [f"c{f}" for f in range(FEATURES)]


def _forward(client: psrt.Client, head: dict[str, np.ndarray], ids: np.ndarray,
             dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    handles = [client.pull_rows_async(t, ids[:, f]) for f, t in enumerate(_tables())]  # all tables in flight
    x = np.concatenate([h.wait() for h in handles] + [dense], axis=1)
    return x, 1 / (1 + np.exp(-(x @ head["w"] + head["b"][0])))


def _checkpoint(client: psrt.Client, step: int) -> bool:
    """Ask every shard for a checkpoint and print its bytes; False when the shards write none."""
    try:
        paths = client.checkpoint()
    except psrt.ServerError as exc:
        if "checkpoint-dir" not in str(exc):
            raise
        print("checkpoints: none (start the shards with --checkpoint-dir DIR to see the delta sizes)", flush=True)
        return False
    sizes = [os.path.getsize(p) if os.path.exists(p) else 0 for p in paths]  # a remote shard's: not readable
    kinds = {"delta" if p.endswith(".delta.psrtckpt") else "full" for p in paths}
    print(f"checkpoint at step {step}: {'/'.join(sorted(kinds))}, {sum(sizes) / 1e6:.2f} MB over {len(paths)} "
          "shards", flush=True)
    return True


def train(servers: Optional[list[str]], rank: Optional[int], workers: Optional[int], steps: int,
          batch: int, capacity: int = CAPACITY) -> None:
    """One worker's training loop (``servers`` None: the scheduler in the environment); ``capacity``: each
    table's rows per shard."""
    with psrt.Client(servers, rank=rank, num_workers=workers) as client:
        opt = psrt.AdaGrad(lr=0.05)
        for f, t in enumerate(_tables()):
            client.init_embedding(t, dim=DIM, optimizer=opt, std=0.01, seed=f,
                                  admit_after=ADMIT_AFTER, capacity=capacity)
        width = FEATURES * DIM + DENSE
        head = client.init({"w": np.zeros(width, np.float32), "b": np.zeros(1, np.float32)}, optimizer=opt)
        w, r = client.num_workers, client.rank
        test_ids, test_dense, test_labels = make_batch(10**6, 8192)
        every = max(steps // 5, 1)
        checkpoints = True
        for step in range(steps + 1):
            if r == 0 and step % every == 0:
                _, p = _forward(client, head, test_ids, test_dense)
                p = np.clip(p, 1e-7, 1 - 1e-7)
                loss = -np.mean(test_labels * np.log(p) + (1 - test_labels) * np.log(1 - p))
                print(f"step {step:4d}: held-out log-loss {loss:.4f}, AUC {auc(p, test_labels):.4f}", flush=True)
                if checkpoints and step:
                    checkpoints = _checkpoint(client, step)
            if step == steps:
                break
            ids, dense, labels = make_batch(step, batch)
            per = batch // w
            ids, dense, labels = ids[r * per:(r + 1) * per], dense[r * per:(r + 1) * per], labels[r * per:(r + 1) * per]
            x, p = _forward(client, head, ids, dense)
            d = ((p - labels) / len(labels)).astype(np.float32)  # d(mean log-loss)/d(logit)
            dx = np.outer(d, head["w"]).astype(np.float32)
            pushed = [client.push_rows_async(t, ids[:, f], np.ascontiguousarray(dx[:, f * DIM:(f + 1) * DIM]))
                      for f, t in enumerate(_tables())]
            head = client.push_pull({"w": (x.T @ d).astype(np.float32), "b": np.array([d.sum()], np.float32)})
            for h in pushed:
                h.wait()
        try:
            client.barrier()  # every worker's pushes are in: the counters are final
        except psrt.ConfigError:
            pass  # servers given by hand, no scheduler to meet at: the counters may miss the others' last pushes
        if r == 0:
            total = {k: 0 for k in ("rows", "admitted", "evicted", "pending")}
            for t in _tables():
                for shard in client.table_stats(t):
                    for k in total:
                        total[k] += shard[k]
            print(f"tables: {FEATURES} x {len(client.servers)} shards, capacity {capacity} rows each per shard; rows "
                  f"held {total['rows']}, admitted {total['admitted']}, evicted {total['evicted']}, ids pending "
                  f"{total['pending']}", flush=True)
