"""Data-parallel training of a small CNN on scikit-learn's digits with PyTorch and psrt (no download).

Each worker process trains on its own slice of the training set with an ordinary PyTorch loop; the
:class:`psrt.torch.DistributedOptimizer` pushes each gradient from a backward hook as soon as it is ready, the
shard servers average the workers' gradients (sync) or apply each as it comes (async) with SGD and momentum,
and the new parameters land in the model's own tensors before ``step()`` returns. Rank 0 prints progress
and the final test accuracy.

Run a whole job on this machine::

    psrt launch -s 2 -w 2 -- python -m psrt.examples.torch_digits

Needs ``pip install "psrt[torch,examples]"`` (torch and scikit-learn).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

import numpy as np

from psrt.errors import ConfigError, PsrtError
from psrt.examples.digits import load_data

__all__ = ["make_model", "train_worker"]


def _require_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ConfigError('the torch_digits example needs PyTorch and scikit-learn: '
                          'pip install "psrt[torch,examples]"') from None


def make_model(seed: int):  # -> torch.nn.Module (torch is imported lazily, so --help works without it)
    """A small CNN for 8x8 digits: two 3x3 convolutions (16 and 32 channels), then 64 hidden units, 10 classes."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10),
    )


def train_worker(epochs: int = 10, lr: float = 0.05, batch: int = 32, seed: int = 0, verbose: bool = True) -> float:
    """Train as one worker of the job in the environment (``psrt launch``); returns the final test accuracy."""
    _require_torch()
    import torch

    import psrt.torch

    torch.set_num_threads(1)  # several workers share this machine's cores
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in load_data(seed))
    x_train, x_test = x_train.reshape(-1, 1, 8, 8), x_test.reshape(-1, 1, 8, 8)
    model = make_model(seed)
    opt = psrt.torch.DistributedOptimizer(model.named_parameters(), optimizer=psrt.SGD(lr=lr, momentum=0.9))
    rank, workers = opt.client.rank, opt.client.num_workers
    mine = np.arange(rank, len(x_train), workers)
    steps = (len(x_train) // workers) // batch  # the same number of steps on every worker, or sync rounds would hang
    rng = np.random.default_rng(seed + 1000 + rank)
    loss_fn = torch.nn.CrossEntropyLoss()

    def accuracy() -> float:
        with torch.no_grad():
            return float((model(x_test).argmax(dim=1) == y_test).float().mean())

    if verbose and rank == 0:
        print(f"training a CNN ({sum(p.numel() for p in model.parameters())} parameters) on scikit-learn digits: "
              f"{workers} worker(s), {len(opt.client.servers)} shard(s), {steps} steps/epoch", flush=True)
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        order = torch.from_numpy(rng.permutation(mine))
        losses = []
        for s in range(steps):
            idx = order[s * batch:(s + 1) * batch]
            opt.zero_grad()
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            loss.backward()  # each gradient is pushed as soon as it is ready
            opt.step()  # returns when the model holds the new parameters
            losses.append(loss.item())
        if verbose and rank == 0:
            print(f"epoch {epoch:3d}/{epochs}  loss {np.mean(losses):.4f}  test accuracy {accuracy():.4f}",
                  flush=True)
    elapsed = time.perf_counter() - start
    opt.client.barrier()  # everyone is done with the shards: read the final parameters
    final = accuracy()
    if verbose and rank == 0:
        print(f"final test accuracy {final:.4f} ({steps * epochs * workers} worker-steps in {elapsed:.1f}s)",
              flush=True)
    opt.close()
    return final


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one worker (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        train_worker(args.epochs, args.lr, args.batch, args.seed)
    except PsrtError as exc:
        print(f"torch_digits: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
