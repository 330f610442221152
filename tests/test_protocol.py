"""The protocol written once: typed reply and control records, their strict decoders, and the one dtype table."""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import packed
from hypothesis import given, settings
from hypothesis import strategies as st

import psrt
from psrt import dtypes, kernels, wire
from psrt.config import ClusterConfig, WireLimits
from psrt.errors import ConfigError, ProtocolError

LIMITS = WireLimits()
PSRT_DIR = Path(psrt.__file__).parent


def params_header(**extra: Any) -> dict[str, Any]:
    return {"op": "params", "id": 7, "tensors": [["w", 0, "<f4", [3]], ["b", 1, "<f8", [2]]], "versions": [4, 5],
            **extra}


# ---------------------------------------------------------------------------------------------- data replies
def test_every_reply_round_trips_into_its_record():
    a, b = np.arange(3, dtype=np.float32), np.arange(2, dtype=np.float64)
    entries = [wire.tensor_entry("w", 0, a.dtype, a.shape), wire.tensor_entry("b", 1, b.dtype, b.shape)]
    job = wire.JobInfo("async", 3, [1])
    frames = wire.encode_params(7, entries, [4, 5], [a, b], job)
    reply = wire.decode_reply(bytes(frames[0]), LIMITS)
    assert isinstance(reply, wire.ParamsReply) and reply.id == 7 and reply.versions == [4, 5]
    assert [m.key for m in reply.tensors] == [("w", 0), ("b", 1)] and reply.job == job
    assert bytes(frames[1]) == a.tobytes() and bytes(frames[2]) == b.tobytes()
    for backup in (0, 2):  # a replicated shard says so, with or without backup workers
        replicated = wire.JobInfo("sync", 3, [], backup, True)
        got = wire.decode_reply(bytes(wire.encode_params(7, entries, [4, 5], [a, b], replicated)[0]), LIMITS)
        assert isinstance(got, wire.ParamsReply) and got.job == replicated
    plain = wire.decode_reply(bytes(wire.encode_params(8, entries, [0, 0], [a, b])[0]), LIMITS)
    assert isinstance(plain, wire.ParamsReply) and plain.job is None
    ack = wire.decode_reply(wire.encode_ack(9, [1, 2], True)[0], LIMITS)
    assert ack == wire.AckReply(9, [1, 2], True)
    timed = wire.decode_reply(wire.encode_ack(9, [1, 2], False, 123_456_789, 2_000)[0], LIMITS)
    assert timed == wire.AckReply(9, [1, 2], False, 123_456_789, 2_000)
    stats = wire.decode_reply(wire.encode_stats(10, {"keys": 2, "uptime_s": 1.5, "mode": "sync"})[0], LIMITS)
    assert stats == wire.StatsReply(10, {"keys": 2, "uptime_s": 1.5, "mode": "sync"})
    err = wire.decode_reply(wire.encode_error(11, "protocol", "bad")[0], LIMITS)
    assert err == wire.ErrorReply(11, "protocol", "bad")


def test_a_shards_stats_of_many_workers_decode():
    """A shard's stats carry a row per worker (lateness, dropped pushes) in one ``workers`` entry, beside its
    counters: a job of 1,000 workers decodes (five flat entries per worker had made the stats of 6 workers a
    malformed reply, at most 64 entries per map then); a map may hold up to 4,096 entries, no more."""
    from psrt.control.metrics import per_worker
    from psrt.shard.stragglers import Lateness

    late = Lateness()
    for w in range(1000):
        late.hosts[w] = "10.0.0.1"
        late.pushes[w] = 3
        late.samples[w] = deque([0.001 * w, 0.002 * w])
    stats = {**{f"counter_{i}": i for i in range(60)}, **late.stats()}
    reply = wire.decode_reply(wire.encode_stats(3, stats)[0], LIMITS)
    assert reply.stats == stats
    workers = per_worker(reply.stats)
    assert sorted(workers) == list(range(1000))
    assert workers[7] == {"pushes": 3, "dropped": 0, "late_p50_s": pytest.approx(0.0105), "late_p99_s":
                          pytest.approx(0.01393), "host": "10.0.0.1"}
    many = {f"k{i}": 0 for i in range(4096)}
    assert wire.decode_reply(wire.encode_stats(3, many)[0], LIMITS).stats == many
    with pytest.raises(psrt.ProtocolError, match="max_map_len"):
        wire.decode_reply(wire.encode_stats(3, {f"k{i}": 0 for i in range(5000)})[0], LIMITS)


@pytest.mark.parametrize("op", [["params"], {"a": 1}, 5, None, True, b"", 1.5])
def test_a_reply_whose_op_is_not_a_string_is_a_protocol_error(op):
    with pytest.raises(ProtocolError, match="unknown op"):
        wire.decode_reply(packed({"op": op, "id": 1}), LIMITS)


