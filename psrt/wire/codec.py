"""The framing both planes share: a msgpack header frame, decoded from untrusted bytes with explicit limits.

Everything a peer sends is decoded as hostile: the header is unpacked with explicit msgpack limits (no binary,
no extension types, string map keys), then checked against a strict per-op schema (exact key set, ``type(v) is
int`` so booleans are not integers); dtypes come from the allow-list in :mod:`psrt.dtypes`; element counts are
computed with Python integers with every dimension capped, and each buffer frame must hold exactly
``count * itemsize`` bytes. Any violation raises :class:`~psrt.errors.ProtocolError` saying what was wrong.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import msgpack
import numpy as np

from psrt import dtypes
from psrt.config import WireLimits
from psrt.errors import ProtocolError
from psrt.wire import compression

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_U63",
    "MAX_WORKER",
    "MAX_HEADER_MAP",
    "Key",
    "TensorMeta",
    "pack_header",
    "unpack_header",
    "check_version",
    "check_fields",
    "uint",
    "string",
    "tensor_metas",
    "same_limits",
    "check_buffers",
    "encode",
    "with_buffers",
    "dtype_name",
    "tensor_entry",
]

PROTOCOL_VERSION = 1

Key = tuple[str, int]

MAX_DIM = 1 << 40
#: Largest unsigned integer a field may hold (ids, sessions, sequence numbers, versions, clocks).
MAX_U63 = (1 << 63) - 1
#: A shard's replay window's holes as runs ``[first, count]`` (replication copies carry them): at most half the
#: window's numbers (:data:`psrt.shard.replay.REPLAY_WINDOW`, which the wire, below the shard, does not import).
MAX_HOLE_RUNS = (1 << 16) // 2


def hole_runs(value: Any) -> bool:
    """Whether ``value`` is a replay window's holes as runs: a list of at most :data:`MAX_HOLE_RUNS`
    ``[first, count]`` pairs of unsigned integers."""
    return type(value) is list and len(value) <= MAX_HOLE_RUNS and all(
        type(p) is list and len(p) == 2 and all(type(x) is int and 0 <= x <= MAX_U63 for x in p) for p in value)
#: Largest worker rank, and number of workers W, on the wire.
MAX_WORKER = 1 << 31
#: Most entries of one map in a header. A shard's stats reply is one flat map that grows by five entries per worker
#: (psrt.shard.stragglers) and by a replicated job's counters: 64 refused the stats of a job of 6 workers (4 when
#: replicated). Every header is also bounded by its bytes (max_header_bytes).
MAX_HEADER_MAP = 4096


@dataclass(frozen=True)
class TensorMeta:
    """One tensor entry of a header: its key, dtype, shape, element count and byte size."""

    name: str
    part: int
    dtype: np.dtype
    shape: tuple[int, ...]
    count: int
    nbytes: int
    #: A compressed gradient (:mod:`psrt.wire.compression`): ``"fp16"``, ``"bf16"`` or ``"topk"``; ``dtype`` is then
    #: float32, the values' dtype once widened, while the frame holds 2 bytes per value (top-k: 8 per entry sent).
    encoding: Optional[str] = None
    #: The shard-side key: ``(name, part)`` (made once: a shard reads it several times per message).
    key: Key = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.name, self.part))


#: One msgpack Packer per thread: msgpack.packb builds (and frees) a new one, buffer included, for every header.
_packers = threading.local()


def pack_header(header: dict[str, Any]) -> bytes:
    """Pack a header map with msgpack (strings as str, no binary fields)."""
    try:
        pack = _packers.pack
    except AttributeError:
        pack = _packers.pack = msgpack.Packer(use_bin_type=True).pack
    return pack(header)


def encode(header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> list[Any]:
    """The frames of a message: the packed header (``v`` added first) and one raw buffer per array.

    Arrays must be C-contiguous; they are passed as memoryviews so the transport can send them zero-copy. The
    typed encoders of :mod:`psrt.wire.data` and :mod:`psrt.wire.control` build every header psrt sends; this
    is the one place headers become bytes.
    """
    return with_buffers(pack_header({"v": PROTOCOL_VERSION, **header}), arrays)


def with_buffers(header: bytes, arrays: Sequence[np.ndarray] = ()) -> list[Any]:
    """The frames of a message whose header is packed already: it, then one raw buffer per array (as
    :func:`encode`)."""
    frames: list[Any] = [header]
    for a in arrays:
        if not a.size:
            frames.append(b"")
            continue
        try:
            frames.append(memoryview(a).cast("B"))  # a C-contiguous array of any shape: no reshaped view needed
        except TypeError:  # not C-contiguous after all: reshape copies it
            frames.append(memoryview(a.reshape(-1)).cast("B"))
    return frames


def unpack_header(data: Any, limits: WireLimits) -> dict[str, Any]:
    """Unpack an untrusted header frame with explicit limits (the caller checks the fields).

    Raises
    ------
    ProtocolError
        When the frame is too large, is not valid msgpack, or is not a map with string keys.
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
            max_map_len=MAX_HEADER_MAP,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"header is not a valid msgpack map: {exc}") from None
    if type(header) is not dict:
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    # strict_map_key admits str and bytes keys only, and max_bin_len=0 the empty bytes only: b"" is the one
    # non-string key that can get here, found with one lookup instead of a loop over every key.
    if b"" in header:
        raise ProtocolError("header keys must all be strings")
    return header


