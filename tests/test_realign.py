"""Sync rounds after a restore (psrt.shard.realign): a push says the version its gradients were computed from, and
a shard restored behind what its workers saw keeps their rounds in step.

The scene each test sets: a sync job of two workers checkpointed at version 1; the shard's previous life went on
to version 4 and died having answered round 3 to worker 0 only. Worker 0 then pushes its next step (computed from
version 4), worker 1 sends its push of round 3 again (from version 3). Without the bases the restored shard
paired them in one round, and for the rest of the job each worker's step with the other's previous one: at the
end, worker 1's last push waited for a worker that had finished.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import pytest
from _helpers import RawPeer, serving

import psrt
from psrt import wire
from psrt.config import ClientConfig, ServerConfig
from psrt.shard import realign
from psrt.shard.store import Entry, Store

LR = 0.5
ENTRIES = [["w", 0, "<f4", [4]]]
CFG = ClientConfig(timeout=20, shm=False)


def _server(tmp_path, **kw) -> ServerConfig:
    return ServerConfig(bind="tcp://127.0.0.1:*", num_workers=2, shm=False, checkpoint_dir=str(tmp_path), **kw)


def _checkpointed(tmp_path, first_round: Callable[[list[psrt.Client], Any], np.ndarray]) -> np.ndarray:
    """A two-worker sync job's first round (``first_round(clients, server)``, which returns what it made),
    checkpointed."""
    with serving(_server(tmp_path)) as server:
        clients = [psrt.Client([server.endpoint], rank=r, num_workers=2, config=CFG) for r in range(2)]
        try:
            made = first_round(clients, server)
            server.checkpoint()
            return made
        finally:
            for c in clients:
                c.close()


def _checkpoint_at_version_1(tmp_path) -> np.ndarray:
    """A job's first round (each worker pushes its rank + 1), checkpointed; the parameters it made."""
    def first_round(clients: list[psrt.Client], server: Any) -> np.ndarray:
        for c in clients:
            c.init({"w": np.zeros(4, np.float32)}, optimizer=psrt.SGD(lr=LR))
        assert all(s.sync for c in clients for s in c._senders)
        handles = [c.push_pull_async({"w": np.full(4, r + 1.0, np.float32)}) for r, c in enumerate(clients)]
        got = [h.wait(20)["w"] for h in handles]
        np.testing.assert_array_equal(got[0], got[1])
        return got[0]
    return _checkpointed(tmp_path, first_round)


def _push(rid: int, worker: int, seq: int, grad: float, base: int) -> list:
    # (Fresh sessions: nothing they send is a duplicate of what the checkpoint's logs hold.)
    return [bytes(f) for f in wire.encode_push(rid, worker, 900 + worker, seq, ENTRIES,
                                               [np.full(4, grad, np.float32)], True, seq + 1, base=base)]


@pytest.mark.parametrize("first", ["behind", "ahead"])
def test_after_a_restore_a_worker_a_round_behind_is_brought_into_step_and_no_round_pairs_two_steps(tmp_path, first):
    v1 = _checkpoint_at_version_1(tmp_path)
    with serving(_server(tmp_path, restore=True)) as server:
        entry = server.store.entries[("w", 0)]
        assert entry.version == 1
        with RawPeer(server.endpoint) as ahead, RawPeer(server.endpoint) as behind:
            if first == "behind":
                behind.send(_push(1, 1, 0, 10.0, base=3))  # round 3 again: it joins, and waits
                assert not behind.answered(0.3)
                ahead.send(_push(1, 0, 0, 20.0, base=4))  # round 4: round 3 was lost, its push is answered
            else:
                ahead.send(_push(1, 0, 0, 20.0, base=4))
                assert not ahead.answered(0.3)  # round 4 waits for worker 1
                behind.send(_push(1, 1, 0, 10.0, base=3))  # a push of a lost round: dropped, answered at once
            head, frames = behind.recv() if behind.answered(5) else pytest.fail("worker 1 was not answered")
            assert head["op"] == "params", head
            # The restored parameters, unchanged, labelled with the version worker 0 saw: nothing of round 3.
            np.testing.assert_array_equal(np.frombuffer(frames[0], np.float32), v1)
            # (The server's thread answers worker 1 before it puts worker 0's push in the round: wait for it.)
            deadline = time.monotonic() + 5
            while entry.contributors != {0} and time.monotonic() < deadline:
                time.sleep(0.01)
            assert entry.version == 4 and entry.contributors == {0}
            assert not ahead.answered(0.2)  # round 4 still waits for worker 1's push from version 4
            behind.send(_push(2, 1, 1, 12.0, base=4))
            replies = []
            for peer in (ahead, behind):
                assert peer.answered(5), "round 4 did not close"
                head, frames = peer.recv()
                replies.append(np.frombuffer(frames[0], np.float32))
            expected = v1 - LR * np.float32((20.0 + 12.0) / 2)  # worker 0's step and worker 1's, together
            for got in replies:
                np.testing.assert_allclose(got, expected)
            assert entry.version == 5 and entry.skipped is None  # in step: the next round is as any
            assert server.store.realigning == 0
        stats = server.stats()
        assert stats["dropped_pushes"] == (1 if first == "ahead" else 0)


