"""A NumPy model of one shard's embedding table with admission, capacity and ttl, written from the documented
rules with dicts and plain loops, to check :class:`psrt.shard.embedding.RowTable` against.

Rules (README "Embedding tables", :mod:`psrt.shard.rowpolicy`): a push's ids are coalesced; an id with a row is
stepped; an id without one is counted, and its k-th count makes its row (initial value, fresh slots) which this
push steps; a pending id's gradient is dropped. The pending map holds at most ``max_pending`` ids, dropping the
least recently pushed (ties: smaller id). After each push (async), rows beyond the capacity go, least recently
pushed first (ties: smaller id). The ttl sweep runs when ``ttl / 16`` passed since the last one and drops rows
and pending ids last pushed ``ttl`` or more ago. A pull of an id without a row returns its initial value.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from psrt.kernels import reference

_KINDS = {"zeros": 0, "uniform": 1, "normal": 2}


class OracleTable:
    """SGD (lr) or AdaGrad (lr, eps) rows, with the table options."""

    def __init__(self, dim: int, seed: int, optimizer: str = "sgd", lr: float = 0.1, eps: float = 1e-10,
                 admit_after: int = 1, capacity: Optional[int] = None, ttl: Optional[float] = None,
                 max_pending: int = 1 << 20, init: str = "normal", a: float = 0.0, b: float = 0.1) -> None:
        self.dim, self.seed, self.optimizer, self.lr, self.eps = dim, seed, optimizer, lr, eps
        self.k, self.capacity, self.ttl, self.max_pending = admit_after, capacity, ttl, max_pending
        self.init, self.a, self.b = init, a, b
        self.rows: dict[int, np.ndarray] = {}
        self.acc: dict[int, np.ndarray] = {}
        self.last: dict[int, int] = {}
        self.when: dict[int, float] = {}
        self.pending: dict[int, list] = {}  # id -> [count, tick, when]
        self.tick = 0
        self.swept = -np.inf
        self.evicted = self.admitted = 0

    def initial(self, i: int) -> np.ndarray:
        return reference.init_rows(np.array([i], np.int64), self.dim, np.float32, self.seed, _KINDS[self.init],
                                   self.a, self.b)[0]

    def push(self, ids: np.ndarray, grads: np.ndarray, now: float = 0.0) -> None:
        summed: dict[int, np.ndarray] = {}
        for i, g in zip(ids.tolist(), grads):
            summed[i] = summed[i] + g if i in summed else g.astype(np.float32).copy()
        for i in sorted(summed):
            if i not in self.rows:
                if self.k > 1:
                    c = self.pending.setdefault(i, [0, 0, 0.0])
                    c[0] += 1
                    c[1], c[2] = self.tick, now
                    if c[0] < self.k:
                        continue
                    del self.pending[i]
                self.rows[i], self.acc[i] = self.initial(i), np.zeros(self.dim, np.float32)
                self.admitted += 1
            self.last[i], self.when[i] = self.tick, now
        while len(self.pending) > self.max_pending:
            del self.pending[min(self.pending, key=lambda j: (self.pending[j][1], j))]
        for i in sorted(summed):
            if i in self.rows:
                self._step(i, summed[i])
        self.tick += 1
        self.evict_due(now)

    def _step(self, i: int, g: np.ndarray) -> None:
        p = self.rows[i].reshape(1, -1)
        if self.optimizer == "sgd":
            reference.sgd_rows(p, np.array([0]), g.reshape(1, -1), self.lr)
        else:
            a = self.acc[i].reshape(1, -1)
            reference.adagrad_rows(p, a, np.array([0]), g.reshape(1, -1), self.lr, self.eps)

    def evict_due(self, now: float) -> None:
        if self.ttl is not None and now - self.swept >= self.ttl / 16:
            self.swept = now
            for i in [i for i in self.rows if now - self.when[i] >= self.ttl]:
                self._evict(i)
            for i in [i for i, c in self.pending.items() if now - c[2] >= self.ttl]:
                del self.pending[i]
        if self.capacity is not None:
            while len(self.rows) > self.capacity:
                self._evict(min(self.rows, key=lambda j: (self.last[j], j)))

    def _evict(self, i: int) -> None:
        del self.rows[i], self.acc[i], self.last[i], self.when[i]
        self.evicted += 1

    def pull(self, ids: np.ndarray, now: float = 0.0) -> np.ndarray:
        self.evict_due(now)
        return np.stack([self.rows[i] if i in self.rows else self.initial(i) for i in ids.tolist()]) \
            if len(ids) else np.empty((0, self.dim), np.float32)
