"""Shard replication (``--replicas R``): the ring, the configuration, the control messages, the scheduler's
placement and the replication channel between shards.

Each test names the invariant of docs/architecture.md ("Replication") it checks:

- I1 ring: range k is held by shard k and the next R shards on the ring, R + 1 distinct shards (R < S).
- I2 one promoter: only the scheduler promotes, and only the first live holder of a range in ring order.
- I3 authenticated copies: a replica takes a copy only from the job's primary of that range (the job's token;
  with keys, over a connection with the job's server key).
- I4 held before answered: a round's replies (and a sync push's ack) go out only once every live replica acked it.
- I5 exactly once: a push whose round a replica holds is acknowledged there as a duplicate, never applied twice.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import numpy as np
import pytest
from _helpers import RawPeer, push_header

from psrt import wire
from psrt.config import ClusterConfig
from psrt.control.placement import Placement, check_job_replicas
from psrt.control.scheduler import Scheduler
from psrt.errors import ConfigError, ProtocolError, PsrtError
from psrt.partition import backed_ranges, check_replicas, range_holders, replica_ring
from psrt.wire import replication as wire_replication


# ---------------------------------------------------------------------------------------------- I1: the ring
@pytest.mark.parametrize("servers", [1, 2, 3, 5, 8])
def test_i1_ring_holders_are_r_plus_one_distinct_shards_and_backed_ranges_invert_the_ring(servers):
    for replicas in range(servers):
        held_by = {j: set() for j in range(servers)}
        for k in range(servers):
            holders = range_holders(servers, replicas, k)
            assert holders[0] == k and len(set(holders)) == replicas + 1
            assert holders[1:] == replica_ring(servers, replicas, k)
            for i, j in enumerate(holders[1:], start=1):
                assert backed_ranges(servers, replicas, j)[i - 1] == k
                held_by[j].add(k)
        # every shard backs exactly R ranges: the load of the copies is spread evenly
        assert all(len(ranges) == replicas for ranges in held_by.values())
        assert all(set(backed_ranges(servers, replicas, j)) == held_by[j] for j in range(servers))


def test_i1_ring_with_no_replicas_is_empty():
    assert replica_ring(3, 0, 1) == () and range_holders(3, 0, 1) == (1,) and backed_ranges(3, 0, 2) == ()


@pytest.mark.parametrize("replicas, servers, says", [
    (-1, 2, ">= 0"),
    (2, 2, "at most S - 1 = 1"),
    (5, 3, "at most S - 1 = 2"),
    (1, 1, "at most S - 1 = 0"),
    (True, 3, ">= 0"),
])
def test_i1_a_replica_count_no_ring_can_hold_is_refused_saying_what_holds(replicas, servers, says):
    with pytest.raises(ConfigError, match=says):
        check_replicas(replicas, servers)


def test_replication_is_refused_with_elastic():
    for mode in ("sync", "async", "ssp"):
        check_job_replicas(1, 2, mode, False)
    with pytest.raises(ConfigError, match="--elastic"):
        check_job_replicas(1, 2, "sync", True)
    check_job_replicas(0, 1, "async", True)  # no replicas: anything goes as before


# ---------------------------------------------------------------------------------------------- configuration
def test_replicas_come_from_psrt_replicas_and_default_to_zero():
    assert ClusterConfig.from_env({}).replicas == 0
    assert ClusterConfig.from_env({"PSRT_REPLICAS": "2"}).replicas == 2
    with pytest.raises(ConfigError, match="PSRT_REPLICAS"):
        ClusterConfig.from_env({"PSRT_REPLICAS": "-1"})


def test_the_scheduler_refuses_replicas_its_shards_cannot_hold():
    with pytest.raises(ConfigError, match="at most S - 1 = 1"):
        Scheduler("tcp://127.0.0.1:*", 2, 2, replicas=2)
    with pytest.raises(ConfigError, match="--elastic"):
        Scheduler("tcp://127.0.0.1:*", 2, 2, elastic=True, replicas=1)


# ---------------------------------------------------------------------------------------------- control messages
def test_an_unreplicated_jobs_register_and_table_are_unchanged_on_the_wire():
    register = wire.unpack_header(wire.encode_register(1, "server", "tcp://h:1", "h", -1)[0], wire.CONTROL_LIMITS)
    assert "replication" not in register
    table = wire.unpack_header(wire.encode_table(1, 0, 2, 2, "sync", ["tcp://h:1", "tcp://h:2"])[0],
                               wire.CONTROL_LIMITS)
    assert "replication" not in table
    assert wire.decode_control_reply(wire.encode_table(1, 0, 2, 2, "sync", ["tcp://h:1"])).replication is None


def test_a_replicated_jobs_register_table_and_ranges_round_trip():
    req = wire.decode_control_request(wire.encode_register(3, "server", "tcp://h:1", "h", -1,
                                                           replication=["tcp://h:2", "tcp://h:3"]))
    assert req.replication == ("tcp://h:2", "tcp://h:3")
    info = wire.Replication(1, ((0, 1), (1, 0)), (("tcp://h:2", "tcp://h:3"), ("tcp://h:4", "tcp://h:5")), "t0k")
    table = wire.decode_control_reply(wire.encode_table(4, 1, 2, 2, "sync", ["tcp://h:1", "tcp://h:6"],
                                                        replication=info))
    assert table.replication == info
    ranges = wire.decode_control_reply(wire.encode_ranges([[1], [1]]))
    assert isinstance(ranges, wire.Ranges) and ranges.holders == ((1,), (1,))


@pytest.mark.parametrize("bad", [["not-an-endpoint"], "tcp://h:1", [1]])
def test_malformed_replication_endpoints_are_a_protocol_error(bad):
    header = wire.unpack_header(wire.encode_register(3, "server", "tcp://h:1", "h", -1)[0], wire.CONTROL_LIMITS)
    header["replication"] = bad
    with pytest.raises(ProtocolError, match="replication"):
        wire.decode_control_request([wire.pack_header(header)])


def test_a_worker_announces_no_replication_endpoints():
    with pytest.raises(ProtocolError, match="only a server"):
        wire.decode_control_request(wire.encode_register(3, "worker", "", "h", -1, replication=["tcp://h:2"]))


# ---------------------------------------------------------------------------------------------- I2: placement
def test_i2_a_dead_primarys_range_goes_to_its_first_live_replica_and_nothing_else_moves():
    placement = Placement(4, 2)
    placement.endpoints = [[f"tcp://r{j}", f"tcp://s{j}-1", f"tcp://s{j}-2"] for j in range(4)]
    main = [f"tcp://m{j}" for j in range(4)]
    promoted, lost = placement.lose(1)
    assert promoted == [(1, 2)] and lost == []
    assert placement.holders == [[0, 2], [2, 3], [2, 3, 0], [3, 0]]
    assert placement.serving_endpoint(1, main) == "tcp://s2-1"  # shard 2 backs range 1 as its nearest
    assert placement.serving_endpoint(0, main) == "tcp://m0"
    promoted, lost = placement.lose(2)  # range 1's next holder in ring order takes it
    assert promoted == [(1, 3), (2, 3)] and lost == []
    assert placement.holders == [[0], [3], [3, 0], [3, 0]]
    assert placement.serving_endpoint(1, main) == "tcp://s3-2"
    assert placement.serving_endpoint(2, main) == "tcp://s3-1"


def test_i2_a_range_whose_every_copy_died_is_lost():
    placement = Placement(2, 1)
    assert placement.lose(0) == ([(0, 1)], [])
    assert placement.lose(1) == ([], [0, 1])


@pytest.mark.parametrize("argv", [["scheduler", "--replicas", "-1"], ["launch", "-s", "2", "-w", "1", "--replicas",
                                                                       "x", "--", "true"]])
def test_a_replica_count_that_is_no_whole_number_is_a_usage_error(argv, capsys):
    from psrt.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2 and "--replicas" in capsys.readouterr().err


def test_launch_refuses_more_replicas_than_its_shards_hold_before_starting_anything():
    from psrt.cluster import launch

    with pytest.raises(ConfigError, match="at most S - 1 = 1"):
        launch.launch(2, 1, ["true"], replicas=2)


# ---------------------------------------------------------------------------------------------- two shards on threads
def _pair(num_workers: int = 1, keys=None, send_timeout: float = 2.0, mode: str = "sync"):
    """A primary (rank 0) and its replica (rank 1) of a job of two shards with R = 1, on threads of this process,
    given the table a scheduler would give them."""
    from psrt.config import ServerConfig
    from psrt.shard.server import Server

    def make() -> Server:
        return Server(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=num_workers, keys=keys,
                                   send_timeout=send_timeout), scheduled=True)

    pair = [make(), make()]
    announced = tuple(s.prepare_replication(1) for s in pair)
    info = wire.Replication(1, ((0, 1), (1, 0)), announced, "the-job-token")
    for rank, shard in enumerate(pair):
        shard.join(wire.Table(0, rank, 2, num_workers, mode, [s.endpoint for s in pair], replication=info,
                              staleness=num_workers if mode == "ssp" else 0))
    threads = [threading.Thread(target=s.serve, daemon=True) for s in pair]
    for t in threads:
        t.start()
    return pair, threads, announced


def _close(pair, threads) -> None:
    for s in pair:
        s.stop()
    for t in threads:
        t.join(10)
    for s in pair:
        s.close()


def _copy(token: str = "the-job-token", sender: int = 0, rng: int = 0, rid: int = 5) -> list:
    from psrt.optim import SGD
    from psrt.shard.store import Store

    store = Store("sync", 2)
    entry = store.create(("w", 0), np.arange(4, dtype=np.float32), SGD(lr=0.1, momentum=0.9))
    entry.version = 3
    entry.slots["momentum_buffer"][:] = [4, 5, 6, 7]
    return wire_replication.encode_replicate(rid, token, sender, rng, [(0, 77, 2)], [(("w", 0), entry)])


def _reply(peer) -> dict:
    assert peer.answered(5.0), "the replica did not answer"
    return peer.recv()[0]


@pytest.mark.parametrize("copy, code", [
    (dict(token="another-job"), "not_job"),
    (dict(sender=1), "not_primary"),  # the replica itself is not range 0's primary
    (dict(rng=1), "not_backed"),  # with S = 2, R = 1 shard 1 backs range 0 alone
])
def test_i3_a_replica_refuses_a_copy_not_from_its_jobs_primary_and_changes_nothing(copy, code):
    pair, threads, announced = _pair()
    try:
        standby = pair[1]._replication._standbys[0]
        with RawPeer(announced[1][0]) as peer:
            peer.send([bytes(f) if not isinstance(f, bytes) else f for f in _copy(**copy)])
            reply = _reply(peer)
            assert reply["op"] == "error" and reply["code"] == code, reply
            assert standby.store.entries == {} and standby.store.workers == {}
            # the job's primary, with the job's token: taken
            peer.send([bytes(f) if not isinstance(f, bytes) else f for f in _copy()])
            assert _reply(peer)["op"] == "replicated"
        entry = standby.store.entries[("w", 0)]
        assert entry.version == 3 and entry.param.tolist() == [0, 1, 2, 3]
        assert entry.slots["momentum_buffer"].tolist() == [4, 5, 6, 7]
        assert (standby.store.workers[0].session, standby.store.workers[0].last_seq) == (77, 2)
    finally:
        _close(pair, threads)


def test_i3_a_copy_carries_the_replay_window_so_a_push_overtaken_before_a_failover_is_still_taken():
    from psrt.config import WireLimits
    from psrt.optim import SGD
    from psrt.shard.replay import WorkerLog
    from psrt.shard.store import Store

    log = WorkerLog(77)
    for q in (0, 1, 3, 5):  # 2 and 4 overtaken (sent again later, after the failover)
        log.take(q)
    settled, holes = log.settled(5)  # 5 is in an open round: not settled
    store = Store("sync", 2)
    entry = store.create(("w", 0), np.arange(4, dtype=np.float32), SGD(lr=0.1))
    runs = {0: WorkerLog(77, settled, holes).hole_runs()}
    frames = wire_replication.encode_replicate(5, "the-job-token", 0, 0, [(0, 77, settled), (1, 78, 3)],
                                               [(("w", 0), entry)], holes=runs)
    req = wire_replication.decode_replicate([bytes(f) for f in frames], WireLimits())
    assert req.workers == [(0, 77, 4), (1, 78, 3)] and req.holes == {0: [[2, 1], [4, 1]]}
    pair, threads, announced = _pair()
    try:
        standby = pair[1]._replication._standbys[0]
        with RawPeer(announced[1][0]) as peer:
            peer.send([bytes(f) for f in frames])
            assert _reply(peer)["op"] == "replicated"
        assert [q for q in range(7) if standby.store.is_duplicate(0, 77, q)] == [0, 1, 3]
        assert [q for q in range(5) if standby.store.is_duplicate(1, 78, q)] == [0, 1, 2, 3]  # no holes: all in
    finally:
        _close(pair, threads)


def test_i5_a_keys_included_pushes_carry_their_holes_so_a_later_one_held_says_nothing_of_an_earlier_one():
    from psrt.config import WireLimits
    from psrt.optim import SGD
    from psrt.shard.replication import holds, replayed
    from psrt.shard.store import Store

    store = Store("sync", 2)
    entries = [(("a", 0), store.create(("a", 0), np.zeros(2, np.float32), SGD(lr=0.1))),
               (("b", 0), store.create(("b", 0), np.zeros(2, np.float32), SGD(lr=0.1)))]
    frames = wire_replication.encode_replicate(5, "the-job-token", 0, 0, [(0, 77, 0), (1, 78, 3)], entries,
                                               [{0: (6, [[2, 1], [4, 2]]), 1: 3}, {0: 6, 1: (3, [])}])
    header = wire.unpack_header(bytes(frames[0]), WireLimits())
    assert header["included"] == [[[0, 6, [[2, 1], [4, 2]]], [1, 3]], [[0, 6], [1, 3]]]  # in order: two numbers
    req = wire_replication.decode_replicate([bytes(f) for f in frames], WireLimits())
    assert req.included == [{0: 6, 1: 3}, {0: 6, 1: 3}] and req.included_holes == [{0: [[2, 1], [4, 2]]}, {}]
    held = (6, [[2, 1], [4, 2]])
    assert [q for q in range(9) if holds(held, q)] == [0, 1, 3, 6]
    assert [q for q in range(9) if holds(6, q)] == list(range(7))  # no holes: every push up to 6, as before
    assert not holds(None, 0)
    sessions = {0: 77, 1: 78}
    included = {("a", 0): (sessions, {0: held}), ("b", 0): (sessions, {0: 6})}
    assert replayed(included, 0, 77, 4, [("a", 0), ("b", 0), ("c", 0)]) == {1}
    assert replayed(included, 0, 77, 3, [("a", 0), ("b", 0)]) == {0, 1}
    assert replayed(included, 1, 78, 0, [("a", 0), ("b", 0)]) == set()
    assert replayed(included, 0, 79, 3, [("a", 0), ("b", 0)]) == set()  # worker 0 restarted: a new session
    # An older psrt's copy (two numbers a worker, no holes) decodes with the meaning it had.
    header["included"] = [[[0, 6]], [[0, 6]]]
    old = wire_replication.decode_replicate([wire.pack_header(header), *[bytes(f) for f in frames[1:]]], WireLimits())
    assert old.included == [{0: 6}, {0: 6}] and old.included_holes == [{}, {}]
    for bad in ([[0, 6, [[1]]]], [[0, 6, "x"]], [[0, 6, [], 1]], [[0, 6, [[-1, 1]]]]):
        header["included"] = [bad, []]
        with pytest.raises(ProtocolError, match="included"):
            wire_replication.decode_replicate([wire.pack_header(header), *[bytes(f) for f in frames[1:]]],
                                              WireLimits())


def test_what_a_key_holds_of_a_worker_is_the_union_of_what_it_was_copied_and_what_its_rounds_took():
    from psrt.shard.replay import WorkerLog
    from psrt.shard.replication import _union

    def held(h) -> list[int]:
        last, holes = h if type(h) is tuple else (h, 0)
        return [q for q in range(12) if WorkerLog(0, last, holes).applied(q)]

    window = WorkerLog(0)
    for q in (0, 1, 3, 6):
        window.take(q)
    copied = (window.last_seq, window.holes)  # holds 0, 1, 3, 6 (not 2, 4, 5)
    assert held(_union(None, copied)) == [0, 1, 3, 6]
    assert held(_union(copied, 4)) == [0, 1, 2, 3, 4, 6]  # the range's new server took 0 .. 4 in order
    assert held(_union(4, copied)) == [0, 1, 2, 3, 4, 6]
    assert held(_union(copied, (5, 0b110))) == [0, 1, 2, 3, 5, 6]  # (5, 0b110) holds 0, 1, 2 and 5
    assert _union(3, 5) == _union(5, 3) == 5
    assert _union(copied, 6) == 6  # holes all filled: an int again, as in order


def test_a_worker_that_restarted_has_nothing_held_of_its_old_session():
    from types import SimpleNamespace

    from psrt.config import ServerConfig
    from psrt.shard.replication import Copier
    from psrt.shard.store import Store

    store = Store("sync", 2)
    copier = Copier(SimpleNamespace(store=store, config=ServerConfig()), None, None, 0, 0, "t", (), lambda: False)
    keys = [("a", 0), ("b", 0)]
    for q in range(5):
        store.record(0, 77, q)
        copier.joined(0, q, keys, [0, 1])
    assert copier._holds == {("a", 0): {0: 4}, ("b", 0): {0: 4}}
    store.record(0, 78, 0)  # restarted: a new session, numbered from 0
    copier.joined(0, 0, keys[:1], [0])
    assert copier._holds == {("a", 0): {0: 0}, ("b", 0): {}}  # (b's 4 was of the old session)


def test_i4_the_primary_copies_a_push_overtaken_by_a_later_one_as_not_applied_until_it_is():
    from psrt.config import ClientConfig
    from psrt.optim import SGD
    from psrt.worker.client import Client

    pair, threads, _ = _pair()
    primary, replica = pair
    standby = replica._replication._standbys[0]
    try:
        with Client(servers=[primary.endpoint], rank=0, num_workers=1, config=ClientConfig(timeout=10)) as client:
            client.init({"w": np.zeros(4, np.float32)}, optimizer=SGD(lr=1.0))
            with RawPeer(primary.endpoint) as peer:
                def push(seq: int) -> dict:
                    frames = wire.encode(push_header(worker=0, session=77, seq=seq), [np.ones(4, np.float32)])
                    reply = peer.ask([bytes(f) for f in frames], timeout=10.0)[0]
                    assert reply["op"] == "ack", reply
                    return reply

                push(0)
                push(2)  # 1 overtaken
                assert [q for q in range(4) if standby.store.is_duplicate(0, 77, q)] == [0, 2]
                assert push(1)["duplicate"] is False
                assert [q for q in range(4) if standby.store.is_duplicate(0, 77, q)] == [0, 1, 2]
            assert standby.store.entries[("w", 0)].version == primary.store.entries[("w", 0)].version == 3
    finally:
        _close(pair, threads)


def test_i3_a_malformed_copy_is_refused_with_a_protocol_error():
    pair, threads, announced = _pair()
    try:
        frames = [bytes(f) if not isinstance(f, bytes) else f for f in _copy()]
        with RawPeer(announced[1][0]) as peer:
            peer.send(frames[:-1])  # a slot's frame missing
            reply = _reply(peer)
            assert reply["op"] == "error" and reply["code"] == "protocol", reply
        assert pair[1]._replication._standbys[0].store.entries == {}
    finally:
        _close(pair, threads)


def test_i3_with_keys_only_the_jobs_server_key_reaches_the_replication_channel(tmp_path):
    from psrt.control.security import keygen, load_keys
    from psrt.shard.replication import peer_keys

    keygen(tmp_path / "keys")
    pair, threads, announced = _pair(keys=tmp_path / "keys")
    try:
        frames = [bytes(f) if not isinstance(f, bytes) else f for f in _copy()]
        with RawPeer(announced[1][0], keys=load_keys(tmp_path / "keys")) as worker:  # a worker's client pair
            worker.send(frames)
            assert not worker.answered(1.5)  # the handshake is refused: the message never arrives
        assert pair[1]._replication.copies_refused == 0
        with RawPeer(announced[1][0], keys=peer_keys(tmp_path / "keys")) as shard:  # the job's server pair
            shard.send(frames)
            assert _reply(shard)["op"] == "replicated"
    finally:
        _close(pair, threads)


def test_i4_a_round_is_answered_only_once_the_replica_holds_it_and_the_copy_is_exact():
    from psrt.config import ClientConfig
    from psrt.errors import ShardTimeoutError
    from psrt.optim import SGD
    from psrt.worker.client import Client

    pair, threads, _ = _pair(send_timeout=3.0)
    primary, replica = pair
    standby = replica._replication._standbys[0]
    try:
        with Client(servers=[primary.endpoint], rank=0, num_workers=1, config=ClientConfig(timeout=10)) as client:
            client.init({"w": np.linspace(0, 1, 5000, dtype=np.float32)}, optimizer=SGD(lr=0.1, momentum=0.9))
            assert standby.store.entries[("w", 0)].version == 0  # the init is held twice before it is answered
            for step in range(3):
                params = client.push_pull({"w": np.full(5000, step + 1, np.float32)})
                held, copy = primary.store.entries[("w", 0)], standby.store.entries[("w", 0)]
                assert copy.version == held.version == step + 1
                assert np.array_equal(copy.param, params["w"]) and np.array_equal(copy.param, held.param)
                assert np.array_equal(copy.slots["momentum_buffer"], held.slots["momentum_buffer"])
                assert standby.store.workers[0].last_seq == primary.store.workers[0].last_seq
            client.push({"w": np.ones(5000, np.float32)})  # a sync push's ack waits for the copy too
            assert standby.store.entries[("w", 0)].version == 4
            replica._replication._stop.set()  # the replica stops taking copies (it is not declared dead)
            replica._replication._thread.join(5)
            with pytest.raises(ShardTimeoutError):
                client.push_pull({"w": np.ones(5000, np.float32)}, timeout=1.0)  # not answered: not held twice
            assert standby.store.entries[("w", 0)].version == 4
    finally:
        _close(pair, threads)



@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_replicated_jobs_acks_say_nothing_of_when_a_push_came_and_its_init_says_replicated(mode):
    """A replicated job's push acks carry no ``taken``/``held`` (a sync push's ack waits for its round, so a
    pipeline pacing by them could hold back the very push another worker's held ack waits for), and its answer to
    ``init`` says ``replicated``: a sync job's pipeline then holds nothing back there (``holding_shards``). The
    same pushes to a job without replicas are timed (tests/test_server.py)."""
    from psrt.config import ClientConfig
    from psrt.optim import SGD
    from psrt.worker.client import Client

    pair, threads, _ = _pair(mode=mode)
    primary = pair[0]
    peer = RawPeer(primary.endpoint)
    try:
        with Client(servers=[primary.endpoint], rank=0, num_workers=1, config=ClientConfig(timeout=10)) as client:
            client.init({"w": np.zeros(4, np.float32)}, optimizer=SGD(lr=1.0))
            assert client.holding_shards == (frozenset({0}) if mode == "sync" else frozenset())
            for seq in range(2):
                ack, _ = peer.ask([bytes(f) for f in wire.encode(push_header(worker=0, session=7, seq=seq),
                                                                 [np.ones(4, np.float32)])])
                assert ack["op"] == "ack" and ack["duplicate"] is False, ack
                assert "taken" not in ack and "held" not in ack, ack
            np.testing.assert_array_equal(client.pull()["w"], np.full(4, -2.0, np.float32))
    finally:
        peer.close()
        _close(pair, threads)

def _early_came(client) -> bool:
    """Whether every call of ``client`` in flight has its parameters, sent before the replicas held them."""
    pending = client._calls._pending.values()
    return bool(pending) and all(p.early is not None for p in pending)


def test_i4_a_sync_rounds_copy_is_not_awaited_by_the_next_ones_and_no_reply_goes_before_its_own_is_held():
    """Pipelined copies: a sync round's copy is sent and the primary serves on, so the next round (the next piece of
    a tensor, here another key) is copied while the first one's copy is still unacknowledged; the push_pulls'
    parameters go at once, marked not held, and their calls end only on the held notice that follows once the
    replica holds that round; then they are exact."""
    from psrt.config import ClientConfig
    from psrt.optim import SGD
    from psrt.worker.client import Client

    pair, threads, _ = _pair(num_workers=2, send_timeout=30.0)
    primary, replica = pair
    standby = replica._replication._standbys[0]
    copier = primary._replication.copier
    clients = [Client(servers=[primary.endpoint], rank=r, num_workers=2, config=ClientConfig(timeout=30))
               for r in range(2)]
    try:
        for client in clients:
            client.init({"w": np.zeros(1000, np.float32), "b": np.zeros(10, np.float32)}, optimizer=SGD(lr=1.0))
        _pause_copies(replica)
        handles = [(c.push_pull_async({"w": np.full(1000, r + 1, np.float32)}),
                    c.push_pull_async({"b": np.full(10, r + 3, np.float32)})) for r, c in enumerate(clients)]
        deadline = time.monotonic() + 10
        while len(copier._flights) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(copier._flights) == 2, "the second round was not copied while the first one's copy waited"
        assert primary.store.entries[("b", 0)].version == 1  # both rounds stepped on the primary ...
        deadline = time.monotonic() + 10
        while not all(_early_came(c) for c in clients) and time.monotonic() < deadline:
            assert not any(h.done() for pair_ in handles for h in pair_)  # none answered: the replica holds neither
            time.sleep(0.01)
        assert all(_early_came(c) for c in clients)  # ... though their parameters came already (early data)
        assert not any(h.done() for pair_ in handles for h in pair_)
        assert standby.store.entries[("w", 0)].version == 0
        _resume_copies(replica)
        for first, second in handles:
            w, b = first.wait(30)["w"], second.wait(30)["b"]
            for key, got in ((("w", 0), w), (("b", 0), b)):
                entry, copy = primary.store.entries[key], standby.store.entries[key]
                assert entry.version == copy.version == 1
                assert np.array_equal(copy.param, entry.param) and np.array_equal(got, entry.param)
            assert w[0] == -1.5 and b[0] == -3.5  # (a round steps by the mean of its pushes)
        assert all(standby.store.workers[r].last_seq == primary.store.workers[r].last_seq for r in range(2))
        assert not copier._flights and not primary.replies.gated
    finally:
        for client in clients:
            client.close()
        _close(pair, threads)


def test_i4_i5_a_primary_dying_between_its_early_parameters_and_their_notice_leaves_the_calls_unanswered():
    """The early parameters of a round came, its held notice never does (the primary dies): the workers' calls stay
    unanswered, go again to the promoted replica, and end there with the exact result, the push applied once."""
    from psrt.config import ClientConfig
    from psrt.optim import SGD
    from psrt.worker.client import Client

    pair, threads, announced = _pair(num_workers=2, send_timeout=30.0)
    primary, replica = pair
    standby = replica._replication._standbys[0]
    clients = [Client(servers=[primary.endpoint], rank=r, num_workers=2, config=ClientConfig(timeout=30, shm=False))
               for r in range(2)]
    try:
        for client in clients:
            client.init({"w": np.zeros(1000, np.float32)}, optimizer=SGD(lr=1.0))
        _pause_copies(replica)
        handles = [c.push_pull_async({"w": np.full(1000, r + 1, np.float32)}) for r, c in enumerate(clients)]
        deadline = time.monotonic() + 10
        while not all(_early_came(c) for c in clients) and time.monotonic() < deadline:
            assert not any(h.done() for h in handles)  # (takes in what came, never blocks)
            time.sleep(0.01)
        assert all(_early_came(c) for c in clients) and not any(h.done() for h in handles)
        primary.stop()  # dies before the replica acknowledged the round: no notice
        threads[0].join(10)
        _resume_copies(replica)  # it takes the copy queued there, whose answer nobody reads
        deadline = time.monotonic() + 10
        while standby.store.entries[("w", 0)].version < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        replica._replication.on_ranges(wire.Ranges(0, ((1,), (1,))))  # the scheduler's word: shard 1 serves
        for client in clients:
            client._calls._moves = {0: (announced[1][1], True)}  # as the scheduler's moved notice fills it
        deadline = time.monotonic() + 30
        while not all(h.done() for h in handles) and time.monotonic() < deadline:  # (each client sends again)
            time.sleep(0.01)
        for h in handles:
            assert h.wait(0)["w"].tolist() == [-1.5] * 1000  # the mean of the two pushes, applied once
        copy = standby.store.entries[("w", 0)]
        assert copy.version == 1 and copy.param.tolist() == [-1.5] * 1000
        assert standby.counters.duplicates == 2  # the copy came before the promotion: both sent again, not applied
    finally:
        for client in clients:
            client.close()
        _close(pair, threads)


def _pause_copies(shard) -> None:
    """The replica stops taking copies (it is not declared dead: its primary waits for it)."""
    shard._replication._stop.set()
    shard._replication._thread.join(5)


def _resume_copies(shard) -> None:
    replication = shard._replication
    replication._stop.clear()
    replication._thread = threading.Thread(target=replication._serve_copies, daemon=True)
    replication._thread.start()


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_i4_async_pushes_queued_together_share_one_copy_and_none_is_answered_before_the_replica_holds_it(mode):
    """Group commit: pushes the primary's loop finds queued together are copied once, at the batch's end (each key
    once, with its latest state and every worker's settled seq); none of them, nor a push_pull's parameters, is
    answered before the replica acknowledged that copy. A lone push is copied (and answered) at once."""
    from psrt.config import ClientConfig
    from psrt.optim import SGD
    from psrt.worker.client import Client

    workers = 6
    pair, threads, _ = _pair(num_workers=workers, send_timeout=30.0, mode=mode)
    primary, replica = pair
    standby = replica._replication._standbys[0]
    clients = [Client(servers=[primary.endpoint], rank=r, num_workers=workers,
                      config=ClientConfig(timeout=30)) for r in range(workers)]
    try:
        for client in clients:
            client.init({"w": np.zeros(1000, np.float32), "b": np.zeros(10, np.float32)}, optimizer=SGD(lr=1.0))
        before = primary.stats()["copies_sent"]
        _pause_copies(replica)
        held: dict[int, bool] = {}
        answers: dict[int, dict] = {}

        def push(r: int) -> None:
            grads = {"w": np.full(1000, r + 1, np.float32), "b": np.full(10, r + 1, np.float32)}
            if r % 2:
                answers[r] = clients[r].push_pull(grads)
            else:
                clients[r].push(grads)
            held[r] = r in standby.store.workers  # (the replica's state, the moment the answer came)

        pushers = [threading.Thread(target=push, args=(r,), daemon=True) for r in range(workers)]
        for t in pushers:
            t.start()
        deadline = time.monotonic() + 10
        while primary.counters.pushes < 1 and time.monotonic() < deadline:  # the first push, applied
            time.sleep(0.01)
        time.sleep(0.5)  # (the others reach the primary's queue behind it, while its copy waits)
        assert not held, "a push was answered while the replica held no copy of it"
        _resume_copies(replica)
        for t in pushers:
            t.join(30)
        assert len(held) == workers and all(held.values()), held
        # The first push alone (its copy went at once), then every push queued behind it in one copy.
        assert primary.stats()["copies_sent"] - before <= 2
        for key in (("w", 0), ("b", 0)):
            entry, copy = primary.store.entries[key], standby.store.entries[key]
            assert entry.version == copy.version == workers
            assert np.array_equal(entry.param, copy.param)
            assert entry.param[0] == -sum(range(1, workers + 1))
        assert all(standby.store.workers[r].last_seq == primary.store.workers[r].last_seq for r in range(workers))
        for r, params in answers.items():  # each push_pull's parameters hold its own push (and are whole)
            assert params["w"][0] <= -(r + 1) and np.all(params["w"] == params["w"][0])
        lone = primary.stats()["copies_sent"]
        clients[0].push({"w": np.ones(1000, np.float32), "b": np.ones(10, np.float32)})
        assert primary.stats()["copies_sent"] == lone + 1
        assert standby.store.entries[("w", 0)].version == workers + 1
    finally:
        for client in clients:
            client.close()
        _close(pair, threads)


def test_i4_the_shards_count_the_bytes_of_the_copies_they_send_and_take():
    """The replica bytes per round (bench/chaos.py's replication overhead) come from these counters: a sync round's
    copy carries the stepped parameters and optimizer slots once (not each worker's gradient), plus a header."""
    from psrt.config import ClientConfig
    from psrt.optim import SGD
    from psrt.worker.client import Client

    pair, threads, _ = _pair()
    primary, replica = pair
    try:
        with Client(servers=[primary.endpoint], rank=0, num_workers=1, config=ClientConfig(timeout=10)) as client:
            client.init({"w": np.zeros(5000, np.float32)}, optimizer=SGD(lr=0.1, momentum=0.9))
            after_init = primary.stats()["copy_bytes_sent"]
            for _ in range(3):
                client.push_pull({"w": np.ones(5000, np.float32)})
        sent, taken = primary.stats()["copy_bytes_sent"], replica.stats()["copy_bytes_taken"]
        per_round = (sent - after_init) / 3
        assert 2 * 5000 * 4 <= per_round < 2 * 5000 * 4 + 4096  # parameters and the momentum slot, and a header
        assert sent == taken and after_init > 0
    finally:
        _close(pair, threads)


# ---------------------------------------------------------------------------------------------- real processes
def _sync_job(tmp_path, name: str, kills=(), steps: int = 120, env=None, servers: int = 2,
              replicas: int = 1, checkpoints=None, stats: Optional[list] = None, role: str = "replicated",
              args: Optional[dict] = None) -> tuple[list[dict], str]:
    """A sync job, S = ``servers``, W = 2, R = ``replicas``, of ``replicated`` workers (SGD with momentum,
    deterministic gradients); ``kills``: ``(step, rank)`` pairs, the shard of that rank SIGKILLed once worker 0
    finished that step. Returns the workers' results (their final parameters loaded) and the scheduler's output;
    ``stats`` gets what ``psrt stats`` printed 30 steps after the last kill; ``role`` and ``args``: another worker
    of ``tests/_workers.py`` that prints ``step N`` and saves its final parameters in ``out``."""
    import io
    import signal

    from _helpers import finish_worker, start_worker, stop_workers

    from psrt.cluster.stats import watch
    from psrt.control.process import SCHEDULER_READY, SERVER_READY, Child, psrt_command

    env = dict(env or {})
    sched = Child(psrt_command("scheduler", "--bind", "tcp://127.0.0.1:*", "--servers", str(servers), "--workers",
                               "2", "--replicas", str(replicas)), label="scheduler", ready=SCHEDULER_READY, env=env)
    children, procs, results = [sched], [], []
    try:
        endpoint = sched.wait_ready(30).group(1)
        serve = ("server", "--scheduler", endpoint) + (("--checkpoint-dir", str(checkpoints)) if checkpoints else ())
        children += [Child(psrt_command(*serve), label=f"shard {i}", ready=SERVER_READY, env=env)
                     for i in range(servers)]
        procs = [start_worker(role, env={**env, "PSRT_SCHEDULER": endpoint, "PSRT_WORKER_ID": str(r)},
                              steps=steps, step_s=0.01, out=str(tmp_path / f"{name}-{r}.npz"), **(args or {}))
                 for r in range(2)]
        ready = [c.wait_ready(30) for c in children[1:]]
        for kill_at, rank in kills:  # rank None: a new server joins the job then
            for line in procs[0].stdout:
                if line.strip() == f"step {kill_at}":
                    break
            if rank is None:  # (and it holds the ranges it backs, by a full copy from each, before the next kill)
                children.append(Child(psrt_command(*serve), label="joined", ready=SERVER_READY, env=env))
                try:
                    ready.append(children[-1].wait_ready(60))
                except PsrtError as exc:
                    raise AssertionError("\n".join(f"[{c.label}] {c.output}" for c in children)) from exc
                deadline = time.monotonic() + 30
                while "holds range" not in children[-1].output and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert "holds range" in children[-1].output, children[-1].output
                continue
            alive = [i + 1 for i, m in enumerate(ready)
                     if f" rank={rank}" in m.string and children[i + 1].poll() is None]
            assert alive, "\n".join(f"[{c.label}] {c.output}" for c in children)
            children[alive[0]].signal(signal.SIGKILL)
        if stats is not None and kills:
            for line in procs[0].stdout:
                if line.strip() == f"step {kills[-1][0] + 30}":
                    break
            printed = io.StringIO()
            assert watch(endpoint, interval=0.2, count=2, out=printed) == 0
            stats.append(printed.getvalue())
        for r, p in enumerate(procs):
            result, err = finish_worker(p, 120)  # exit 0: no worker saw an error
            assert "Traceback" not in err, err
            result["params"] = dict(np.load(tmp_path / f"{name}-{r}.npz"))
            results.append(result)
        assert sched.wait(30) == 0, sched.output
    finally:
        stop_workers(procs)
        for c in children:
            c.stop()
    return results, sched.output


@pytest.mark.integration
def test_i5_a_sigkilled_shard_loses_nothing_and_stops_nobody(tmp_path):
    """The issue's target: SIGKILL one shard of a sync job (S = 2, W = 2, R = 1, SGD with momentum) mid-run; every
    step completes, no worker sees an error, and the final parameters are bit-identical to a failure-free run's
    (I4: no acknowledged round is lost; I5: no push is applied twice; I2: the replica was promoted)."""
    fast = {"PSRT_HEARTBEAT_INTERVAL": "0.2", "PSRT_HEARTBEAT_TIMEOUT": "1.0"}
    clean, _ = _sync_job(tmp_path, "clean", env=fast)
    printed: list[str] = []
    failed, sched = _sync_job(tmp_path, "failover", kills=[(40, 0)], env=fast, checkpoints=tmp_path / "ckpt",
                              stats=printed)
    assert "key range 0 is served by its replica, server 1" in sched, sched
    assert "range 0: shard 1 (" in printed[0] and "range 1: shard 1 (" in printed[0], printed  # psrt stats says
    # psrt checkpoint still works: the range taken over writes rank 0's checkpoints, here its final one at the end
    from psrt.config import ClientConfig
    from psrt.partition import PartitionMap
    from psrt.shard.checkpoint import load_latest

    saved = load_latest(tmp_path / "ckpt", "rank-0").store.entries
    specs = {n: (a.shape, a.dtype) for n, a in failed[0]["params"].items()}  # the workers' map (loopback)
    chunks = {c.key: c for c in PartitionMap(2, ClientConfig().partition_bytes, network=False).add(specs)}
    assert set(saved) == {k for k, c in chunks.items() if c.shard == 0}
    for key, entry in saved.items():
        assert entry.version == 120
        assert np.array_equal(entry.param, chunks[key].of(failed[0]["params"][key[0]]))
    for a, b in zip(clean, failed):
        assert a["steps"] == b["steps"] == 120
        assert a["params"].keys() == b["params"].keys()
        for name in a["params"]:
            assert np.array_equal(a["params"][name], b["params"][name]), name
    assert max(r["max_gap"] for r in failed) < 15.0  # heartbeat timeout + promotion: a "does not hang" bound
    print(f"failover: longest step {max(r['max_gap'] for r in failed):.2f}s (heartbeat timeout 1.0s), "
          f"failure-free {max(r['max_gap'] for r in clean):.3f}s")


@pytest.mark.parametrize("replicated, code", [(True, 0), (False, 137)])
@pytest.mark.integration
def test_launch_goes_on_when_a_server_of_a_replicated_job_dies(replicated, code):
    """psrt launch ends an unreplicated job when a server dies, but leaves a replicated one to its scheduler (which
    promotes the replicas, or fails the job itself when a range lost every copy)."""
    import io
    import sys
    import threading

    from psrt.cluster.launch import _supervise
    from psrt.control.process import Child

    out, lock = io.StringIO(), threading.Lock()
    py = sys.executable
    sched = Child([py, "-c", "import time; time.sleep(1.5)"], label="scheduler", out=out, lock=lock)
    server = Child([py, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], label="server 0", out=out,
                   lock=lock)
    worker = Child([py, "-c", "import time; time.sleep(1.0)"], label="worker 0", out=out, lock=lock)
    procs = [sched, server, worker]
    try:
        assert _supervise(sched, [server], [worker], procs, out, lock, replicated=replicated) == code
    finally:
        for p in procs:
            p.stop()
    if replicated:
        assert "server 0" in out.getvalue() and "its key ranges are served by their replicas" in out.getvalue()


def test_stats_shows_each_key_ranges_primary_and_replicas():
    from _helpers import scheduling

    from psrt.cluster.stats import format_ranges, job_table
    from psrt.config import ClientConfig

    with scheduling(servers=3, workers=1, replicas=2) as sched:
        table = job_table(sched.endpoint, ClientConfig())
    assert table.replication.replicas == 2 and table.replication.token == ""  # no token for a monitor
    assert table.replication.holders == ((0, 1, 2), (1, 2, 0), (2, 0, 1))
    after = wire.Table(0, -1, 3, 1, "sync", ["tcp://a:1", "tcp://b:2", "tcp://b:3"],
                       replication=wire.Replication(2, ((1, 2), (1, 2), (2,)), ()))
    assert format_ranges(after).splitlines()[1:] == [
        "  range 0: shard 1 (tcp://a:1), replicas: shard 2",
        "  range 1: shard 1 (tcp://b:2), replicas: shard 2",
        "  range 2: shard 2 (tcp://b:3), replicas: none left"]
    assert format_ranges(wire.Table(0, -1, 1, 1, "sync", ["tcp://a:1"])) == ""


@pytest.mark.integration
def test_i2_i5_two_successive_deaths_with_two_replicas_lose_nothing(tmp_path):
    """S = 3, R = 2: shard 1 dies (shard 2 takes range 1 over and copies it on to shard 0), then shard 2 dies
    (shard 0 takes ranges 1 and 2 over, from copies the promoted shard 2 made): bit-identical to no failure."""
    fast = {"PSRT_HEARTBEAT_INTERVAL": "0.2", "PSRT_HEARTBEAT_TIMEOUT": "1.0"}
    clean, _ = _sync_job(tmp_path, "clean", env=fast, servers=3, replicas=2)
    failed, sched = _sync_job(tmp_path, "twice", kills=[(30, 1), (80, 2)], env=fast, servers=3, replicas=2)
    assert "key range 1 is served by its replica, server 2" in sched, sched
    assert "key range 1 is served by its replica, server 0" in sched, sched
    assert "key range 2 is served by its replica, server 0" in sched, sched
    for a, b in zip(clean, failed):
        assert a["steps"] == b["steps"] == 120
        for name in a["params"]:
            assert np.array_equal(a["params"][name], b["params"][name]), name


def test_i2_a_forged_promotion_promotes_nothing():
    """A promotion is a ``ranges`` notice on the scheduler's link alone: the same message on a shard's data plane
    or on its replication channel is a protocol error, and a notice naming a shard first for a range it does not
    back, or for another number of ranges, makes it serve nothing new."""
    pair, threads, announced = _pair()
    replication = pair[1]._replication
    try:
        forged = [bytes(f) for f in wire.encode_ranges([[1], [1]])]
        for endpoint in (pair[1].endpoint, announced[1][0]):
            with RawPeer(endpoint) as peer:
                peer.send(forged)
                reply = _reply(peer)
                assert reply["op"] == "error" and reply["code"] == "protocol", reply
        replication.on_ranges(wire.Ranges(0, ((0,), (1,), (1,))))  # three ranges in a job of two
        replication.on_ranges(wire.Ranges(0, ((0, 1), (1,))))  # range 1 is shard 1's own: nothing to take over
        time.sleep(0.3)
        assert replication.serving_ranges() == [1] and replication.holders == ((0, 1), (1,))
        assert not replication._serving  # no standby serves
    finally:
        _close(pair, threads)


@pytest.mark.parametrize("mode", ["async", "ssp"])
@pytest.mark.integration
def test_i4_i5_async_a_sigkilled_shard_loses_no_acknowledged_push_and_applies_none_twice(tmp_path, mode):
    """Async and ssp modes, S = 2, W = 2, R = 1: every push is copied before it is answered (ssp: with the keys'
    clocks). Each push is recognisable (SGD lr=1 moves its own index by exactly -W): after a SIGKILL of a shard
    mid-run, every index moved exactly once."""
    import signal

    from _helpers import finish_workers, start_worker, stop_workers

    from psrt.config import ClientConfig
    from psrt.control.process import SCHEDULER_READY, SERVER_READY, Child, psrt_command
    from psrt.partition import PartitionMap

    workers, steps = 2, 150
    env = {"PSRT_HEARTBEAT_INTERVAL": "0.2", "PSRT_HEARTBEAT_TIMEOUT": "1.0"}
    sched = Child(psrt_command("scheduler", "--bind", "tcp://127.0.0.1:*", "--servers", "2", "--workers",
                               str(workers), "--mode", mode, "--replicas", "1",
                               *(["--staleness", "1"] if mode == "ssp" else [])), label="scheduler",
                  ready=SCHEDULER_READY, env=env)
    children, procs, results = [sched], [], []
    try:
        endpoint = sched.wait_ready(30).group(1)
        children += [Child(psrt_command("server", "--scheduler", endpoint), label=f"shard {i}", ready=SERVER_READY,
                           env=env) for i in range(2)]
        procs = [start_worker("ride", env={**env, "PSRT_SCHEDULER": endpoint, "PSRT_WORKER_ID": str(r)},
                              servers=None, rank=r, workers=workers, steps=steps, step_s=0.01, settle=True)
                 for r in range(workers)]
        ready = [c.wait_ready(30) for c in children[1:]]
        (chunk,) = PartitionMap(2, ClientConfig().partition_bytes).add({"w": ((workers * steps,), np.float32)})
        victim = next(i for i, m in enumerate(ready) if f" rank={chunk.shard}" in m.string) + 1  # w's shard
        for p in procs:
            assert p.stdout.readline().strip() == "training"
        time.sleep(0.4)
        children[victim].signal(signal.SIGKILL)
        results = finish_workers(procs, 120)
        assert sched.wait(30) == 0, sched.output
    finally:
        stop_workers(procs)
        for c in children:
            c.stop()
    assert f"key range {chunk.shard} is served by its replica" in sched.output, sched.output
    for res in results:
        assert res["counts"] == {f"{-float(workers)}": workers * steps}, res  # once each: none lost, none twice


def _irregular_rounds(fail: bool) -> dict:
    """W = 2 over one range, R = 1: worker 0 pushes a and b in one message, worker 1 pushes them apart, so a's round
    completes (and is copied) while b's is open. With ``fail``, the primary stops right then and its replica takes
    the range over: worker 0's push goes again there, though a's copied state holds its part already."""
    from psrt.config import ClientConfig
    from psrt.optim import SGD
    from psrt.worker.client import Client

    pair, threads, announced = _pair(num_workers=2)
    primary, replica = pair
    grads = [{n: np.full(5, (r + 1) * (2 if n == "b" else 1), np.float32) for n in "ab"} for r in range(2)]
    clients = [Client(servers=[primary.endpoint], rank=r, num_workers=2, config=ClientConfig(timeout=10, shm=False))
               for r in range(2)]
    try:
        for c in clients:
            c.init({n: np.linspace(0, 1, 5, dtype=np.float32) for n in "ab"}, optimizer=SGD(lr=0.1, momentum=0.9))
        both = clients[0].push_pull_async(grads[0])  # one message: a and b
        clients[1].push({"a": grads[1]["a"]})  # a's round completes, b's waits for worker 1
        standby = replica._replication._standbys[0]
        assert standby.store.entries[("a", 0)].version == 1 and standby.store.entries[("b", 0)].version == 0
        if fail:
            primary.stop()
            threads[0].join(10)
            replica._replication.on_ranges(wire.Ranges(0, ((1,), (1,))))  # the scheduler's word: shard 1 serves
            for c in clients:
                c._calls._moves = {0: (announced[1][1], True)}  # as the scheduler's moved notice fills it
            # Worker 0 (a process of its own in a job) waits for its push_pull meanwhile: it follows the move and
            # sends the push again, which joins b's round on the range's new server.
            deadline = time.monotonic() + 10
            while 0 not in standby.store.entries[("b", 0)].contributors and time.monotonic() < deadline:
                clients[0]._calls.progress(both, 0.1)
        clients[1].push({"b": grads[1]["b"]})
        first = both.wait(10)
        second = [clients[0].push_pull_async(grads[0])]
        clients[1].push({"a": grads[1]["a"]})
        clients[1].push({"b": grads[1]["b"]})
        final = second[0].wait(10)
        if fail:
            assert replica._replication.serving_ranges() == [1, 0]
        return {"first": first, "final": final}
    finally:
        for c in clients:
            c.close()
        _close(pair, threads)


def test_i5_a_push_partly_in_a_copied_round_is_applied_once_to_each_key_after_a_failover():
    clean, failed = _irregular_rounds(False), _irregular_rounds(True)
    for when in ("first", "final"):
        for name in "ab":
            assert np.array_equal(clean[when][name], failed[when][name]), (when, name)



def _raw_push(peer, worker: int, session: int, seq: int, grads: dict) -> None:
    """Send push ``seq`` of ``worker``'s ``session`` (``grads``: name to 4 float32 values), not waiting."""
    header = push_header(id=seq + 1, worker=worker, session=session, seq=seq,
                         tensors=[[n, 0, "<f4", [4]] for n in grads])
    peer.send([bytes(f) for f in wire.encode(header, list(grads.values()))])


def _acks(peer, count: int) -> list[dict]:
    """Up to ``count`` acks ``peer`` gets (fewer: a push whose round never completes is not answered)."""
    out = []
    while len(out) < count and peer.answered(10.0):
        out.append(peer.recv()[0])
        assert out[-1]["op"] == "ack", out[-1]
    return out


def _fail_over(pair, threads, announced, peers: list) -> list:
    """Stop the primary of a :func:`_pair`, promote its replica as the scheduler would, and give raw peers of the
    range's new server in place of ``peers``."""
    pair[0].stop()
    threads[0].join(10)
    pair[1]._replication.on_ranges(wire.Ranges(0, ((1,), (1,))))  # the scheduler's word: shard 1 serves
    for p in peers:
        p.close()
    return [RawPeer(announced[1][1]) for _ in peers]


def test_i5_a_push_overtaken_before_a_failover_is_applied_once_to_a_key_that_holds_a_later_one():
    """W = 2 over one range, R = 1, sync: worker 0's push 0 (of a) is overtaken by its push 1 (of a and b), which
    completes a's round with worker 1's push while b's stays open; the primary dies. a's copied state holds push 1
    but not push 0: sent again to the range's new server, push 0 joins a's next round (not taken for one a holds),
    and push 1 sent again goes to b alone (a holds it). The result is the NumPy sum of each push once."""
    from psrt.config import ClientConfig
    from psrt.optim import SGD
    from psrt.worker.client import Client

    pair, threads, announced = _pair(num_workers=2)
    primary, replica = pair
    init = {n: np.full(4, 8.0, np.float32) for n in "ab"}
    g0, g1, h0, h1, h2 = (np.full(4, v, np.float32) for v in (1.0, 2.0, 4.0, 16.0, 32.0))
    peers = []
    try:
        with Client(servers=[primary.endpoint], rank=0, num_workers=2, config=ClientConfig(timeout=10)) as client:
            client.init(init, optimizer=SGD(lr=1.0))

        peers = [RawPeer(primary.endpoint), RawPeer(primary.endpoint)]
        _raw_push(peers[0], 0, 77, 1, {"a": g1, "b": g1})  # (push 0, {"a": g0}, lost with a dying connection)
        _raw_push(peers[1], 1, 88, 0, {"a": h0})  # a's round completes (and is copied); b's waits for worker 1
        assert len(_acks(peers[1], 1)) == 1
        standby = replica._replication._standbys[0]
        assert standby.store.entries[("a", 0)].version == 1 and standby.store.entries[("b", 0)].version == 0
        assert not standby.store.is_duplicate(0, 77, 0) and not standby.store.is_duplicate(0, 77, 1)
        peers = _fail_over(pair, threads, announced, peers)
        _raw_push(peers[0], 0, 77, 0, {"a": g0})  # sent again, behind push 1: a holds 1, not 0
        _raw_push(peers[0], 0, 77, 1, {"a": g1, "b": g1})  # unanswered: sent again too; a holds it, b does not
        _raw_push(peers[1], 1, 88, 1, {"b": h1})
        _raw_push(peers[1], 1, 88, 2, {"a": h2})
        answered = _acks(peers[1], 2) + _acks(peers[0], 2)
        assert replica._replication.serving_ranges() == [1, 0]
        expect = {"a": init["a"] - (g1 + h0) / 2 - (g0 + h2) / 2, "b": init["b"] - (g1 + h1) / 2}
        for n in "ab":
            entry = standby.store.entries[(n, 0)]
            assert entry.version == (2 if n == "a" else 1), (n, entry.version, entry.param)
            np.testing.assert_array_equal(entry.param, expect[n], err_msg=n)
        assert len(answered) == 4 and not any(a["duplicate"] for a in answered), answered
    finally:
        for p in peers:
            p.close()
        _close(pair, threads)


def test_i5_a_key_holding_an_overtaken_push_and_the_later_one_is_given_neither_again_after_a_failover():
    """W = 2, sync: worker 0's push 1 (a, c) overtakes its push 0 (a, b), so push 0 joins a's next round, whose seq
    is below push 1's; b's and c's rounds stay open, so neither push is settled when the primary dies. a holds both:
    sent again to the range's new server, each goes to its other key alone, and a's next round is not joined."""
    from psrt.config import ClientConfig
    from psrt.optim import SGD
    from psrt.worker.client import Client

    pair, threads, announced = _pair(num_workers=2)
    primary, replica = pair
    init = {n: np.full(4, 8.0, np.float32) for n in "abc"}
    g0, g1, h0, h1, hb, hc = (np.full(4, v, np.float32) for v in (1.0, 2.0, 4.0, 16.0, 32.0, 64.0))
    peers = []
    try:
        with Client(servers=[primary.endpoint], rank=0, num_workers=2, config=ClientConfig(timeout=10)) as client:
            client.init(init, optimizer=SGD(lr=1.0))

        peers = [RawPeer(primary.endpoint), RawPeer(primary.endpoint)]
        _raw_push(peers[0], 0, 77, 1, {"a": g1, "c": g1})
        _raw_push(peers[1], 1, 88, 0, {"a": h0})  # a's first round: pushes 1 and 0 of the two workers
        assert len(_acks(peers[1], 1)) == 1
        _raw_push(peers[0], 0, 77, 0, {"a": g0, "b": g0})  # the overtaken one, late: a's second round
        _raw_push(peers[1], 1, 88, 1, {"a": h1})
        assert len(_acks(peers[1], 1)) == 1
        standby = replica._replication._standbys[0]
        assert [standby.store.entries[(n, 0)].version for n in "abc"] == [2, 0, 0]
        peers = _fail_over(pair, threads, announced, peers)
        _raw_push(peers[0], 0, 77, 0, {"a": g0, "b": g0})  # both unanswered (b's and c's rounds): sent again
        _raw_push(peers[0], 0, 77, 1, {"a": g1, "c": g1})
        _raw_push(peers[1], 1, 88, 2, {"b": hb})
        _raw_push(peers[1], 1, 88, 3, {"c": hc})
        answered = _acks(peers[1], 2) + _acks(peers[0], 2)
        assert replica._replication.serving_ranges() == [1, 0]
        expect = {"a": init["a"] - (g1 + h0) / 2 - (g0 + h1) / 2, "b": init["b"] - (g0 + hb) / 2,
                  "c": init["c"] - (g1 + hc) / 2}
        for n in "abc":
            entry = standby.store.entries[(n, 0)]
            assert (entry.version, entry.contributors) == (2 if n == "a" else 1, set()), (n, entry.contributors)
            np.testing.assert_array_equal(entry.param, expect[n], err_msg=n)
        assert len(answered) == 4 and not any(a["duplicate"] for a in answered), answered
    finally:
        for p in peers:
            p.close()
        _close(pair, threads)


def test_i5_a_whole_range_copy_keeps_what_its_keys_hold_of_pushes_not_settled():
    """W = 2, sync: worker 0's push 0 (a, b) is in a's completed round, b's is open, when the primary copies the
    whole range (as it does for a replica that connected anew; here on the next init); then it dies. The copy of a
    still says a holds push 0: sent again, it goes to b alone."""
    from psrt.config import ClientConfig
    from psrt.optim import SGD
    from psrt.worker.client import Client

    pair, threads, announced = _pair(num_workers=2)
    primary, replica = pair
    init = {n: np.full(4, 8.0, np.float32) for n in "ab"}
    g0, h0, hb = (np.full(4, v, np.float32) for v in (1.0, 2.0, 4.0))
    peers = []
    try:
        with Client(servers=[primary.endpoint], rank=0, num_workers=2, config=ClientConfig(timeout=10)) as client:
            client.init(init, optimizer=SGD(lr=1.0))
            peers = [RawPeer(primary.endpoint), RawPeer(primary.endpoint)]
            _raw_push(peers[0], 0, 77, 0, {"a": g0, "b": g0})
            _raw_push(peers[1], 1, 88, 0, {"a": h0})  # a's round completes, b's waits for worker 1
            assert len(_acks(peers[1], 1)) == 1
            primary._replication.copier._fresh.add(1)  # as if shard 1 had connected anew: the whole range next
            client.init({"z": np.zeros(4, np.float32)}, optimizer=SGD(lr=1.0))
        standby = replica._replication._standbys[0]
        assert ("z", 0) in standby.store.entries and standby.store.entries[("a", 0)].version == 1
        peers = _fail_over(pair, threads, announced, peers)
        _raw_push(peers[0], 0, 77, 0, {"a": g0, "b": g0})  # unanswered (b's round): sent again
        _raw_push(peers[1], 1, 88, 1, {"b": hb})
        answered = _acks(peers[1], 1) + _acks(peers[0], 1)
        # What the range's new server copies on to further replicas says of a, as its own copy said:
        assert replica._replication._copiers[0]._holds[("a", 0)] == {0: 0, 1: 0}
        expect = {"a": init["a"] - (g0 + h0) / 2, "b": init["b"] - (g0 + hb) / 2}
        for n in "ab":
            entry = standby.store.entries[(n, 0)]
            assert (entry.version, entry.contributors) == (1, set()), (n, entry.contributors)
            np.testing.assert_array_equal(entry.param, expect[n], err_msg=n)
        assert len(answered) == 2 and not any(a["duplicate"] for a in answered), answered
    finally:
        for p in peers:
            p.close()
        _close(pair, threads)

@pytest.mark.integration
def test_i2_i5_a_server_started_later_takes_a_dead_shards_place_by_state_transfer(tmp_path):
    """S = 3, R = 1: shard 0 dies (shard 1 serves range 0; range 2 has no copy left); a server started later takes
    rank 0's place as range 2's replica, getting the whole range from its primary; then shard 2 dies and range 2
    is served by the server that joined: every step completes, bit-identical to no failure."""
    # The default heartbeat timeout: a loaded host must not make a live shard look dead between the events.
    clean, _ = _sync_job(tmp_path, "clean", servers=3, replicas=1, steps=150)
    failed, sched = _sync_job(tmp_path, "rejoin", kills=[(25, 0), (50, None), (85, 2)], servers=3, replicas=1,
                              steps=150)
    assert "key range 0 is served by its replica, server 1" in sched, sched
    assert "server 0 (" in sched and "joined the job again as a replica of key ranges [2]" in sched, sched
    assert "key range 2 is served by its replica, server 0" in sched, sched
    for a, b in zip(clean, failed):
        assert a["steps"] == b["steps"] == 150
        for name in a["params"]:
            assert np.array_equal(a["params"][name], b["params"][name]), name


@pytest.mark.parametrize("field", ["id", "token", "sender", "range", "workers", "optimizers", "tensors", "versions",
                                   "opt", "slots", "included", "full", "clocks"])
@pytest.mark.parametrize("bad", ["x", -1, {"a": 1}, [[1, 2, 3, 4]], None])
def test_i3_every_malformed_field_of_a_copy_is_a_protocol_error(field, bad):
    from psrt.config import WireLimits

    frames = [bytes(f) for f in _copy()]
    header = wire.unpack_header(frames[0], WireLimits())
    if header[field] == bad or (field == "token" and isinstance(bad, str)):
        return  # (a token is any string: checked against the job's by the replica, not by the decoder)
    header[field] = bad
    with pytest.raises(ProtocolError):
        wire_replication.decode_replicate([wire.pack_header(header), *frames[1:]], WireLimits())
    del header[field]
    with pytest.raises(ProtocolError):
        wire_replication.decode_replicate([wire.pack_header(header), *frames[1:]], WireLimits())


def test_a_whole_range_is_copied_in_messages_the_replicas_limits_take(monkeypatch):
    """A range of more keys than one copy carries (here 3 a message) arrives whole, in several messages; the
    replica counts it as held only once the last one came."""
    from psrt.config import ClientConfig
    from psrt.optim import SGD
    from psrt.shard import replication
    from psrt.worker.client import Client

    monkeypatch.setattr(replication, "COPY_KEYS", 3)
    pair, threads, _ = _pair()
    try:
        with Client(servers=[pair[0].endpoint], rank=0, num_workers=1, config=ClientConfig(timeout=10)) as client:
            params = {f"t{i}": np.full(3, i, np.float32) for i in range(10)}
            client.init(params, optimizer=SGD(lr=0.5))
            client.push_pull({n: np.ones(3, np.float32) for n in params})
        standby = pair[1]._replication._standbys[0]
        assert sorted(standby.store.entries) == sorted((n, 0) for n in params)
        assert all(e.version == 1 and e.param.tolist() == [float(n[1:]) - 0.5] * 3
                   for (n, _), e in standby.store.entries.items())
        assert pair[0]._replication.copier.copies_sent >= 4 + 4  # 10 keys: 4 messages, for the init and the round
    finally:
        _close(pair, threads)


def _pushes_around_a_move(fail: bool) -> dict:
    """W = 1 over one range, R = 1: a push of ``a``, then (after the client followed the range's move, when
    ``fail``) a push of ``b``, both unanswered at first. The push of ``a`` went to the dead primary; the one of
    ``b`` goes straight to the range's new server, as a framework's per-tensor pushes do."""
    from psrt.config import ClientConfig
    from psrt.optim import SGD
    from psrt.worker.client import Client

    pair, threads, announced = _pair()
    primary, replica = pair
    client = Client(servers=[primary.endpoint], rank=0, num_workers=1, config=ClientConfig(timeout=10, shm=False))
    try:
        client.init({n: np.zeros(5, np.float32) for n in "ab"}, optimizer=SGD(lr=1.0))
        client.push({n: np.ones(5, np.float32) for n in "ab"})
        if fail:
            primary.stop()
            threads[0].join(10)
            replica._replication.on_ranges(wire.Ranges(0, ((1,), (1,))))  # the scheduler's word: shard 1 serves
            client._calls._moves = {0: (announced[1][1], True)}  # as the scheduler's moved notice fills it
        first = client.push_async({"a": np.full(5, 2, np.float32)})  # (fail: to the dead primary)
        first.done()  # takes the move in: the channel points at the range's new server now
        second = client.push_async({"b": np.full(5, 3, np.float32)})  # (fail: sent there, after the move)
        first.wait(10)
        second.wait(10)
        if fail:
            assert replica._replication.serving_ranges() == [1, 0]
        return client.pull()
    finally:
        client.close()
        _close(pair, threads)


def test_i5_a_push_the_dead_primary_never_answered_is_applied_though_a_later_one_reached_the_new_server_first():
    """The push the dead primary never answered goes again to the range's new server before anything the worker
    sends after it: taken after a later push it would look like one already applied (a duplicate) and be lost."""
    clean, failed = _pushes_around_a_move(False), _pushes_around_a_move(True)
    assert clean["a"].tolist() == [-3.0] * 5 and clean["b"].tolist() == [-4.0] * 5
    for name in "ab":
        assert np.array_equal(clean[name], failed[name]), (name, failed[name])


def test_i4_an_early_params_reply_and_its_held_notice_round_trip_and_a_held_reply_is_unchanged_on_the_wire():
    from psrt.config import WireLimits

    limits = WireLimits()
    entry = [wire.tensor_entry("w", 0, np.dtype(np.float32), (4,))]
    plain = wire.encode_params(3, entry, [2], [np.zeros(4, np.float32)])
    assert b"held" not in bytes(plain[0]) and wire.decode_reply(plain[0], limits).held
    early = wire.encode_params(3, entry, [2], [np.zeros(4, np.float32)], held=False)
    reply = wire.decode_reply(early[0], limits)
    assert isinstance(reply, wire.ParamsReply) and not reply.held and reply.versions == [2]
    notice = wire.decode_reply(wire.encode_held([3, 9])[0], limits)
    assert isinstance(notice, wire.HeldReply) and notice.ids == [3, 9]
    header = wire.unpack_header(early[0], limits)
    for bad in ({**header, "held": True}, {**header, "held": 0}):
        with pytest.raises(ProtocolError, match="held"):
            wire.decode_reply(wire.pack_header(bad), limits)
    for ids in ([], [-1], "3"):
        with pytest.raises(ProtocolError):
            wire.decode_reply(wire.pack_header({"v": header["v"], "op": "held", "id": 0, "ids": ids}), limits)