@pytest.mark.parametrize("header, match", [
    (params_header(mode="sync", num_workers=2), "missing fields"),  # the job's fields come all together
    (params_header(mode="sync", num_workers=2, conflicts=[2]), "conflicts"),  # index past the tensors
    (params_header(mode="sync", num_workers=2, conflicts=[True]), "conflicts"),
    (params_header(mode="sync", num_workers=2, conflicts="0"), "conflicts"),
    (params_header(mode="bsp", num_workers=2, conflicts=[]), "mode"),
    (params_header(mode=["sync"], num_workers=2, conflicts=[]), "mode"),
    (params_header(mode="sync", num_workers=0, conflicts=[]), "num_workers"),
    (params_header(mode="sync", num_workers=2.0, conflicts=[]), "num_workers"),
    (params_header(extra=1), "unexpected fields"),
    (params_header(mode="sync", num_workers=2, conflicts=[], replicated=False), "replicated"),
    ({**params_header(), "versions": [4]}, "versions"),
    ({**params_header(), "versions": [4, -1]}, "versions"),
    ({**params_header(), "versions": [4, False]}, "versions"),
    ({"op": "ack", "id": 1, "versions": [1], "duplicate": 0}, "duplicate"),
    ({"op": "ack", "id": 1, "versions": "1", "duplicate": False}, "versions"),
    ({"op": "ack", "id": 1, "versions": [1]}, "missing fields"),
    ({"op": "ack", "id": 1, "versions": [1], "duplicate": False, "taken": 5}, "unexpected fields"),  # both or none
    ({"op": "ack", "id": 1, "versions": [1], "duplicate": False, "held": 5}, "unexpected fields"),
    ({"op": "ack", "id": 1, "versions": [1], "duplicate": False, "taken": -5, "held": 0}, "taken"),
    ({"op": "ack", "id": 1, "versions": [1], "duplicate": False, "taken": 5, "held": 1.5}, "held"),
    ({"op": "stats", "id": 1, "stats": [1]}, "stats"),
    ({"op": "stats", "id": 1, "stats": {"a": [1]}}, "stats"),
    ({"op": "error", "id": 1, "code": 5, "message": "m"}, "code"),
    ({"op": "error", "id": -1, "code": "c", "message": "m"}, "id"),
    ({"op": "error", "id": 1, "code": "c"}, "missing fields"),
])
def test_malformed_replies_are_refused(header, match):
    with pytest.raises(ProtocolError, match=match):
        wire.decode_reply(packed(header), LIMITS)


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=12))
def test_any_reply_header_decodes_or_raises_protocol_error(value):
    for header in ({"op": "params", "id": 1, "tensors": [], "versions": value},
                   {"op": value, "id": 1}, {"op": "ack", "id": 1, "versions": value, "duplicate": False},
                   {"op": "stats", "id": 1, "stats": value}, {"op": "error", "id": value, "code": "", "message": ""}):
        try:
            wire.decode_reply(packed(header), LIMITS)
        except ProtocolError:
            pass


# ---------------------------------------------------------------------------------------------- control plane
def test_control_requests_and_replies_round_trip():
    cases = [
        (wire.encode_register(1, "server", "tcp://127.0.0.1:5", "127.0.0.1", -1),
         wire.Register(1, "server", "tcp://127.0.0.1:5", "127.0.0.1", -1)),
        (wire.encode_register(2, "server", "ipc:///x", "", 3, restorable=True),
         wire.Register(2, "server", "ipc:///x", "", 3, True)),
        (wire.encode_register(3, "server", "tcp://h:7", "h", 1, restorable=True, restore=True),
         wire.Register(3, "server", "tcp://h:7", "h", 1, True, True)),
        (wire.encode_barrier(2, 3, "epoch-1"), wire.Barrier(2, 3, "epoch-1")),
        (wire.encode_done(3, 0), wire.Done(3, 0)),
        (wire.encode_table_query(4), wire.TableQuery(4)),
        (wire.encode_heartbeat(5, "worker", 2, 4242, 3), wire.Heartbeat(5, "worker", 2, 4242, 3)),
        (wire.encode_beats(6, [3, 0, 9], 4242), wire.Beats(6, (3, 0, 9), 4242)),
        (wire.encode_beats(7, range(wire.MAX_BEAT_RANKS), 1), wire.Beats(7, tuple(range(wire.MAX_BEAT_RANKS)), 1)),
    ]
    for frames, record in cases:
        assert wire.decode_control_request(frames) == record
    with pytest.raises(ProtocolError, match="max_array_len"):  # more ranks than one beats carries: msgpack's limit
        wire.decode_control_request(wire.encode_beats(8, range(wire.MAX_BEAT_RANKS + 1), 1))
    replies = [
        (wire.encode_table(5, 1, 2, 3, "sync", ["tcp://a:1", "ipc:///tmp/x"]),
         wire.Table(5, 1, 2, 3, "sync", ["tcp://a:1", "ipc:///tmp/x"])),
        (wire.encode_table(5, 1, 2, 3, "async", [], elastic=True), wire.Table(5, 1, 2, 3, "async", [], True)),
        (wire.encode_table(6, 0, 1, 2, "ssp", [], staleness=3), wire.Table(6, 0, 1, 2, "ssp", [], False, 3)),
        (wire.encode_abort("peer_failed", "worker 2 died"), wire.Abort(0, "peer_failed", "worker 2 died")),
        (wire.encode_members(4, [0, 2, 7]), wire.Members(0, 4, [0, 2, 7])),
        (wire.encode_moved(1, "tcp://10.0.0.2:40123", False), wire.Moved(0, 1, "tcp://10.0.0.2:40123", False)),
        (wire.encode_moved(1, "tcp://10.0.0.2:40123", True), wire.Moved(0, 1, "tcp://10.0.0.2:40123", True)),
        (wire.encode_ok(6), wire.Ok(6)),
        (wire.encode_control_error(7, "rank", "taken"), wire.ControlError(7, "rank", "taken")),
        (wire.encode_shutdown(), wire.Shutdown(0)),
        (wire.encode_not_members(6, [4, 7], "gone"), wire.NotMembers(6, (4, 7), "gone")),
    ]
    for frames, record in replies:
        assert wire.decode_control_reply(frames) == record


