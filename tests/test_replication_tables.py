"""Embedding tables in a replicated job (``--replicas R``): each range's rows of every table are held by the range's
replicas too, copied under the dense keys' invariants (docs/architecture.md, "Replication"; the names are
tests/test_replication.py's): I3 authenticated copies, I4 held before answered, I5 exactly once, and the
failover of a table's rows to the promoted replica.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from _helpers import RawPeer
from test_replication import _close, _pair, _pause_copies, _reply, _resume_copies, _sync_job

import psrt
from psrt import wire
from psrt.config import ClientConfig
from psrt.errors import ProtocolError
from psrt.shard.embedding import RowTable
from psrt.tablespec import TableSpec
from psrt.wire import rowcopy

FAST = {"PSRT_HEARTBEAT_INTERVAL": "0.2", "PSRT_HEARTBEAT_TIMEOUT": "1.0"}


def _client(pair, workers: int = 1, rank: int = 0) -> psrt.Client:
    return psrt.Client(servers=[pair[0].endpoint], rank=rank, num_workers=workers,
                       config=ClientConfig(timeout=10, shm=False))


def _same_table(a: RowTable, b: RowTable, ids: np.ndarray) -> None:
    """Two tables hold the same rows, optimizer slots, push clocks, counters and admission counts."""
    assert (a.used, a.version, a.tick, a.evicted, a.admitted) == (b.used, b.version, b.tick, b.evicted, b.admitted)
    assert np.array_equal(a.gather(ids), b.gather(ids))
    held = ids[a.find(ids) >= 0]
    assert np.array_equal(np.sort(held), np.sort(ids[b.find(ids) >= 0]))
    for name in a.slots:
        assert np.array_equal(a.slots[name][a.find(held)], b.slots[name][b.find(held)]), name
    assert np.array_equal(a.last[a.find(held)], b.last[b.find(held)])
    if a.pending is not None:
        assert a.pending.used == b.pending.used
        assert np.array_equal(a.pending.counts_of(ids), b.pending.counts_of(ids))


# ---------------------------------------------------------------------------------------------- two shards on threads
@pytest.mark.parametrize("policy", [{}, {"admit_after": 2, "capacity": 40}])
def test_i4_a_tables_round_is_answered_only_once_the_replica_holds_its_rows(policy):
    """Sync, W = 2: the replica holds the table once init_embedding is answered, and after each round exactly the
    primary's rows, slots, push clocks, counters and admission counts; a push_rows's ack waits for its round."""
    pair, threads, _ = _pair(num_workers=2)
    primary, replica = pair
    standby = replica._replication._standbys[0]
    clients = [_client(pair, 2, r) for r in range(2)]
    try:
        for c in clients:
            c.init_embedding("emb", 4, psrt.AdaGrad(lr=0.1), **policy)
        assert "emb" in standby.tables.tables  # held twice before it was answered
        ids_all = np.arange(120)
        for step in range(12):
            ids = np.random.default_rng(step).integers(0, 120, 30)
            first = clients[0].push_rows_async("emb", ids, np.ones((30, 4), np.float32))
            deadline = time.monotonic() + 5
            while primary.tables.tables["emb"].round.contributors != {0} and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not first.done(), "a sync push_rows was acknowledged before its round was copied"
            clients[1].push_rows("emb", ids, np.full((30, 4), step, np.float32))
            first.wait(10)
            _same_table(primary.tables.tables["emb"], standby.tables.tables["emb"], ids_all)
            assert standby.tables.logs[("emb", 0)].last_seq == primary.tables.logs[("emb", 0)].last_seq == step
    finally:
        for c in clients:
            c.close()
        _close(pair, threads)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_i4_async_row_pushes_queued_together_share_one_copy_and_none_is_acked_before_the_replica_holds_it(mode):
    """Group commit of a table: the push_rows the primary's loop finds queued together go in one copy of the rows
    they touched, at the batch's end, and none is acknowledged before the replica acknowledged that copy."""
    pair, threads, _ = _pair(num_workers=1, send_timeout=30.0, mode=mode)
    primary, replica = pair
    standby = replica._replication._standbys[0]
    client = _client(pair)
    try:
        client.init_embedding("emb", 4, psrt.AdaGrad(lr=0.1))
        before = primary.stats()["copies_sent"]
        _pause_copies(replica)
        pushes = [client.push_rows_async("emb", np.arange(n, n + 20), np.ones((20, 4), np.float32))
                  for n in range(8)]
        deadline = time.monotonic() + 10
        while primary.tables.pushes < 1 and time.monotonic() < deadline:  # the first, applied: its copy waits
            time.sleep(0.01)
        time.sleep(0.5)  # (the others reach the primary's queue behind it)
        assert not any(p.done() for p in pushes), "a push_rows was acknowledged while the replica held no copy of it"
        _resume_copies(replica)
        for p in pushes:
            p.wait(30)
        assert primary.stats()["copies_sent"] - before <= 2  # the first alone, then the 7 queued behind it in one
        _same_table(primary.tables.tables["emb"], standby.tables.tables["emb"], np.arange(40))
        assert standby.tables.logs[("emb", 0)].last_seq == primary.tables.logs[("emb", 0)].last_seq
    finally:
        client.close()
        _close(pair, threads)


