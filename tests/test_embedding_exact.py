"""Exactness: two sync workers, each on half of every batch, end with single-process torch's rows and weights."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _helpers import run_workers  # noqa: E402
from _workers import click_batch as batch  # noqa: E402
from _workers import click_loss as loss_of  # noqa: E402

pytestmark = pytest.mark.integration


def test_two_sync_workers_match_torch_sparse_adagrad(shards, tmp_path):
    vocab, dim, bag, size, steps, lr = 200, 16, 4, 64, 30, 0.05
    torch.manual_seed(0)
    emb = torch.nn.Embedding(vocab, dim, sparse=True)
    head = torch.nn.Linear(dim, 1)
    w0, b0 = head.weight.detach()[0].clone(), head.bias.detach().clone()
    np.savez(tmp_path / "init.npz", emb=emb.weight.detach().numpy(), w=w0.numpy(), b=b0.numpy())
    # The reference: one process, the whole batch, nn.Embedding(sparse=True) and torch.optim.Adagrad.
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    opt = torch.optim.Adagrad([emb.weight, w, b], lr=lr)
    with torch.sparse.check_sparse_tensor_invariants():  # (opted into: torch warns when nobody chose)
        for step in range(steps):
            ids, labels = batch(step, size, bag, vocab)
            opt.zero_grad()
            loss_of(emb(torch.from_numpy(ids.reshape(-1))), w, b, torch.from_numpy(labels), bag).backward()
            opt.step()

    group = shards(2, workers=2, mode="sync")
    out = tmp_path / "final.npz"
    common = dict(servers=group.endpoints, workers=2, bag=bag, size=size, vocab=vocab, steps=steps, lr=lr,
                  init=str(tmp_path / "init.npz"), out=str(out))
    run_workers("embedding_clicks", [{**common, "rank": r} for r in range(2)], timeout=180)
    got = np.load(out)
    touched = np.unique(np.concatenate([batch(s, size, bag, vocab)[0].reshape(-1) for s in range(steps)]))
    assert len(touched) > 20
    for name, ref in (("emb", emb.weight), ("w", w), ("b", b)):
        expected = ref.detach().numpy()
        scale = float(np.max(np.abs(expected)))
        np.testing.assert_allclose(got[name], expected, rtol=1e-4, atol=1e-4 * scale, err_msg=name)
    assert not np.allclose(got["emb"][touched], np.load(tmp_path / "init.npz")["emb"][touched])
