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

import pytest

from psrt import wire
from psrt.config import ClusterConfig
from psrt.control.placement import Placement, check_job_replicas
from psrt.control.scheduler import Scheduler
from psrt.errors import ConfigError, ProtocolError
from psrt.partition import backed_ranges, check_replicas, range_holders, replica_ring


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


def test_replication_is_refused_outside_sync_and_with_elastic():
    with pytest.raises(ConfigError, match="--mode sync"):
        check_job_replicas(1, 2, "async", False)
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
    with pytest.raises(ConfigError, match="--mode sync"):
        Scheduler("tcp://127.0.0.1:*", 2, 2, mode="async", replicas=1)


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
