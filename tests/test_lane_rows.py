"""Embedding rows over shared-memory lanes: ``push_rows``/``pull_rows`` of a worker and a shard of one host carry
their ids and rows in the worker's segment (the header over the socket), with the same results bit for bit as
over sockets and as the NumPy oracle; hostile lane offsets get an error reply and change nothing."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from _helpers import needs_shm, serving
from _row_oracle import OracleTable
from test_lanes import LanePeer

import psrt
from psrt import wire
from psrt.config import ClientConfig, ServerConfig
from psrt.shm import lanes

pytestmark = needs_shm(256)

DIM = 16
BATCH = 4096  # 4096 x 16 float32 = 256 KiB a call: over the lane threshold on every shard of up to three


def _steps(seed: int = 3, steps: int = 4, dim: int = DIM) -> list[tuple[np.ndarray, np.ndarray]]:
    """Zipf ids (many repeated) and their gradient rows, per step."""
    rng = np.random.default_rng(seed)
    return [((rng.zipf(1.05, BATCH) - 1) % 50_000, rng.standard_normal((BATCH, dim)).astype(np.float32))
            for _ in range(steps)]


def _train(endpoints: list[str], shm_on: bool, admit_after: int = 1, dim: int = DIM) -> tuple[list[np.ndarray],
                                                                                               list[dict]]:
    """Pull, push, pull again per step; returns every pull's rows and the shards' stats."""
    pulled = []
    with psrt.Client(endpoints, config=ClientConfig(timeout=30, shm=shm_on)) as c:
        c.init_embedding("t", dim=dim, optimizer=psrt.AdaGrad(lr=0.1, eps=1e-10), std=0.1, seed=7,
                         admit_after=admit_after)
        for ids, grads in _steps(dim=dim):
            pulled.append(c.pull_rows("t", ids))
            c.push_rows("t", ids, grads)
            pulled.append(c.pull_rows("t", ids))
        return pulled, c.stats()


def _oracle(admit_after: int = 1, dim: int = DIM) -> list[np.ndarray]:
    table = OracleTable(dim, 7, optimizer="adagrad", lr=0.1, eps=1e-10, admit_after=admit_after, b=0.1)
    pulled = []
    for ids, grads in _steps(dim=dim):
        pulled.append(table.pull(ids))
        table.push(ids, grads)
        pulled.append(table.pull(ids))
    return pulled


@pytest.mark.integration
@pytest.mark.parametrize("num_shards, admit_after, dim", [(1, 1, 16), (2, 1, 16), (2, 2, 16), (3, 2, 16), (2, 1, 32),
                                                          (3, 2, 32)])
def test_rows_over_lanes_give_bit_for_bit_what_sockets_give_and_match_the_oracle(shards, num_shards, admit_after,
                                                                                  dim):
    """S = 1 (the answer gathered from its lane area into the caller's order), 2 and 3 (3 splits the ids by a
    division, not a mask); rows of 64 bytes (dim 16: the answers gathered into order at the end) and of 128
    (dim 32: each answer moved to its places as it comes, psrt.worker.embedding_client.MOVED_ROW_BYTES)."""
    from psrt.worker.embedding_client import MOVED_ROW_BYTES

    assert (dim * 4 >= MOVED_ROW_BYTES) == (dim == 32), "each way of taking answers in has its cases"
    lane_group, socket_group = shards(num_shards, mode="async"), shards(num_shards, mode="async")
    over_lanes, lane_stats = _train(lane_group.endpoints, True, admit_after, dim)
    over_sockets, socket_stats = _train(socket_group.endpoints, False, admit_after, dim)
    assert all(s["shm_bytes_in"] > 0 and s["shm_bytes_out"] > 0 for s in lane_stats), "the rows took the lanes"
    assert all(s["shm_bytes_in"] == 0 == s["shm_bytes_out"] for s in socket_stats)
    for a, b, want in zip(over_lanes, over_sockets, _oracle(admit_after, dim)):
        assert a.tobytes() == b.tobytes()
        np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-6)


def _rows_header(op: str, lane: list, count: int = 4, **over) -> dict:
    h = {"op": op, "id": 9, "worker": 0, "table": "t", "clock": 0, "count": count, "lane": lane}
    if op == "push_rows":
        h.update(session=5, seq=0, dim=DIM, dtype="<f4")
    else:
        h.update(min_version=0)
    return {**h, **over}


@pytest.mark.integration
def test_hostile_row_lane_offsets_get_errors_and_change_nothing(shards):
    group = shards(1, mode="async")
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=20, shm=False)) as c:
        c.init_embedding("t", dim=DIM, optimizer=psrt.SGD(lr=1.0), init="zeros")
    peer = LanePeer(group.endpoints[0])
    try:
        g, size = peer.generation, peer.segment.size
        peer.segment.array(64, np.dtype(np.int64), 4)[:] = [1, 2, 3, 4]
        peer.segment.array(128, np.dtype(np.float32), 4 * DIM)[:] = 1.0
        cases = [
            (_rows_header("push_rows", [g + 1, [64, 128], []]), "lane_stale"),  # a generation never made
            (_rows_header("push_rows", [g, [size - 16, 128], []]), "lane_bounds"),  # ids past the end
            (_rows_header("push_rows", [g, [64, size - 64], []]), "lane_bounds"),  # rows past the end
            (_rows_header("push_rows", [g, [0, 128], []]), "lane_bounds"),  # ids over the segment's header
            (_rows_header("push_rows", [g, [64, 100], []]), "lane_bounds"),  # rows not aligned
            (_rows_header("push_rows", [g, [64, 128], []], count=1 << 20), "lane_bounds"),  # more than it holds
            (_rows_header("pull_rows", [g, [64], [size - 64]]), "lane_bounds"),  # the answer to go outside
            (_rows_header("pull_rows", [g, [size + 4096], [128]]), "lane_bounds"),
            (_rows_header("push_rows", [g, [64], []]), "protocol"),  # a push names ids and rows
            (_rows_header("pull_rows", [g, [64], []]), "protocol"),  # a pull names where its rows go
            (_rows_header("push_rows", [g, [64, -128], []]), "protocol"),
            (_rows_header("push_rows", [g, [64, 128]]), "protocol"),
            ({"op": "table_stats", "id": 9, "table": "t", "lane": [g, [], []]}, "protocol"),
        ]
        for header, code in cases:
            reply, _ = peer.ask(header)
            assert (reply["op"], reply.get("code")) == ("error", code), (header, reply)
        reply, _ = peer.ask(_rows_header("push_rows", [g, [64, 128], []]), (b"\0" * 32,))  # frames besides a lane
        assert reply.get("code") == "protocol"
        with psrt.Client(group.endpoints, config=ClientConfig(timeout=20, shm=False)) as c:
            c.init_embedding("t", dim=DIM, optimizer=psrt.SGD(lr=1.0), init="zeros")
            stats = c.stats()[0]
            assert stats["row_pushes"] == 0 and stats["table_rows"] == 0 and stats["shm_bytes_in"] == 0
            assert c.pull_rows("t", np.array([1, 2, 3, 4])).tolist() == [[0.0] * DIM] * 4, "nothing was applied"
        # A well-formed pair: the push's rows read from the segment, the pull's answer written into it.
        reply, frames = peer.ask(_rows_header("push_rows", [g, [64, 128], []]))
        assert reply["op"] == "ack" and frames == []
        reply, frames = peer.ask(_rows_header("pull_rows", [g, [64], [512]], id=10))
        assert (reply["op"], reply["lane"], reply["count"], frames) == ("rows", g, 4, [])
        assert peer.segment.array(512, np.dtype(np.float32), 4 * DIM).tolist() == [-1.0] * (4 * DIM)
    finally:
        peer.close()


def test_row_messages_over_a_lane_round_trip_without_frames():
    limits = ClientConfig().limits
    ref = wire.LaneRef(3, [64, 128], [])
    frames = wire.encode_push_rows(1, 0, 5, 2, "t", np.arange(4, dtype=np.int64), np.ones((4, 8), np.float32),
                                   lane=ref)
    assert len(frames) == 1
    req = wire.decode_request(frames, limits)
    assert (req.lane, req.lane_count, req.dim, len(req.ids)) == (ref, 4, 8, 0), "bound by the shard, not here"
    frames = wire.encode_pull_rows(2, 0, "t", 1, np.arange(4, dtype=np.int64), lane=wire.LaneRef(3, [64], [128]))
    req = wire.decode_request(frames, limits)
    assert (req.lane.outputs, req.lane_count) == ([128], 4)
    (head,) = wire.encode_rows(2, "t", 5, np.zeros((4, 8), np.float32), lane=3)
    assert wire.decode_reply(head, limits).lane == 3
    (head, _) = wire.encode_rows(2, "t", 5, np.zeros((4, 8), np.float32))
    assert wire.decode_reply(head, limits).lane is None


@pytest.fixture()
def one_lane_shard(monkeypatch):
    """A shard in this process keeping one lane, which a new worker's takes over at once."""
    monkeypatch.setattr(lanes, "MAX_LANES", 1)
    monkeypatch.setattr(lanes, "LANE_IDLE_S", 0.0)
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async", shm=True)) as server:
        yield server


