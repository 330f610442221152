"""The wire protocol: round trips of every request op, and strict rejection of anything malformed."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from _helpers import frames_of, push_header
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import psrt
from psrt import wire
from psrt.config import WireLimits
from psrt.errors import ProtocolError, PsrtError
from psrt.wire.codec import MAX_HEADER_MAP

LIMITS = WireLimits()
#: No "explain" phase: when a fuzz test finds a failure, report it without the slow re-runs that phase adds.
HSETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
)

TENSOR_OPS = ("init", "push", "push_pull")


def entry(name: str, a: np.ndarray, part: int = 0) -> list:
    return [name, part, wire.dtype_name(a.dtype), list(a.shape)]


def sample_arrays() -> list[tuple[str, int, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        ("w", 0, rng.standard_normal((3, 5)).astype(np.float32)),
        ("w", 1, rng.standard_normal(7).astype(np.float32)),
        ("bias", 0, rng.standard_normal(4)),  # float64
        ("scalar", 0, np.array(2.5, np.float32)),
        ("empty", 0, np.zeros((0, 3))),
        ("layer.0/ünïcode", 3, np.arange(6, dtype=np.float64).reshape(2, 3)),
    ]


def header_for(op: str, req_id: int = 42) -> tuple[dict[str, Any], list[np.ndarray]]:
    """A valid request header (without ``v``) and its arrays."""
    if op in TENSOR_OPS:
        arrs = sample_arrays()
        h: dict[str, Any] = {"op": op, "id": req_id, "worker": 3, "session": 12345,
                             "tensors": [entry(n, a, p) for n, p, a in arrs]}
        if op == "init":
            h["optimizer"] = psrt.AdamW(lr=0.01).to_wire()
        else:
            h["seq"] = 9
            h["clock"] = 4
        return h, [a for _, _, a in arrs]
    if op == "pull":
        return {"op": op, "id": req_id, "worker": 0, "clock": 3,
                "keys": [["w", 0, 0], ["w", 1, 5], ["bias", 0, 2**40]]}, []
    return {"op": op, "id": req_id}, []


ALL_OPS = ["init", "push", "push_pull", "pull", "stats", "checkpoint"]


def record_fields(req: wire.Request) -> dict[str, Any]:
    """A decoded request's header fields other than op, id and tensors, read back from its typed record."""
    if isinstance(req, wire.InitRequest):
        return {"worker": req.worker, "session": req.session, "optimizer": req.optimizer}
    if isinstance(req, wire.PushRequest):
        return {"worker": req.worker, "session": req.session, "seq": req.seq, "clock": req.clock}
    if isinstance(req, wire.PullRequest):
        return {"worker": req.worker, "clock": req.clock, "keys": [[k.name, k.part, k.min_version] for k in req.keys]}
    return {}


def reject(frames, limits: WireLimits = LIMITS, match: str | None = None, request_id: Any = "unset") -> ProtocolError:
    with pytest.raises(ProtocolError, match=match) as info:
        wire.decode_request(frames, limits)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, PsrtError)
    assert hasattr(err, "request_id")
    if request_id != "unset":
        assert err.request_id == request_id
    assert str(err)
    return err


# ---------------------------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("as_bytes", [False, True], ids=["memoryview", "bytes"])
def test_encode_decode_round_trip(op, as_bytes):
    header, arrays = header_for(op)
    frames = wire.encode(header, arrays)
    assert len(frames) == 1 + len(arrays)
    if as_bytes:  # as received from a socket that copied
        frames = [bytes(f) for f in frames]
    req = wire.decode_request(frames, LIMITS)
    assert req.op == op
    assert req.id == 42
    assert record_fields(req) == {k: v for k, v in header.items() if k not in ("op", "id", "tensors")}
    if op not in TENSOR_OPS:
        return
    assert len(req.tensors) == len(arrays) == len(req.buffers)
    for i, (meta, a) in enumerate(zip(req.tensors, arrays)):
        assert meta.name == header["tensors"][i][0]
        assert meta.part == header["tensors"][i][1]
        assert meta.dtype == a.dtype
        assert meta.shape == a.shape
        assert meta.count == a.size and meta.nbytes == a.nbytes
        got = req.array(i)
        assert got.dtype == a.dtype and got.ndim == 1
        np.testing.assert_array_equal(got, a.reshape(-1))
    assert req.keys() == [(t[0], t[1]) for t in header.get("tensors", [])]


