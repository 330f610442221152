"""The one table of tensor dtypes psrt moves and computes on: float32 and float64; and the wire forms of
compressed gradients (fp16, bf16, top-k), whose encoding is :mod:`psrt.wire.compression`.

The kernels are compiled for exactly these, the wire names them with little-endian NumPy strings, and the client
refuses anything else. Every other module asks this one, so adding a dtype is a change in one place (and in the
kernels' fused types).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

__all__ = ["SUPPORTED", "BY_WIRE_NAME", "WIRE_NAMES", "wire_name", "from_wire_name", "describe", "COMPRESSED", "TOPK",
           "CODECS", "check_compression", "topk_ratio"]

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


# ---------------------------------------------------------------------------------------------- compressed forms
#: The compressions a client can ask for (:mod:`psrt.wire.compression`), and the wire dtype name of each.
COMPRESSED: dict[str, str] = {"fp16": "<f2", "bf16": "bf16"}

#: Wire dtype name (and encoding) of a top-k sparsified gradient chunk.
TOPK = "topk"

#: Wire dtype name -> compression (the shard's allow-list for compressed gradients).
CODECS: dict[str, str] = {**{name: codec for codec, name in COMPRESSED.items()}, TOPK: TOPK}


def check_compression(compression: Optional[str]) -> Optional[str]:
    """``compression`` if it is one psrt knows (None, ``""`` or ``"none"``: none).

    Raises
    ------
    ValueError
        Naming the ones there are.
    """
    if compression in (None, "", "none"):
        return None
    if isinstance(compression, str) and compression.startswith(TOPK + ":"):
        topk_ratio(compression)
        return compression
    if compression not in COMPRESSED:
        raise ValueError(f"compression must be one of {sorted(COMPRESSED)} or 'topk:RATIO' with 0 < RATIO <= 1 "
                         f"(or none), got {compression!r}")
    return compression


def topk_ratio(compression: str) -> float:
    """The RATIO of ``"topk:RATIO"``.

    Raises
    ------
    ValueError
        Unless RATIO is a number in (0, 1].
    """
    try:
        ratio = float(compression[len(TOPK) + 1:])
    except ValueError:
        ratio = math.nan
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"compression must be one of {sorted(COMPRESSED)} or 'topk:RATIO' with 0 < RATIO <= 1, "
                         f"got {compression!r}")
    return ratio