def test_rows_whose_lane_the_shard_dropped_go_again_over_the_socket(one_lane_shard):
    """Two workers take each other's lane at every call: each refused row call is sent again over the socket."""
    config = ClientConfig(timeout=20)
    ids = np.arange(BATCH, dtype=np.int64)
    with psrt.Client([one_lane_shard.endpoint], config=config) as a, \
            psrt.Client([one_lane_shard.endpoint], config=config) as b:
        for c in (a, b):
            c.init_embedding("t", dim=DIM, optimizer=psrt.SGD(lr=1.0), init="zeros")
        for step in range(3):
            a.push_rows("t", ids, np.ones((BATCH, DIM), np.float32))
            b.push_rows("t", ids, np.ones((BATCH, DIM), np.float32))
            assert (a.pull_rows("t", ids) == -(2 * step + 2)).all()
            assert (b.pull_rows("t", ids) == -(2 * step + 2)).all()
    assert one_lane_shard.tables.pushes == 6


def test_a_shard_that_refuses_rows_over_lanes_gets_them_over_the_socket_from_then_on(monkeypatch):
    """A shard older than rows over lanes refuses the field (``protocol``): the call goes again over the socket,
    and later row calls to that shard no longer try the lane."""
    monkeypatch.setattr(wire.rows, "_LANE_AREAS", {})  # the shard's decoder knows no rows over lanes
    ids = np.arange(BATCH, dtype=np.int64)
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async", shm=True)) as server, \
            psrt.Client([server.endpoint], config=ClientConfig(timeout=20)) as c:
        c.init_embedding("t", dim=DIM, optimizer=psrt.SGD(lr=1.0), init="zeros")
        for step in range(3):
            c.push_rows("t", ids, np.ones((BATCH, DIM), np.float32))
            assert (c.pull_rows("t", ids) == -(step + 1)).all()
        assert server.counters.errors == 1, "one refusal, then sockets"