def test_round_trip_of_received_frames_gives_read_only_zero_copy_arrays():
    header, arrays = header_for("push")
    frames = [bytes(f) for f in wire.encode(header, arrays)]
    req = wire.decode_request(frames, LIMITS)
    a = req.array(0)
    assert not a.flags.writeable
    assert np.shares_memory(a, np.frombuffer(frames[1], dtype=np.uint8))


def test_encode_uses_zero_copy_views_and_adds_version():
    a = np.arange(10, dtype=np.float32)
    frames = wire.encode({"op": "push", "id": 1}, [a, np.zeros(0, np.float32)])
    assert msgpack.unpackb(frames[0]) == {"v": wire.PROTOCOL_VERSION, "op": "push", "id": 1}
    assert isinstance(frames[1], memoryview) and frames[1].nbytes == a.nbytes
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.float32), a)
    assert frames[2] == b""


@st.composite
def tensor_messages(draw):
    n = draw(st.integers(0, 6))
    names = draw(st.lists(st.text(min_size=1, max_size=20), min_size=n, max_size=n))
    parts = draw(st.lists(st.integers(0, 2**63 - 1), min_size=n, max_size=n))
    keys = list(dict.fromkeys(zip(names, parts)))  # distinct keys
    entries, arrays = [], []
    for name, part in keys:
        dtype = draw(st.sampled_from([np.float32, np.float64]))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=4)))
        seed = draw(st.integers(0, 2**32 - 1))
        a = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
        entries.append([name, part, wire.dtype_name(a.dtype), list(shape)])
        arrays.append(a)
    return entries, arrays


@HSETTINGS
@given(
    msg=tensor_messages(), op=st.sampled_from(TENSOR_OPS), rid=st.integers(0, 2**63 - 1),
    worker=st.integers(0, 2**31), session=st.integers(0, 2**63 - 1), seq=st.integers(0, 2**63 - 1),
)
def test_round_trip_hypothesis(msg, op, rid, worker, session, seq):
    entries, arrays = msg
    header: dict[str, Any] = {"op": op, "id": rid, "worker": worker, "session": session, "tensors": entries}
    if op == "init":
        header["optimizer"] = psrt.SGD().to_wire()
    else:
        header["seq"] = seq
        header["clock"] = seq % 1000
    req = wire.decode_request([bytes(f) for f in wire.encode(header, arrays)], LIMITS)
    assert (req.op, req.id) == (op, rid)
    assert req.worker == worker and req.session == session
    for i, a in enumerate(arrays):
        assert req.tensors[i].shape == a.shape
        np.testing.assert_array_equal(req.array(i), a.reshape(-1))


def test_dtype_name():
    assert wire.dtype_name(np.float32) == "<f4"
    assert wire.dtype_name(np.dtype("<f8")) == "<f8"
    # Big-endian bytes must never travel labelled as little-endian.
    for bad in (np.int32, np.float16, np.complex64, object, np.dtype(">f8")):
        with pytest.raises(ProtocolError, match="float32 or float64"):
            wire.dtype_name(bad)


# ---------------------------------------------------------------------------------------------------------------
# Framing and header-level rejection
# ---------------------------------------------------------------------------------------------------------------


def test_empty_message_is_rejected():
    reject([], match="empty message", request_id=None)


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\xff\xff\xff", b"\x00" * 7, b"hello world", bytes(range(256)), b"\x81", b"\xdf\xff\xff\xff\xff"],
)
def test_garbage_header_is_rejected(data):
    reject([data], request_id=None)


@pytest.mark.parametrize("op", ALL_OPS)
def test_every_truncation_of_a_header_is_rejected(op):
    header, arrays = header_for(op)
    frames = wire.encode(header, arrays)
    full = bytes(frames[0])
    for k in range(len(full)):
        err = reject([full[:k], *frames[1:]])
        assert "msgpack" in str(err) or "map" in str(err)


