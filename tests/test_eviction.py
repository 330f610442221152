"""Admission, capacity and ttl of embedding tables, exact against a NumPy model of the documented rules
(``tests/_row_oracle.py``): a table on its own, then shards on threads behind a real client."""

from __future__ import annotations

import contextlib

import msgpack
import numpy as np
import pytest
from _helpers import RawPeer, serving
from _row_oracle import OracleTable

import psrt
from psrt import wire
from psrt.config import ClientConfig, RowLimits, ServerConfig, WireLimits
from psrt.errors import ConfigError, ProtocolError
from psrt.kernels.rows import shard_of
from psrt.shard.embedding import RowTable
from psrt.tablespec import TableSpec

DIM = 4


def make(optimizer: str = "sgd", **policy) -> tuple[RowTable, OracleTable]:
    opt = psrt.SGD(lr=0.1) if optimizer == "sgd" else psrt.AdaGrad(lr=0.1, eps=1e-10)
    spec = TableSpec(dim=DIM, dtype=np.dtype(np.float32), optimizer=opt, a=0.0, b=0.1, seed=3, **policy)
    oracle_policy = {k: v for k, v in policy.items() if v is not None}
    return RowTable(spec, 1 << 20, "t"), OracleTable(DIM, 3, optimizer, lr=0.1, **oracle_policy)


def push(table: RowTable, ids: np.ndarray, grads: np.ndarray, now: float = 0.0) -> None:
    """As the shard takes a push in async mode: rows, one step, then what must go."""
    slots, summed = table.push(ids, grads, now)
    table.apply(slots, summed, 1.0)
    table.evict_due(now)


def check(table: RowTable, oracle: OracleTable, probe: np.ndarray, now: float = 0.0) -> None:
    table.evict_due(now)
    oracle.evict_due(now)
    np.testing.assert_allclose(table.gather(probe), oracle.pull(probe, now), rtol=1e-6, atol=1e-7)
    assert table.used == len(oracle.rows)
    assert sorted(table.row_ids[:table.used].tolist()) == sorted(oracle.rows)
    assert (table.evicted, table.admitted) == (oracle.evicted, oracle.admitted)
    pending = table.pending
    got = {} if pending is None else dict(zip(pending.ids[:pending.used].tolist(),
                                             pending.counts[:pending.used].tolist()))
    assert got == {i: c[0] for i, c in oracle.pending.items()}


def test_admission_counts_pushes_and_the_kth_makes_the_row_and_is_applied():
    table, oracle = make(admit_after=3)
    ids = np.array([5, 9], np.int64)
    ones = np.ones((2, DIM), np.float32)
    initial = table.gather(ids)
    for n in (1, 2):
        push(table, ids, ones)
        assert table.used == 0 and table.pending.counts_of(ids).tolist() == [n, n]
        np.testing.assert_array_equal(table.gather(ids), initial)  # pending: the initial value, no row made
        assert table.used == 0
    push(table, np.array([5, 5], np.int64), np.ones((2, DIM), np.float32))  # repeats in one push count once
    np.testing.assert_allclose(table.gather(ids[:1]), initial[:1] - 0.1 * 2, rtol=1e-6)  # the k-th is applied
    assert table.used == 1 and table.pending.counts_of(ids).tolist() == [0, 2] and table.admitted == 1


def test_capacity_evicts_the_least_recently_pushed_with_its_state_and_it_starts_over():
    table, oracle = make("adagrad", capacity=3, admit_after=2)
    g = np.ones((1, DIM), np.float32)
    for i in (1, 2, 3, 1, 2, 3):  # rows 1, 2, 3
        push(table, np.array([i], np.int64), g)
        oracle.push(np.array([i]), g)
    push(table, np.array([2], np.int64), g)  # 2 is now the most recent; 1 the least
    oracle.push(np.array([2]), g)
    for _ in range(2):
        push(table, np.array([4], np.int64), g)
        oracle.push(np.array([4]), g)
    assert 1 not in table.row_ids[:table.used].tolist() and table.evicted == 1
    check(table, oracle, np.arange(6, dtype=np.int64))
    push(table, np.array([1], np.int64), g)  # an evicted id starts over: admission again ...
    oracle.push(np.array([1]), g)
    assert table.pending.counts_of(np.array([1], np.int64)).tolist() == [1]
    for _ in range(2):  # ... and fresh AdaGrad sums (a kept sum would give a smaller step)
        push(table, np.array([1], np.int64), g)
        oracle.push(np.array([1]), g)
    check(table, oracle, np.arange(6, dtype=np.int64))


