"""What defines an embedding table, which a worker's ``init_embedding`` and every shard agree on: :class:`TableSpec`.

Both sides build one: the worker to check its arguments before sending anything (:mod:`psrt.worker.embedding_client`),
the shard from the ``init_table`` request (:mod:`psrt.shard.tables`), whose rows it keeps (:mod:`psrt.shard.embedding`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

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
    """

    dim: int
    dtype: np.dtype
    optimizer: optim.Optimizer
    init: str = "normal"
    a: float = 0.0
    b: float = 0.01
    seed: int = 0
    num_rows: Optional[int] = None

    def __post_init__(self) -> None:
        if type(self.dim) is not int or self.dim < 1:
            raise ConfigError(f"dim must be a positive integer, got {self.dim!r}")
        if self.init not in INITIALIZERS:
            raise ConfigError(f"init must be one of {sorted(INITIALIZERS)}, got {self.init!r}")
        if self.num_rows is not None and (type(self.num_rows) is not int or self.num_rows < 1):
            raise ConfigError(f"num_rows must be a positive integer, got {self.num_rows!r}")
        if type(self.seed) is not int or not 0 <= self.seed < 1 << 63:
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
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