def test_trailing_bytes_after_header_are_rejected():
    frames = wire.encode(*header_for("stats"))
    reject([bytes(frames[0]) + b"\x00"], match="not a valid msgpack map")


@pytest.mark.parametrize("obj", [[1, 2], 7, "stats", None, True, 1.5, [{"v": 1, "op": "stats", "id": 1}]], ids=repr)
def test_non_map_header_is_rejected(obj):
    reject([msgpack.packb(obj)], match="must be a msgpack map", request_id=None)


@pytest.mark.parametrize("version", [0, 2, -1, "1", 1.0, True, None, [1]], ids=repr)
def test_wrong_protocol_version_is_rejected(version):
    header, _ = header_for("stats")
    err = reject(frames_of({**header, "v": version}), match="protocol version", request_id=42)
    assert f"speaks {wire.PROTOCOL_VERSION}" in str(err)


def test_missing_protocol_version_is_rejected():
    reject([msgpack.packb({"op": "stats", "id": 1})], match="protocol version None")


def test_header_over_max_header_bytes_is_rejected():
    header, _ = header_for("pull")
    header["keys"] = [["k" * 50, i, 0] for i in range(100)]
    frames = frames_of(header)
    size = len(frames[0])
    wire.decode_request(frames, WireLimits(max_header_bytes=size))  # at the limit: fine
    err = reject(frames, WireLimits(max_header_bytes=size - 1), match="limit", request_id=None)
    assert str(size) in str(err)


def test_header_map_with_too_many_keys_is_rejected():
    header = {"v": 1, "op": "stats", "id": 1, **{f"k{i}": i for i in range(MAX_HEADER_MAP + 1)}}
    reject([msgpack.packb(header)], match="not a valid msgpack map")


def test_deeply_nested_header_is_rejected():
    # {"v":1,"op":"init",...,"optimizer":{"a":[[[...]]]}} nested far beyond msgpack's stack limit
    head = b"\x87" + b"".join(msgpack.packb(x) for x in
                              ["v", 1, "op", "init", "id", 1, "worker", 0, "session", 0, "tensors", [], "optimizer"])
    data = head + b"\x81" + msgpack.packb("a") + b"\x91" * 5000 + b"\x90"
    reject([data], match="not a valid msgpack map")


@pytest.mark.parametrize(
    "value",
    [b"x", b"\x00" * 100, msgpack.ExtType(1, b"abc"), msgpack.Timestamp(1, 0)],
    ids=["bin1", "bin100", "ext", "timestamp"],
)
@pytest.mark.parametrize("where", ["id", "name", "optimizer", "extra"])
def test_binary_and_extension_types_in_the_header_are_rejected(value, where):
    header, arrays = header_for("init")
    if where == "id":
        header["id"] = value
    elif where == "name":
        header["tensors"][0][0] = value
    elif where == "optimizer":
        header["optimizer"]["lr"] = value
    else:
        header["blob"] = value
    err = reject(frames_of(header, arrays), match="not a valid msgpack map")
    assert "max_bin_len" in str(err) or "max_ext_len" in str(err)


@pytest.mark.parametrize("value", [b"", msgpack.ExtType(5, b"")], ids=["empty-bin", "empty-ext"])
def test_empty_binary_and_extension_values_are_rejected_by_the_schema(value):
    # msgpack's max_bin_len=0 / max_ext_len=0 still admit zero-length values; the schema must refuse them.
    header, arrays = header_for("push")
    reject(frames_of({**header, "id": value}, arrays), match="'id' must be an integer", request_id=None)
    bad = [list(e) for e in header["tensors"]]
    bad[0][0] = value
    reject(frames_of({**header, "tensors": bad}, arrays), match="name must be a non-empty string", request_id=42)


