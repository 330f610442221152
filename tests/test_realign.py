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


# Plain pushes (a push, then a pull). A push is acknowledged as it arrives; its worker then pulls the version the
# round will make, and after a restart that pull goes again (``again``: any version will do) and is answered at
# once with the restored parameters. So a base cannot tell the worker whose push the previous life took: its next
# push says the same base as the other worker's push of the round it lost. The pull sent again says it (the
# version it asks for).
def _plain_push(rid: int, worker: int, seq: int, grad: float, base: int) -> list:
    return [bytes(f) for f in wire.encode_push(rid, worker, 900 + worker, seq, ENTRIES,
                                               [np.full(4, grad, np.float32)], False, seq + 1, base=base)]


def _pulled(peer: RawPeer, rid: int, worker: int, version: int, again: bool = False,
            send: bool = True) -> tuple[int, np.ndarray]:
    if send:
        peer.send([bytes(f) for f in wire.encode_pull(rid, worker, [["w", 0, version]], again=again)])
    assert peer.answered(5), "a pull was not answered"
    head, frames = peer.recv()
    assert head["op"] == "params", head
    return head["versions"][0], np.frombuffer(frames[0], np.float32)


def _ack(peer: RawPeer) -> int:
    assert peer.answered(5), "a push was not acknowledged"
    head, _ = peer.recv()
    assert head["op"] == "ack", head
    return head["versions"][0]


@pytest.mark.parametrize("first", ["pull", "push"])
def test_after_a_restore_a_pull_sent_again_shows_the_push_the_shard_lost(tmp_path, first):
    """The previous life took worker 0's push of round 2 (acknowledged) and died before worker 1's came: worker 0's
    pull of version 2 goes again, and worker 1 pushes round 2. Round 2 is lost for both: worker 1's push is dropped
    (or its round, when it came first), and both workers' next pushes make round 3 together."""
    v1 = _checkpoint_at_version_1(tmp_path)
    with serving(_server(tmp_path, restore=True)) as server:
        entry = server.store.entries[("w", 0)]
        with RawPeer(server.endpoint) as w0, RawPeer(server.endpoint) as w1:
            if first == "pull":
                version, params = _pulled(w0, 1, 0, 2, again=True)
                assert version == 2
                w1.send(_plain_push(1, 1, 0, 10.0, base=1))  # its push of round 2: dropped
                assert _ack(w1) == 2
            else:
                w1.send(_plain_push(1, 1, 0, 10.0, base=1))  # it joins round 2, which worker 0's pull then drops
                assert _ack(w1) == 2
                w1.send([bytes(f) for f in wire.encode_pull(2, 1, [["w", 0, 2]])])
                assert not w1.answered(0.3)  # (round 2 waits for worker 0)
                version, params = _pulled(w0, 1, 0, 2, again=True)
                assert version == 2
            np.testing.assert_array_equal(params, v1)  # the restored parameters: nothing of round 2
            version, params = _pulled(w1, 3, 1, 2, send=first == "pull")
            assert version == 2
            np.testing.assert_array_equal(params, v1)
            assert entry.version == 2 and not entry.contributors
            # Each worker's next step, from version 2: one round.
            w0.send(_plain_push(2, 0, 1, 20.0, base=2))
            w1.send(_plain_push(4, 1, 1, 12.0, base=2))
            assert _ack(w0) == 3 and _ack(w1) == 3
            version, params = _pulled(w0, 3, 0, 3)
            assert version == 3
            np.testing.assert_allclose(params, v1 - LR * np.float32((20.0 + 12.0) / 2))
            assert server.store.realigning == 0
        assert server.stats()["dropped_pushes"] == (1 if first == "pull" else 0)