def test_a_rounds_copy_carries_the_rows_it_touched_not_the_table():
    pair, threads, _ = _pair()
    primary, replica = pair
    try:
        with _client(pair) as client:
            client.init_embedding("emb", 64, psrt.AdaGrad(lr=0.1))
            client.pull_rows("emb", np.arange(5000))  # 5,000 rows made
            client.push_rows("emb", np.arange(10), np.ones((10, 64), np.float32))  # (and copied once)
            before = primary.stats()["copy_bytes_sent"]
            client.push_rows("emb", np.arange(10), np.ones((10, 64), np.float32))
            per_round = primary.stats()["copy_bytes_sent"] - before
        row = 64 * 4 * 2 + 8 * 3  # the row, its AdaGrad slot, its id, push clock and time
        assert 10 * row <= per_round < 10 * row + 4096, per_round
        assert replica.stats()["copy_bytes_taken"] == primary.stats()["copy_bytes_sent"]
    finally:
        _close(pair, threads)


def test_a_replica_that_connected_anew_gets_every_table_whole():
    """A server that took a dead shard's place holds nothing: its primary's next copy is the whole range, tables
    included (rows made long before, and the pending admission counts)."""
    pair, threads, _ = _pair()
    primary, replica = pair
    standby = replica._replication._standbys[0]
    try:
        with _client(pair) as client:
            client.init_embedding("emb", 4, psrt.SGD(lr=0.5), admit_after=2)
            for step in range(5):
                client.push_rows("emb", np.arange(step * 10, step * 10 + 40), np.ones((40, 4), np.float32))
            standby.tables.tables.clear()
            standby.tables.logs.clear()
            primary._replication.copier._fresh.add(1)  # as after a new shard took rank 1's place
            client.push_rows("emb", np.arange(3), np.ones((3, 4), np.float32))
        _same_table(primary.tables.tables["emb"], standby.tables.tables["emb"], np.arange(100))
        assert standby.tables.logs[("emb", 0)].last_seq == 5
    finally:
        _close(pair, threads)


def _genuine(token: str = "the-job-token", sender: int = 0, rng: int = 0, table: str = "emb") -> list[bytes]:
    spec = TableSpec(dim=3, dtype=np.dtype(np.float32), optimizer=psrt.SGD(lr=0.1), init="zeros")
    rows = RowTable(spec, 1000, table)
    slots, grads = rows.push(np.arange(4), np.ones((4, 3), np.float32))
    rows.apply(slots, grads, 1.0)
    record, arrays = rows.state(False)
    frames = rowcopy.encode_replicate_rows(9, token, sender, rng, table, record, arrays, [(0, 77, 0)], {}, True)
    return [bytes(f) if not isinstance(f, bytes) else f for f in frames]


@pytest.mark.parametrize("copy, code", [
    (dict(token="another-job"), "not_job"),
    (dict(sender=1), "not_primary"),  # the replica itself is not range 0's primary
    (dict(rng=1), "not_backed"),  # with S = 2, R = 1 shard 1 backs range 0 alone
])
def test_i3_a_forged_table_copy_is_refused_and_changes_nothing(copy, code):
    pair, threads, announced = _pair()
    try:
        standby = pair[1]._replication._standbys[0]
        with RawPeer(announced[1][0]) as peer:
            peer.send(_genuine(**copy))
            reply = _reply(peer)
            assert reply["op"] == "error" and reply["code"] == code, reply
            assert standby.tables.tables == {} and standby.tables.logs == {}
            frames = _genuine()
            peer.send(frames[:-1])  # an array's frame missing
            reply = _reply(peer)
            assert reply["op"] == "error" and reply["code"] == "protocol", reply
            header = wire.unpack_header(frames[0], wire.CONTROL_LIMITS)
            header["record"]["used"] = 5  # rows that do not add up
            peer.send([wire.pack_header(header), *frames[1:]])
            reply = _reply(peer)
            assert reply["op"] == "error" and reply["code"] == "conflict", reply
            assert standby.tables.tables == {} and standby.tables.logs == {}
            peer.send(frames)  # the job's primary, with the job's token: taken
            assert _reply(peer)["op"] == "replicated"
        table = standby.tables.tables["emb"]
        assert table.version == 1 and np.array_equal(table.gather(np.arange(4)), np.full((4, 3), -0.1, np.float32))
        assert standby.tables.logs[("emb", 0)].last_seq == 0
    finally:
        _close(pair, threads)