def test_empty_binary_map_key_next_to_an_unexpected_string_key_is_a_protocol_error():
    # A hostile header with an extra key b"" (a zero-length bin, which max_bin_len=0 admits) and an extra str key:
    # decoding must raise ProtocolError (the server only catches that), not fail while formatting the message.
    header, _ = header_for("stats")
    data = msgpack.packb({"v": 1, **header, b"": 1, "junk": 2}, use_bin_type=True)
    reject([data], match="keys must all be strings", request_id=None)


def test_non_string_map_keys_are_rejected():
    reject([msgpack.packb({"v": 1, "op": "stats", "id": 1, 5: 2})], match="not a valid msgpack map", request_id=None)


# ---------------------------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["PUSH", "params", "ack", "error", "", "push ", 5, None, True, ["push"]], ids=repr)
def test_unknown_op_is_rejected_with_the_request_id(op):
    err = reject(frames_of({"op": op, "id": 77}), match="unknown op", request_id=77)
    assert "push_pull" in str(err)  # lists the known ops


def test_missing_op_is_rejected():
    reject(frames_of({"id": 8}), match="unknown op None", request_id=8)


@pytest.mark.parametrize("op", ALL_OPS)
def test_each_missing_field_is_rejected(op):
    header, arrays = header_for(op)
    for key in header:
        if key == "op":
            continue
        partial = {k: v for k, v in header.items() if k != key}
        expected_id = None if key == "id" else 42
        reject(frames_of(partial, arrays), match=rf"missing fields \['{key}'\]", request_id=expected_id)


EXTRA_CASES = [
    (op, extra)
    for op in ALL_OPS
    for extra in ["x", "seq", "keys", "optimizer", "tensors", "worker", "session", "name"]
    if extra not in header_for(op)[0]
]


@pytest.mark.parametrize(("op", "extra"), EXTRA_CASES)
def test_extra_fields_are_rejected(op, extra):
    header, arrays = header_for(op)
    reject(frames_of({**header, extra: 0}, arrays), match=rf"unexpected fields \['{extra}'\]", request_id=42)


INT_FIELDS = {
    "init": ["id", "worker", "session"],
    "push": ["id", "worker", "session", "seq"],
    "push_pull": ["id", "worker", "session", "seq"],
    "pull": ["id", "worker"],
    "stats": ["id"],
}
INT_CASES = [(op, f) for op, fields in INT_FIELDS.items() for f in fields]


@pytest.mark.parametrize(("op", "field"), INT_CASES)
@pytest.mark.parametrize("value", [True, False, -1, -(2**63), 1.0, "1", None, [1], 2**64 - 1], ids=repr)
def test_integer_fields_reject_bools_negatives_and_non_integers(op, field, value):
    header, arrays = header_for(op)
    header[field] = value
    expected_id = None if field == "id" else 42
    reject(frames_of(header, arrays), match=f"field '{field}' must be an integer", request_id=expected_id)


@pytest.mark.parametrize("op", ["init", "push", "pull"])
def test_worker_above_2_31_is_rejected(op):
    header, arrays = header_for(op)
    header["worker"] = 2**31
    wire.decode_request(frames_of(header, arrays), LIMITS)
    header["worker"] = 2**31 + 1
    reject(frames_of(header, arrays), match="'worker'", request_id=42)


@pytest.mark.parametrize("value", [[], "adam", None, 1, [["name", "adam"]]], ids=repr)
def test_init_optimizer_must_be_a_map(value):
    header, arrays = header_for("init")
    header["optimizer"] = value
    reject(frames_of(header, arrays), match="'optimizer' must be a map", request_id=42)


