"""Gradient compression on the worker's side of a push (:mod:`psrt.wire.compression` has the encodings).

:class:`Compressor` encodes each float32 chunk of a push as the client's compression says (fp16, bf16 or
``topk:RATIO``), in place of its full-precision header entry and bytes. Top-k's residuals change as a push is
encoded; a push the shard refuses takes its changes back (:func:`psrt.wire.compression.undo`), and the residuals
of a shard that restarted (maybe from a checkpoint, behind what it was) or of tensors initialized again start
from zero.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from psrt.partition import Chunk
from psrt.wire import compression

__all__ = ["Compressor"]


class Compressor:
    """A client's gradient compression, with top-k's error feedback by chunk key.

    Parameters
    ----------
    compress : str
        The compression (:data:`psrt.config.ClientConfig.compression`).
    max_frame : int
        The shards' per-tensor frame limit: a top-k frame that would exceed it goes dense.
    """

    def __init__(self, compress: str, max_frame: int) -> None:
        self._compress = compress
        self._max_frame = max_frame
        self._residuals: compression.Residuals = {}  # top-k: what earlier pushes left out, by chunk key
        self._residual_shard: dict[tuple[str, int], int] = {}  # top-k: the shard each residual's chunk is on

    def compress(self, shard: int, msg: Sequence[Chunk], entries: list[list[Any]],
                 payload: list[np.ndarray]) -> Optional[Callable[[], None]]:
        """Compress a message's float32 gradients in place of ``entries``/``payload``; returns what takes its
        residual changes back should the shard refuse it (None: nothing changed)."""
        changes: compression.Changes = []
        for i, chunk in enumerate(payload):
            key = (msg[i].name, msg[i].part)
            packed = compression.encode(self._compress, chunk, self._residuals, key, changes, self._max_frame)
            if packed is not None:  # else the chunk goes at full precision (float64, or out of fp16's range)
                entries[i][2], payload[i] = packed
        for key, _, _ in changes:
            self._residual_shard[key] = shard
        residuals = self._residuals
        return (lambda: compression.undo(residuals, changes)) if changes else None

    def restarted(self, shard: int) -> None:
        """A shard came back: what its residuals owed it is relative to a state it may no longer have."""
        for key in [k for k, s in self._residual_shard.items() if s == shard]:
            self._residuals.pop(key, None)

    def forget(self, names: Iterable[str]) -> None:
        """Tensors ``names`` are (re)initialized: their residuals start from zero."""
        names = set(names)
        for key in [k for k in self._residuals if k[0] in names]:
            del self._residuals[key]