@pytest.mark.integration
def test_a_long_first_embedding_call_does_not_ask_whether_a_server_runs_there(shards, caplog):
    """A shard that took the connection but is busy making a large table is not reported as unreachable."""
    group = shards(1, mode="async")
    rows = np.zeros((1 << 20, DIM), np.float32)
    with caplog.at_level(logging.WARNING, logger="psrt.client"), \
            psrt.Client(group.endpoints, config=ClientConfig(timeout=60, warn_after=0.001)) as c:
        # The shard takes the connection first (a handshake the client's monitor has seen): 1 ms into a call whose
        # connection is not made yet, the client cannot tell a busy shard from none, and says so.
        deadline = time.monotonic() + 10
        while not c._calls._reached(0):
            assert time.monotonic() < deadline, "the shard never took the connection"
            time.sleep(0.01)
        c.init_embedding("big", dim=DIM, initial=rows)
    waits = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert waits, "the call took longer than warn_after"
    assert not any("is a psrt server running there" in m for m in waits), waits


def _sync_worker(endpoints: list[str], shm_on: bool, rank: int, pulled: list) -> None:
    config = ClientConfig(timeout=30, shm=shm_on)
    with psrt.Client(endpoints, rank=rank, num_workers=2, config=config) as c:
        c.init_embedding("t", dim=DIM, optimizer=psrt.AdaGrad(lr=0.1, eps=1e-10), std=0.1, seed=7)
        for ids, grads in _steps(seed=10 + rank, steps=3):
            c.push_rows("t", ids, grads)
            pulled.append(c.pull_rows("t", ids))  # waits for the round both workers' pushes joined


@pytest.mark.integration
def test_sync_rounds_over_lanes_give_bit_for_bit_what_sockets_give(shards):
    """Two workers of a sync job: each round's pulls wait, their answers gathered into the lane when it completes."""
    import threading

    results = {}
    for shm_on in (True, False):
        group = shards(2, workers=2, mode="sync")
        pulled: list[list] = [[], []]
        threads = [threading.Thread(target=_sync_worker, args=(group.endpoints, shm_on, r, pulled[r]))
                   for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert all(len(p) == 3 for p in pulled), "every worker finished its steps"
        with psrt.Client(group.endpoints, config=ClientConfig(timeout=20, shm=False)) as c:
            lane_bytes = sum(s["shm_bytes_out"] for s in c.stats())
        assert (lane_bytes > 0) == shm_on
        results[shm_on] = pulled
    for a, b in zip(results[True], results[False]):
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))