def test_without_a_restore_an_old_base_joins_the_round_as_ever(tmp_path):
    """A worker that pushes without pulling keeps an old base: no key was ever skipped, so it is never dropped."""
    v1 = _checkpoint_at_version_1(tmp_path)
    with serving(_server(tmp_path, restore=True)) as server:
        with RawPeer(server.endpoint) as a, RawPeer(server.endpoint) as b:
            a.send(_push(1, 0, 0, 2.0, base=0))
            b.send(_push(1, 1, 0, 4.0, base=1))
            for peer in (a, b):
                assert peer.answered(5)
                head, frames = peer.recv()
                np.testing.assert_allclose(np.frombuffer(frames[0], np.float32), v1 - LR * 3.0)
        assert server.stats()["dropped_pushes"] == 0


def _entry(version: int, contributors: set[int]) -> Entry:
    param = np.zeros(2, np.float32)
    e = Entry(param=param, optimizer=psrt.SGD(lr=1.0), slots={}, version=version, contributors=set(contributors))
    e.acc, e.acc_filled = np.ones(2, np.float32), bool(contributors)
    return e


def test_realign_rules_key_by_key():
    a, b = _entry(1, set()), _entry(7, {2})
    store = Store("sync", 3)
    store.entries = {("a", 0): a, ("b", 0): b}
    realign.restored(store)
    assert store.realigning == 2 and a.skipped == (1, 1) and realign.behind(0, [a, b], [0, 6]) is None
    # A base beyond one key's version moves it; the other's open round (from an older version) is dropped.
    assert realign.jump(store, [a, b], [3, 9]) == [1]
    assert (a.version, a.skipped, b.version, b.skipped) == (3, (1, 3), 9, (7, 9))
    assert not b.contributors and not b.acc_filled
    # A base inside the skipped versions is dropped, once per worker; at or past the jump it joins.
    assert realign.behind(0, [a, b], [2, 9]) == [True, False]
    realign.dropped(0, [a, b], [True, False])
    assert realign.behind(0, [a, b], [2, 9]) is None
    assert realign.behind(1, [a, b], 1) == [True, False]  # 1 is below b's skipped versions (7..8)
    assert realign.behind(1, [a, b], 8) == [False, True]
    # A base at or below the version with nothing skipped never moves or drops anything.
    c = _entry(5, {0})
    assert realign.jump(store, [c], 5) == [] and realign.behind(1, [c], 2) is None and c.contributors == {0}
    # Once a round completed after the jump, the key is as any; once every key has, the shard looks no more.
    a.contributors, a.acc_filled = {0, 1}, True
    store._step_round(a)
    assert a.version == 4 and a.skipped is None and realign.behind(2, [a], 1) is None and store.realigning == 1
    b.contributors, b.acc_filled = {0, 1}, True
    store._step_round(b)
    assert store.realigning == 0


# Embedding tables: the same scene, with a table's rows. A row push is acknowledged as it arrives (its worker then
# pulls the version the round will make), so the previous life needs only to have taken one worker's push of a
# round before it died: the other's, still being computed, goes to the restored shard.
IDS = np.array([3, 8, 11], np.int64)