def test_an_init_check_carries_names_and_sizes_and_no_bytes():
    """``init`` with ``check``: the parts a client would send, no bytes; anything else about it is refused."""
    header, arrays = header_for("init")
    req = wire.decode_request(frames_of({**header, "check": True}), LIMITS)
    assert isinstance(req, wire.InitRequest) and req.check and req.buffers == []
    assert [(m.key, m.count) for m in req.tensors] == [(m.key, m.count) for m in
                                                       wire.decode_request(frames_of(header, arrays), LIMITS).tensors]
    assert not wire.decode_request(frames_of(header, arrays), LIMITS).check
    entries = [wire.tensor_entry("w", 0, np.dtype(np.float32), (4,))]
    frames = wire.encode_init(3, 0, 1, psrt.SGD().to_wire(), entries, [], check=True)
    assert wire.decode_request(frames, LIMITS).check
    with pytest.raises(ValueError, match="no tensor bytes"):
        wire.encode_init(3, 0, 1, psrt.SGD().to_wire(), entries, [np.zeros(4, np.float32)], check=True)
    reject(frames_of({**header, "check": True}, arrays), match="check takes no buffer frames", request_id=42)
    for value in (False, 1, "yes", None):
        reject(frames_of({**header, "check": value}), match="'check' must be true", request_id=42)
    push = push_header(id=5, check=True)
    reject(frames_of(push, [np.zeros(4, np.float32)]), match="unexpected fields", request_id=5)


def test_a_pull_sent_again_says_so_and_keeps_its_versions():
    """``again``: a pull sent again after a restart (any version will do; its versions still say what its pushes
    targeted); only ``true`` is taken, and only on a pull."""
    req = wire.decode_request(wire.encode_pull(7, 1, [["w", 0, 3]], 2, again=True), LIMITS)
    assert isinstance(req, wire.PullRequest) and req.again and [k.min_version for k in req.keys] == [3]
    assert not wire.decode_request(wire.encode_pull(7, 1, [["w", 0, 3]], 2), LIMITS).again
    header = {"op": "pull", "id": 7, "worker": 1, "clock": 2, "keys": [["w", 0, 3]]}
    for value in (False, 1, "yes", None):
        reject(frames_of({**header, "again": value}), match="'again' must be true", request_id=7)
    reject(frames_of({**push_header(id=5), "again": True}, [np.zeros(4, np.float32)]), match="unexpected fields",
           request_id=5)


# ---------------------------------------------------------------------------------------------------------------
# Tensor entries
# ---------------------------------------------------------------------------------------------------------------


def push_with(entries: list, buffers: list[bytes]) -> list[bytes]:
    return frames_of(push_header(id=5, tensors=entries), buffers)


@pytest.mark.parametrize("value", [{}, "w", None, 3, [["w", 0, "<f4"]]], ids=repr)
def test_tensors_field_must_be_a_list_of_entries(value):
    reject(push_with(value, []), match="tensor", request_id=5)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (["w", 0, "<f4"], r"must be \[name, part, dtype, shape\]"),
        (["w", 0, "<f4", [1], 0], r"must be \[name, part, dtype, shape\]"),
        ({"name": "w"}, r"must be \[name, part, dtype, shape\]"),
        (["", 0, "<f4", [1]], "name must be a non-empty string"),
        ([7, 0, "<f4", [1]], "name must be a non-empty string"),
        (["w" * 1025, 0, "<f4", [1]], "name must be a non-empty string of at most 1024"),
        (["w", -1, "<f4", [1]], "part must be a non-negative integer"),
        (["w", True, "<f4", [1]], "part must be a non-negative integer"),
        (["w", 0.0, "<f4", [1]], "part must be a non-negative integer"),
        (["w", 2**63, "<f4", [1]], "part must be a non-negative integer"),
        (["w", 0, "<f4", 4], "shape must be a list"),
        (["w", 0, "<f4", "4"], "shape must be a list"),
        (["w", 0, "<f4", [-1]], "dimension -1"),
        (["w", 0, "<f4", [True]], "dimension True"),
        (["w", 0, "<f4", [1.0]], "dimension 1.0"),
        (["w", 0, "<f4", [None]], "dimension None"),
        (["w", 0, "<f4", [2**40 + 1]], r"must be an integer in \[0, 2\*\*40\]"),
        (["w", 0, "<f4", [2**63]], r"must be an integer in \[0, 2\*\*40\]"),
    ],
    ids=repr,
)
def test_malformed_tensor_entries_are_rejected(entry, match):
    reject(push_with([entry], [b"\x00" * 4]), match=match, request_id=5)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (["w", 0.0, "<f4", [1]], "part must be a non-negative integer"),
        (["w", True, "<f4", [1]], "part must be a non-negative integer"),
        (["w", 0, "<f4", [1.0]], "dimension 1.0"),
        (["w", 0, "<f4", [True]], "dimension True"),
        (["w", 0, "<f4", [1, 1]], None),  # accepted, but a separate entry: its shape is (1, 1)
    ],
    ids=repr,
)
def test_an_entry_equal_to_one_seen_before_is_checked_again_unless_identical(bad, match):
    # Decoding remembers checked entries; an entry that only compares equal to one (0.0 == 0, True == 1) is not it.
    good = ["w", 0, "<f4", [1]]
    assert wire.decode_request(push_with([good], [b"\x00" * 4]), LIMITS).tensors[0].shape == (1,)
    if match is None:
        assert wire.decode_request(push_with([bad], [b"\x00" * 4]), LIMITS).tensors[0].shape == (1, 1)
    else:
        reject(push_with([bad], [b"\x00" * 4]), match=match, request_id=5)
    assert wire.decode_request(push_with([good], [b"\x00" * 4]), LIMITS).tensors[0].shape == (1,)