@pytest.mark.parametrize("header, match", [
    ({"op": "register", "id": 1, "role": "boss", "endpoint": "", "host": "", "rank": -1,
      "restorable": False, "restore": False}, "role"),
    ({"op": "register", "id": 1, "role": "server", "endpoint": "nowhere", "host": "", "rank": -1,
      "restorable": False, "restore": False}, "endpoint"),
    ({"op": "register", "id": 1, "role": "worker", "endpoint": 5, "host": "", "rank": -1,
      "restorable": False, "restore": False}, "endpoint"),
    ({"op": "register", "id": 1, "role": "worker", "endpoint": "", "host": "", "rank": -2,
      "restorable": False, "restore": False}, "rank"),
    ({"op": "register", "id": 1, "role": "worker", "endpoint": "", "host": "", "rank": True,
      "restorable": False, "restore": False}, "rank"),
    ({"op": "barrier", "id": 1, "rank": 0, "name": "x" * 300}, "name"),
    ({"op": "register", "id": 1, "role": "server", "endpoint": "tcp://h:1", "host": "", "rank": 0,
      "restorable": 1, "restore": False}, "restorable"),
    ({"op": "register", "id": 1, "role": "server", "endpoint": "tcp://h:1", "host": "", "rank": 0,
      "restorable": True, "restore": "yes"}, "restore"),
    ({"op": "register", "id": 1, "role": "server", "endpoint": "tcp://h:1", "host": "", "rank": 0,
      "restorable": True}, "missing fields"),
    ({"op": "done", "id": 1}, "missing fields"),
    ({"op": "table", "id": 1, "extra": 0}, "unexpected fields"),
    ({"op": ["table"], "id": 1}, "unknown op"),
    ({"op": "shutdown", "id": 1}, "unknown op"),  # a reply op is not a request
    ({"op": "beats", "id": 1, "ranks": [], "pid": 1}, "ranks"),
    ({"op": "beats", "id": 1, "ranks": [0, -1], "pid": 1}, "ranks"),
    ({"op": "beats", "id": 1, "ranks": [0, True], "pid": 1}, "ranks"),
    ({"op": "beats", "id": 1, "ranks": 3, "pid": 1}, "ranks"),
    ({"op": "beats", "id": 1, "ranks": [0], "pid": -1}, "pid"),
    ({"op": "beats", "id": 1, "ranks": [0]}, "missing fields"),
])
def test_malformed_control_requests_are_refused_with_their_id(header, match):
    with pytest.raises(ProtocolError, match=match) as info:
        wire.decode_control_request([packed(header)])
    assert info.value.request_id == 1


