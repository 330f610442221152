"""The one table of tensor dtypes psrt moves and computes on: float32 and float64.

The kernels are compiled for exactly these, the wire names them with little-endian NumPy strings, and the client
refuses anything else. Every other module asks this one, so adding a dtype is a change in one place (and in the
kernels' fused types).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

__all__ = ["SUPPORTED", "BY_WIRE_NAME", "WIRE_NAMES", "wire_name", "from_wire_name", "describe"]

#: Wire name of every supported dtype, in this machine's (native) byte order.
WIRE_NAMES: dict[np.dtype, str] = {np.dtype(np.float32): "<f4", np.dtype(np.float64): "<f8"}

#: The supported dtypes, as a tuple (fast ``in`` checks on the hot path).
SUPPORTED: tuple[np.dtype, ...] = tuple(WIRE_NAMES)

#: The allow-list for decoding: wire name to dtype. Never ``np.dtype(untrusted)``.
BY_WIRE_NAME: dict[str, np.dtype] = {name: np.dtype(name) for name in WIRE_NAMES.values()}


def describe() -> str:
    """``"float32 or float64"``: for error messages."""
    return " or ".join(d.name for d in SUPPORTED)


def wire_name(dtype: Any) -> Optional[str]:
    """The wire name of a supported dtype (a ``np.dtype``, type or string), or None when it is not supported."""
    name = WIRE_NAMES.get(dtype) if isinstance(dtype, np.dtype) else None
    if name is None and not isinstance(dtype, np.dtype):  # a type object or string: normalise it (slow path)
        try:
            name = WIRE_NAMES.get(np.dtype(dtype))
        except TypeError:
            name = None
    return name


def from_wire_name(name: Any) -> Optional[np.dtype]:
    """The dtype an untrusted wire name stands for, or None when it is not on the allow-list."""
    return BY_WIRE_NAME.get(name) if type(name) is str else None
