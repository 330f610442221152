"""A click-through-rate model on embedding tables: synthetic data with a planted signal, trained data-parallel.

Each sample is a user id and a bag of item ids drawn Zipf-distributed (hot items, like real traffic); its label
is a Bernoulli draw whose log-odds are a hidden per-user and per-item score. The model learns one embedding
table per field (psrt's dynamic tables, rows made on first touch, AdaGrad on the shards), mean-pools the item
bag, and feeds ``[user, items]`` to a logistic head held as a dense tensor. Gradients are computed with NumPy;
each worker trains on its own slice of every batch, and rank 0 prints held-out log-loss and AUC as they improve.

    psrt launch -s 2 -w 2 -- python -m psrt.examples.ctr

``--criteo-like`` trains on data shaped like Criteo's instead (:mod:`psrt.examples.criteo`): 26 categorical
features with Zipf-distributed ids over a 10M-id space and 13 dense features, a table per feature with
``admit_after=2`` and a capacity, and prints the rows held, evicted and admitted, and, when the shards write
checkpoints, the bytes of each (full or delta).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import numpy as np

import psrt
from psrt.examples.metrics import auc

__all__ = ["make_batch", "auc", "main", "train"]

USERS, ITEMS, BAG, DIM = 5000, 20000, 5, 16


def make_batch(step: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(users, item bags, labels)`` of one batch; the hidden scores come from a fixed seed."""
    hidden = np.random.default_rng(12345)
    user_score, item_score = hidden.normal(0, 1.5, USERS), hidden.normal(0, 1.5, ITEMS)
    rng = np.random.default_rng(step)
    users = (rng.zipf(1.2, size) - 1) % USERS
    items = (rng.zipf(1.2, (size, BAG)) - 1) % ITEMS
    logit = user_score[users] + item_score[items].mean(1)
    labels = (rng.random(size) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return users.astype(np.int64), items.astype(np.int64), labels


def forward(client: psrt.Client, head: dict[str, np.ndarray], users: np.ndarray, items: np.ndarray):
    """Rows, pooled features and click probabilities of a batch."""
    u = client.pull_rows("users", users)
    it = client.pull_rows("items", items.reshape(-1))
    x = np.concatenate([u, it.reshape(len(users), BAG, DIM).mean(1)], axis=1)
    p = 1 / (1 + np.exp(-(x @ head["w"] + head["b"][0])))
    return u, it, x, p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Train under ``psrt launch`` (or with ``--servers``), printing held-out log-loss and AUC; returns the exit
    code (2, after one error line, when psrt refuses: no scheduler to find, a shard's error, ...)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default=None, help="comma-separated shard endpoints (default: the scheduler)")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--criteo-like", action="store_true",
                    help="26 categorical features (Zipf ids over 10M), 13 dense, admission and eviction")
    ap.add_argument("--capacity", type=int, default=None,
                    help="--criteo-like: rows per table and shard (default 2048)")
    a = ap.parse_args(argv)
    servers = a.servers.split(",") if a.servers else None
    try:
        if a.criteo_like:
            from psrt.examples import criteo

            criteo.train(servers, a.rank, a.workers, a.steps, a.batch, a.capacity or criteo.CAPACITY)
        else:
            train(servers, a.rank, a.workers, a.steps, a.batch)
    except psrt.PsrtError as exc:
        print(f"ctr: error: {exc}", file=sys.stderr)
        return 2
    return 0


def train(servers: Optional[list[str]], rank: Optional[int], workers: Optional[int], steps: int, batch: int) -> None:
    """One worker's training loop (``servers`` None: the scheduler in the environment)."""
    with psrt.Client(servers, rank=rank, num_workers=workers) as client:
        opt = psrt.AdaGrad(lr=0.1)
        client.init_embedding("users", dim=DIM, optimizer=opt, std=0.01, seed=1)
        client.init_embedding("items", dim=DIM, optimizer=opt, std=0.01, seed=2)
        head = client.init({"w": np.zeros(2 * DIM, np.float32), "b": np.zeros(1, np.float32)}, optimizer=opt)
        w, r = client.num_workers, client.rank
        test_users, test_items, test_labels = make_batch(10**6, 4000)
        for step in range(steps + 1):
            if r == 0 and step % 50 == 0:
                *_, p = forward(client, head, test_users, test_items)
                p = np.clip(p, 1e-7, 1 - 1e-7)
                loss = -np.mean(test_labels * np.log(p) + (1 - test_labels) * np.log(1 - p))
                print(f"step {step:4d}: held-out log-loss {loss:.4f}, AUC {auc(p, test_labels):.4f}", flush=True)
            if step == steps:
                break
            users, items, labels = make_batch(step, batch)
            per = batch // w
            users, items, labels = (v[r * per:(r + 1) * per] for v in (users, items, labels))
            u, it, x, p = forward(client, head, users, items)
            d = ((p - labels) / len(labels)).astype(np.float32)  # d(mean log-loss)/d(logit)
            dx = np.outer(d, head["w"]).astype(np.float32)
            pushed = [client.push_rows_async("users", users, dx[:, :DIM]),
                      client.push_rows_async("items", items.reshape(-1),
                                             np.repeat(dx[:, DIM:] / BAG, BAG, axis=0))]
            head = client.push_pull({"w": (x.T @ d).astype(np.float32), "b": np.array([d.sum()], np.float32)})
            for h in pushed:
                h.wait()


if __name__ == "__main__":
    sys.exit(main())