@pytest.mark.parametrize("header, match", [
    ({"op": "table", "id": 1, "rank": 0, "num_servers": 1, "num_workers": 1, "mode": "sync", "servers": ["x"],
      "elastic": False, "staleness": 0}, "servers"),
    ({"op": "table", "id": 1, "rank": 0, "num_servers": 0, "num_workers": 1, "mode": "sync", "servers": [],
      "elastic": False, "staleness": 0}, "num_servers"),
    ({"op": "table", "id": 1, "rank": 0, "num_servers": 1, "num_workers": 1, "mode": "x", "servers": [],
      "elastic": False, "staleness": 0}, "mode"),
    ({"op": "table", "id": 1, "rank": 0, "num_servers": 1, "num_workers": 1, "mode": "sync", "servers": [],
      "elastic": 1, "staleness": 0}, "elastic"),
    ({"op": "table", "id": 1, "rank": 0, "num_servers": 1, "num_workers": 1, "mode": "sync", "servers": []},
     "missing fields"),
    ({"op": "table", "id": 1, "rank": 0, "num_servers": 1, "num_workers": 1, "mode": "ssp", "servers": [],
      "elastic": False, "staleness": -1}, "staleness"),
    ({"op": "members", "id": 0, "epoch": 1, "workers": [0, -1]}, "workers"),
    ({"op": "members", "id": 0, "epoch": -1, "workers": [0]}, "epoch"),
    ({"op": "abort", "id": 0, "code": "x"}, "missing fields"),
    ({"op": "moved", "id": 0, "shard": 0, "endpoint": "nowhere", "replica": False}, "endpoint"),
    ({"op": "moved", "id": 0, "shard": -1, "endpoint": "tcp://h:1", "replica": False}, "shard"),
    ({"op": "moved", "id": 0, "shard": True, "endpoint": "tcp://h:1", "replica": False}, "shard"),
    ({"op": "moved", "id": 0, "shard": 0, "endpoint": "tcp://" + "h" * 2000, "replica": False}, "endpoint"),
    ({"op": "moved", "id": 0, "shard": 0, "endpoint": "tcp://h:1", "replica": 1}, "replica"),
    ({"op": "moved", "id": 0, "shard": 0}, "missing fields"),
    ({"op": "ok", "id": "1"}, "id"),
    ({"op": {"ok": 1}, "id": 1}, "unknown op"),
    ({"op": "register", "id": 1}, "unknown op"),
    ({"op": "not_members", "id": 1, "workers": [], "message": "x"}, "workers"),
    ({"op": "not_members", "id": 1, "workers": [1], "message": 3}, "message"),
])
def test_malformed_control_replies_are_refused(header, match):
    with pytest.raises(ProtocolError, match=match):
        wire.decode_control_reply([packed(header)])


def test_control_messages_are_one_frame():
    with pytest.raises(ProtocolError, match="one frame"):
        wire.decode_control_request([*wire.encode_ok(1), b""])
    with pytest.raises(ProtocolError, match="one frame"):
        wire.decode_control_reply([*wire.encode_ok(1), b""])


# ---------------------------------------------------------------------------------------------- one table
def test_one_dtype_table_serves_kernels_wire_and_client():
    assert kernels.DTYPES is dtypes.SUPPORTED
    assert {wire.dtype_name(d) for d in dtypes.SUPPORTED} == set(dtypes.BY_WIRE_NAME)
    assert dtypes.from_wire_name("<f2") is None and dtypes.from_wire_name(["<f4"]) is None
    # Nobody else spells the dtypes: the names appear in psrt's sources only in psrt/dtypes.py.
    for path in PSRT_DIR.rglob("*.py"):
        if path.name == "dtypes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in ("<f4", "<f8"):
                pytest.fail(f"{path.relative_to(PSRT_DIR)} spells the wire dtype {node.value!r}")


def test_no_module_but_wire_indexes_a_raw_header():
    """The server, client and scheduler work on typed records: none of them subscripts a header dict."""
    for name in ("shard/server.py", "worker/client.py", "control/scheduler.py", "cluster/stats.py"):
        tree = ast.parse((PSRT_DIR / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Attribute, ast.Name)):
                target = node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id
                assert target not in ("header", "h", "reply", "table"), f"{name} indexes {target}[...]"


def test_only_transport_imports_zmq():
    for path in PSRT_DIR.rglob("*.py"):
        if path.parent.name == "transport":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "zmq" or n.startswith("zmq.") for n in names), f"{path.name} imports zmq"


@pytest.mark.parametrize("name, value", [("PSRT_START_TIMEOUT", "soon"), ("PSRT_NUM_WORKERS", "four"),
                                         ("DMLC_NUM_SERVER", "2.5"), ("PSRT_WORKER_ID", "x")])
def test_a_bad_number_in_the_environment_names_the_variable(name, value):
    with pytest.raises(ConfigError, match=name):
        ClusterConfig.from_env({name: value})


@pytest.mark.parametrize("name", ["PSRT_TIMEOUT", "PSRT_PARTITION_BYTES", "PSRT_WARN_AFTER"])
def test_a_bad_client_number_in_the_environment_names_the_variable(monkeypatch, name):
    monkeypatch.setenv(name, "lots")
    with pytest.raises(ConfigError, match=name):
        psrt.config.ClientConfig()
