"""Gradient compression on the wire: float32 gradients travel as 16-bit floats and are widened on the shard.

``Client(..., compression="fp16")`` (or ``"bf16"``, or ``PSRT_COMPRESSION``) sends each float32 gradient chunk
of a push as IEEE half floats (wire name ``<f2``) or as bfloat16 (wire name ``bf16``: the upper 16 bits of each
float32, rounded to nearest even); the shard widens them back to float32 before summing and stepping, so the
parameters, accumulators and optimizer state stay float32. Parameters always travel at full precision.

fp16 holds magnitudes up to 65504 and rounds away those below about 6e-8: a chunk with a value out of fp16's
range, or one that fp16 would turn into a NaN or Inf, is sent as float32 instead (never silently as Inf), and
the push says so per chunk through its dtype name. bf16 has float32's range and 8 bits of mantissa.
float64 tensors are never compressed.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

__all__ = ["CODECS", "WIRE_NAMES", "encode", "decode", "check"]

#: The compressions a client can ask for, and the wire dtype name of each.
WIRE_NAMES: dict[str, str] = {"fp16": "<f2", "bf16": "bf16"}

#: Wire dtype name -> compression (the shard's allow-list for gradients).
CODECS: dict[str, str] = {name: codec for codec, name in WIRE_NAMES.items()}

_FP16_MAX = float(np.finfo(np.float16).max)


def check(compression: Optional[str]) -> Optional[str]:
    """``compression`` if it is one psrt knows (None or ``""``: none).

    Raises
    ------
    ValueError
        Naming the ones there are.
    """
    if compression in (None, "", "none"):
        return None
    if compression not in WIRE_NAMES:
        raise ValueError(f"compression must be one of {sorted(WIRE_NAMES)} (or none), got {compression!r}")
    return compression


def encode(compression: str, chunk: np.ndarray) -> Optional[tuple[str, np.ndarray]]:
    """The wire dtype name and 16-bit payload of a float32 ``chunk``, or None to send it as it is.

    None for a chunk that is not float32, or (fp16) that holds a value fp16 cannot carry.
    """
    if chunk.dtype != np.float32 or chunk.size == 0:
        return None
    if compression == "fp16":
        peak = float(np.max(np.abs(chunk)))
        if not peak <= _FP16_MAX:  # also catches NaN: it is refused by the shard at full precision
            return None
        return WIRE_NAMES["fp16"], chunk.astype(np.float16)
    bits = chunk.view(np.uint32)
    # Round to nearest even on the 16 bits kept; NaN keeps a set mantissa bit (never rounds into Inf).
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = np.isnan(chunk)
    if nan.any():
        rounded[nan] = (bits[nan] >> np.uint32(16)) | np.uint32(0x40)
    return WIRE_NAMES["bf16"], rounded.astype(np.uint16)


def decode(compression: str, buffer: Any) -> np.ndarray:
    """The float32 values of a received 16-bit payload (a new, writable array)."""
    if compression == "fp16":
        return np.frombuffer(buffer, dtype="<f2").astype(np.float32)
    widened = np.frombuffer(buffer, dtype="<u2").astype(np.uint32) << np.uint32(16)
    return widened.view(np.float32)