def test_i3_a_table_copy_carries_each_log_s_replay_holes():
    from psrt.config import WireLimits

    spec = TableSpec(dim=3, dtype=np.dtype(np.float32), optimizer=psrt.SGD(lr=0.1), init="zeros")
    record, arrays = RowTable(spec, 1000, "emb").state(False)
    frames = rowcopy.encode_replicate_rows(9, "t", 0, 0, "emb", record, arrays, [(0, 77, 6), (1, 78, 2)], {}, True,
                                           {0: [[4, 2]], 1: []})
    header = wire.unpack_header(bytes(frames[0]), WireLimits())
    assert header["logs"] == [[0, 77, 7, [[4, 2]]], [1, 78, 3]]  # none: as an older psrt sends it
    req = rowcopy.decode_replicate_rows([bytes(f) for f in frames], WireLimits())
    assert req.logs == [(0, 77, 6), (1, 78, 2)] and req.holes == {0: [[4, 2]]}
    for bad in ("x", [[1, 2, 3]], [[-1, 2]], [[0, 1]] * (1 << 16)):
        header["logs"] = [[0, 77, 7, bad]]
        with pytest.raises(ProtocolError):
            rowcopy.decode_replicate_rows([wire.pack_header(header), *frames[1:]], WireLimits())


def test_i3_a_table_copy_carries_its_open_round_s_clock():
    """The clock of the round in progress (psrt.shard.realign reads it after a restore) travels with a copy; a
    malformed one is a protocol error, a copy without it (an older psrt's) is taken."""
    from psrt.config import WireLimits

    spec = TableSpec(dim=3, dtype=np.dtype(np.float32), optimizer=psrt.SGD(lr=0.1), init="zeros")
    table = RowTable(spec, 1000, "emb")
    table.round.add(1, np.zeros(0, np.int64), np.zeros((0, 3), np.float32), 7)
    record, arrays = table.state(False)
    assert record["round_clock"] == 7
    frames = rowcopy.encode_replicate_rows(9, "t", 0, 0, "emb", record, arrays, [], {}, True)
    header = wire.unpack_header(bytes(frames[0]), WireLimits())
    assert rowcopy.decode_replicate_rows([bytes(f) for f in frames], WireLimits()).record["round_clock"] == 7
    for bad in (-1, "7", 1.5, 2**63):
        header["record"]["round_clock"] = bad
        with pytest.raises(ProtocolError, match="round_clock"):
            rowcopy.decode_replicate_rows([wire.pack_header(header), *frames[1:]], WireLimits())
    del header["record"]["round_clock"]
    assert rowcopy.decode_replicate_rows([wire.pack_header(header), *frames[1:]], WireLimits()).record["name"] == "emb"


@pytest.mark.parametrize("field", ["token", "sender", "range", "table", "record", "logs", "clocks", "full"])
@pytest.mark.parametrize("bad", [-1, {"a": 1}, [[1, 2, 3, 4]], None])
def test_i3_every_malformed_field_of_a_table_copy_is_a_protocol_error(field, bad):
    from psrt.config import WireLimits
    from psrt.errors import ProtocolError

    frames = _genuine()
    header = wire.unpack_header(frames[0], WireLimits())
    header[field] = bad
    with pytest.raises(ProtocolError):
        rowcopy.decode_replicate_rows([wire.pack_header(header), *frames[1:]], WireLimits())