def test_an_entry_seen_before_is_held_to_each_callers_limits():
    frames = push_with([["weights", 0, "<f4", [4]]], [b"\x00" * 16])
    wire.decode_request(frames, LIMITS)
    reject(frames, WireLimits(max_name_len=3), match="at most 3 characters")
    reject(frames, WireLimits(max_tensor_bytes=8), match="16 bytes; the limit is 8")
    assert wire.decode_request(frames, LIMITS).tensors[0].nbytes == 16


@pytest.mark.parametrize("dname", ["<i4", ">f4", ">f8", "O", ">f2", "f2", "bfloat16", "float32", "f4", "=f4", "|f4",
                                   "<c8", "", 4, None])
def test_unknown_dtypes_are_rejected(dname):
    err = reject(push_with([["w", 0, dname, [1]]], [b"\x00" * 4]), match="is not allowed", request_id=5)
    assert "<f4" in str(err) and "<f8" in str(err)


@pytest.mark.parametrize("dname", ["<f2", "bf16"])
def test_compressed_gradients_are_accepted_in_pushes_only(dname):
    entry = ["w", 0, dname, [3]]
    req = wire.decode_request(push_with([entry], [b"\x00" * 6]), LIMITS)
    assert req.tensors[0].encoding in ("fp16", "bf16") and req.tensors[0].dtype == np.float32
    assert req.array(0).dtype == np.float32 and req.array(0).tolist() == [0.0] * 3
    reject(push_with([entry], [b"\x00" * 12]), match="needs 6")  # 2 bytes a value, not 4
    init = {"op": "init", "id": 7, "worker": 0, "session": 1, "optimizer": psrt.SGD().to_wire(), "tensors": [entry]}
    reject(frames_of(init, [np.zeros(3, np.float16)]), match="is not allowed", request_id=7)  # never parameters


@pytest.mark.parametrize(
    "shape",
    [[2**32, 2**32], [2**40, 2**40], [2**40, 2**40, 2**40, 2**40], [2**21] * 3, [2**40], [3] * 32],
    ids=["2^64", "2^80", "2^160", "2^63-elements", "2^40", "3^32"],
)
def test_huge_shapes_are_rejected_without_overflow(shape):
    err = reject(push_with([["w", 0, "<f4", shape]], [b""]), match="bytes; the limit is", request_id=5)
    assert str(LIMITS.max_tensor_bytes) in str(err)


def test_huge_shapes_under_a_permissive_limit_still_fail_cleanly():
    limits = WireLimits(max_tensor_bytes=1 << 100)
    reject(push_with([["w", 0, "<f8", [2**40, 2**40]]], [b"\x00" * 8]), limits, match="frame has 8 bytes")


def test_zero_sized_dimension_makes_an_empty_tensor():
    req = wire.decode_request(push_with([["w", 0, "<f4", [2**40, 0]]], [b""]), LIMITS)
    assert req.tensors[0].count == 0 and req.tensors[0].nbytes == 0