def _table_checkpoint_at_version_1(tmp_path) -> np.ndarray:
    """A job's first round of a table (each worker pushes rank + 1 on every row), checkpointed; its rows."""
    def first_round(clients: list[psrt.Client], server: Any) -> np.ndarray:
        for c in clients:
            c.init_embedding("emb", dim=4, optimizer=psrt.SGD(lr=LR))
        for r, c in enumerate(clients):
            c.push_rows("emb", IDS, np.full((3, 4), r + 1.0, np.float32))
        rows = [h.wait(20) for h in [c.pull_rows_async("emb", IDS) for c in clients]]
        np.testing.assert_array_equal(rows[0], rows[1])
        assert server.tables.tables["emb"].version == 1
        return rows[0]
    return _checkpointed(tmp_path, first_round)


def _push_rows(rid: int, worker: int, seq: int, grad: float, base: int) -> list:
    return [bytes(f) for f in wire.encode_push_rows(rid, worker, 900 + worker, seq, "emb", IDS,
                                                    np.full((3, 4), grad, np.float32), seq + 1, base)]


def _acked(peer: RawPeer) -> int:
    assert peer.answered(5), "a push_rows was not acknowledged"
    head, _ = peer.recv()
    assert head["op"] == "ack", head
    return head["versions"][0]


@pytest.mark.parametrize("first", ["behind", "ahead"])
def test_after_a_restore_a_table_keeps_its_workers_rounds_in_step(tmp_path, first):
    r1 = _table_checkpoint_at_version_1(tmp_path)
    with serving(_server(tmp_path, restore=True)) as server:
        table = server.tables.tables["emb"]
        assert table.version == 1 and server.tables.realigning == 1
        with RawPeer(server.endpoint) as ahead, RawPeer(server.endpoint) as behind:
            if first == "behind":
                behind.send(_push_rows(1, 1, 0, 10.0, base=3))  # round 3 again: it joins (acknowledged at once)
                assert _acked(behind) == 4
                ahead.send(_push_rows(1, 0, 0, 20.0, base=4))  # round 4: round 3 was lost, dropped with its push
                assert _acked(ahead) == 5
            else:
                ahead.send(_push_rows(1, 0, 0, 20.0, base=4))
                assert _acked(ahead) == 5
                behind.send(_push_rows(1, 1, 0, 10.0, base=3))  # a push of a lost round: dropped
                assert _acked(behind) == 4  # (its next pull gets the rows as they are)
            assert table.version == 4 and table.round.contributors == {0}
            # Worker 1's pull of what its push reached: the restored rows, nothing of round 3 in them.
            head, frames = behind.ask(wire.encode_pull_rows(2, 1, "emb", 4, IDS))
            assert head["op"] == "rows" and head["version"] == 4, head
            np.testing.assert_array_equal(np.frombuffer(frames[0], np.float32).reshape(3, 4), r1)
            behind.send(_push_rows(3, 1, 1, 12.0, base=4))  # from version 4: round 4 closes
            assert _acked(behind) == 5
            head, frames = ahead.ask(wire.encode_pull_rows(2, 0, "emb", 5, IDS))
            assert head["version"] == 5, head
            expected = r1 - LR * np.float32((20.0 + 12.0) / 2)  # worker 0's step and worker 1's, together
            np.testing.assert_allclose(np.frombuffer(frames[0], np.float32).reshape(3, 4), expected)
            assert table.skipped is None and server.tables.realigning == 0  # in step: the next round is as any
        assert server.stats()["dropped_row_pushes"] == (1 if first == "ahead" else 0)


def test_a_table_restored_at_the_version_its_workers_saw_takes_an_old_base_into_its_round(tmp_path):
    """Nothing skipped: a worker that pushes without pulling (an old base) joins, as without a restore."""
    r1 = _table_checkpoint_at_version_1(tmp_path)
    with serving(_server(tmp_path, restore=True)) as server:
        with RawPeer(server.endpoint) as a, RawPeer(server.endpoint) as b:
            a.send(_push_rows(1, 0, 0, 2.0, base=0))
            b.send(_push_rows(1, 1, 0, 4.0, base=1))
            assert _acked(a) == 2 and _acked(b) == 2
            head, frames = a.ask(wire.encode_pull_rows(2, 0, "emb", 2, IDS))
            np.testing.assert_allclose(np.frombuffer(frames[0], np.float32).reshape(3, 4), r1 - LR * 3.0)
        assert server.stats()["dropped_row_pushes"] == 0 and server.tables.realigning == 0