def check_version(header: dict[str, Any]) -> None:
    """Raise :class:`ProtocolError` unless the header speaks this protocol version."""
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported; this peer speaks {PROTOCOL_VERSION}")


def op_of(header: dict[str, Any], known: dict[str, frozenset[str]], what: str) -> str:
    """The header's ``op``, checked to be a string naming one of ``known``, with exactly its fields."""
    op = header.get("op")
    fields = known.get(op) if type(op) is str else None
    if fields is None:
        raise ProtocolError(f"unknown op {op!r} in a {what}; known: {sorted(known)}")
    check_fields(op, header, fields)
    return op


def check_fields(op: str, header: dict[str, Any], fields: frozenset[str]) -> None:
    """Raise :class:`ProtocolError` unless the header has exactly ``fields``."""
    if header.keys() != fields:
        missing, extra = sorted(fields - set(header)), sorted(set(header) - fields)
        raise ProtocolError(f"op {op!r}: missing fields {missing}, unexpected fields {extra}")


def uint(header: dict[str, Any], key: str, hi: int = MAX_U63, lo: int = 0) -> int:
    """The integer field ``key``, checked to lie in ``[lo, hi]`` (booleans are not integers)."""
    value = header.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"field {key!r} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def string(header: dict[str, Any], key: str, max_len: int = 4096, allowed: Optional[Sequence[str]] = None) -> str:
    """The string field ``key``, at most ``max_len`` characters, one of ``allowed`` when given."""
    value = header.get(key)
    if type(value) is not str or len(value) > max_len:
        raise ProtocolError(f"field {key!r} must be a string of at most {max_len} characters, got {value!r:.80}")
    if allowed is not None and value not in allowed:
        raise ProtocolError(f"field {key!r} must be one of {list(allowed)}, got {value!r}")
    return value


def uint_list(header: dict[str, Any], key: str, length: Optional[int] = None) -> list[int]:
    """The field ``key`` as a list of non-negative integers (of ``length`` items when given)."""
    value = header.get(key)
    ok = type(value) is list and (length is None or len(value) == length)
    if ok:
        for v in value:  # a loop, not any(generator): every reply has such a list, and most hold one or two
            if type(v) is not int or not 0 <= v <= MAX_U63:
                ok = False
                break
    if not ok:
        count = "" if length is None else f" of {length}"
        raise ProtocolError(f"field {key!r} must be a list{count} non-negative integers")
    return value