def test_too_many_dims_are_rejected():
    ok = wire.decode_request(push_with([["w", 0, "<f4", [1] * 32]], [b"\x00" * 4]), LIMITS)
    assert ok.tensors[0].shape == (1,) * 32
    reject(push_with([["w", 0, "<f4", [1] * 33]], [b"\x00" * 4]), match="at most 32 dimensions", request_id=5)
    reject(push_with([["w", 0, "<f4", [1] * 3]], [b"\x00" * 4]), WireLimits(max_dims=2), match="at most 2")


def test_too_many_tensors_are_rejected():
    entries = [[f"t{i}", 0, "<f4", [0]] for i in range(5)]
    wire.decode_request(push_with(entries, [b""] * 5), WireLimits(max_tensors=5))
    reject(push_with(entries, [b""] * 5), WireLimits(max_tensors=4))


@pytest.mark.parametrize("delta", [-5, -4, -1, 1, 4, 8])
@pytest.mark.parametrize("dname", ["<f4", "<f8"])
def test_wrong_byte_count_is_rejected(delta, dname):
    shape = [3, 5]
    nbytes = 15 * (4 if dname == "<f4" else 8)
    err = reject(push_with([["w", 2, dname, shape]], [b"\x00" * (nbytes + delta)]), match="frame has", request_id=5)
    assert f"needs {nbytes}" in str(err) and "'w' part 2" in str(err)


def test_byte_count_checked_for_every_tensor():
    entries = [["a", 0, "<f4", [2]], ["b", 0, "<f8", [2]]]
    wire.decode_request(push_with(entries, [b"\x00" * 8, b"\x00" * 16]), LIMITS)
    reject(push_with(entries, [b"\x00" * 8, b"\x00" * 8]), match="'b'")


@pytest.mark.parametrize("op", TENSOR_OPS)
@pytest.mark.parametrize("delta", [-1, 1, -100])
def test_frame_count_mismatch_is_rejected(op, delta):
    header, arrays = header_for(op)
    frames = frames_of(header, arrays)
    n = len(arrays)
    frames = frames[: max(1, 1 + n + delta)] if delta < 0 else frames + [b"\x00" * 4] * delta
    err = reject(frames, match=f"header lists {n} tensors but", request_id=42)
    assert f"but {len(frames) - 1} buffer frames" in str(err)


@pytest.mark.parametrize("op", ["pull", "stats"])
def test_ops_without_tensors_take_no_buffer_frames(op):
    header, _ = header_for(op)
    reject(frames_of(header) + [b""], match="takes no buffer frames", request_id=42)


@pytest.mark.parametrize("op", TENSOR_OPS)
def test_duplicate_tensor_keys_are_rejected(op):
    header, arrays = header_for(op)
    header["tensors"] = header["tensors"] + [header["tensors"][0]]
    arrays = arrays + [arrays[0]]
    reject(frames_of(header, arrays), match="appears twice", request_id=42)


def test_same_name_different_parts_is_not_a_duplicate():
    entries = [["w", 0, "<f4", [1]], ["w", 1, "<f4", [1]]]
    req = wire.decode_request(push_with(entries, [b"\x00" * 4] * 2), LIMITS)
    assert req.keys() == [("w", 0), ("w", 1)]


# ---------------------------------------------------------------------------------------------------------------
# Pull keys
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "keys",
    [
        None, "w", {"w": 0}, [["w", 0]], [["w", 0, 0, 0]], [("", 0, 0)], [["", 0, 0]], [[1, 0, 0]], [["w", -1, 0]],
        [["w", 0, -1]], [["w", True, 0]], [["w", 0, False]], [["w", 0.0, 0]], [["w", 0, None]], [["w", 2**63, 0]],
        [["w", 0, 2**64 - 1]], [["x" * 1025, 0, 0]], [["w", 0, 0], "w"], [["w", 0, 0], None],
    ],
    ids=repr,
)
def test_malformed_pull_keys_are_rejected(keys):
    header, _ = header_for("pull")
    header["keys"] = keys
    err = reject(frames_of(header), match="key", request_id=42)
    assert "[name, part, min_version]" in str(err)


