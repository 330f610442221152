"""Embedding tables end to end: real shard processes, the client's split and reassembly, sync rounds, and
hostile messages that must change nothing."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from _helpers import RawPeer

import psrt
from psrt.config import ClientConfig
from psrt.kernels import reference
from psrt.shard.embedding import RowTable
from psrt.tablespec import TableSpec

pytestmark = pytest.mark.integration


def cfg() -> ClientConfig:
    return ClientConfig(timeout=20)


def test_dynamic_table_pull_push_in_caller_order(shards):
    group = shards(3, workers=1, mode="async")
    spec = TableSpec(dim=5, dtype=np.dtype(np.float32), optimizer=psrt.AdaGrad(lr=0.1), init="normal", a=0.0,
                     b=0.1, seed=9)
    local = RowTable(spec, 1 << 20)  # what the shards must hold, on one table
    rng = np.random.default_rng(0)
    with psrt.Client(group.endpoints, config=cfg()) as c:
        c.init_embedding("items", dim=5, optimizer=psrt.AdaGrad(lr=0.1), std=0.1, seed=9)
        ids = np.array([7, -2**40, 7, 3, 2**62, 11, 3], np.int64)
        rows = c.pull_rows("items", ids)
        np.testing.assert_array_equal(rows, reference.init_rows(ids, 5, np.float32, 9, 2, 0.0, 0.1))
        local.gather(ids)
        for _ in range(3):
            ids = rng.integers(-50, 50, 40)
            grads = rng.standard_normal((40, 5)).astype(np.float32)
            c.push_rows("items", ids, grads)
            slots, summed = local.push(ids.astype(np.int64), grads)
            local.apply(slots, summed, 1.0)
        probe = np.arange(-60, 60)
        np.testing.assert_allclose(c.pull_rows("items", probe), local.gather(probe.astype(np.int64)), rtol=1e-6)
        out = np.empty((len(probe), 5), np.float32)
        assert c.pull_rows_async("items", probe[::-1], out=out).wait() is out
        stats = c.stats()
        assert sum(s["table_rows"] for s in stats) == local.used
        assert all(s["table_rows"] > 0 for s in stats)  # hashed over every shard


def test_sync_round_averages_over_workers_and_pull_sees_it(shards):
    group = shards(2, workers=2, mode="sync")
    initial = np.arange(40, dtype=np.float64).reshape(10, 4)
    results: dict[int, np.ndarray] = {}

    def worker(rank: int) -> None:
        with psrt.Client(group.endpoints, rank=rank, num_workers=2, config=cfg()) as c:
            c.init_embedding("users", dim=4, optimizer=psrt.SGD(lr=1.0), initial=initial, dtype=np.float64)
            for step in range(3):
                ids = np.array([rank, 5, 5, 9])  # 5 is pushed twice by each worker: summed
                c.push_rows_async("users", ids, np.full((4, 4), float(step + 1))).wait()
                results[(rank, step)] = c.pull_rows("users", np.arange(10))

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    expect = initial.copy()
    for step in range(3):
        g = np.zeros_like(expect)
        for rank in range(2):
            np.add.at(g, [rank, 5, 5, 9], step + 1.0)
        expect -= g / 2
        for rank in range(2):
            np.testing.assert_allclose(results[(rank, step)], expect)


def test_fixed_tables_refuse_ids_outside_their_rows(shards):
    group = shards(2)
    with psrt.Client(group.endpoints, config=cfg()) as c:
        c.init_embedding("fixed", dim=2, initial=np.zeros((5, 2), np.float32))
        with pytest.raises(psrt.ConfigError, match=r"outside table 'fixed'.*\[0, 5\)"):
            c.pull_rows("fixed", [1, 5])
        with pytest.raises(psrt.ConfigError, match="never initialized"):
            c.push_rows("nope", [1], np.zeros((1, 2), np.float32))
        with pytest.raises(psrt.ServerError, match="mismatch"):
            c.init_embedding("fixed", dim=3, initial=np.zeros((5, 3), np.float32))
        with pytest.raises(psrt.ConfigError, match="shape"):
            c.push_rows("fixed", [1, 2], np.zeros((1, 2), np.float32))


def _raw(endpoint: str, header: dict, frames: list[bytes]) -> dict:
    with RawPeer(endpoint) as peer:
        return peer.ask(header, frames, timeout=10.0)[0]


def test_hostile_row_messages_change_nothing(shards):
    group = shards(1, extra=())
    ep = group.endpoints[0]
    with psrt.Client(group.endpoints, config=cfg()) as c:
        c.init_embedding("t", dim=3, initial=np.ones((4, 3), np.float32), optimizer=psrt.SGD(lr=1.0))
        before = c.pull_rows("t", np.arange(4))
        push = {"op": "push_rows", "id": 1, "worker": 0, "session": 1, "seq": 0, "table": "t", "dim": 3,
                "dtype": "<f4", "count": 2}
        ids = np.array([0, 1], "<i8").tobytes()
        good = np.ones((2, 3), np.float32).tobytes()
        cases = [
            (push, [ids, good[:-4]]),                                       # rows frame too short
            (push, [ids[:-8], good]),                                       # ids frame too short
            ({**push, "dtype": "<i4"}, [ids, good]),                        # dtype not allowed
            ({**push, "count": True}, [ids, good]),                         # bool is not an int
            ({**push, "extra": 1}, [ids, good]),                            # unknown field
            ({**push, "dim": 4}, [ids, np.ones((2, 4), np.float32).tobytes()]),  # dim of another table
            (push, [np.array([0, 9], "<i8").tobytes(), good]),              # id outside a fixed table
            (push, [ids, np.array([[1, np.nan, 1], [1, 1, 1]], np.float32).tobytes()]),  # NaN
            ({**push, "table": "u"}, [ids, good]),                          # unknown table
            (push, [ids]),                                                  # a frame missing
        ]
        for header, frames in cases:
            reply = _raw(ep, header, frames)
            assert reply["op"] == "error", (header, reply)
        np.testing.assert_array_equal(c.pull_rows("t", np.arange(4)), before)
        assert c.stats()[0]["row_pushes"] == 0


def test_a_row_push_overtaken_by_a_later_one_is_applied_once(shards):
    """As a dense push: seq 2 arrives before seq 1 (sent again after a reconnect); both are applied, once."""
    group = shards(1, extra=())
    with psrt.Client(group.endpoints, config=cfg()) as c:
        c.init_embedding("t", dim=3, initial=np.ones((4, 3), np.float32), optimizer=psrt.SGD(lr=1.0))
        ids = np.array([0], "<i8").tobytes()
        with RawPeer(group.endpoints[0]) as peer:
            def push(seq: int, value: float) -> dict:
                header = {"op": "push_rows", "id": 1, "worker": 0, "session": 1, "seq": seq, "table": "t", "dim": 3,
                          "dtype": "<f4", "count": 1, "clock": 0}
                reply = peer.ask(header, [ids, np.full((1, 3), value, np.float32).tobytes()], timeout=10.0)[0]
                assert reply["op"] == "ack", reply
                return reply

            assert [push(q, v)["duplicate"] for q, v in ((0, 1.0), (2, 4.0), (1, 2.0))] == [False, False, False]
            assert [push(1, 2.0)["duplicate"], push(2, 4.0)["duplicate"]] == [True, True]
        np.testing.assert_array_equal(c.pull_rows("t", [0]), np.full((1, 3), -6.0, np.float32))


def test_row_cap_per_message_and_table(shards, monkeypatch):
    monkeypatch.setenv("PSRT_MAX_ROWS_PER_MESSAGE", "100")
    monkeypatch.setenv("PSRT_MAX_TABLE_ROWS", "150")
    group = shards(1)
    with psrt.Client(group.endpoints, config=cfg()) as c:
        c.init_embedding("d", dim=2)
        with pytest.raises(psrt.ServerError, match="too_many_rows"):
            c.pull_rows("d", np.arange(101))
        c.pull_rows("d", np.arange(100))
        with pytest.raises(psrt.ServerError, match="table_full"):
            c.pull_rows("d", np.arange(100, 200))
        c.pull_rows("d", np.arange(50))  # existing rows: still served
        assert c.stats()[0]["table_rows"] == 100


def test_ctr_example_learns_under_launch():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "psrt.cli", "launch", "-s", "2", "-w", "2", "--", sys.executable,
                          "-m", "psrt.examples.ctr", "--steps", "100"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr + out.stdout
    aucs = [float(line.rsplit("AUC", 1)[1]) for line in out.stdout.splitlines() if "AUC" in line]
    assert len(aucs) == 3 and aucs[-1] > aucs[0] + 0.15


@pytest.mark.parametrize("servers", [1, 3])
def test_pull_rows_sends_a_repeated_id_once(shards, servers):
    group = shards(servers, workers=1, mode="async")
    with psrt.Client(group.endpoints, config=cfg()) as c:
        c.init_embedding("items", dim=8, std=0.1, seed=4)
        distinct = np.array([5, -3, 2**40, 17, 0], np.int64)
        expected = reference.init_rows(distinct, 8, np.float32, 4, 2, 0.0, 0.1)
        ids = np.random.default_rng(1).integers(0, len(distinct), 20_000)  # 20,000 ids, 5 of them distinct
        before = c.stats()
        rows = c.pull_rows("items", distinct[ids])
        after = c.stats()
        np.testing.assert_array_equal(rows, expected[ids])  # every row in the caller's order
        moved = sum(a["bytes_out"] + a.get("shm_bytes_out", 0) + a["bytes_in"] + a.get("shm_bytes_in", 0)
                    - b["bytes_out"] - b.get("shm_bytes_out", 0) - b["bytes_in"] - b.get("shm_bytes_in", 0)
                    for a, b in zip(after, before))
        # 20,000 rows of 32 bytes and their ids would be 800 kB; 5 rows and ids plus headers are well under 10 kB.
        assert moved < 10_000, moved
        out = np.empty((len(ids), 8), np.float32)
        assert c.pull_rows_async("items", distinct[ids], out=out).wait() is out
        np.testing.assert_array_equal(out, expected[ids])
        np.testing.assert_array_equal(c.pull_rows("items", distinct[::-1]), expected[::-1])  # no repeats
