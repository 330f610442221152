"""Gradient compression on the wire: float32 gradients travel as 16-bit floats and are widened on the shard.

``Client(..., compression="fp16")`` (or ``"bf16"``, or ``PSRT_COMPRESSION``) sends each float32 gradient chunk
of a push as IEEE half floats (wire name ``<f2``) or as bfloat16 (wire name ``bf16``: the upper 16 bits of each
float32, rounded to nearest even); the shard widens them back to float32 before summing and stepping, so the
parameters, accumulators and optimizer state stay float32. The parameters of a ``push_pull`` whose gradients
were 16-bit come back in the same 16-bit form (the client widens them into its float32 arrays); a plain pull,
``init`` and top-k pushes get full precision.

fp16 holds magnitudes up to 65504 and rounds away those below about 6e-8: a chunk with a value out of fp16's
range, or one that fp16 would turn into a NaN or Inf, is sent as float32 instead (never silently as Inf), and
the push says so per chunk through its dtype name. bf16 has float32's range and 8 bits of mantissa.
float64 tensors are never compressed.

``"topk:RATIO"`` (0 < RATIO <= 1, e.g. ``"topk:0.01"``) sparsifies instead: for each float32 chunk the client
adds the chunk's error-feedback residual (what earlier pushes left out) to the gradient, sends the
``k = ceil(RATIO * count)`` entries of largest magnitude of that sum, and keeps the rest as the new residual, so
every entry travels eventually. The wire dtype name is ``topk`` (pushes only) and the entry's shape is the chunk's
dense shape; its one frame holds ``k`` little-endian int32 indices, strictly increasing (so never duplicated) and
below the chunk's count, followed by the ``k`` float32 values: ``8 * k`` bytes, ``k <= count``. A frame that
breaks any of this is refused by the shard's decoder before anything changes (:func:`check_frame`). The shard
widens it to a dense float32 gradient (zeros elsewhere), so sync accumulation and every optimizer treat it
exactly like an uncompressed gradient. A chunk whose gradient plus residual holds a NaN or Inf is sent dense at
full precision (the shard's ``nonfinite`` policy judges it) and its residual is dropped. A chunk whose top-k
frame would exceed the shards' per-tensor frame limit (``k`` near ``count``: up to twice the dense bytes) is sent
dense too.

A residual is updated when its push is encoded (the next push builds on it while this one is in flight); each
change is recorded (``changes``), so that a push the shard refuses can be taken back out of the residuals
(:func:`undo`): what a refused push sent is owed again, and its gradient was never applied.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from psrt.dtypes import CODECS, TOPK, topk_ratio
from psrt.dtypes import COMPRESSED as WIRE_NAMES
from psrt.dtypes import check_compression as check
from psrt.errors import ProtocolError

__all__ = ["CODECS", "WIRE_NAMES", "TOPK", "encode", "decode", "check", "check_frame", "topk_ratio", "undo",
           "Residuals", "Changes"]

#: Residuals of top-k compression, by chunk key ``(name, part)``: what earlier pushes left out.
Residuals = dict[Any, np.ndarray]

#: What encoding a push did to the residuals: ``(key, residual before or None, residual after or None)`` per
#: chunk, in order.
Changes = list[tuple[Any, Optional[np.ndarray], Optional[np.ndarray]]]

_INDEX = np.dtype("<i4")
_VALUE = np.dtype(np.float32).newbyteorder("<")

_FP16_MAX = float(np.finfo(np.float16).max)
_FLOAT32 = np.dtype(np.float32).newbyteorder("<").str  # the wire name of float32 ("<f4")


def encode(compression: str, chunk: np.ndarray, residuals: Optional[Residuals] = None, key: Any = None,
           changes: Optional[Changes] = None, max_frame: Optional[int] = None) -> Optional[tuple[str, np.ndarray]]:
    """The wire dtype name and payload of a float32 ``chunk``, or None to send it as it is.

    None for a chunk that is not float32, or (fp16) that holds a value fp16 cannot carry, or (top-k) whose frame
    would be larger than ``max_frame`` bytes. For ``topk:RATIO``, ``residuals[key]`` is the chunk's error-feedback
    residual, read and replaced here (no ``residuals``: none), the change appended to ``changes``.
    """
    if chunk.dtype != np.float32 or chunk.size == 0:
        return None
    if compression.startswith(TOPK):
        return _encode_topk(topk_ratio(compression), chunk, residuals, key, changes, max_frame)
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


def _encode_topk(ratio: float, chunk: np.ndarray, residuals: Optional[Residuals], key: Any,
                 changes: Optional[Changes], max_frame: Optional[int]) -> Optional[tuple[str, np.ndarray]]:
    n = chunk.size
    k = min(n, max(1, math.ceil(ratio * n)))
    if n > np.iinfo(_INDEX).max:
        return None
    residual = residuals.get(key) if residuals is not None else None
    if residual is not None and residual.size != n:
        residual = None  # another tensor's, under the same key before (never the case in a client)
    total = chunk + residual if residual is not None else chunk.astype(np.float32)
    if not np.isfinite(total).all():
        if residuals is not None and key in residuals:
            dropped = residuals.pop(key)
            if changes is not None:
                changes.append((key, dropped, None))
        return None
    if max_frame is not None and 8 * k > max_frame:  # the shard would cut such a frame off: send it all dense
        if residual is None:
            return None
        if residuals is not None:
            del residuals[key]
            if changes is not None:
                changes.append((key, residual, None))
        return _FLOAT32, total
    if k == n:
        index = np.arange(n, dtype=_INDEX)
    else:
        index = np.argpartition(np.abs(total), n - k)[n - k:].astype(_INDEX)
        index.sort()
    out = np.empty(2 * k, _INDEX)
    out[:k] = index
    out.view(_VALUE)[k:] = total[index]
    if residuals is not None:
        total[index] = 0.0
        residuals[key] = total
        if changes is not None:
            changes.append((key, residual, total))
    return TOPK, out


def undo(residuals: Residuals, changes: Changes) -> None:
    """Take a refused push's ``changes`` back out of ``residuals``, keeping those of pushes encoded since.

    Residuals are only ever replaced, never written in place, so ``after`` still being the residual means no
    later push touched it; otherwise the later residual is corrected by what this push changed.
    """
    for key, before, after in reversed(changes):
        now = residuals.get(key)
        if now is after:
            if before is None:
                residuals.pop(key, None)
            else:
                residuals[key] = before
        elif now is not None and after is not None and now.shape == after.shape:
            residuals[key] = now - after if before is None or before.shape != now.shape else now + (before - after)


def check_frame(buffer: Any, count: int) -> None:
    """Check a top-k frame of a chunk of ``count`` values against the rules in this module's docstring.

    Raises
    ------
    ProtocolError
        Saying what is wrong.
    """
    n = len(buffer)
    if n % 8 or n // 8 > count:
        raise ProtocolError(f"topk frame has {n} bytes: it must hold k int32 indices and k float32 values "
                            f"(8 * k bytes) with k <= {count}, the chunk's count")
    index = np.frombuffer(buffer, _INDEX, n // 8)
    if index.size and (index[0] < 0 or index[-1] >= count or not bool(np.all(index[1:] > index[:-1]))):
        raise ProtocolError(f"topk indices must be strictly increasing (no duplicates) and in [0, {count})")


def decode(compression: str, buffer: Any, count: int = 0) -> np.ndarray:
    """The float32 values of a received compressed payload (a new, writable array), ``count`` of them for top-k
    (zeros where no index names an entry). The buffer must have passed :func:`check_frame`."""
    if compression == TOPK:
        k = len(buffer) // 8
        dense = np.zeros(count, np.float32)
        dense[np.frombuffer(buffer, _INDEX, k)] = np.frombuffer(buffer, _VALUE, k, offset=4 * k)
        return dense
    if compression == "fp16":
        return np.frombuffer(buffer, dtype="<f2").astype(np.float32)
    widened = np.frombuffer(buffer, dtype="<u2").astype(np.uint32) << np.uint32(16)
    return widened.view(np.float32)