def test_pull_keys_limit():
    header, _ = header_for("pull")
    header["keys"] = [["w", i, 0] for i in range(10)]
    wire.decode_request(frames_of(header), WireLimits(max_tensors=10))
    reject(frames_of(header), WireLimits(max_tensors=9), request_id=None)  # over msgpack's max_array_len


def test_empty_pull_is_accepted():
    header, _ = header_for("pull")
    header["keys"] = []
    assert wire.decode_request(frames_of(header), LIMITS).keys == []


# ---------------------------------------------------------------------------------------------------------------
# Fuzzing: decode only ever raises ProtocolError
# ---------------------------------------------------------------------------------------------------------------


def decode_or_protocol_error(frames, limits: WireLimits = LIMITS) -> None:
    try:
        req = wire.decode_request(frames, limits)
    except ProtocolError as exc:
        assert hasattr(exc, "request_id")
        assert exc.request_id is None or (type(exc.request_id) is int and exc.request_id >= 0)
    else:
        assert req.op in ALL_OPS


msgpack_scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=3) | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=2))
)
msgpack_objects = st.recursive(
    msgpack_scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=6), children, max_size=5),
    max_leaves=20,
)


@HSETTINGS
@given(data=st.binary(max_size=300), more=st.lists(st.binary(max_size=16), max_size=3))
def test_fuzz_random_bytes(data, more):
    decode_or_protocol_error([data, *more])


@HSETTINGS
@given(op=st.sampled_from(ALL_OPS), data=st.binary(min_size=1, max_size=40), at=st.integers(0, 10**6))
def test_fuzz_corrupted_valid_headers(op, data, at):
    header, arrays = header_for(op)
    frames = [bytes(f) for f in wire.encode(header, arrays)]
    raw = frames[0]
    i = at % (len(raw) + 1)
    frames[0] = raw[:i] + data + raw[i + len(data):]
    decode_or_protocol_error(frames)


@HSETTINGS
@given(obj=msgpack_objects)
def test_fuzz_random_msgpack_objects(obj):
    decode_or_protocol_error([msgpack.packb(obj, use_bin_type=True)])


@HSETTINGS
@given(
    op=st.sampled_from(ALL_OPS),
    replace=st.dictionaries(st.sampled_from(["v", "op", "id", "worker", "session", "seq", "tensors", "keys",
                                             "optimizer"]), msgpack_objects, max_size=3),
    drop=st.sets(st.sampled_from(["v", "op", "id", "worker", "session", "seq", "tensors", "keys", "optimizer"]),
                 max_size=2),
    extra_frames=st.integers(-2, 2),
)
def test_fuzz_mutated_valid_headers(op, replace, drop, extra_frames):
    header, arrays = header_for(op)
    header = {"v": 1, **header, **replace}
    for k in drop:
        header.pop(k, None)
    frames = [msgpack.packb(header, use_bin_type=True), *(a.tobytes() for a in arrays)]
    frames = frames[: len(frames) + extra_frames] if extra_frames < 0 else frames + [b"\x00" * 8] * extra_frames
    decode_or_protocol_error(frames)


@HSETTINGS
@given(
    op=st.sampled_from(TENSOR_OPS),
    i=st.integers(0, 5), j=st.integers(0, 3),
    value=msgpack_objects,
)
def test_fuzz_mutated_tensor_entries(op, i, j, value):
    header, arrays = header_for(op)
    entries = header["tensors"]
    entries[i % len(entries)][j] = value
    decode_or_protocol_error(frames_of(header, arrays))


@HSETTINGS
@given(
    extra_keys=st.dictionaries(st.text(max_size=4) | st.just(b""), msgpack_scalars, min_size=1, max_size=3),
    op=st.sampled_from(ALL_OPS),
)
def test_fuzz_extra_keys_of_any_admissible_type(extra_keys, op):
    header, arrays = header_for(op)
    data = msgpack.packb({"v": 1, **header, **extra_keys}, use_bin_type=True)
    decode_or_protocol_error([data, *(a.tobytes() for a in arrays)])
