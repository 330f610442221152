"""Worker programs the integration tests run as separate processes.

``python tests/_workers.py ROLE JSON_ARGS`` runs one worker and prints one JSON line with its result.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import psrt
from psrt.config import ClientConfig


def async_pusher(servers: list[str], rank: int, workers: int, steps: int, size: int, partition_bytes: int) -> dict:
    """Push ``steps`` integer-valued gradients (rank+1+step mod 7) of ``size`` float32; SGD lr=1."""
    config = ClientConfig(partition_bytes=partition_bytes, timeout=60)
    with psrt.Client(servers, rank=rank, num_workers=workers, config=config) as client:
        client.init({"w": np.zeros(size, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        for step in range(steps):
            grad = np.full(size, float((rank + 1 + step) % 7), np.float32)
            grad[::3] = -1.0
            if step % 2:
                client.push({"w": grad})
            else:
                client.push_pull({"w": grad})
    return {"rank": rank}


def async_pusher_expected(workers: int, steps: int, size: int) -> np.ndarray:
    """The parameters after every :func:`async_pusher` of W workers ran (from zeros, SGD lr=1): exact in float32."""
    expected = np.zeros(size, np.float64)
    for r in range(workers):
        for step in range(steps):
            g = np.full(size, float((r + 1 + step) % 7))
            g[::3] = -1.0
            expected -= g
    return expected.astype(np.float32)


def sync_slice(servers: list[str], rank: int, workers: int, steps: int, seed: int, optimizer: dict) -> dict:
    """Least squares on this worker's slice of a fixed batch; returns the final parameters."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((workers * 16, 40))
    y = rng.standard_normal(workers * 16)
    xs, ys = x[rank::workers], y[rank::workers]
    opt = psrt.optim.from_wire(optimizer)
    with psrt.Client(servers, rank=rank, num_workers=workers, config=ClientConfig(partition_bytes=128)) as client:
        p = client.init({"w": np.zeros(40), "b": np.zeros(1)}, optimizer=opt)
        for _ in range(steps):
            r = xs @ p["w"] + p["b"][0] - ys
            p = client.push_pull({"w": xs.T @ r / len(ys), "b": np.array([r.mean()])})
        stats = client.stats()
    return {"w": p["w"].tolist(), "b": p["b"].tolist(), "stats": stats}


if __name__ == "__main__":
    role, args = sys.argv[1], json.loads(sys.argv[2])
    result = {"async_pusher": async_pusher, "sync_slice": sync_slice}[role](**args)
    print(json.dumps(result), flush=True)