@pytest.mark.parametrize("first", ["pull", "push"])
def test_after_a_restore_a_pull_sent_again_gets_the_version_the_other_worker_saw(tmp_path, first):
    """The previous life closed round 2 and answered worker 0's pull only: worker 0 pushes round 3 (from version
    2), worker 1's pull of version 2 goes again. Worker 1 gets the restored parameters labelled version 2, so its
    push of round 3 joins worker 0's (asked for any version, it got version 1, and its push from it was then
    dropped as behind: a step more lost than worker 0's, and the two a step apart to the job's end)."""
    v1 = _checkpoint_at_version_1(tmp_path)
    with serving(_server(tmp_path, restore=True)) as server:
        with RawPeer(server.endpoint) as w0, RawPeer(server.endpoint) as w1:
            if first == "push":
                w0.send(_plain_push(1, 0, 0, 20.0, base=2))
                assert _ack(w0) == 3
            version, params = _pulled(w1, 1, 1, 2, again=True)
            assert version == 2
            np.testing.assert_array_equal(params, v1)
            if first == "pull":
                w0.send(_plain_push(1, 0, 0, 20.0, base=2))
                assert _ack(w0) == 3
            w1.send(_plain_push(2, 1, 0, 12.0, base=version))
            assert _ack(w1) == 3
            version, params = _pulled(w1, 3, 1, 3)
            assert version == 3
            np.testing.assert_allclose(params, v1 - LR * np.float32((20.0 + 12.0) / 2))
        assert server.stats()["dropped_pushes"] == 0


def test_a_pull_sent_again_to_a_shard_never_restored_takes_any_version(tmp_path):
    """Without a restore a pull sent again is answered at once with what the shard holds, whatever it asks for."""
    with serving(_server(tmp_path)) as server:
        with RawPeer(server.endpoint) as w0:
            c = psrt.Client([server.endpoint], rank=1, num_workers=2, config=CFG)
            try:
                c.init({"w": np.ones(4, np.float32)}, optimizer=psrt.SGD(lr=LR))
            finally:
                c.close()
            version, params = _pulled(w0, 1, 0, 7, again=True)
            assert version == 0
            np.testing.assert_array_equal(params, np.ones(4, np.float32))
            assert server.store.entries[("w", 0)].version == 0


# Embedding tables. A row push is acknowledged as it arrives, and its worker then pulls the version the round
# will make; after a restart that pull goes again asking for any version and is answered at once with the
# restored rows. So bases say nothing of rounds here: a push's clock (the worker's count of pushes to the table)
# does. The scene: round 1 checkpointed (each worker's push 1); the previous life went on to take worker 0's push 4
# and died before worker 1's push 4 came.
IDS = np.array([3, 8, 11], np.int64)


def _table_checkpointed(tmp_path, pushers_of_round_2: tuple[int, ...] = ()) -> np.ndarray:
    """Round 1 of a table (each worker pushes rank + 1 on every row), then the pushes of round 2 by
    ``pushers_of_round_2`` (its round left open), checkpointed; the rows after round 1."""
    def first_round(clients: list[psrt.Client], server: Any) -> np.ndarray:
        for c in clients:
            c.init_embedding("emb", dim=4, optimizer=psrt.SGD(lr=LR))
        for r, c in enumerate(clients):
            c.push_rows("emb", IDS, np.full((3, 4), r + 1.0, np.float32))
        rows = [h.wait(20) for h in [c.pull_rows_async("emb", IDS) for c in clients]]
        np.testing.assert_array_equal(rows[0], rows[1])
        for r in pushers_of_round_2:
            clients[r].push_rows("emb", IDS, np.full((3, 4), 50.0, np.float32))
        table = server.tables.tables["emb"]
        assert table.version == 1 and table.round.contributors == set(pushers_of_round_2)
        return rows[0]
    return _checkpointed(tmp_path, first_round)


def _push_rows(rid: int, worker: int, clock: int, grad: float, base: int = 0) -> list:
    # (Fresh sessions; a push's seq counts from 0 in each.)
    return [bytes(f) for f in wire.encode_push_rows(rid, worker, 900 + worker, rid - 1, "emb", IDS,
                                                    np.full((3, 4), grad, np.float32), clock, base)]


def _acked(peer: RawPeer) -> int:
    assert peer.answered(5), "a push_rows was not acknowledged"
    head, _ = peer.recv()
    assert head["op"] == "ack", head
    return head["versions"][0]


def _rows(peer: RawPeer, worker: int, version: int) -> tuple[int, np.ndarray]:
    head, frames = peer.ask(wire.encode_pull_rows(100 + version, worker, "emb", version, IDS))
    assert head["op"] == "rows", head
    return head["version"], np.frombuffer(frames[0], np.float32).reshape(3, 4)


