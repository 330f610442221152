"""A worker of the embedding exactness test: an EmbeddingBag-style click model, rows and dense head on psrt.

Run as ``python _embed_worker.py JSON``; worker ``rank`` of W trains on its slice of every batch and rank 0
writes the final rows and dense weights to ``out``.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

import psrt
from psrt.config import ClientConfig


def batch(step: int, size: int, bag: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The step's whole batch: ``(size, bag)`` ids with hot ids repeating, and 0/1 labels."""
    rng = np.random.default_rng(1000 + step)
    ids = (rng.zipf(1.3, (size, bag)) - 1) % vocab
    return ids.astype(np.int64), rng.integers(0, 2, size).astype(np.float32)


def loss_of(rows: torch.Tensor, w: torch.Tensor, b: torch.Tensor, labels: torch.Tensor, bag: int) -> torch.Tensor:
    """Mean-pooled bags, a linear head, binary cross-entropy (the mean over the samples given)."""
    pooled = rows.view(-1, bag, rows.shape[-1]).mean(1)
    return torch.nn.functional.binary_cross_entropy_with_logits(pooled @ w + b, labels)


def main(args: dict) -> None:
    rank, workers, bag, size, vocab = args["rank"], args["workers"], args["bag"], args["size"], args["vocab"]
    init = np.load(args["init"])
    opt = psrt.AdaGrad(lr=args["lr"])
    with psrt.Client(args["servers"], rank=rank, num_workers=workers, config=ClientConfig(timeout=60)) as c:
        c.init_embedding("items", dim=init["emb"].shape[1], optimizer=opt, initial=init["emb"])
        dense = c.init({"w": init["w"], "b": init["b"]}, optimizer=opt)
        per = size // workers
        for step in range(args["steps"]):
            ids, labels = batch(step, size, bag, vocab)
            ids, labels = ids[rank * per:(rank + 1) * per].reshape(-1), labels[rank * per:(rank + 1) * per]
            rows = torch.from_numpy(c.pull_rows("items", ids)).requires_grad_()
            w, b = (torch.from_numpy(dense[k]).requires_grad_() for k in ("w", "b"))
            loss_of(rows, w, b, torch.from_numpy(labels), bag).backward()
            pushed = c.push_rows_async("items", ids, rows.grad.numpy())
            dense = c.push_pull({"w": w.grad.numpy(), "b": b.grad.numpy()})
            pushed.wait()
        if rank == 0:
            final = c.pull_rows("items", np.arange(vocab))
            np.savez(args["out"], emb=final, w=dense["w"], b=dense["b"])
    print(json.dumps({"rank": rank}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
