"""What defines an embedding table, which a worker's ``init_embedding`` and every shard agree on: :class:`TableSpec`.

Both sides build one: the worker to check its arguments before sending anything (:mod:`psrt.worker.embedding_client`),
the shard from the ``init_table`` request (:mod:`psrt.shard.tables`), whose rows it keeps (:mod:`psrt.shard.embedding`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Optional

import numpy as np

from psrt import optim
from psrt.errors import ConfigError
from psrt.kernels.rows import INITIALIZERS

__all__ = ["TableSpec", "INITIALIZERS"]


@dataclass(frozen=True)
class TableSpec:
    """What defines a table: every worker's ``init_embedding`` must agree on it.

    Parameters
    ----------
    dim : int
        Row length.
    dtype : numpy.dtype
        float32 or float64.
    optimizer : Optimizer
        The row-wise optimizer (:class:`psrt.SGD`, :class:`psrt.AdaGrad`, :class:`psrt.Adam` without weight
        decay).
    init : str
        ``"normal"`` (mean 0, deviation ``std``), ``"uniform"`` (on ``[low, high)``) or ``"zeros"``.
    a, b : float
        The initializer's parameters: ``(0, std)`` for normal, ``(low, high)`` for uniform.
    seed : int
        The table's seed, in ``[0, 2**63)``.
    num_rows : int or None
        A fixed table's size (ids in ``[0, num_rows)``); None for a dynamic table (any int64 id).
    admit_after : int
        An id gets a row on its ``admit_after``-th push to its shard; 1 (the default): on its first touch.
    capacity : int or None
        The most rows a shard holds; making one more evicts the least recently pushed. None: no bound but
        ``PSRT_MAX_TABLE_ROWS``, which refuses.
    ttl : float or None
        Seconds after its last push at which a row (or a pending count) is evicted. None: never.
    max_pending : int or None
        The most ids a shard counts towards admission (:class:`psrt.shard.rowpolicy.Pending`); None: 2**20.
        Only with ``admit_after > 1``.
    """

    dim: int
    dtype: np.dtype
    optimizer: optim.Optimizer
    init: str = "normal"
    a: float = 0.0
    b: float = 0.01
    seed: int = 0
    num_rows: Optional[int] = None
    admit_after: int = 1
    capacity: Optional[int] = None
    ttl: Optional[float] = None
    max_pending: Optional[int] = None

    @property
    def managed(self) -> bool:
        """Whether rows come and go (admission, a capacity or a ttl): then a pull never makes a row."""
        return self.admit_after > 1 or self.capacity is not None or self.ttl is not None

    def policy(self) -> Optional[dict[str, Any]]:
        """The admission and eviction options as ``init_table`` carries them; None when all are the defaults."""
        if not self.managed and self.max_pending is None:
            return None
        return {"admit_after": self.admit_after, "capacity": self.capacity,
                "ttl": None if self.ttl is None else float(self.ttl),
                "max_pending": self.max_pending}

    def __post_init__(self) -> None:
        if type(self.dim) is not int or self.dim < 1:
            raise ConfigError(f"dim must be a positive integer, got {self.dim!r}")
        if self.init not in INITIALIZERS:
            raise ConfigError(f"init must be one of {sorted(INITIALIZERS)}, got {self.init!r}")
        if self.num_rows is not None and (type(self.num_rows) is not int or self.num_rows < 1):
            raise ConfigError(f"num_rows must be a positive integer, got {self.num_rows!r}")
        if type(self.seed) is not int or not 0 <= self.seed < 1 << 63:
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if type(self.admit_after) is not int or self.admit_after < 1:
            raise ConfigError(f"admit_after must be a positive integer (1: a row on first touch), got "
                              f"{self.admit_after!r}")
        if self.capacity is not None and (type(self.capacity) is not int or self.capacity < 1):
            raise ConfigError(f"capacity must be a positive integer (rows per shard) or None, got {self.capacity!r}")
        if self.ttl is not None and (isinstance(self.ttl, bool) or not isinstance(self.ttl, (int, float))
                                     or not math.isfinite(self.ttl) or self.ttl <= 0):
            raise ConfigError(f"ttl must be a positive number of seconds or None, got {self.ttl!r}")
        if self.max_pending is not None:
            if type(self.max_pending) is not int or self.max_pending < 1:
                raise ConfigError(f"max_pending must be a positive integer or None, got {self.max_pending!r}")
            if self.admit_after == 1:
                raise ConfigError("max_pending bounds the ids counted towards admission; it needs admit_after > 1")
        if self.num_rows is not None and self.managed:
            raise ConfigError("admit_after, capacity and ttl are for dynamic tables; a fixed table (num_rows or "
                              "initial) keeps all its rows")
        opt = self.optimizer
        if isinstance(opt, optim.Adam) and opt.weight_decay:
            raise ConfigError("embedding tables step Adam as torch.optim.SparseAdam, which has no weight decay; "
                              "pass weight_decay=0")

    def differences(self, other: TableSpec) -> str:
        """Where ``other`` differs from this one, field by field, as a user writes them (``float32``, not
        ``dtype('float32')``): ``"dim 4 vs 8; optimizer SGD(lr=0.01, ...) vs AdaGrad(...)"``."""
        def show(value: object) -> str:
            return str(value) if isinstance(value, np.dtype) else repr(value)

        return "; ".join(f"{f.name} {show(getattr(self, f.name))} vs {show(getattr(other, f.name))}"
                         for f in fields(self) if getattr(self, f.name) != getattr(other, f.name))
