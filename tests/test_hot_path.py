"""The per-message fast paths of a small push_pull behave exactly like the general ones they shortcut."""

from __future__ import annotations

import threading
import time
from typing import Any
from unittest import mock

import msgpack
import numpy as np
import pytest
import zmq
from _helpers import serving
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import psrt
from psrt import transport, wire
from psrt.config import ClientConfig, ServerConfig, WireLimits
from psrt.errors import ProtocolError
from psrt.shard.pulls import PullQueue, Waiter
from psrt.wire import data, replies
from psrt.wire import rows as rows_wire
from psrt.wire.codec import pack_header

LIMITS = WireLimits()


def test_a_pull_queue_is_true_while_a_pull_waits():
    versions = {("w", 0): 0}
    queue = PullQueue(versions.__getitem__)
    assert not queue
    assert not queue.add(Waiter(b"id", 1, [("w", 0)], {("w", 0): 1}))
    assert queue and len(queue) == 1
    versions[("w", 0)] = 1
    assert [w.request_id for w in queue.wake(("w", 0))] == [1]
    assert not queue


def _pair() -> tuple[zmq.Context, transport.RouterChannel, transport.DealerChannel]:
    ctx = transport.new_context()
    router = transport.RouterChannel(ctx, "tcp://127.0.0.1:*", 1000, 5.0)
    dealer = transport.DealerChannel(ctx, router.endpoint, 1000)
    return ctx, router, dealer


def test_both_ends_judge_a_connection_by_the_peers_kernel_not_by_zeromq_heartbeats():
    """No ZMTP heartbeat (its pong queues behind slow data: tests/test_multihost.py shows what that did); a
    connection's unacknowledged bytes drop it after DEAD_AFTER_S, and keepalives probe it when idle, giving up
    no sooner."""
    ctx, router, dealer = _pair()
    try:
        for sock in (router.sock, dealer.sock):
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 0
            assert sock.getsockopt(zmq.TCP_MAXRT) == int(transport.DEAD_AFTER_S * 1000)
            assert sock.getsockopt(zmq.TCP_KEEPALIVE) == 1
            idle, every, count = (sock.getsockopt(o) for o in (zmq.TCP_KEEPALIVE_IDLE, zmq.TCP_KEEPALIVE_INTVL,
                                                                zmq.TCP_KEEPALIVE_CNT))
            assert 0 < idle < transport.DEAD_AFTER_S and idle + every * count >= transport.DEAD_AFTER_S
    finally:
        dealer.close()
        router.close()
        ctx.term()


def test_router_reads_whole_messages_back_to_back_and_says_when_one_waits():
    ctx, router, dealer = _pair()
    try:
        assert not router.readable()
        dealer.send([b"h1", b"a" * 10, b"b" * 20], 5.0)
        dealer.send([b"h2"], 5.0)
        assert router.poll(5.0)
        identity, frames = router.recv()
        assert [bytes(f) for f in frames] == [b"h1", b"a" * 10, b"b" * 20]
        for _ in range(100):  # the second message may still be on its way
            if router.readable():
                break
            router.poll(0.05)
        _, frames = router.recv()
        assert [bytes(f) for f in frames] == [b"h2"]
        assert router.recv() is None and not router.readable()
    finally:
        dealer.close()
        router.close()
        ctx.term()


def _ready(dealer: transport.DealerChannel) -> bool:
    # poll() also returns (False) when only the handshake monitor spoke: ask again.
    return any(dealer.poll(0.1) for _ in range(50))


def test_dealer_knows_where_each_reply_ends():
    ctx, router, dealer = _pair()
    try:
        dealer.send([b"hello"], 5.0)
        assert router.poll(5.0)
        identity, _ = router.recv()
        router.send(identity, [b"head", b"\x01" * 8, b"tail"])
        router.send(identity, [b"only"])
        router.send(identity, [b"next", b"x", b"y"])
        assert _ready(dealer)
        assert dealer.recv_frame() == b"head" and dealer.more()
        buf = bytearray(8)
        assert dealer.recv_into(buf) == 8 and bytes(buf) == b"\x01" * 8
        assert dealer.more()
        assert dealer.recv_into(bytearray(4)) == 4 and not dealer.more()
        assert _ready(dealer)
        assert dealer.recv_frame() == b"only" and not dealer.more()
        dealer.discard_rest()  # nothing left: must not swallow the next message
        assert _ready(dealer)
        assert dealer.recv_frame() == b"next" and dealer.more()
        dealer.discard_rest()
        assert not dealer.more()
    finally:
        dealer.close()
        router.close()
        ctx.term()


def test_a_dealer_tries_a_receive_and_copies_what_fits():
    ctx, router, dealer = _pair()
    try:
        assert dealer.try_recv_frame() is None  # nothing queued: no wait, no error
        dealer.send([b"hello"], 5.0)
        assert router.poll(5.0)
        identity, _ = router.recv()
        router.send(identity, [b"head", b"\x01" * 8, b"\x02" * 3, b"\x03" * 2])
        assert _ready(dealer)
        assert dealer.try_recv_frame() == b"head" and dealer.more()
        small, large = bytearray(4), bytearray(b"\xff" * 6)
        assert dealer.recv_into(small) == 8 and bytes(small) == b"\x01" * 4  # the frame's size; what fits copied
        assert dealer.recv_into(large) == 3 and bytes(large) == b"\x02" * 3 + b"\xff" * 3
        into = np.zeros(1, np.uint16)
        assert dealer.recv_into(memoryview(into)) == 2 and into[0] == 0x0303 and not dealer.more()
        assert dealer.try_recv_frame() is None
    finally:
        dealer.close()
        router.close()
        ctx.term()


