"""Local connections: a worker and a shard of one host exchange messages over a Unix socket of their own
(psrt.transport.local). The framing both ways, hostile bytes, the greeting's secret, and real clients and shards
that switch to it and end exact."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import numpy as np
import pytest
from _helpers import needs_shm, serving

import psrt
from psrt import wire
from psrt.config import ClientConfig, ServerConfig
from psrt.transport import local

pytestmark = pytest.mark.skipif(not local.available(), reason="local connections need Linux")

BIG = 300_000  # float32 values: 1.2 MB, over the lane threshold (a lane proves a shared host)


def pair(max_frame=None) -> tuple[local.LocalConn, local.LocalConn]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return local.LocalConn(a, max_frame), local.LocalConn(b, max_frame)


def drain(sender: local.LocalConn, receiver: local.LocalConn, count: int) -> list[list[bytes]]:
    """Move bytes until ``receiver`` holds ``count`` messages; their frames as bytes."""
    for _ in range(100_000):
        sender.flush()
        assert receiver.fill()
        if len(receiver.messages) >= count:
            break
    got = [[bytes(f) for f in receiver.messages.popleft()] for _ in range(count)]
    assert not receiver.messages
    return got


# ---------------------------------------------------------------------------------------------- framing
def test_messages_of_any_shape_arrive_whole_and_in_order():
    a, b = pair()
    rng = np.random.default_rng(0)
    sent = [[b"head"], [b"h", b""], [b"h", rng.bytes(70_000)], [b"h", *[rng.bytes(n) for n in (1, 5, 4096)]],
            [b"x" * 10, rng.bytes(3 << 20)],  # longer than a read: read into its own buffer
            [b"h", *[bytes([i % 256]) * (i % 7) for i in range(2000)]]]  # more frames than one sendmsg takes
    for msg in sent:
        a.send(msg)
    assert drain(a, b, len(sent)) == sent
    # The first frame is bytes (a header), the others read-only views.
    a.send([b"h", b"body"])
    drain_one = None
    for _ in range(1000):
        b.fill()
        if b.messages:
            drain_one = b.messages.popleft()
            break
    assert type(drain_one[0]) is bytes and drain_one[1].readonly


def test_a_send_the_kernel_cannot_take_is_kept_copied_and_sent_later():
    a, b = pair()
    buf = bytearray(b"y" * (8 << 20))  # far more than a socket buffer holds
    a.send([b"h", buf])
    assert a.pending > 0, "the kernel took only part of it"
    buf[:] = b"z" * len(buf)  # the caller may reuse its buffer once send returns
    assert drain(a, b, 1) == [[b"h", b"y" * (8 << 20)]]
    assert a.pending == 0


def test_numpy_frames_are_sent_by_their_bytes():
    a, b = pair()
    arr = np.arange(12, dtype=np.float64).reshape(3, 4)
    a.send([b"h", arr])
    (msg,) = drain(a, b, 1)
    np.testing.assert_array_equal(np.frombuffer(msg[1], np.float64), arr.ravel())


@pytest.mark.parametrize("head", [struct.pack("<I", 0), struct.pack("<I", local.MAX_FRAMES + 1),
                                  struct.pack("<IQ", 1, 1 << 20)])
def test_what_no_message_is_closes_the_connection(head):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = local.LocalConn(b, max_frame=4096)
    a.sendall(head + b"\0" * 64)
    assert conn.fill() is False and not conn.open and not conn.messages


def test_a_peer_that_closes_ends_the_connection_and_whole_messages_stay():
    a, b = pair()
    a.send([b"last"])
    a.close()
    b.fill()  # (the message; a read that comes up short stops before the close is seen)
    assert b.fill() is False and not b.open
    assert [bytes(f) for f in b.messages.popleft()] == [b"last"]
    with pytest.raises(ConnectionError):
        a.send([b"x"])


# ---------------------------------------------------------------------------------------------- the greeting
def test_only_the_secret_granted_to_a_peer_connects_and_only_once():
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async", shm=True)) as server:
        chan = server._chan
        name, secret = chan.grant_local(b"\x00peer")
        with pytest.raises(OSError):
            local.connect(name, "0" * 32, timeout=5)  # no secret of the shard's
        conn = local.connect(name, secret, timeout=5)
        conn.close()
        with pytest.raises(OSError):
            local.connect(name, secret, timeout=5)  # a secret is good for one connection
        with pytest.raises(OSError):
            local.connect("psrt-" + "0" * 24, secret, timeout=5)  # no such listener (another host)


def test_a_greeting_waits_for_nothing_and_its_answer_is_read_when_it_comes():
    listener = local.LocalListener()
    try:
        started = time.monotonic()
        conn = local.begin(listener.name, "s3cret")  # the listener takes nothing yet: a stopped shard
        assert not local.greeted(conn) and time.monotonic() - started < 0.5
        (sock,) = listener.accept()
        shard_end = local.LocalConn(sock)
        assert drain(conn, shard_end, 1) == [[local.AUTH, b"s3cret"]]
        shard_end.send([local.AUTH, b"ok"])
        for _ in range(1000):
            if local.greeted(conn):
                break
            time.sleep(0.001)
        else:
            raise AssertionError("the answer to the greeting was never read")
        refused = local.begin(listener.name, "other")
        (sock,) = listener.accept()
        sock.close()  # (what a shard does with a secret it never granted)
        with pytest.raises(OSError, match="refused"):
            for _ in range(1000):
                local.greeted(refused)
                time.sleep(0.001)
        assert not refused.open
    finally:
        listener.close()


def test_a_shard_serves_hundreds_of_local_peers_and_forgets_each_that_leaves():
    import zmq

    from psrt.transport import RouterChannel

    PEERS = 200  # (two descriptors each in this process: well inside a common limit of 1,024)
    ctx = zmq.Context()
    chan = RouterChannel(ctx, "tcp://127.0.0.1:*", 1000, 5.0)
    peers = []
    try:
        for i in range(PEERS):
            name, secret = chan.grant_local(b"\x00peer%d" % i)
            peers.append(local.begin(name, secret))
            chan.poll(0.0)  # (the shard's loop takes the connections and greetings in as they come)
        waiting, deadline = set(range(PEERS)), time.monotonic() + 10
        while waiting and time.monotonic() < deadline:
            chan.poll(0.05)
            waiting = {i for i in waiting if not local.greeted(peers[i])}
        assert not waiting, f"{len(waiting)} greetings unanswered"
        for i, conn in enumerate(peers):
            conn.send([b"hello %d" % i])

        def take(count: int) -> dict[bytes, bytes]:
            got: dict[bytes, bytes] = {}
            deadline = time.monotonic() + 10
            while len(got) < count and time.monotonic() < deadline:
                chan.poll(0.1)
                while (msg := chan.recv()) is not None:
                    got[msg[0]] = bytes(msg[1][0])
            return got

        got = take(PEERS)
        assert got == {b"\x00peer%d" % i: b"hello %d" % i for i in range(PEERS)} and chan.local_peers == PEERS
        for conn in peers[::2]:  # half of them leave: each is forgotten, its replies go over ZeroMQ again
            conn.close()
        for conn in peers[1::2]:
            conn.send([b"again"])
        got = take(PEERS // 2)
        assert set(got) == {b"\x00peer%d" % i for i in range(1, PEERS, 2)} and set(got.values()) == {b"again"}
        deadline = time.monotonic() + 5
        while chan.local_peers > PEERS // 2 and time.monotonic() < deadline:
            chan.poll(0.05)
        assert chan.local_peers == PEERS // 2 and len(chan._conns) == PEERS // 2
        chan.send(b"\x00peer1", [b"reply"])  # a staying peer's reply goes over its connection
        assert drain_one(peers[1]) == [b"reply"]
    finally:
        for conn in peers:
            conn.close()
        chan.close()
        ctx.term()


def test_a_shard_waiting_on_local_peers_still_wakes_for_zeromq_at_once():
    """With local connections a shard waits on its epoll set alone, ZeroMQ's descriptor in it: a message over
    ZeroMQ ends the wait, and so does one left queued after a use of the socket, which ZeroMQ does not signal
    again (a wait that missed either would sleep its whole 30 s and say nothing came)."""
    import zmq

    from psrt.transport import RouterChannel

    ctx = zmq.Context()
    chan = RouterChannel(ctx, "tcp://127.0.0.1:*", 1000, 5.0)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"remote")
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(chan.endpoint)
    conn = None
    try:
        name, secret = chan.grant_local(b"\x00peer")
        conn = local.begin(name, secret)
        deadline = time.monotonic() + 10
        while not local.greeted(conn) and time.monotonic() < deadline:
            chan.poll(0.05)
        for round_ in range(3):  # local traffic: the shard's waits read nothing of ZeroMQ's socket
            conn.send([b"local %d" % round_])
            assert chan.poll(30.0)
            assert chan.recv() == (b"\x00peer", [b"local %d" % round_])
            chan.send(b"\x00peer", [b"ok"])
            assert drain_one(conn) == [b"ok"]
        assert chan.recv() is None
        dealer.send(b"over zeromq")
        assert chan.poll(30.0)  # the descriptor's signal ends the wait
        identity, frames = chan.recv()
        assert (identity, [bytes(f) for f in frames]) == (b"remote", [b"over zeromq"])
        dealer.send(b"first")
        dealer.send(b"second")
        assert chan.poll(30.0)
        assert chan.recv()[0] == b"remote"  # "first"; "second" stays queued
        chan.send(b"remote", [b"reply"])  # a use of the socket: "second" is not signalled again
        assert dealer.poll(10_000) and dealer.recv() == b"reply"
        assert chan.poll(30.0)
        identity, frames = chan.recv()
        assert [bytes(f) for f in frames] == [b"second"]
        assert chan.recv() is None
        conn.send([b"local again"])  # and local peers are still heard, ZeroMQ's queue empty
        assert chan.poll(30.0) and chan.recv() == (b"\x00peer", [b"local again"])
        assert not chan.poll(-1.0)  # a wait past its deadline is none (epoll would read -1 as "for ever")
    finally:
        if conn is not None:
            conn.close()
        dealer.close()
        chan.close()
        ctx.term()


def drain_one(conn: local.LocalConn) -> list[bytes]:
    for _ in range(10_000):
        conn.fill()
        if conn.messages:
            return [bytes(f) for f in conn.messages.popleft()]
        time.sleep(0.001)
    raise AssertionError("no message came")


def test_a_worker_without_the_beacon_token_is_refused_a_local_connection():
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async", shm=True)) as server:
        with psrt.Client([server.endpoint], config=ClientConfig(timeout=20, shm=False)) as c:
            c.init({"w": np.zeros(4, np.float32)})
            sender = c._senders[0]
            with pytest.raises(psrt.ServerError, match="local connections are for workers of this host"):
                sender.ask(lambda rid: wire.encode_local_open(rid, "0" * 32))  # (what a worker elsewhere shows)
            assert not server._chan.local_peers
            assert server.counters.errors == 0  # an answer, not a fault of the traffic


def test_a_shard_without_shared_memory_grants_no_local_connection():
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async", shm=False)) as server:
        with psrt.Client([server.endpoint], config=ClientConfig(timeout=20)) as c:
            c.init({"w": np.zeros(4, np.float32)}, optimizer=psrt.SGD(lr=1.0))
            for _ in range(5):
                out = c.push_pull({"w": np.ones(4, np.float32)})
            assert c.stats()[0]["local_messages"] == 0 and not c._calls.channels[0].local_connected
        assert server.counters.errors == 0
    assert np.all(out["w"] == -5.0)


# ---------------------------------------------------------------------------------------------- real calls
@needs_shm(64)
def test_a_worker_with_a_lane_switches_to_a_local_connection_and_ends_exact():
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async", shm=True)) as server:
        with psrt.Client([server.endpoint], config=ClientConfig(timeout=20)) as c:
            c.init({"w": np.zeros(BIG, np.float32), "s": np.zeros(3, np.float32)}, optimizer=psrt.SGD(lr=1.0))
            channel = c._calls.channels[0]
            handles = []
            for step in range(20):
                grads = {"w": np.full(BIG, 1.0, np.float32), "s": np.full(3, 2.0, np.float32)}
                if step % 4 == 3:  # several in flight: the switch waits for none to be outstanding
                    handles += [c.push_pull_async(grads), c.push_async({"s": grads["s"]})]
                    for h in handles:
                        h.wait()
                    handles = []
                else:
                    c.push_pull(grads)
            out = c.pull()
            assert channel.local_connected and server._chan.local_peers == 1
            stats = c.stats()[0]
            # (set up without waiting over the first few calls: most of the 27 requests went locally)
            assert stats["local_peers"] == 1 and stats["local_messages"] >= 15
            c.init_embedding("e", dim=8, optimizer=psrt.SGD(lr=1.0), init="zeros")
            ids = np.arange(5000) % 3000
            c.push_rows("e", ids, np.ones((5000, 8), np.float32))
            rows = c.pull_rows("e", np.array([0, 2999, 1]))
        assert server.counters.errors == 0
    steps_w, steps_s = 20, 25  # every push_pull and push applied once
    assert np.all(out["w"] == -steps_w) and np.all(out["s"] == -2.0 * steps_s)
    # Rows 0..1999 were pushed twice (the ids repeat), 2000..2999 once, from zeros with SGD at lr 1.
    np.testing.assert_array_equal(rows, np.array([[-2.0] * 8, [-1.0] * 8, [-2.0] * 8], np.float32))


@needs_shm(1)
def test_small_calls_on_one_host_take_a_local_connection_without_a_lane(caplog):
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async", shm=True)) as server:
        with psrt.Client([server.endpoint], config=ClientConfig(timeout=20)) as c, caplog.at_level(logging.INFO):
            c.init({"w": np.zeros(1024, np.float32)}, optimizer=psrt.SGD(lr=1.0))
            c.init_embedding("e", dim=4, optimizer=psrt.SGD(lr=1.0), init="zeros")
            steps = 0
            channel = c._calls.channels[0]
            while not channel.local_connected and steps < 200:  # (set up by the first few calls, 3-7 here)
                out = c.push_pull({"w": np.ones(1024, np.float32)})
                steps += 1
            assert channel.local_connected, (steps, channel.local_tried, c._senders[0]._opening,
                                             [r.getMessage() for r in caplog.records])
            before = c.stats()[0]["local_messages"]  # (this request included)
            out = c.push_pull({"w": np.ones(1024, np.float32)})
            c.push({"w": np.ones(1024, np.float32)})
            c.push_rows("e", np.array([3, 3, 7]), np.ones((3, 4), np.float32))
            rows = c.pull_rows("e", np.array([7, 3]))
            last = c.pull()
            stats = c.stats()[0]
            assert server._chan.local_peers == 1
            assert stats["local_messages"] - before == 6  # every request since: 5 calls and this stats request
            assert stats["shm_bytes_in"] == 0  # no lane: every byte local
        assert server.counters.errors == 0
    assert np.all(out["w"] == -(steps + 1.0)) and np.all(last["w"] == -(steps + 2.0))
    np.testing.assert_array_equal(rows, np.array([[-1.0] * 4, [-2.0] * 4], np.float32))


@needs_shm(1)
@pytest.mark.parametrize("mode", ["async", "sync", "ssp"])
def test_a_client_that_always_keeps_a_call_in_flight_moves_to_the_local_connection(mode):
    """A pipelined loop sends its next push_pull before waiting for the last, from its first call on: no moment
    has nothing in flight. One of its calls waits once for those in flight, and the rest go locally (before,
    every one went over ZeroMQ, at under half the calls a second). Sync and ssp: two such workers, every round
    exact, every push applied once."""
    workers, steps = (1, 300) if mode == "async" else (2, 150)
    config = ServerConfig(bind="tcp://127.0.0.1:*", num_workers=workers, mode=mode, shm=True,
                          **({"staleness": 1} if mode == "ssp" else {}))
    with serving(config) as server:
        results: list = [None] * workers

        def work(rank: int) -> None:
            with psrt.Client([server.endpoint], rank=rank, num_workers=workers,
                             config=ClientConfig(timeout=20)) as c:
                c.init({"w": np.zeros(1024, np.float32)}, optimizer=psrt.SGD(lr=1.0))
                grads = {"w": np.ones(1024, np.float32)}
                last = c.push_pull_async(grads)
                for _ in range(steps - 1):
                    nxt = c.push_pull_async(grads)
                    last.wait()
                    last = nxt
                out = last.wait()["w"].copy()
                results[rank] = (out, c._calls.channels[0].local_connected, c._senders[0]._settled)

        threads = [threading.Thread(target=work, args=(r,)) for r in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        local_messages = server._chan.local_messages
        with psrt.Client([server.endpoint], rank=0, num_workers=workers, config=ClientConfig(timeout=20)) as c:
            final = c.init({"w": np.zeros(1024, np.float32)}, optimizer=psrt.SGD(lr=1.0))["w"]  # (joins: as stored)
        assert server.counters.errors == 0
    for rank, got in enumerate(results):
        assert got is not None, f"worker {rank} did not finish"
        out, connected, settled = got
        assert connected and settled, rank
        if mode == "sync":  # each read is the mean of the round's pushes
            assert np.all(out == -float(steps)), (rank, out[:3])
        else:  # applied on arrival: its own pushes, and a prefix of the other's
            assert -float(workers * steps) <= out[0] <= -float(steps) and np.all(out == out[0]), (rank, out[:3])
    assert np.all(final == -float(steps if mode == "sync" else workers * steps)), final[:3]
    # The set-up takes the first calls (a probe and an open, answered while the loop goes on: 6 to 22 of 300 calls
    # here, 43 once under CI's load), and every request after the one wait goes locally: most of them, where before
    # none did.
    assert local_messages >= workers * steps // 2, local_messages


@needs_shm(1)
def test_a_pipelined_client_of_embedding_tables_alone_moves_to_the_local_connection():
    """Its calls are row pushes (push_rows), which move as the dense calls above do."""
    steps = 200
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async", shm=True)) as server:
        with psrt.Client([server.endpoint], config=ClientConfig(timeout=20)) as c:
            c.init_embedding("e", dim=8, optimizer=psrt.SGD(lr=1.0), init="zeros")
            ids, grads = np.arange(50), np.ones((50, 8), np.float32)
            last = c.push_rows_async("e", ids, grads)
            for _ in range(steps - 1):
                nxt = c.push_rows_async("e", ids, grads)
                last.wait()
                last = nxt
            last.wait()
            rows = c.pull_rows("e", np.array([0, 49]))
            assert c._calls.channels[0].local_connected and c._senders[0]._settled
        assert server.counters.errors == 0 and server._chan.local_messages >= steps - 20
    np.testing.assert_array_equal(rows, np.full((2, 8), -float(steps), np.float32))


def _client_with_calls_never_answered(endpoint: str) -> psrt.Client:
    """Worker 0 of a sync job of 2 whose worker 1 never comes: its local connection to the shard ready, and calls
    in flight that no round will answer."""
    c = psrt.Client([endpoint], rank=0, num_workers=2, config=ClientConfig(timeout=20))
    try:
        c.init({"w": np.zeros(BIG, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        channel, sent = c._calls.channels[0], 0
        while not channel.local_ready and sent < 20:  # (set up over the first calls: the stats call's wait takes
            c.push_pull_async({"w": np.ones(BIG, np.float32)})  # the answers in)
            c.stats()
            sent += 1
        assert channel.local_ready and c._calls.outstanding(0)
    except BaseException:
        c.close()
        raise
    return c


@needs_shm(64)
def test_a_client_closing_with_calls_in_flight_waits_for_none_of_them(monkeypatch):
    """Its local connection ready and calls in flight that will never be answered (a sync round whose other
    worker never comes): what close sends (lane_close) does not wait for them to move onto the connection."""
    from psrt.worker.sender import ShardSender

    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=2, mode="sync", shm=True)) as server:
        c = _client_with_calls_never_answered(server.endpoint)
        try:
            c._senders[0]._settled = False  # (as if the next call were the first since it got ready)
            waited: list[int] = []
            monkeypatch.setattr(ShardSender, "_settle", lambda self: waited.append(self.shard))
            start = time.monotonic()
        finally:
            c.close()
        assert not waited and time.monotonic() - start < 5.0


@needs_shm(64)
def test_news_of_a_dead_peer_ends_the_wait_for_calls_in_flight_promptly():
    """The one wait a pipelined client's call makes before it moves onto the local connection (at most a second)
    reads the job's news as every other wait does: a peer's death raises from it within a quarter of a second."""
    from psrt.errors import PeerFailedError

    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=2, mode="sync", shm=True)) as server:
        c = _client_with_calls_never_answered(server.endpoint)
        try:
            died = time.monotonic() + 0.3

            def check() -> None:
                if time.monotonic() >= died:
                    raise PeerFailedError("worker 1 died", peer="worker 1")

            c._calls._check = check
            start = time.monotonic()
            with pytest.raises(PeerFailedError, match="worker 1 died"):
                c._calls.settle(0, 1.0)
            assert time.monotonic() - start < 0.3 + 0.25 + 0.2
        finally:
            c._calls._check = None
            c.close()


@needs_shm(64)
def test_sockets_only_keeps_a_worker_off_local_connections():
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async", shm=True)) as server:
        with psrt.Client([server.endpoint], config=ClientConfig(timeout=20, shm=False)) as c:
            c.init({"w": np.zeros(BIG, np.float32)}, optimizer=psrt.SGD(lr=1.0))
            for _ in range(3):
                out = c.push_pull({"w": np.ones(BIG, np.float32)})
            assert not c._calls.channels[0].local_connected and c.stats()[0]["local_messages"] == 0
    assert np.all(out["w"] == -3.0)


@needs_shm(64)
def test_a_broken_local_connection_sends_the_next_requests_over_zeromq():
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async", shm=True)) as server:
        with psrt.Client([server.endpoint], config=ClientConfig(timeout=20)) as c:
            c.init({"w": np.zeros(BIG, np.float32)}, optimizer=psrt.SGD(lr=1.0))
            channel = c._calls.channels[0]
            calls = 0
            while not channel.local_connected and calls < 20:  # (set up by the first calls, none waiting on it)
                c.push_pull({"w": np.ones(BIG, np.float32)})
                calls += 1
            assert channel.local_connected
            channel._conn.sock.shutdown(socket.SHUT_RDWR)  # broken under it, nothing in flight
            for _ in range(3):
                out = c.push_pull({"w": np.ones(BIG, np.float32)})
            assert not channel.local_connected
    assert np.all(out["w"] == -(calls + 3.0))


def test_a_connection_that_never_greets_is_closed(monkeypatch):
    from psrt import transport

    monkeypatch.setattr(transport, "_GREET_S", 0.0)
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async", shm=True)) as server:
        name, secret = server._chan.grant_local(b"\x00peer")
        stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stranger.connect("\0" + name)
        time.sleep(0.5)  # the shard's loop takes it in (its listener is polled from the next wait on)
        local.connect(name, secret, timeout=5).close()  # the next connection: the silent one is closed
        stranger.settimeout(5)
        assert stranger.recv(1) == b""
        stranger.close()
