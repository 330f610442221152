"""Where pulled parameters land: the caller's own arrays (``out=``), or arrays psrt reuses once they are free.

A pull or push_pull without ``out=`` returns arrays the client allocated. Writing a fresh multi-megabyte array
costs a page fault per 4 KiB page, so the client keeps the arrays it returned last (at most :data:`POOL_SIZE` per
tensor) and receives into one again once **nothing but the pool refers to it**: no variable, container, view,
memoryview or pending handle of the caller's. The caller never sees an array it still holds change; a loop that
rebinds ``params = client.push_pull(grads)`` alternates between two arrays whose pages are touched only once.
"""

from __future__ import annotations

import sys
from typing import Iterable, Mapping, Optional

import numpy as np

from psrt.errors import ConfigError

__all__ = ["ReceivePool", "POOL_SIZE"]

#: Arrays kept per tensor for reuse.
POOL_SIZE = 3
#: The reference count of an array held by nothing but the pool: the pool's list, the loop variable, and
#: ``sys.getrefcount``'s own argument.
_POOL_ONLY = 3


class ReceivePool:
    """Receive arrays per tensor name, reused once the caller has let go of them."""

    def __init__(self) -> None:
        self._pool: dict[str, list[np.ndarray]] = {}

    def outputs(self, names: Iterable[str], tensors: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                out: Optional[Mapping[str, np.ndarray]] = None) -> dict[str, np.ndarray]:
        """Destination arrays of ``names``: the caller's ``out`` where given (checked), else :meth:`reusable`.

        Raises
        ------
        ConfigError
            When a name was never initialized, or an ``out`` array has the wrong shape, dtype or layout.
        """
        outputs = {}
        for name in names:
            spec = tensors.get(name)
            if spec is None:
                raise ConfigError(f"tensor {name!r} was never initialized; call client.init() with it first")
            shape, dtype = spec
            given = None if out is None else out.get(name)
            if given is None:
                outputs[name] = self.reusable(name, shape, dtype)
                continue
            if not isinstance(given, np.ndarray) or given.shape != shape or given.dtype != dtype:
                raise ConfigError(f"out[{name!r}] must be a numpy array of shape {shape} and dtype {dtype}")
            if not given.flags.c_contiguous or not given.flags.writeable:
                raise ConfigError(f"out[{name!r}] must be C-contiguous and writable")
            outputs[name] = given
        return outputs

    def reusable(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An array this pool handed out before and nobody else holds any more, else a new one."""
        pool = self._pool.get(name)  # (not setdefault: its default list would be made on every call)
        if pool is None:
            pool = self._pool[name] = []
        refs = sys.getrefcount
        for a in pool:
            if refs(a) <= _POOL_ONLY:
                return a
        a = np.empty(shape, dtype)
        if len(pool) == POOL_SIZE:
            pool.pop(0)  # every pooled array is still the caller's: let the oldest go (the caller keeps it)
        pool.append(a)
        return a
