"""Data-parallel training of a small MLP on scikit-learn's digits (shipped inside scikit-learn, no download).

Each worker process trains on its own slice of the training set: it computes gradients with NumPy and calls
``client.push_pull`` every step; the shard servers average the workers' gradients (sync) or apply each as it
comes (async) and return fresh parameters. Rank 0 prints progress and the final test accuracy.

Run a whole job on this machine::

    psrt launch -s 2 -w 2 -- python -m psrt.examples.digits

(``psrt demo`` does the same), or one worker against shards started by hand::

    python -m psrt.examples.digits --servers tcp://127.0.0.1:5701,tcp://127.0.0.1:5702 --rank 0 --workers 2
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

import numpy as np

import psrt
from psrt.errors import ConfigError, PsrtError

__all__ = ["load_data", "MLP", "train_worker", "run_local"]

HIDDEN = 64


def _require_sklearn() -> None:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise ConfigError("the digits example needs scikit-learn: pip install 'psrt[examples]'") from None


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits, standardized, split 80/20 with a fixed permutation: ``(x_train, y_train, x_test, y_test)``."""
    _require_sklearn()
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


def train_worker(servers: Optional[Sequence[str]] = None, rank: Optional[int] = None,
                 num_workers: Optional[int] = None, epochs: int = 30, lr: float = 0.1, batch: int = 32,
                 seed: int = 0, verbose: bool = True) -> float:
    """Train as one worker; returns the final test accuracy.

    With ``servers`` omitted the client finds the scheduler, its rank and W in the environment (``psrt launch``).
    """
    x_train, y_train, x_test, y_test = load_data(seed)
    with psrt.Client(servers, rank=rank, num_workers=num_workers) as client:
        rank, num_workers = client.rank, client.num_workers
        mine = np.arange(rank, len(x_train), num_workers)
        # Every worker takes the same number of steps per epoch, or a sync round would wait forever for the others.
        steps = (len(x_train) // num_workers) // batch
        rng = np.random.default_rng(seed + 1000 + rank)
        params = client.init(MLP.init(seed + rank), optimizer=psrt.SGD(lr=lr, momentum=0.9))
        if verbose and rank == 0:
            print(f"training an MLP 64-{HIDDEN}-10 on scikit-learn digits: {num_workers} worker(s), "
                  f"{len(client.servers)} shard(s), {steps} steps/epoch", flush=True)
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
        client.barrier()
    accuracy = MLP.accuracy(params, x_test, y_test)
    if verbose and rank == 0:
        print(f"final test accuracy {accuracy:.4f} ({steps * epochs * num_workers} worker-steps in "
              f"{elapsed:.1f}s)", flush=True)
    return accuracy


def run_local(servers: int = 2, workers: int = 2, mode: str = "sync", epochs: int = 30, lr: float = 0.1,
              batch: int = 32, seed: int = 0) -> int:
    """``psrt launch`` a scheduler, ``servers`` shards and ``workers`` copies of this trainer; returns the exit code."""
    from psrt.cluster.launch import launch

    _require_sklearn()  # say so once, here, rather than in a traceback from every worker
    cmd = [sys.executable, "-m", "psrt.examples.digits", "--epochs", str(epochs), "--lr", str(lr),
           "--batch", str(batch), "--seed", str(seed)]
    return launch(servers, workers, cmd, mode=mode)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one worker (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default=None,
                        help="comma-separated shard endpoints (default: from the scheduler in the environment)")
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    servers = args.servers.split(",") if args.servers else None
    try:
        train_worker(servers, args.rank, args.workers, args.epochs, args.lr, args.batch, args.seed)
    except PsrtError as exc:
        print(f"digits: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