def test_ttl_evicts_rows_and_pending_counts_not_pushed_for_that_long():
    table, oracle = make(ttl=10.0, admit_after=2)
    g = np.ones((1, DIM), np.float32)
    for i, t in ((1, 0.0), (1, 1.0), (2, 2.0), (3, 8.0), (3, 8.5)):
        push(table, np.array([i], np.int64), g, t)
        oracle.push(np.array([i]), g, t)
    check(table, oracle, np.arange(5, dtype=np.int64), 9.0)
    assert table.used == 2
    check(table, oracle, np.arange(5, dtype=np.int64), 11.0)  # row 1 (pushed at 1.0) went
    assert table.used == 1 and table.evicted == 1 and table.pending.used == 1
    check(table, oracle, np.arange(5, dtype=np.int64), 12.5)  # and the count of 2 (pushed at 2.0)
    assert table.used == 1 and table.pending.used == 0 and table.pending.forgotten == 1


@pytest.mark.parametrize("seed", range(8))
def test_random_pushes_and_pulls_match_the_model(seed):
    rng = np.random.default_rng(seed)
    policy = dict(admit_after=int(rng.integers(1, 4)), capacity=[None, 5, 40][seed % 3],
                  ttl=[None, 3.0][seed % 2], max_pending=[None, 7][(seed // 2) % 2])
    if policy["admit_after"] == 1:
        policy["max_pending"] = None
    if policy["admit_after"] == 1 and policy["capacity"] is None and policy["ttl"] is None:
        policy["capacity"] = 30
    table, oracle = make("adagrad" if seed % 2 else "sgd", **policy)
    now = 0.0
    for _ in range(80):
        now += float(rng.exponential(0.3))
        ids = rng.zipf(1.3, int(rng.integers(1, 30))).astype(np.int64) % 200 - 20
        grads = rng.standard_normal((len(ids), DIM)).astype(np.float32)
        push(table, ids, grads, now)
        oracle.push(ids, grads, now)
        if rng.random() < 0.3:
            check(table, oracle, rng.integers(-25, 200, 50).astype(np.int64), now)
    check(table, oracle, np.arange(-20, 200, dtype=np.int64), now)


def test_checkpoint_state_restores_rows_clocks_and_pending_exactly():
    table, _ = make("adagrad", admit_after=2, capacity=20, ttl=100.0)
    rng = np.random.default_rng(1)
    for step in range(30):
        ids = rng.integers(0, 60, 10).astype(np.int64)
        push(table, ids, rng.standard_normal((10, DIM)).astype(np.float32), float(step))
    record, arrays = table.state()
    back = RowTable.from_state(record, [np.array(a) for a in arrays])
    probe = np.arange(60, dtype=np.int64)
    np.testing.assert_array_equal(back.gather(probe), table.gather(probe))
    for t in (table, back):  # the same next push evicts the same rows (choices never depend on where rows lie)
        push(t, np.arange(100, 105, dtype=np.int64), np.ones((5, DIM), np.float32), 31.0)
        push(t, np.arange(100, 105, dtype=np.int64), np.ones((5, DIM), np.float32), 32.0)
    assert sorted(back.row_ids[:back.used].tolist()) == sorted(table.row_ids[:table.used].tolist())
    np.testing.assert_array_equal(back.gather(probe), table.gather(probe))
    assert (back.evicted, back.admitted, back.pending.used) == (table.evicted, table.admitted, table.pending.used)


@pytest.mark.parametrize("bad,match", [
    (dict(admit_after=0), "admit_after"), (dict(admit_after=1.5), "admit_after"), (dict(capacity=0), "capacity"),
    (dict(capacity=True), "capacity"), (dict(ttl=-1.0), "ttl"), (dict(ttl=float("inf")), "ttl"),
    (dict(max_pending=10), "needs admit_after"), (dict(admit_after=2, max_pending=0), "max_pending"),
    (dict(capacity=5, num_rows=10), "dynamic tables")])
def test_bad_options_are_refused_with_what_to_do(bad, match):
    with pytest.raises(ConfigError, match=match):
        TableSpec(dim=DIM, dtype=np.dtype(np.float32), optimizer=psrt.SGD(lr=0.1), **bad)


@contextlib.contextmanager
def two_shards():
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async")) as a, \
            serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async")) as b:
        yield [a, b]


def test_client_tables_admit_evict_and_report_per_shard_over_real_sockets():
    """Two shards on threads, one client: pushes are counted per shard, each shard holds at most its capacity,
    pulls match one model per shard, and ``table_stats`` reports each shard's counters."""
    with two_shards() as servers:
        now = [100.0]
        for s in servers:
            s.tables.clock = lambda: now[0]
        oracles = [OracleTable(DIM, 7, "adagrad", lr=0.05, admit_after=2, capacity=25, ttl=50.0) for _ in servers]
        with psrt.Client([s.endpoint for s in servers], config=ClientConfig(timeout=20)) as c:
            c.init_embedding("items", dim=DIM, optimizer=psrt.AdaGrad(lr=0.05, eps=1e-10), std=0.1, seed=7,
                             admit_after=2, capacity=25, ttl=50.0)
            rng = np.random.default_rng(4)
            for _ in range(40):
                now[0] += 2.0
                ids = (rng.zipf(1.4, 64) % 300).astype(np.int64)
                grads = rng.standard_normal((64, DIM)).astype(np.float32)
                c.push_rows("items", ids, grads)
                where = shard_of(ids, 2)
                for s, o in enumerate(oracles):
                    o.push(ids[where == s], grads[where == s], now[0])
            probe = np.arange(300, dtype=np.int64)
            got = c.pull_rows("items", probe)
            where = shard_of(probe, 2)
            for s, o in enumerate(oracles):
                np.testing.assert_allclose(got[where == s], o.pull(probe[where == s], now[0]), rtol=1e-6, atol=1e-7)
            stats = c.table_stats("items")
            for st, o in zip(stats, oracles):
                assert (st["rows"], st["evicted"], st["admitted"], st["pending"]) == \
                    (len(o.rows), o.evicted, o.admitted, len(o.pending))
                assert st["rows"] <= 25 and st["bytes"] > 0
            assert sum(st["evicted"] for st in stats) > 0 and sum(st["pending"] for st in stats) > 0
            with pytest.raises(psrt.ServerError, match="init_embedding"):
                c.table_stats("nope")
            with pytest.raises(ConfigError, match="capacity"):
                c.init_embedding("bad", dim=DIM, capacity=-1)


def _init_header(**over) -> dict:
    h = {"op": "init_table", "id": 1, "worker": 0, "table": "t", "dim": DIM, "dtype": "<f4",
         "optimizer": psrt.SGD(lr=0.1).to_wire(), "init": "normal", "a": 0.0, "b": 0.1, "seed": 0, "num_rows": None,
         "count": 0, "policy": {"admit_after": 2, "capacity": 10, "ttl": 5.0, "max_pending": None}}
    h.update(over)
    return h


def test_the_policy_travels_in_init_table_and_is_checked_as_hostile_input():
    policy = {"admit_after": 2, "capacity": 10, "ttl": 5.0, "max_pending": 3}
    frames = wire.encode_init_table(1, 0, "t", DIM, np.dtype(np.float32), {}, "normal", 0.0, 0.1, 0, None,
                                    np.empty(0, np.int64), None, policy)
    header = msgpack.unpackb(frames[0], raw=False)
    assert header["policy"] == policy
    plain = wire.encode_init_table(1, 0, "t", DIM, np.dtype(np.float32), {}, "normal", 0.0, 0.1, 0, None,
                                   np.empty(0, np.int64), None)
    assert "policy" not in msgpack.unpackb(plain[0], raw=False)  # the defaults: the message of before
    for bad in ({"admit_after": 2}, {**policy, "capacity": -1}, {**policy, "ttl": "x"}, {**policy, "admit_after": 0},
                {**policy, "ttl": float("nan")}, [1, 2], {**policy, "extra": 1}):
        with pytest.raises(ProtocolError, match="policy|admit_after|capacity|ttl"):
            wire.rows.decode_row_request({**header, "policy": bad}, [], WireLimits())


def test_a_shard_refuses_a_bad_policy_and_makes_no_table():
    limits = RowLimits(max_table_rows=1000)
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async", row_limits=limits)) as server:
        for over, match in [({"policy": {"admit_after": 1, "capacity": None, "ttl": None, "max_pending": 5}},
                             "needs admit_after"),
                            ({"policy": {"admit_after": 2, "capacity": 5000, "ttl": None, "max_pending": None}},
                             "PSRT_MAX_TABLE_ROWS"),
                            ({"num_rows": 10}, "dynamic tables"),
                            ({"policy": {"admit_after": 2, "capacity": "many", "ttl": None, "max_pending": None}},
                             "capacity")]:
            with RawPeer(server.endpoint) as peer:
                reply = peer.ask(_init_header(**over), [], timeout=10.0)[0]
            assert reply["op"] == "error" and match in reply["message"], reply
        assert server.tables.tables == {}
        for header in ({"op": "table_stats", "id": 2, "table": "t", "extra": 1}, {"op": "table_stats", "id": 2},
                       {"op": "table_stats", "id": 2, "table": "t"}):  # (no table "t" yet)
            with RawPeer(server.endpoint) as peer:
                assert peer.ask(header, [], timeout=10.0)[0]["op"] == "error"
        with psrt.Client([server.endpoint], config=ClientConfig(timeout=20)) as c:
            c.init_embedding("t", dim=DIM, admit_after=2, capacity=10)
            with pytest.raises(psrt.ServerError, match="admit_after 2 vs 3"):
                c.init_embedding("t", dim=DIM, admit_after=3, capacity=10)  # every worker must agree


@pytest.mark.parametrize("seed", range(4))
def test_a_full_state_and_its_deltas_rebuild_the_table_exactly(seed):
    """Random pushes between checkpoints (admissions, evictions, pending ids forgotten and counted again): the
    full state and the deltas after it, applied in order, give the same rows, counts and later choices."""
    table, _ = make("adagrad", admit_after=2, capacity=30, ttl=20.0, max_pending=25)
    rng = np.random.default_rng(seed)
    chain = []
    now = 0.0
    for _ in range(12):
        for _ in range(5):
            now += 1.0
            ids = (rng.zipf(1.3, 20) % 120).astype(np.int64)
            push(table, ids, rng.standard_normal((20, DIM)).astype(np.float32), now)
        record, arrays = table.state(delta=bool(chain))
        chain.append((record, [np.array(a) for a in arrays]))
        table.saved()
    back = RowTable.from_state(*chain[0])
    for record, arrays in chain[1:]:
        back.apply_delta(record, arrays)
    probe = np.arange(120, dtype=np.int64)
    for t in (table, back):
        push(t, probe[:40], np.ones((40, DIM), np.float32), now + 1)
    np.testing.assert_array_equal(back.gather(probe), table.gather(probe))
    assert sorted(back.row_ids[:back.used].tolist()) == sorted(table.row_ids[:table.used].tolist())
    def counts(t: RowTable) -> dict[int, int]:
        return dict(zip(t.pending.ids[:t.pending.used].tolist(), t.pending.counts[:t.pending.used].tolist()))

    assert counts(back) == counts(table)
    assert (back.evicted, back.admitted, back.pending.forgotten) == (table.evicted, table.admitted,
                                                                     table.pending.forgotten)


@pytest.mark.parametrize("seed", range(6))
def test_the_oldest_rows_kept_between_passes_are_exactly_the_least_recently_pushed(seed):
    """:class:`Oldest` (one pass for many evictions) against :func:`lru_victims` (a pass each time), with rows
    pushed again, new rows, rows gone, and the rows of a round in progress pinned (pushed in that round)."""
    from psrt.shard.rowpolicy import Oldest, lru_victims

    rng = np.random.default_rng(seed)
    stamps: dict[int, int] = {}
    oldest, tick, next_id = Oldest(), 0, 0
    for _ in range(300):
        ids = np.array(list(stamps), np.int64)
        again = rng.choice(ids, min(len(ids), int(rng.integers(0, 6))), replace=False) if len(ids) else ids
        fresh = np.arange(next_id, next_id + int(rng.integers(0, 8)))
        next_id += len(fresh)
        pushed = set(again.tolist()) | set(fresh.tolist())
        for i in pushed:
            stamps[i] = tick
        tick += 1
        if rng.random() < 0.1 and stamps:
            stamps.pop(int(rng.choice(list(stamps))))  # gone another way (a ttl sweep)
        ids = np.array(list(stamps), np.int64)
        last = np.array([stamps[i] for i in ids.tolist()], np.int64)
        where = {int(i): s for s, i in enumerate(ids.tolist())}

        def find(q: np.ndarray, where: dict[int, int] = where) -> np.ndarray:
            return np.array([where.get(int(i), -1) for i in q.tolist()], np.int64)

        pinned = np.array([where[i] for i in pushed if i in where], np.int64) if rng.random() < 0.3 else None
        count = int(rng.integers(0, 6))
        got = oldest.take(find, last, ids, count, pinned)
        assert sorted(ids[got].tolist()) == sorted(ids[lru_victims(last, ids, count, pinned)].tolist())
        for i in ids[got].tolist():
            del stamps[i]