def test_a_busy_poller_reads_its_monitors_every_interval_and_a_blocking_wait_at_once():
    """The handshake monitors are left out of polls while they were read a moment ago (half of zmq_poll's items),
    yet a handshake is heard within MONITOR_INTERVAL by polls that never wait, and at once by a wait."""
    ctx = transport.new_context()
    routers = [transport.RouterChannel(ctx, "tcp://127.0.0.1:*", 1000, 5.0) for _ in range(2)]
    dealers = [transport.DealerChannel(ctx, r.endpoint, 1000) for r in routers]
    poller = transport.Poller(dealers)
    try:
        # A wait that blocks reads the monitors: both handshakes are heard, neither channel has a reply.
        deadline = time.monotonic() + 5.0
        while sum(d.connections for d in dealers) < 2 and time.monotonic() < deadline:
            assert poller.wait(0.2) == []
        assert [d.connections for d in dealers] == [1, 1] and poller.heard
        poller.heard = False
        # Replies arrive on channel 1; polls without a wait find them without reading the monitors ...
        dealers[1].send([b"hello"], 5.0)
        assert routers[1].poll(5.0)
        identity, _ = routers[1].recv()
        routers[1].send(identity, [b"reply"])
        deadline = time.monotonic() + 5.0
        while poller.wait(0.0) != [1]:
            assert time.monotonic() < deadline
        # ... while a new connection's handshake waits for the interval (polls without a wait hear it then).
        dealers[0].repoint(routers[0].endpoint)  # a reconnection: the same shard, a new handshake
        start = time.monotonic()
        while dealers[0].connections < 2:
            assert poller.wait(0.0) == [1]  # the reply stays queued: the sockets are still polled every time
            assert time.monotonic() - start < 5.0
        assert poller.heard
        assert time.monotonic() - start <= transport.MONITOR_INTERVAL + 1.0
    finally:
        for ch in (*dealers, *routers):
            ch.close()
        ctx.term()


def test_a_handshake_taken_in_by_a_send_is_heard_by_the_poller():
    """A channel's first send reads its monitor (a channel never connected): the handshake it takes in moves the
    connection count, and the poller says so, as it does for a handshake its own wait reads."""
    ctx = transport.new_context()
    router = transport.RouterChannel(ctx, "tcp://127.0.0.1:*", 1000, 5.0)
    dealer = transport.DealerChannel(ctx, router.endpoint, 1000)
    poller = transport.Poller([dealer])
    try:
        deadline = time.monotonic() + 5.0
        while not dealer.monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # the handshake done, not yet read
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert dealer.connections == 0 and not poller.heard
        dealer.send([b"hello"], 5.0)
        assert dealer.connections == 1 and poller.heard
    finally:
        dealer.close()
        router.close()
        ctx.term()


