"""A PyTorch worker the torch integration tests run as a separate process.

``python tests/_torch_worker.py JSON_ARGS`` trains :func:`make_cnn` with :class:`psrt.torch.DistributedOptimizer`
on its half of every batch of a fixed synthetic data set and saves its initial and final parameters to an
``.npz`` file, read right after the loop (after ``opt.synchronize()`` only if ``synchronize`` is true).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

import psrt
import psrt.torch


def make_cnn(seed: int) -> torch.nn.Module:
    """A small float64 CNN on 8x8 single-channel images, 10 classes."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(8 * 4 * 4, 10),
    ).double()


def batches(steps: int, size: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same ``steps`` batches in every process."""
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(size, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (size,), generator=g))
            for _ in range(steps)]


def train(servers: list[str], rank: int, workers: int, steps: int, out: str, lr: float, momentum: float,
          weight_decay: float, overlap: bool = True, overlap_forward: bool = False, synchronize: bool = False) -> None:
    model = make_cnn(100 + rank)  # a different start per worker: the first init wins
    opt = psrt.torch.DistributedOptimizer(
        model.named_parameters(), optimizer=psrt.SGD(lr=lr, momentum=momentum, weight_decay=weight_decay),
        client=psrt.Client(servers, rank=rank, num_workers=workers), overlap=overlap,
        overlap_forward=overlap_forward)
    initial = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in batches(steps):
        opt.zero_grad()
        loss_fn(model(x[rank::workers]), y[rank::workers]).backward()
        opt.step()
    if synchronize:
        opt.synchronize()
    final = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    np.savez(out, **{f"initial/{k}": v for k, v in initial.items()}, **{f"final/{k}": v for k, v in final.items()})
    opt.close()
    opt.client.close()


if __name__ == "__main__":
    train(**json.loads(sys.argv[1]))
