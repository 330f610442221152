"""Data-parallel training of a small MLP on scikit-learn's digits (shipped inside scikit-learn, no download).

Each worker process trains on its own slice of the training set: it computes gradients with NumPy and calls
``client.push_pull`` every step; the shard servers average the workers' gradients (sync) or apply each as it
comes (async) and return fresh parameters. Rank 0 prints progress and the final test accuracy.

Run one worker by hand::

    python -m psrt.examples.digits --servers tcp://127.0.0.1:5701,tcp://127.0.0.1:5702 --rank 0 --workers 2

or everything at once with ``psrt demo``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Optional, Sequence

import numpy as np

import psrt
from psrt.local import LocalShards

__all__ = ["load_data", "MLP", "train_worker", "run_local"]

HIDDEN = 64
#: Final line every worker prints: launchers parse it.
RESULT_PREFIX = "psrt-demo-result "


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits, standardized, split 80/20 with a fixed permutation: ``(x_train, y_train, x_test, y_test)``."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-3
    x = ((x - mean) / std).astype(np.float32)
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


class MLP:
    """A 64-64-10 perceptron with a tanh hidden layer and softmax cross-entropy, in NumPy."""

    @staticmethod
    def init(seed: int) -> dict[str, np.ndarray]:
        """Random initial parameters (Glorot-scaled)."""
        rng = np.random.default_rng(seed)
        return {
            "w1": (rng.standard_normal((64, HIDDEN)) / np.sqrt(64)).astype(np.float32),
            "b1": np.zeros(HIDDEN, np.float32),
            "w2": (rng.standard_normal((HIDDEN, 10)) / np.sqrt(HIDDEN)).astype(np.float32),
            "b2": np.zeros(10, np.float32),
        }

    @staticmethod
    def forward(p: dict[str, np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Hidden activations and class probabilities."""
        h = np.tanh(x @ p["w1"] + p["b1"])
        logits = h @ p["w2"] + p["b2"]
        logits -= logits.max(axis=1, keepdims=True)
        e = np.exp(logits)
        return h, e / e.sum(axis=1, keepdims=True)

    @classmethod
    def loss_and_grads(cls, p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
                       ) -> tuple[float, dict[str, np.ndarray]]:
        """Mean cross-entropy over the batch and its gradients."""
        h, prob = cls.forward(p, x)
        n = len(x)
        loss = float(-np.log(prob[np.arange(n), y] + 1e-12).mean())
        d = prob
        d[np.arange(n), y] -= 1.0
        d /= n
        dh = (d @ p["w2"].T) * (1.0 - h * h)
        grads = {"w1": x.T @ dh, "b1": dh.sum(axis=0), "w2": h.T @ d, "b2": d.sum(axis=0)}
        return loss, {k: v.astype(np.float32) for k, v in grads.items()}

    @classmethod
    def accuracy(cls, p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
        """Fraction of correct predictions."""
        return float((cls.forward(p, x)[1].argmax(axis=1) == y).mean())


def train_worker(servers: Sequence[str], rank: int, num_workers: int, epochs: int = 30, lr: float = 0.1,
                 batch: int = 32, seed: int = 0, verbose: bool = True) -> float:
    """Train as worker ``rank`` of ``num_workers`` against the given shards; returns the final test accuracy."""
    x_train, y_train, x_test, y_test = load_data(seed)
    mine = np.arange(rank, len(x_train), num_workers)
    # Every worker takes the same number of steps per epoch, or a sync round would wait forever for the others.
    steps = (len(x_train) // num_workers) // batch
    rng = np.random.default_rng(seed + 1000 + rank)
    with psrt.Client(list(servers), rank=rank, num_workers=num_workers) as client:
        params = client.init(MLP.init(seed + rank), optimizer=psrt.SGD(lr=lr, momentum=0.9))
        start = time.perf_counter()
        for epoch in range(1, epochs + 1):
            order = rng.permutation(mine)
            losses = []
            for s in range(steps):
                idx = order[s * batch:(s + 1) * batch]
                loss, grads = MLP.loss_and_grads(params, x_train[idx], y_train[idx])
                losses.append(loss)
                params = client.push_pull(grads)
            if verbose and rank == 0 and (epoch == 1 or epoch % 5 == 0 or epoch == epochs):
                print(f"epoch {epoch:3d}/{epochs}  loss {np.mean(losses):.4f}  "
                      f"test accuracy {MLP.accuracy(params, x_test, y_test):.4f}", flush=True)
        elapsed = time.perf_counter() - start
        params = client.pull()
    accuracy = MLP.accuracy(params, x_test, y_test)
    result = {"rank": rank, "accuracy": accuracy, "steps": steps * epochs, "seconds": round(elapsed, 3)}
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return accuracy


def run_local(servers: int = 2, workers: int = 2, mode: str = "sync", epochs: int = 30, lr: float = 0.1,
              batch: int = 32, seed: int = 0, timeout: float = 600.0) -> int:
    """Start ``servers`` shards and ``workers`` worker processes on this machine, train, and report.

    Returns the process exit code: 0 when every worker succeeded.
    """
    print(f"psrt demo: {servers} shard server(s), {workers} worker process(es), {mode} mode, "
          f"MLP 64-{HIDDEN}-10 on scikit-learn digits", flush=True)
    procs: list[subprocess.Popen] = []
    with LocalShards(servers, workers, mode) as shards:
        print("shards: " + ", ".join(shards.endpoints), flush=True)
        try:
            for rank in range(workers):
                cmd = [sys.executable, "-m", "psrt.examples.digits", "--servers", ",".join(shards.endpoints),
                       "--rank", str(rank), "--workers", str(workers), "--epochs", str(epochs), "--lr", str(lr),
                       "--batch", str(batch), "--seed", str(seed)]
                procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                              env={**os.environ, "PYTHONUNBUFFERED": "1"}))
            results = []
            deadline = time.monotonic() + timeout
            for rank, proc in enumerate(procs):
                assert proc.stdout is not None
                for line in proc.stdout:
                    if line.startswith(RESULT_PREFIX):
                        results.append(json.loads(line[len(RESULT_PREFIX):]))
                    else:
                        print(f"[worker {rank}] {line}", end="", flush=True)
                proc.wait(max(1.0, deadline - time.monotonic()))
            codes = [p.returncode for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    if any(codes) or len(results) != workers:
        print(f"psrt demo: FAILED (worker exit codes {codes})", flush=True)
        return next((c for c in codes if c), 1)
    steps = sum(r["steps"] for r in results)
    seconds = max(r["seconds"] for r in results)
    print(f"psrt demo: done. final test accuracy {results[0]['accuracy']:.4f} "
          f"({steps} worker-steps in {seconds:.1f}s, {steps / seconds:.0f} worker-steps/s)", flush=True)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one worker (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", required=True, help="comma-separated shard endpoints")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train_worker(args.servers.split(","), args.rank, args.workers, args.epochs, args.lr, args.batch, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