@pytest.mark.parametrize("first", ["behind", "ahead"])
def test_after_a_restore_a_table_pairs_pushes_of_one_clock_and_every_worker_loses_the_same_rounds(tmp_path, first):
    r1 = _table_checkpointed(tmp_path)
    with serving(_server(tmp_path, restore=True)) as server:
        table = server.tables.tables["emb"]
        assert table.version == 1 and server.tables.realigning == 1
        with RawPeer(server.endpoint) as ahead, RawPeer(server.endpoint) as behind:
            if first == "behind":
                behind.send(_push_rows(1, 1, 4, 10.0, base=3))  # its push 4: worker 0's was lost with the old life
                assert _acked(behind) == 2
                ahead.send(_push_rows(1, 0, 5, 20.0, base=1))  # push 5: round 4 can never close, and is dropped
                assert _acked(ahead) == 3
                # Worker 1's pull of what its push 4 would make: the restored rows, nothing of round 4.
                version, rows = _rows(behind, 1, 2)
                assert version == 2
                np.testing.assert_array_equal(rows, r1)
            else:
                ahead.send(_push_rows(1, 0, 5, 20.0, base=1))
                assert _acked(ahead) == 2
                behind.send(_push_rows(1, 1, 4, 10.0, base=3))  # a push of a lost round: dropped
                assert _acked(behind) == 1  # (its pull gets the rows as they are)
                version, rows = _rows(behind, 1, 1)
                assert version == 1
                np.testing.assert_array_equal(rows, r1)
            assert table.round.contributors == {0} and table.round.clock == 5
            behind.send(_push_rows(2, 1, 5, 12.0))  # its push 5: round 5 closes with worker 0's
            v = _acked(behind)
            version, rows = _rows(ahead, 0, v)
            assert version == v == table.version
            np.testing.assert_allclose(rows, r1 - LR * np.float32((20.0 + 12.0) / 2))  # the two pushes 5, together
            assert not table.realigning and server.tables.realigning == 0  # in step: the next round is as any
        assert server.stats()["dropped_row_pushes"] == (1 if first == "ahead" else 0)


def test_after_a_restore_pushes_of_one_clock_pair_whatever_their_bases(tmp_path):
    """The previous life closed round 4 and answered worker 0's pull only: worker 1's pull, sent again, got the
    restored rows. Their pushes 5 say bases 5 and 1, and still make one round."""
    r1 = _table_checkpointed(tmp_path)
    with serving(_server(tmp_path, restore=True)) as server:
        with RawPeer(server.endpoint) as a, RawPeer(server.endpoint) as b:
            a.send(_push_rows(1, 0, 5, 2.0, base=5))
            b.send(_push_rows(1, 1, 5, 4.0, base=1))
            assert _acked(a) == 2 and _acked(b) == 2
            np.testing.assert_allclose(_rows(a, 0, 2)[1], r1 - LR * 3.0)
            assert server.tables.realigning == 0
            # Once in step, clocks decide nothing (as in a job never restored).
            a.send(_push_rows(2, 0, 9, 2.0))
            b.send(_push_rows(2, 1, 6, 4.0))
            assert _acked(a) == 3 and _acked(b) == 3
        assert server.stats()["dropped_row_pushes"] == 0


def test_a_round_in_progress_in_the_checkpoint_keeps_its_clock(tmp_path):
    """Worker 0's push 2 is in the checkpoint's open round; the previous life went further. Worker 1's push 4 shows
    round 2 lost: it is dropped, and worker 0's push 4, held back behind it, makes round 4 with worker 1's."""
    r1 = _table_checkpointed(tmp_path, pushers_of_round_2=(0,))
    with serving(_server(tmp_path, restore=True)) as server:
        table = server.tables.tables["emb"]
        assert table.round.contributors == {0} and table.round.clock == 2
        with RawPeer(server.endpoint) as a, RawPeer(server.endpoint) as b:
            a.send(_push_rows(1, 0, 4, 2.0))  # worker 0 is in the open round: held back
            assert not a.answered(0.3)
            b.send(_push_rows(1, 1, 4, 4.0))
            assert _acked(a) == 3 and _acked(b) == 3
            version, rows = _rows(b, 1, 3)
            assert version == 3
            np.testing.assert_allclose(rows, r1 - LR * 3.0)  # nothing of round 2's 50s