def tensor_metas(entries: Any, limits: WireLimits, compressed: bool = False) -> list[TensorMeta]:
    """Check a ``tensors`` field, ``[[name, part, dtype, shape], ...]``, and describe each entry.

    ``compressed``: the dtype may also name a gradient compression (pushes only; never parameters).
    """
    if type(entries) is not list:
        raise ProtocolError("field 'tensors' must be a list of [name, part, dtype, shape]")
    if len(entries) > limits.max_tensors:
        raise ProtocolError(f"{len(entries)} tensors in one message; the limit is {limits.max_tensors}")
    metas = []
    for i, entry in enumerate(entries):
        if type(entry) is not list or len(entry) != 4:
            raise ProtocolError(f"tensor entry {i} must be [name, part, dtype, shape]")
        name, part, dname, shape = entry
        # A peer sends the same few entries every step. With every field's type exact (so that equal means
        # identical: no 1.0 for 1, no True for 1), an entry seen before is its cached, already checked meta; only
        # the limits, which differ between callers, are checked again.
        if (type(name) is str and type(part) is int and type(dname) is str and type(shape) is list
                and len(shape) == 1 and type(shape[0]) is int):
            meta = _SEEN.get((name, part, dname, shape[0], compressed))
            if (meta is not None and len(name) <= limits.max_name_len and meta.nbytes <= limits.max_tensor_bytes):
                metas.append(meta)
                continue
        if type(name) is not str or not 0 < len(name) <= limits.max_name_len:
            raise ProtocolError(f"tensor entry {i}: name must be a non-empty string of at most "
                                f"{limits.max_name_len} characters")
        if type(part) is not int or not 0 <= part <= MAX_U63:
            raise ProtocolError(f"tensor {name!r}: part must be a non-negative integer, got {part!r}")
        dtype, encoding, itemsize = dtypes.from_wire_name(dname), None, 0
        if dtype is None and compressed and type(dname) is str and dname in compression.CODECS:
            # 16-bit: 2 bytes a value; top-k: the dense count's float32 size bounds it (the frame: check_buffers)
            encoding = compression.CODECS[dname]
            dtype, itemsize = np.dtype(np.float32), 4 if encoding == compression.TOPK else 2
        if dtype is None:
            allowed = sorted(dtypes.BY_WIRE_NAME) + (sorted(compression.CODECS) if compressed else [])
            raise ProtocolError(f"tensor {name!r}: dtype {dname!r} is not allowed; use one of {allowed}")
        if type(shape) is not list or len(shape) > limits.max_dims:
            raise ProtocolError(f"tensor {name!r}: shape must be a list of at most {limits.max_dims} dimensions")
        for d in shape:
            if type(d) is not int or not 0 <= d <= MAX_DIM:
                raise ProtocolError(f"tensor {name!r}: dimension {d!r} must be an integer in [0, 2**40]")
        count = math.prod(shape)  # Python integers: cannot overflow
        nbytes = count * (itemsize or dtype.itemsize)
        if nbytes > limits.max_tensor_bytes:
            raise ProtocolError(f"tensor {name!r}: shape {shape} is {nbytes} bytes; the limit is "
                                f"{limits.max_tensor_bytes}")
        meta = TensorMeta(name, part, dtype, tuple(shape), count, nbytes, encoding)
        if len(shape) == 1:
            if len(_SEEN) >= _SEEN_MAX:
                _SEEN.clear()  # a peer inventing entries must not grow this without bound
            _SEEN[(name, part, dname, shape[0], compressed)] = meta
        metas.append(meta)
    return metas


#: Checked 1-D tensor entries, by ``(name, part, dtype name, count, compressed)``: see :func:`tensor_metas`.
_SEEN: dict[tuple[str, int, str, int, bool], TensorMeta] = {}
_SEEN_MAX = 1 << 16


def same_limits(limits: WireLimits) -> WireLimits:
    """One object for all equal limits: the first of them seen. Caches of decoded headers remember the limits
    they were checked under and compare them by identity, where comparing two equal ``WireLimits`` field by
    field would cost more than the lookup saves (each client of a process holds its own, equal, limits)."""
    known = _LIMITS_BY_ID.get(id(limits))
    if known is not None and known[0] is limits:
        return known[1]
    first = _LIMITS.setdefault(limits, limits)
    if len(_LIMITS_BY_ID) >= 1024:
        _LIMITS_BY_ID.clear()
        if len(_LIMITS) >= 1024:
            _LIMITS.clear()
            _LIMITS[limits] = first = limits
    _LIMITS_BY_ID[id(limits)] = (limits, first)  # holds ``limits``: its id is not reused while it is here
    return first


_LIMITS: dict[WireLimits, WireLimits] = {}
_LIMITS_BY_ID: dict[int, tuple[WireLimits, WireLimits]] = {}


def check_buffers(metas: list[TensorMeta], buffers: Sequence[Any]) -> None:
    """Raise :class:`ProtocolError` unless there is one buffer per tensor, each of exactly its byte size."""
    if len(buffers) != len(metas):
        raise ProtocolError(f"header lists {len(metas)} tensors but {len(buffers)} buffer frames follow")
    for meta, buf in zip(metas, buffers):
        if meta.encoding == compression.TOPK:
            try:
                compression.check_frame(buf, meta.count)
            except ProtocolError as exc:
                raise ProtocolError(f"tensor {meta.name!r} part {meta.part}: {exc}") from None
        elif len(buf) != meta.nbytes:
            raise ProtocolError(f"tensor {meta.name!r} part {meta.part}: frame has {len(buf)} bytes, "
                                f"shape {list(meta.shape)} of {meta.encoding or meta.dtype.str} needs {meta.nbytes}")


def tensor_entry(name: str, part: int, dtype: np.dtype, shape: Sequence[int]) -> list[Any]:
    """The header entry ``[name, part, dtype, shape]`` of one tensor.

    Raises
    ------
    ProtocolError
        When the dtype is not one psrt moves (:mod:`psrt.dtypes`).
    """
    return [name, part, dtype_name(dtype), list(shape)]


def dtype_name(dtype: Any) -> str:
    """The wire name of a dtype psrt moves.

    Raises
    ------
    ProtocolError
        When the dtype is not float32 or float64 (in this machine's byte order).
    """
    name = dtypes.wire_name(dtype)
    if name is None:
        raise ProtocolError(f"dtype {dtype} cannot be sent; psrt tensors are {dtypes.describe()}")
    return name