# ---------------------------------------------------------------------------------------------- real processes
@pytest.mark.parametrize("policy", [{}, {"admit_after": 2, "capacity": 200}], ids=["plain", "admit-capacity"])
@pytest.mark.integration
def test_i5_a_sigkilled_shard_loses_no_row_and_stops_nobody(tmp_path, policy):
    """The target: S = 2, W = 2, R = 1 sync, an embedding table (AdaGrad), deterministic row gradients; SIGKILL a
    shard mid-run: every step completes, no worker sees an error, and the final rows of every id are bit-identical
    to a failure-free run's; the range taken over writes rank 0's checkpoints, its table included."""
    from psrt.shard.checkpoint import load_latest

    args = {"vocab": 600, **policy}
    clean, _ = _sync_job(tmp_path, "clean", env=FAST, steps=60, role="replicated_rows", args=args)
    failed, sched = _sync_job(tmp_path, "failover", kills=[(20, 0)], env=FAST, steps=60, role="replicated_rows",
                              args=args, checkpoints=tmp_path / "ckpt")
    assert "key range 0 is served by its replica, server 1" in sched, sched
    for a, b in zip(clean, failed):
        assert a["steps"] == b["steps"] == 60
        assert np.array_equal(a["params"]["emb"], b["params"]["emb"])
    assert not np.array_equal(clean[0]["params"]["emb"][:10], np.zeros((10, 8), np.float32))
    saved = load_latest(tmp_path / "ckpt", "rank-0")
    (table,) = saved.tables
    assert table.name == "emb" and table.version == 60 and table.used > 0


@pytest.mark.parametrize("mode", ["async", "ssp"])
@pytest.mark.integration
def test_i4_i5_async_a_sigkilled_shard_loses_no_acknowledged_row_push_and_applies_none_twice(mode):
    """Async and ssp, S = 2, W = 2, R = 1: every push_rows is copied before it is acknowledged (ssp: with the
    table's clocks). Each push is recognisable
    (its own id's row moves by exactly -1): after a SIGKILL of a shard mid-run, every row moved exactly once."""
    import signal

    from _helpers import finish_workers, start_worker, stop_workers

    from psrt.control.process import SCHEDULER_READY, SERVER_READY, Child, psrt_command

    workers, steps = 2, 150
    sched = Child(psrt_command("scheduler", "--bind", "tcp://127.0.0.1:*", "--servers", "2", "--workers",
                               str(workers), "--mode", mode, "--replicas", "1",
                               *(["--staleness", "1"] if mode == "ssp" else [])), label="scheduler",
                  ready=SCHEDULER_READY, env=FAST)
    children, procs, results = [sched], [], []
    try:
        endpoint = sched.wait_ready(30).group(1)
        children += [Child(psrt_command("server", "--scheduler", endpoint), label=f"shard {i}", ready=SERVER_READY,
                           env=FAST) for i in range(2)]
        procs = [start_worker("ride_rows", env={**FAST, "PSRT_SCHEDULER": endpoint, "PSRT_WORKER_ID": str(r)},
                              steps=steps, step_s=0.01, workers=workers) for r in range(workers)]
        ready = [c.wait_ready(30) for c in children[1:]]
        for p in procs:
            assert p.stdout.readline().strip() == "training"
        time.sleep(0.4)
        victim = next(i for i, m in enumerate(ready) if " rank=0" in m.string) + 1
        children[victim].signal(signal.SIGKILL)
        results = finish_workers(procs, 120)
        assert sched.wait(30) == 0, sched.output
    finally:
        stop_workers(procs)
        for c in children:
            c.stop()
    assert "key range 0 is served by its replica" in sched.output, sched.output
    for res in results:
        assert res["counts"] == {"-1.0": workers * steps * 2}, res  # once each: none lost, none twice


@pytest.mark.integration
def test_i2_i5_a_server_in_a_dead_shards_place_gets_the_tables_by_state_transfer(tmp_path):
    """S = 3, R = 1: shard 0 dies (shard 1 serves range 0); a server started later takes rank 0's place as range
    2's replica, getting its rows whole; then shard 2 dies and the newcomer serves range 2's rows: bit-identical."""
    args = {"vocab": 600, "pause": 0.03}
    clean, _ = _sync_job(tmp_path, "clean", env=FAST, servers=3, steps=100, role="replicated_rows", args=args)
    failed, sched = _sync_job(tmp_path, "rejoin", kills=[(15, 0), (35, None), (60, 2)], env=FAST, servers=3,
                              steps=100, role="replicated_rows", args=args)
    assert "joined the job again as a replica of key ranges [2]" in sched, sched
    assert "key range 2 is served by its replica, server 0" in sched, sched
    for a, b in zip(clean, failed):
        assert a["steps"] == b["steps"] == 100
        assert np.array_equal(a["params"]["emb"], b["params"]["emb"])