def test_pipelined_calls_each_get_their_own_answer_in_any_order_of_waiting():
    """Many calls in flight: a wait takes the replies already queued without a poll (its reply is most likely
    there), whichever call each answers; waiting out of order, or asking done(), changes nothing."""
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async")) as server:
        with psrt.Client([server.endpoint], rank=0, num_workers=1, config=ClientConfig(timeout=20)) as c:
            c.init({"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float64)}, optimizer=psrt.SGD(lr=1.0))
            handles = [c.push_pull_async({"w": np.ones(4, np.float32), "b": np.ones(2)}) for _ in range(12)]
            order = [3, 0, 11, 1, 2, *range(4, 11)]
            deadline = time.monotonic() + 20  # (done() takes in what has arrived, never waits)
            while not handles[5].done() and time.monotonic() < deadline:
                time.sleep(0.001)
            for i in order:
                got = handles[i].wait()
                np.testing.assert_array_equal(got["w"], np.full(4, -(i + 1.0), np.float32))
                np.testing.assert_array_equal(got["b"], np.full(2, -(i + 1.0)))
            for _ in range(3):  # one in flight at a time (a poll first), then many again
                c.push_pull({"w": np.ones(4, np.float32), "b": np.ones(2)})
            more = [c.push_async({"w": np.ones(4, np.float32)}) for _ in range(5)]
            for h in reversed(more):
                assert h.wait() is None
            np.testing.assert_array_equal(c.pull(["w"])["w"], np.full(4, -20.0, np.float32))
        assert server.counters.pushes == 20 and server.counters.errors == 0


@pytest.mark.integration
def test_replies_queued_behind_the_awaited_one_reach_their_own_calls(shards):
    group = shards(1, workers=1, mode="async")
    with psrt.Client(group.endpoints, rank=0, num_workers=1, config=ClientConfig(timeout=20)) as c:
        c.init({"w": np.zeros(4, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        handles = [c.push_pull_async({"w": np.ones(4, np.float32)}) for _ in range(5)]
        last = handles[-1].wait()
        np.testing.assert_array_equal(last["w"], np.full(4, -5.0, np.float32))
        # The earlier calls' replies came first; whether taken in already or still queued, each gets its own.
        for i, h in enumerate(handles[:-1]):
            np.testing.assert_array_equal(h.wait()["w"], np.full(4, -(i + 1.0), np.float32))
        assert c.stats()[0]["queued_pulls"] == 0


@pytest.mark.integration
def test_a_push_pull_whose_round_is_complete_is_answered_at_once_and_counted(shards):
    group = shards(1, workers=1, mode="sync")
    with psrt.Client(group.endpoints, rank=0, num_workers=1, config=ClientConfig(timeout=20)) as c:
        c.init({"w": np.zeros(3, np.float32)}, optimizer=psrt.SGD(lr=0.5))
        for step in range(1, 4):
            got = c.push_pull({"w": np.ones(3, np.float32)})["w"]
            np.testing.assert_array_equal(got, np.full(3, -0.5 * step, np.float32))
        stats = c.stats()[0]
        assert stats["pushes"] == 3 and stats["pulls"] == 3 and stats["queued_pulls"] == 0


def test_headers_pack_as_msgpack_does_in_every_thread_and_after_a_failure():
    header = {"v": 1, "op": "push", "id": 7, "tensors": [["w", 0, "<f4", [3]]], "name": "ünï"}
    want = msgpack.packb(header, use_bin_type=True)
    with pytest.raises(TypeError):
        pack_header({"v": 1, "bad": object()})
    assert pack_header(header) == want  # nothing of the failed header is left in the packer's buffer
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda: got.extend(pack_header(header) for _ in range(200))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want] * 800


def test_encoded_buffers_hold_each_arrays_bytes_whatever_its_shape_or_layout():
    arrays = [np.arange(6.0).reshape(2, 3), np.array(2.5, np.float32), np.arange(6, dtype=np.float32).reshape(2, 3).T,
              np.zeros((0, 3))]
    frames = wire.encode({"op": "push", "id": 1}, arrays)
    # (the transposed array is not C-contiguous: its frame is a C-ordered copy, as reshape(-1) makes it)
    assert [bytes(f) for f in frames[1:]] == [a.tobytes() for a in arrays]
    assert np.shares_memory(np.frombuffer(frames[1], np.float64), arrays[0])  # contiguous: no copy


@pytest.mark.parametrize("base", [None, 0, 2**40])
@pytest.mark.parametrize("pull", [False, True])
@pytest.mark.parametrize("rid,seq,clock", [(1, 0, 1), (2**63 - 1, 2**40, 0), (300, 70000, 2**32)])
def test_a_push_from_its_packed_prefix_decodes_as_the_whole_header_does(pull, rid, seq, clock, base):
    entries = [["w", 0, "<f4", [3]], ["w", 1, "<f4", [2]], ["b", 0, "<f8", [1]]]
    payload = [np.ones(3, np.float32), np.ones(2, np.float32), np.ones(1)]
    prefix = wire.push_prefix(5, 2**62, entries, pull)
    got = wire.encode_push_after(prefix, rid, seq, clock, payload, base)
    want = wire.encode_push(rid, 5, 2**62, seq, entries, payload, pull, clock, base=base)
    assert msgpack.unpackb(got[0]) == msgpack.unpackb(want[0])
    assert [bytes(f) for f in got[1:]] == [bytes(f) for f in want[1:]]
    assert wire.decode_request(got, LIMITS) == wire.decode_request(want, LIMITS)
    assert wire.decode_request(got, LIMITS).base == base  # (the second time from the remembered prefix)


@pytest.mark.integration
def test_a_repeated_push_sends_the_header_of_a_fresh_one(shards):
    group = shards(2, workers=1, mode="async")
    with psrt.Client(group.endpoints, rank=0, num_workers=1, config=ClientConfig(timeout=20)) as c:
        c.init({"w": np.zeros(5, np.float32), "b": np.zeros(2)}, optimizer=psrt.SGD(lr=1.0))
        for step in range(1, 4):  # the first push packs its prefixes, the others reuse them
            got = c.push_pull({"w": np.ones(5, np.float32), "b": np.ones(2)})
            np.testing.assert_array_equal(got["w"], np.full(5, -step, np.float32))
            np.testing.assert_array_equal(got["b"], np.full(2, -step, np.float64))
        c.push({"b": np.ones(2)})
        np.testing.assert_array_equal(c.pull(["b"])["b"], np.full(2, -4.0))
        assert sum(s["pushes"] for s in c.stats()) == 7 and sum(s["errors"] for s in c.stats()) == 0


def test_a_plain_params_reply_decodes_by_the_short_path_as_by_the_general_one():
    entries = [["w", 0, "<f4", [3]], ["w", 1, "<f2", [2]]]
    frames = wire.encode_params(9, entries, [4, 5], [np.ones(3, np.float32), np.ones(2, np.float16)])
    reply = wire.decode_reply(bytes(frames[0]), LIMITS)
    assert reply == wire.ParamsReply(9, [m for m in wire.decode_request(wire.encode_push(
        1, 0, 0, 0, entries, [np.ones(3, np.float32), np.ones(2, np.float16)], True), LIMITS).tensors], [4, 5])
    for bad, match in [({"versions": [4]}, "versions"), ({"versions": [4, True]}, "versions"),
                       ({"id": -1}, "id"), ({"v": 2}, "version"), ({"op": "parms"}, "unknown op"),
                       ({"tensors": [["w", 0, "topk", [3]], ["w", 1, "<f4", [2]]]}, "top-k")]:
        header = {**msgpack.unpackb(frames[0]), **bad}
        with pytest.raises(ProtocolError, match=match):
            wire.decode_reply(msgpack.packb(header), LIMITS)


# The fast paths are cut from the one field table of their message: random headers pin them to the general ones.
_HSETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_U63 = st.integers(0, 2**63 - 1)
_ITEMSIZE = {"<f4": 4, "<f8": 8, "<f2": 2, "bf16": 2}
_ENTRIES = st.lists(st.tuples(st.sampled_from(["w", "b", "layer.0/ünï", "x" * 300]), st.integers(0, 2**40),
                              st.sampled_from(sorted(_ITEMSIZE)), st.integers(0, 16)), max_size=6)


def _outcome(decode: Any, *args: Any) -> Any:
    """What a decoder makes of a message: its record, or the error it raises."""
    try:
        return decode(*args)
    except ProtocolError as exc:
        return ("error", str(exc))


@_HSETTINGS
@given(entries=_ENTRIES, worker=st.integers(0, 2**31 + 1), session=_U63, rid=_U63, seq=_U63, clock=_U63,
       pull=st.booleans(), generation=st.none() | _U63)
def test_a_push_from_its_prefix_is_byte_for_byte_the_push_packed_whole(entries, worker, session, rid, seq, clock,
                                                                         pull, generation):
    entries = [[name, part, dname, [count]] for name, part, dname, count in entries]
    payload = [np.zeros(count * _ITEMSIZE[dname], np.uint8) for _, _, dname, (count,) in entries]
    lane = None
    if generation is not None:
        lane = wire.LaneRef(generation, [64 * (i + 1) for i in range(len(entries))],
                            [64 * (i + 1) for i in range(len(entries))] if pull else [])
        payload = []
    whole = wire.encode_push(rid, worker, session, seq, entries, payload, pull, clock, lane)
    # The header holds the table's fields in the table's order (a lane's place after the fixed ones).
    fields: dict[str, Any] = {"v": wire.PROTOCOL_VERSION, "op": "push_pull" if pull else "push", "worker": worker,
                              "session": session, "tensors": entries}
    assert tuple(fields) == data.PUSH_FIXED
    if lane is not None:
        fields["lane"] = lane.to_wire()
    fields.update(id=rid, seq=seq, clock=clock)
    assert tuple(fields)[-3:] == data.PUSH_PER_CALL
    got = msgpack.unpackb(whole[0])
    assert got == fields and list(got) == list(fields)
    # Its constant bytes are msgpack's own: integers msgpack packs as uint64 too give the very same bytes.
    big = {"id": rid | 1 << 32, "seq": seq | 1 << 32, "clock": clock | 1 << 32}
    assert bytes(wire.encode_push(big["id"], worker, session, big["seq"], entries, payload, pull, big["clock"],
                                  lane)[0]) == pack_header({**fields, **big})
    if lane is None:
        fast = wire.encode_push_after(wire.push_prefix(worker, session, entries, pull), rid, seq, clock, payload)
        assert bytes(fast[0]) == bytes(whole[0])
        assert [bytes(f) for f in fast[1:]] == [bytes(f) for f in whole[1:]]
    # Decoded (the short path for a push without a lane), it is the record of msgpack's packing of the fields.
    frames = [bytes(whole[0]), *whole[1:]]
    assert _outcome(wire.decode_request, frames, LIMITS) == \
        _outcome(wire.decode_request, [pack_header(fields), *whole[1:]], LIMITS)


def _general_reply(data: bytes, limits: WireLimits) -> Any:
    with mock.patch.object(replies, "_plain_params", lambda h, limits: None):  # the short path declines all
        return wire.decode_reply(data, limits)


@_HSETTINGS
@given(entries=_ENTRIES, rid=st.integers(-1, 2**63), versions=st.lists(st.integers(-1, 2**63) | st.booleans(),
                                                                        max_size=7),
       v=st.sampled_from([wire.PROTOCOL_VERSION, 2]), op=st.sampled_from(["params", "parms"]), topk=st.booleans())
def test_a_plain_params_reply_decodes_by_the_short_path_as_by_the_general_one_whatever_it_holds(
        entries, rid, versions, v, op, topk):
    tensors = [[name, part, "topk" if topk and i == 0 else dname, [count]]
               for i, (name, part, dname, count) in enumerate(entries)]
    header = msgpack.packb({"v": v, "op": op, "id": rid, "tensors": tensors, "versions": versions})
    assert _outcome(wire.decode_reply, header, LIMITS) == _outcome(_general_reply, header, LIMITS)
    valid = [[name, part, dname, [count]] for name, part, dname, count in entries]
    frames = wire.encode_params(abs(rid) % 2**63, valid, list(range(len(valid))), [])
    assert _outcome(wire.decode_reply, bytes(frames[0]), LIMITS) == \
        _outcome(_general_reply, bytes(frames[0]), LIMITS)


# A push whose fixed fields were seen before is decoded from its last 40 bytes; a params reply packed by the shard
# from its tensors' bytes. Both must decode every header exactly as msgpack and the general checks do.
def _general_request(frames: list[Any], limits: WireLimits) -> Any:
    with mock.patch.object(data, "_SEEN_PUSHES", {}), mock.patch.object(data, "_remember_push", lambda *a: None):
        return wire.decode_request(frames, limits)


def _tail(rid: int, seq: int, clock: int) -> bytes:
    return data._PUSH_TAIL.pack(data._ID, rid, data._SEQ, seq, data._CLOCK, clock)


@_HSETTINGS
@given(entries=_ENTRIES, worker=st.integers(0, 2**31 + 1), session=_U63, pull=st.booleans(),
       calls=st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
                      min_size=1, max_size=3),
       frames_missing=st.booleans())
def test_a_push_seen_before_decodes_from_its_tail_as_the_general_path_does(entries, worker, session, pull, calls,
                                                                           frames_missing):
    entries = [[name, part, dname, [count]] for name, part, dname, count in entries]
    payload = [np.zeros(count * _ITEMSIZE[dname], np.uint8) for _, _, dname, (count,) in entries]
    prefix = wire.push_prefix(worker, session, entries, pull)
    first = [prefix + _tail(1, 1, 1), *payload]
    assert _outcome(wire.decode_request, first, LIMITS) == _outcome(_general_request, first, LIMITS)
    remembered = prefix in data._SEEN_PUSHES
    # Remembered exactly when the general path took the push: a refused one teaches nothing.
    assert remembered == (not isinstance(_outcome(_general_request, first, LIMITS), tuple))
    for rid, seq, clock in calls:  # ids beyond 2**63 - 1 are refused by both, with the same words
        frames = [prefix + _tail(rid, seq, clock), *(payload[:-1] if frames_missing and payload else payload)]
        assert _outcome(wire.decode_request, frames, LIMITS) == _outcome(_general_request, frames, LIMITS)
        if remembered and max(rid, seq, clock) < 2**63 and not (frames_missing and payload):
            assert wire.decode_request(frames, LIMITS).id == rid


def _based_tail(rid: int, seq: int, clock: int, base: int) -> bytes:
    k = data._BASED_KEYS
    return data._BASED_TAIL.pack(k[0], rid, k[1], seq, k[2], clock, k[3], base)


@_HSETTINGS
@given(entries=_ENTRIES, worker=st.integers(0, 2**31 + 1), session=_U63, pull=st.booleans(),
       calls=st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
                                st.integers(0, 2**64 - 1)), min_size=1, max_size=3))
def test_a_sync_push_seen_before_decodes_from_its_tail_with_its_base_as_the_general_path_does(
        entries, worker, session, pull, calls):
    entries = [[name, part, dname, [count]] for name, part, dname, count in entries]
    payload = [np.zeros(count * _ITEMSIZE[dname], np.uint8) for _, _, dname, (count,) in entries]
    prefix = data._BASED_HEAD + wire.push_prefix(worker, session, entries, pull)[1:]
    first = [prefix + _based_tail(1, 1, 1, 1), *payload]
    assert _outcome(wire.decode_request, first, LIMITS) == _outcome(_general_request, first, LIMITS)
    assert (prefix in data._SEEN_PUSHES) == (not isinstance(_outcome(_general_request, first, LIMITS), tuple))
    for rid, seq, clock, base in calls:  # (integers beyond 2**63 - 1 are refused by both, with the same words)
        frames = [prefix + _based_tail(rid, seq, clock, base), *payload]
        assert _outcome(wire.decode_request, frames, LIMITS) == _outcome(_general_request, frames, LIMITS)


def test_a_remembered_push_prefix_serves_no_other_tail_nor_stricter_limits():
    entries = [["layer.0", 3, "<f4", [4]]]
    payload = [np.ones(4, np.float32).tobytes()]
    prefix = wire.push_prefix(2, 99, entries, True)
    wire.decode_request([prefix + _tail(1, 1, 1), *payload], LIMITS)
    assert prefix in data._SEEN_PUSHES
    # The same fields in msgpack's own packing (small integers, another order) take the general path.
    for header in [msgpack.packb({**msgpack.unpackb(prefix[:1] + prefix[1:] + _tail(5, 6, 7))}),
                   msgpack.packb({"v": 1, "op": "push_pull", "worker": 2, "session": 99, "tensors": entries,
                                  "seq": 6, "id": 5, "clock": 7})]:
        assert wire.decode_request([header, *payload], LIMITS) == \
            wire.decode_request([prefix + _tail(5, 6, 7), *payload], LIMITS)
    # Limits that refuse the tensor's name refuse it though its prefix was checked under looser ones.
    strict = WireLimits(max_name_len=3)
    with pytest.raises(ProtocolError, match="name") as exc:
        wire.decode_request([prefix + _tail(8, 9, 10), *payload], strict)
    assert exc.value.request_id == 8
    # A frame of the wrong size is refused with the request's id, as by the general path.
    with pytest.raises(ProtocolError, match="frame has 3 bytes") as exc:
        wire.decode_request([prefix + _tail(11, 12, 13), b"abc"], LIMITS)
    assert exc.value.request_id == 11


def test_the_remembered_push_prefixes_are_bounded(monkeypatch):
    monkeypatch.setattr(data, "_SEEN_PUSHES", {})
    monkeypatch.setattr(data, "_SEEN_PUSHES_MAX", 4)
    for worker in range(10):  # a peer inventing sessions, workers or names
        prefix = wire.push_prefix(worker, 1, [["w", 0, "<f4", [1]]], False)
        wire.decode_request([prefix + _tail(1, 1, 1), np.ones(1, np.float32).tobytes()], LIMITS)
        assert 1 <= len(data._SEEN_PUSHES) <= 4


def test_a_push_from_a_received_frame_decodes_as_from_bytes():
    ctx, router, dealer = _pair()
    try:
        prefix = wire.push_prefix(1, 2, [["w", 0, "<f4", [2]]], True)
        for rid in (3, 4):  # the first teaches the prefix, the second is decoded from its tail
            dealer.send([prefix + _tail(rid, rid, rid), np.ones(2, np.float32).tobytes()], 5.0)
            assert router.poll(5.0)
            _, frames = router.recv()
            got = wire.decode_request(frames, LIMITS)
            got.buffers = [bytes(b) for b in got.buffers]
            assert got == wire.decode_request([bytes(f) for f in frames], LIMITS) and got.id == rid
    finally:
        dealer.close()
        router.close()
        ctx.term()


def _packed_reply(rid: int, entries: list[list[Any]], versions: list[int]) -> bytes:
    tensors = replies._TENSORS_KEY + replies._array_head(len(entries)) + b"".join(pack_header(e) for e in entries)
    return bytes(wire.encode_params_packed(rid, tensors, versions, [])[0])


def _general_reply_only(data_: bytes, limits: WireLimits) -> Any:
    with mock.patch.object(replies, "_packed_params", lambda d, limits: None), \
            mock.patch.object(replies, "_remember_tensors", lambda *a: None):
        return _general_reply(data_, limits)


@_HSETTINGS
@given(entries=_ENTRIES, rid=_U63, versions=st.data())
def test_a_packed_params_reply_is_the_map_encode_params_makes_and_decodes_alike(entries, rid, versions):
    entries = [[name, part, dname, [count]] for name, part, dname, count in entries]
    got = versions.draw(st.lists(_U63, min_size=len(entries), max_size=len(entries)))
    packed = _packed_reply(rid, entries, got)
    assert msgpack.unpackb(packed) == msgpack.unpackb(bytes(wire.encode_params(rid, entries, got, [])[0]))
    for _ in range(2):  # the second time the tensors are known by their bytes
        assert _outcome(wire.decode_reply, packed, LIMITS) == _outcome(_general_reply_only, packed, LIMITS)


@pytest.mark.parametrize("change", ["id", "version", "marker", "count", "limits"])
def test_a_packed_params_reply_out_of_bounds_decodes_as_the_general_path_says(change):
    entries = [["w", 0, "<f4", [3]], ["w", 1, "<f4", [2]]]
    good = _packed_reply(7, entries, [1, 2])
    wire.decode_reply(good, LIMITS)  # the tensors' bytes are known from now on
    at = len(replies._PACKED_HEAD)
    limits = LIMITS
    if change == "id":  # 2**64 - 1: beyond a request id
        bad = good[:at] + b"\xff" * 8 + good[at + 8:]
    elif change == "version":
        bad = good.replace(b"\xcf" + (2).to_bytes(8, "big"), b"\xcf" + (2**63).to_bytes(8, "big"))
    elif change == "marker":  # a version as uint32: valid msgpack, another layout
        bad = good.replace(b"\xcf" + (2).to_bytes(8, "big"), b"\xce" + (2).to_bytes(4, "big"))
    elif change == "count":  # one version for two tensors
        bad = _packed_reply(7, entries, [1, 2]).replace(b"\x92\xcf" + (1).to_bytes(8, "big") + b"\xcf" +
                                                        (2).to_bytes(8, "big"), b"\x91\xcf" + (1).to_bytes(8, "big"))
    else:
        bad, limits = good, WireLimits(max_tensors=1)
    assert bad != good or change == "limits"
    assert _outcome(wire.decode_reply, bad, limits) == _outcome(_general_reply_only, bad, limits)
    assert isinstance(_outcome(wire.decode_reply, bad, limits), tuple) == (change != "marker")


def test_replies_held_back_go_in_order_as_they_were_when_given():
    ctx, router, dealer = _pair()
    try:
        dealer.send([b"hello"], 5.0)
        assert router.poll(5.0)
        identity, _ = router.recv()
        buf = bytearray(b"first")
        router.hold(3)
        router.send(identity, [b"h1", memoryview(buf)])
        buf[:] = b"later"  # the reply was copied when given
        router.send(identity, [b"h2"])
        router.send(identity, [b"h3", b"x" * (transport.ZERO_COPY_BYTES + 1)])  # large: the held go first
        router.send(identity, [b"h4"])
        assert router.release() == []
        got = []
        while len(got) < 4:
            assert _ready(dealer)
            got.append(dealer.recv_frame())
            dealer.discard_rest()
        assert got == [b"h1", b"h2", b"h3", b"h4"]
    finally:
        dealer.close()
        router.close()
        ctx.term()


def test_a_reply_held_back_to_a_departed_peer_is_reported_at_release():
    ctx, router, dealer = _pair()
    try:
        with pytest.raises(transport.SendDropped):
            router.send(b"nobody", [b"h"])
        router.hold(16)
        assert router.send(b"nobody", [b"head", b"abc"]) == [None, None]
        dropped = router.release()
        assert len(dropped) == 1 and dropped[0][0] == 7
        with pytest.raises(transport.SendDropped):  # released: replies go at once again
            router.send(b"nobody", [b"h"])
    finally:
        dealer.close()
        router.close()
        ctx.term()


def test_a_shard_answers_requests_that_take_long_each_as_it_is_done_not_at_the_end_of_its_batch():
    """Replies to queued requests are held back to go out together, but not behind requests that take long (a
    large tensor's pieces): each request after the first waits here until the worker has the previous one's
    answer, which a shard holding the answers until its batch ends would never send."""
    from psrt.shard.server import Server

    server = Server(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async"))
    answered = [threading.Event() for _ in range(5)]
    waited_in_vain: list[int] = []
    handle, calls = server.handle, [0]

    def slow_handle(identity: bytes, frames: list[Any]) -> None:
        n = calls[0]
        calls[0] += 1
        time.sleep(0.001)  # the work of a large piece (milliseconds), far beyond what holding a reply saves
        if n >= 2 and not answered[n - 1].wait(10.0):  # request n is rid n + 1: the previous reply is rid n
            waited_in_vain.append(n)
        handle(identity, frames)

    server.handle = slow_handle  # type: ignore[method-assign]
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    ctx = transport.new_context()
    dealer = transport.DealerChannel(ctx, server.endpoint, 1000)
    try:
        for rid in range(1, 5):  # queued together: one wake-up of the shard takes them all
            dealer.send(data.encode_stats_request(rid), 5.0)
        got = []
        while len(got) < 4:
            assert _ready(dealer), f"answers {got} only"
            reply = wire.decode_reply(dealer.recv_frame(), LIMITS)
            dealer.discard_rest()
            got.append(reply.id)
            answered[reply.id].set()
        assert got == [1, 2, 3, 4] and not waited_in_vain, (got, waited_in_vain)
    finally:
        dealer.close()
        server.stop()
        thread.join(10)
        server.close()
        ctx.term()


def test_a_shard_counts_a_held_reply_it_could_not_send():
    from psrt.config import ServerConfig
    from psrt.shard.server import Server

    server = Server(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async"))
    try:
        server._chan.hold(4)
        server.replies.error(b"gone", 5, "protocol", "bad")  # a peer that left before its answer
        before = server.counters.bytes_out
        server.replies.dropped(server._chan.release())
        assert server.counters.dropped_replies == 1 and server.counters.errors == 1
        assert server.counters.bytes_out < before
    finally:
        server.close()


# The shard's path for a push applied on arrival (Server._at_once) against its general one (Server._push): the
# same messages give the same answers, the same parameters and the same counters, whichever takes them.
class _Capture:
    """A shard's socket that keeps what it is given."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, list[bytes]]] = []

    def send(self, identity: bytes, frames: list[Any], track: bool = False) -> list[None]:
        self.sent.append((identity, [bytes(f) for f in frames]))
        return [None] * len(frames)


def _run_shard(messages: list[tuple[bytes, list[bytes]]], mode: str, workers: int, nonfinite: str,
               general: bool, members: Any = None, finished: Any = None) -> tuple[list[Any], dict[str, Any], dict, int]:
    from psrt.config import ServerConfig
    from psrt.shard.server import Server

    server = Server(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=workers, mode=mode, nonfinite=nonfinite))
    try:
        out = _Capture()
        server.replies._chan = out
        taken = [0]
        if general:
            server._at_once = lambda identity, req: False
        else:
            at_once = server._at_once

            def counting(identity: bytes, req: Any) -> bool:
                took = at_once(identity, req)
                taken[0] += took
                return took
            server._at_once = counting
        for i, (identity, frames) in enumerate(messages):
            if i == 2 and members is not None:
                server.set_members(members)
            if i == 2 and finished is not None:
                server.set_finished(finished)
            server.handle(identity, list(frames))
        params = {k: e.param.copy() for k, e in server.store.entries.items()}
        # (Times differ from run to run: the uptime, and how late each worker's pushes came.)
        stats = {k: v for k, v in server.stats().items() if k not in ("uptime_s", "endpoint", "workers")}
        # (each worker's row without its lateness)
        stats["workers"] = [row[:3] + row[5:] for row in server.stats().get("workers", [])]
        return out.sent, params, stats, taken[0]
    finally:
        server.close()


def _shard_messages() -> list[tuple[bytes, list[bytes]]]:
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    w = wire.tensor_entry("w", 0, f32, (4,))
    b = wire.tensor_entry("b", 0, f64, (2,))
    grad_w, grad_b = np.full(4, 0.5, np.float32), np.full(2, 0.25)
    msgs = [(b"a", wire.encode_init(1, 0, 7, psrt.SGD(lr=0.5).to_wire(), [w, b],
                                    [np.zeros(4, np.float32), np.zeros(2)]))]
    rid = 2
    for worker, session in ((0, 7), (1, 8)):
        ident = b"ab"[worker:worker + 1] * 2
        for seq in range(0, 8, 2):
            msgs.append((ident, wire.encode_push(rid, worker, session, seq, [w], [grad_w], True)))  # push_pull
            rid += 1
            msgs.append((ident, wire.encode_push(rid, worker, session, seq + 1, [w, b], [grad_w, grad_b],
                                                 seq % 4 == 0)))  # push_pull, push
            rid += 1
        msgs.append((ident, wire.encode_push(rid, worker, session, 1, [w], [grad_w], True)))  # a replay
        rid += 1
    bad = [([w], [np.array([1.0, np.nan, 0.0, 0.0], np.float32)]),  # not finite
           ([wire.tensor_entry("nope", 0, f32, (4,))], [grad_w]),  # unknown key
           ([wire.tensor_entry("w", 0, f32, (3,))], [grad_w[:3]]),  # another size
           ([wire.tensor_entry("b", 0, f32, (2,))], [np.ones(2, np.float32)]),  # another dtype
           ([w, wire.tensor_entry("nope", 1, f32, (4,))], [grad_w, grad_w])]  # the second tensor is wrong
    for entries, payload in bad:
        msgs.append((b"aa", wire.encode_push(rid, 0, 7, rid, entries, payload, True)))
        rid += 1
    fp16 = wire.encode_push(rid, 0, 7, rid, [["w", 0, "<f2", [4]]], [np.full(4, 0.5, np.float16)], True)
    msgs.append((b"aa", fp16))
    msgs.append((b"aa", wire.encode_push(rid + 1, 0, 7, rid + 1, [w], [grad_w], True)))
    return [(ident, [bytes(f) for f in frames]) for ident, frames in msgs]


@pytest.mark.parametrize("mode, workers, nonfinite, members, finished", [
    ("async", 2, "reject", None, None), ("async", 2, "allow", None, None), ("sync", 1, "reject", None, None),
    ("sync", 2, "reject", None, None), ("ssp", 2, "reject", None, None), ("async", 2, "reject", [0], None),
    ("async", 2, "reject", None, [1]),
])
def test_a_push_applied_at_once_is_answered_and_applied_as_by_the_general_path(monkeypatch, mode, workers, nonfinite,
                                                                                members, finished):
    import time

    # (An ack says when the shard took its push in, and how long it held the answer: a clock that stands still
    # makes the two paths' answers comparable byte for byte.)
    monkeypatch.setattr(time, "monotonic_ns", lambda: 1_000_000)
    msgs = _shard_messages()
    fast = _run_shard(msgs, mode, workers, nonfinite, general=False, members=members, finished=finished)
    slow = _run_shard(msgs, mode, workers, nonfinite, general=True, members=members, finished=finished)
    assert fast[0] == slow[0]  # every answer, byte for byte, in order
    assert fast[1].keys() == slow[1].keys()
    for key in fast[1]:
        np.testing.assert_array_equal(fast[1][key], slow[1][key])
    assert fast[2] == slow[2]
    # Taken at once where pushes are steps and nothing unusual holds (and then most of them), never elsewhere.
    if mode == "ssp" or (mode == "sync" and workers > 1):
        assert fast[3] == 0
    elif members is None and finished is None:
        assert fast[3] >= 12
    else:  # a worker left, or one finished: from then on the general path takes the pushes that concern it
        assert fast[3] < 12
    if mode == "async" and members is None and finished is None and nonfinite == "reject":
        assert fast[2]["pushes"] == 18 and fast[2]["duplicates"] == 2 and fast[2]["errors"] == 5


# Embedding rows over a lane: every call sends a request to every shard, decoded by a short path
# (psrt.wire.rows._lane_rows, _lane_rows_reply) that must agree with the general one on any header.
def _norm(record: Any) -> Any:
    """A decoded record as plain values (its arrays by dtype, shape and values), or the error as it was."""
    if isinstance(record, tuple):
        return record
    out = {"type": type(record).__name__}
    for key, value in vars(record).items():
        out[key] = (str(value.dtype), value.shape, value.tolist()) if isinstance(value, np.ndarray) else value
    return out


def _general_rows(decode: Any, *args: Any) -> Any:
    with mock.patch.object(rows_wire, "_lane_rows", lambda *a: None), \
            mock.patch.object(rows_wire, "_lane_rows_reply", lambda *a: None):
        return decode(*args)


_ODD = (st.integers(-2, 3) | st.integers(2**63 - 2, 2**64 - 1) | st.booleans() | st.none() | st.text(max_size=3)
        | st.floats(allow_nan=False) | st.lists(st.integers(-1, 2**64 - 1), max_size=3)
        | st.tuples(st.integers(-1, 2**64 - 1), st.lists(st.integers(-1, 2**64 - 1), max_size=3),
                    st.lists(st.integers(-1, 2**64 - 1), max_size=3)).map(list))
_ROW_REQUESTS = {
    "pull_rows": {"v": wire.PROTOCOL_VERSION, "op": "pull_rows", "id": 7, "worker": 1, "table": "emb",
                  "min_version": 3, "clock": 2, "count": 1120, "lane": [4, [4096], [20480]]},
    "push_rows": {"v": wire.PROTOCOL_VERSION, "op": "push_rows", "id": 7, "worker": 1, "session": 9, "seq": 5,
                  "clock": 2, "table": "emb", "dim": 16, "dtype": "<f4", "count": 1120,
                  "lane": [4, [4096, 20480], []]},
    # (a sync job's push says the table version its rows came from: psrt.shard.realign)
    "push_rows+base": {"v": wire.PROTOCOL_VERSION, "op": "push_rows", "id": 7, "worker": 1, "session": 9, "seq": 5,
                       "clock": 2, "table": "emb", "dim": 16, "dtype": "<f4", "count": 1120, "base": 4,
                       "lane": [4, [4096, 20480], []]},
}


@_HSETTINGS
@given(op=st.sampled_from(sorted(_ROW_REQUESTS)), data=st.data(), drop=st.booleans(), extra=st.booleans(),
       frame=st.booleans(), limits=st.sampled_from([LIMITS, WireLimits(max_name_len=2),
                                                    WireLimits(max_tensor_bytes=4096)]))
def test_a_row_request_over_a_lane_decodes_by_the_short_path_as_by_the_general_one(op, data, drop, extra, frame,
                                                                                   limits):
    header = dict(_ROW_REQUESTS[op])
    field = data.draw(st.sampled_from(sorted(header)))
    if drop:
        del header[field]
    else:
        header[field] = data.draw(_ODD | st.sampled_from(["pull_rows", "push_rows", "<f2", "int8", "bf16"]))
    if extra:
        header[data.draw(st.sampled_from(["base", "session", "extra"]))] = data.draw(_ODD)
    frames = [msgpack.packb(header), *([b"\0" * 8] if frame else [])]
    assert _norm(_outcome(wire.decode_request, frames, limits)) == \
        _norm(_outcome(_general_rows, wire.decode_request, frames, limits))
    valid = [msgpack.packb(_ROW_REQUESTS[op])]
    assert _norm(_outcome(wire.decode_request, valid, limits)) == \
        _norm(_outcome(_general_rows, wire.decode_request, valid, limits))
    if limits is LIMITS:
        assert wire.decode_request(valid, limits).lane is not None


@_HSETTINGS
@given(data=st.data(), drop=st.booleans(), limits=st.sampled_from([LIMITS, WireLimits(max_name_len=2),
                                                                  WireLimits(max_tensor_bytes=4096)]))
def test_a_rows_reply_over_a_lane_decodes_by_the_short_path_as_by_the_general_one(data, drop, limits):
    header = {"v": wire.PROTOCOL_VERSION, "op": "rows", "id": 7, "table": "emb", "dim": 16, "dtype": "<f4",
              "count": 1120, "version": 3, "lane": 4}
    field = data.draw(st.sampled_from(sorted(header)))
    if drop:
        del header[field]
    else:
        header[field] = data.draw(_ODD | st.sampled_from(["rows", "<f8", "int8"]))
    packed = msgpack.packb(header)
    assert _norm(_outcome(wire.decode_reply, packed, limits)) == \
        _norm(_outcome(_general_rows, wire.decode_reply, packed, limits))
