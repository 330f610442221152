"""The wire protocol: one msgpack header frame followed by raw buffer frames.

A request or reply is a multipart ZeroMQ message ``[header, buf_0, ..., buf_{n-1}]``. The header is a msgpack
map; tensor bytes never pass through msgpack, so large buffers travel zero-copy. Each tensor in a message is
described by one entry ``[name, part, dtype, shape]`` in the header's ``tensors`` list, and its bytes are the
buffer frame at the same position. ``part`` numbers the contiguous chunks of a tensor split by
:mod:`psrt.partition` (0 for a whole tensor).

Everything a peer sends is decoded as hostile: the header is unpacked with explicit msgpack limits (no binary,
no extension types, string map keys), checked against a strict per-op schema (exact key set, ``type(v) is
int`` so booleans are not integers), dtypes come from a small allow-list of little-endian names, element counts
are computed with Python integers with every dimension capped, and each buffer frame must hold exactly
``count * itemsize`` bytes. Any violation raises :class:`~psrt.errors.ProtocolError` saying what was wrong.

Requests (worker to shard)
    ``init``       ``worker, session, optimizer, tensors`` + buffers: set values unless the key exists
    ``push``       ``worker, session, seq, tensors`` + buffers: gradients
    ``push_pull``  as ``push``; the reply carries the parameters once the push's round is applied
    ``pull``       ``worker, keys``: ``[[name, part, min_version], ...]``
    ``stats``      no fields: the shard's counters
Replies (shard to worker)
    ``params``     ``tensors, versions`` + buffers (and ``mode, num_workers, optimizers`` after ``init``)
    ``ack``        ``versions, duplicate``
    ``stats``      ``stats``
    ``error``      ``code, message``
Every header also carries ``v`` (the protocol version), ``op`` and ``id`` (the request id, echoed in the reply).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import msgpack
import numpy as np

from psrt.config import WireLimits
from psrt.errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "DTYPES",
    "TensorMeta",
    "Request",
    "Reply",
    "pack_header",
    "unpack_header",
    "check_version",
    "dtype_name",
    "encode",
    "decode_request",
    "decode_reply_header",
]

PROTOCOL_VERSION = 1

#: The allow-list of dtype names on the wire. Never ``np.dtype(untrusted)``.
DTYPES: dict[str, np.dtype] = {"<f4": np.dtype("<f4"), "<f8": np.dtype("<f8")}

_MAX_DIM = 1 << 40
_MAX_U63 = (1 << 63) - 1

_REQUEST_FIELDS: dict[str, frozenset[str]] = {
    "init": frozenset({"v", "op", "id", "worker", "session", "optimizer", "tensors"}),
    "push": frozenset({"v", "op", "id", "worker", "session", "seq", "tensors"}),
    "push_pull": frozenset({"v", "op", "id", "worker", "session", "seq", "tensors"}),
    "pull": frozenset({"v", "op", "id", "worker", "keys"}),
    "stats": frozenset({"v", "op", "id"}),
}
_REPLY_OPS = frozenset({"params", "ack", "stats", "error"})


@dataclass(frozen=True)
class TensorMeta:
    """One tensor entry of a header: its key, dtype, shape, element count and byte size."""

    name: str
    part: int
    dtype: np.dtype
    shape: tuple[int, ...]
    count: int
    nbytes: int

    @property
    def key(self) -> tuple[str, int]:
        """The shard-side key: ``(name, part)``."""
        return (self.name, self.part)


@dataclass
class Request:
    """A decoded, validated request. ``buffers[i]`` holds the bytes of ``tensors[i]``."""

    op: str
    id: int
    header: dict[str, Any]
    tensors: list[TensorMeta]
    buffers: list[Any]

    def array(self, i: int) -> np.ndarray:
        """The i-th buffer as a flat, read-only-if-received array of its declared dtype (no copy)."""
        return np.frombuffer(self.buffers[i], dtype=self.tensors[i].dtype)

    def tensors_keys(self) -> list[tuple[str, int]]:
        """The ``(name, part)`` key of every tensor, in message order."""
        return [m.key for m in self.tensors]


@dataclass
class Reply:
    """A decoded reply header; the caller receives the ``tensors`` buffer frames itself."""

    op: str
    id: int
    header: dict[str, Any]
    tensors: list[TensorMeta]


_NAMES: dict[np.dtype, str] = {np.dtype("float32"): "<f4", np.dtype("float64"): "<f8"}


def dtype_name(dtype: np.dtype) -> str:
    """The wire name of a dtype from the allow-list.

    Raises
    ------
    ProtocolError
        When the dtype is not float32 or float64 (in this machine's byte order).
    """
    name = _NAMES.get(dtype) if isinstance(dtype, np.dtype) else None
    if name is None:  # a type object or string: normalise it (the slow path)
        try:
            name = _NAMES.get(np.dtype(dtype))
        except TypeError:
            name = None
    if name is None:
        raise ProtocolError(f"dtype {dtype} cannot be sent; psrt tensors are float32 or float64")
    return name


def pack_header(header: dict[str, Any]) -> bytes:
    """Pack a header map with msgpack (strings as str, no binary fields)."""
    return msgpack.packb(header, use_bin_type=True)


def unpack_header(data: Any, limits: WireLimits) -> dict[str, Any]:
    """Unpack an untrusted header frame with explicit limits (the caller checks the fields).

    Raises
    ------
    ProtocolError
        When the frame is too large, is not valid msgpack, or is not a map.
    """
    n = len(data)
    if n > limits.max_header_bytes:
        raise ProtocolError(f"header frame is {n} bytes; the limit is {limits.max_header_bytes}")
    try:
        header = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=max(limits.max_name_len, 4096),
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=limits.max_tensors,
            max_map_len=64,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"header is not a valid msgpack map: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    if any(type(k) is not str for k in header):
        raise ProtocolError("header keys must all be strings")
    return header


def check_version(header: dict[str, Any]) -> None:
    """Raise :class:`ProtocolError` unless the header speaks this protocol version."""
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported; this peer speaks {PROTOCOL_VERSION}")


def _uint(header: dict[str, Any], key: str, hi: int = _MAX_U63) -> int:
    value = header.get(key)
    if type(value) is not int or not 0 <= value <= hi:
        raise ProtocolError(f"field {key!r} must be an integer in [0, {hi}], got {value!r}")
    return value


def _tensor_metas(entries: Any, limits: WireLimits) -> list[TensorMeta]:
    if type(entries) is not list:
        raise ProtocolError("field 'tensors' must be a list of [name, part, dtype, shape]")
    if len(entries) > limits.max_tensors:
        raise ProtocolError(f"{len(entries)} tensors in one message; the limit is {limits.max_tensors}")
    metas = []
    for i, entry in enumerate(entries):
        if type(entry) is not list or len(entry) != 4:
            raise ProtocolError(f"tensor entry {i} must be [name, part, dtype, shape]")
        name, part, dname, shape = entry
        if type(name) is not str or not 0 < len(name) <= limits.max_name_len:
            raise ProtocolError(f"tensor entry {i}: name must be a non-empty string of at most "
                                f"{limits.max_name_len} characters")
        if type(part) is not int or not 0 <= part <= _MAX_U63:
            raise ProtocolError(f"tensor {name!r}: part must be a non-negative integer, got {part!r}")
        dtype = DTYPES.get(dname) if type(dname) is str else None
        if dtype is None:
            raise ProtocolError(f"tensor {name!r}: dtype {dname!r} is not allowed; use one of {sorted(DTYPES)}")
        if type(shape) is not list or len(shape) > limits.max_dims:
            raise ProtocolError(f"tensor {name!r}: shape must be a list of at most {limits.max_dims} dimensions")
        for d in shape:
            if type(d) is not int or not 0 <= d <= _MAX_DIM:
                raise ProtocolError(f"tensor {name!r}: dimension {d!r} must be an integer in [0, 2**40]")
        count = math.prod(shape)  # Python integers: cannot overflow
        nbytes = count * dtype.itemsize
        if nbytes > limits.max_tensor_bytes:
            raise ProtocolError(f"tensor {name!r}: shape {shape} is {nbytes} bytes; the limit is "
                                f"{limits.max_tensor_bytes}")
        metas.append(TensorMeta(name, part, dtype, tuple(shape), count, nbytes))
    return metas


def _check_buffers(metas: list[TensorMeta], buffers: Sequence[Any]) -> None:
    if len(buffers) != len(metas):
        raise ProtocolError(f"header lists {len(metas)} tensors but {len(buffers)} buffer frames follow")
    for meta, buf in zip(metas, buffers):
        if len(buf) != meta.nbytes:
            raise ProtocolError(f"tensor {meta.name!r} part {meta.part}: frame has {len(buf)} bytes, "
                                f"shape {list(meta.shape)} of {meta.dtype.str} needs {meta.nbytes}")


def decode_request(frames: Sequence[Any], limits: WireLimits) -> Request:
    """Decode and validate a request ``[header, buffers...]`` (frames after the ROUTER identity).

    Parameters
    ----------
    frames : sequence of buffer-like
        The message frames (``zmq.Frame``, ``bytes`` or ``memoryview``).
    limits : WireLimits
        Decode limits.

    Raises
    ------
    ProtocolError
        With ``request_id`` set to the request's id when the header got that far, else ``None``.
    """
    request_id = None
    try:
        if len(frames) < 1:
            raise ProtocolError("empty message: expected a header frame")
        header = unpack_header(frames[0], limits)
        if type(header.get("id")) is int and 0 <= header["id"] <= _MAX_U63:
            request_id = header["id"]
        check_version(header)
        op = header.get("op")
        fields = _REQUEST_FIELDS.get(op) if type(op) is str else None
        if fields is None:
            raise ProtocolError(f"unknown op {op!r}; known: {sorted(_REQUEST_FIELDS)}")
        if set(header) != fields:
            missing, extra = sorted(fields - set(header)), sorted(set(header) - fields)
            raise ProtocolError(f"op {op!r}: missing fields {missing}, unexpected fields {extra}")
        _uint(header, "id")
        buffers = frames[1:]
        metas: list[TensorMeta] = []
        if op in ("init", "push", "push_pull"):
            _uint(header, "worker", 1 << 31)
            _uint(header, "session")
            if op != "init":
                _uint(header, "seq")
            elif type(header["optimizer"]) is not dict:
                raise ProtocolError("field 'optimizer' must be a map")
            metas = _tensor_metas(header["tensors"], limits)
            _check_buffers(metas, buffers)
            keys = {m.key for m in metas}
            if len(keys) != len(metas):
                raise ProtocolError("a tensor key appears twice in one message")
        else:
            if buffers:
                raise ProtocolError(f"op {op!r} takes no buffer frames, got {len(buffers)}")
            if op == "pull":
                _uint(header, "worker", 1 << 31)
                _pull_keys(header["keys"], limits)
        return Request(op, header["id"], header, metas, list(buffers))
    except ProtocolError as exc:
        exc.request_id = request_id  # type: ignore[attr-defined]
        raise


def _pull_keys(keys: Any, limits: WireLimits) -> None:
    if type(keys) is not list or len(keys) > limits.max_tensors:
        raise ProtocolError(f"field 'keys' must be a list of at most {limits.max_tensors} [name, part, min_version]")
    for i, entry in enumerate(keys):
        if (type(entry) is not list or len(entry) != 3 or type(entry[0]) is not str
                or not 0 < len(entry[0]) <= limits.max_name_len
                or type(entry[1]) is not int or not 0 <= entry[1] <= _MAX_U63
                or type(entry[2]) is not int or not 0 <= entry[2] <= _MAX_U63):
            raise ProtocolError(f"pull key {i} must be [name, part, min_version] with a non-empty name "
                                "and non-negative integers")


def decode_reply_header(data: Any, limits: WireLimits) -> Reply:
    """Decode a reply header from a shard; the ``tensors`` buffers follow as separate frames.

    Raises
    ------
    ProtocolError
        When the header is malformed.
    """
    header = unpack_header(data, limits)
    check_version(header)
    op = header.get("op")
    if op not in _REPLY_OPS:
        raise ProtocolError(f"unknown reply op {op!r}")
    rid = _uint(header, "id")
    metas: list[TensorMeta] = []
    if op == "params":
        metas = _tensor_metas(header.get("tensors"), limits)
        versions = header.get("versions")
        if type(versions) is not list or len(versions) != len(metas) or any(type(v) is not int for v in versions):
            raise ProtocolError("params reply: 'versions' must list one integer per tensor")
    elif op == "ack":
        versions = header.get("versions")
        if type(versions) is not list or any(type(v) is not int for v in versions):
            raise ProtocolError("ack reply: 'versions' must be a list of integers")
    elif op == "error":
        if type(header.get("code")) is not str or type(header.get("message")) is not str:
            raise ProtocolError("error reply: 'code' and 'message' must be strings")
    return Reply(op, rid, header, metas)


def encode(header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> list[Any]:
    """Build the frames of a message: the packed header (``v`` added) and one raw buffer per array.

    Arrays must be C-contiguous; they are passed as memoryviews so the transport can send them zero-copy.
    """
    header = {"v": PROTOCOL_VERSION, **header}
    frames: list[Any] = [pack_header(header)]
    for a in arrays:
        frames.append(memoryview(a.reshape(-1)).cast("B") if a.size else b"")
    return frames
