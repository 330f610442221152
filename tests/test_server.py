"""Integration tests: real shard server processes, real ZeroMQ sockets, workers in their own processes."""

from __future__ import annotations

import math
import os

import msgpack
import numpy as np
import pytest
from _helpers import RawPeer, packed, push_header, run_workers
from _workers import async_pusher_expected

import psrt
from psrt import wire
from psrt.config import ClientConfig

pytestmark = pytest.mark.integration


def small(timeout: float = 20, partition_bytes: int = 4 << 20) -> ClientConfig:
    return ClientConfig(timeout=timeout, partition_bytes=partition_bytes)


# ---------------------------------------------------------------------------------------------- correctness
def test_async_exact_sum(shards):
    """W workers x T pushes of integer-valued gradients with SGD lr=1 give exactly -(sum of all gradients)."""
    workers, steps, size = 4, 40, 10_001
    group = shards(2, workers=workers, mode="async")
    args = [dict(servers=group.endpoints, rank=r, workers=workers, steps=steps, size=size, partition_bytes=16_384)
            for r in range(workers)]
    run_workers("async_pusher", args)
    expected = async_pusher_expected(workers, steps, size)
    with psrt.Client(group.endpoints, rank=0, num_workers=workers, config=small(partition_bytes=16_384)) as c:
        got = c.init({"w": np.ones(size, np.float32)}, optimizer=psrt.SGD(lr=1.0))["w"]
        stats = c.stats()
    np.testing.assert_array_equal(got, expected)
    assert sum(s["pushes"] for s in stats) == workers * steps * 3  # 40 KB split in 3 chunks of <= 16 KiB
    assert all(s["keys"] > 0 for s in stats), "both shards hold part of the tensor"


@pytest.mark.parametrize("optimizer", [
    psrt.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    psrt.AdamW(lr=0.01, weight_decay=0.1),
    psrt.AdaGrad(lr=0.1, lr_decay=0.01),
], ids=["sgd-nesterov", "adamw", "adagrad"])
def test_sync_equals_single_process(shards, optimizer):
    """W workers on slices of a batch end with the parameters of one process doing the whole batch."""
    workers, steps, seed = 3, 25, 7
    group = shards(2, workers=workers, mode="sync")
    args = [dict(servers=group.endpoints, rank=r, workers=workers, steps=steps, seed=seed,
                 optimizer=optimizer.to_wire()) for r in range(workers)]
    results = run_workers("sync_slice", args)

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((workers * 16, 40))
    y = rng.standard_normal(workers * 16)
    w, b = np.zeros(40), np.zeros(1)
    slots_w, slots_b = optimizer.init_slots(w), optimizer.init_slots(b)
    for step in range(1, steps + 1):
        # The server averages per-worker mean gradients; equal slices make that the full-batch mean.
        gw, gb = np.zeros(40), np.zeros(1)
        for r in range(workers):
            xs, ys = x[r::workers], y[r::workers]
            res = xs @ w + b[0] - ys
            gw += xs.T @ res / len(ys)
            gb += res.mean()
        optimizer.step(w, slots_w, gw, 1.0 / workers, step)
        optimizer.step(b, slots_b, gb, 1.0 / workers, step)
    for res in results:
        np.testing.assert_allclose(res["w"], w, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(res["b"], b, rtol=1e-9, atol=1e-12)
    # Every worker ends on identical parameters.
    assert all(res["w"] == results[0]["w"] for res in results)
    # One accumulator per key at most, whatever W: accumulator bytes never exceed parameter bytes.
    for shard in results[0]["stats"]:
        assert shard["accumulators"] <= shard["keys"]
        assert shard["accumulator_bytes"] <= shard["param_bytes"]
        assert shard["rounds"] == steps * shard["keys"]


def test_large_tensor_over_three_shards_roundtrips_bit_exact(shards):
    group = shards(3)
    rng = np.random.default_rng(3)
    big = rng.standard_normal(3_000_001).astype(np.float32)
    big[::1000] = np.float32(np.nextafter(np.float32(0), np.float32(1)))  # subnormals survive too
    odd = rng.standard_normal((7, 11, 13))  # float64, not split
    with psrt.Client(group.endpoints, config=small(partition_bytes=1 << 20)) as c:
        c.init({"big": big, "odd": odd})
        got = c.pull()
        stats = c.stats()
        chunks = c.partition.chunks["big"]
    assert got["big"].tobytes() == big.tobytes()
    assert got["odd"].tobytes() == odd.tobytes() and got["odd"].shape == odd.shape
    assert len(chunks) == math.ceil(big.nbytes / (1 << 20))
    assert {ch.shard for ch in chunks} == {0, 1, 2}
    loads = [s["param_bytes"] for s in stats]
    assert max(loads) - min(loads) <= (1 << 20) + odd.nbytes


def test_sync_round_waits_for_all_workers_and_queues_early_pushes(shards):
    """A pull for the next version waits; a worker's push for round r+1 waits until round r completes."""
    group = shards(1, workers=2)
    cfg = small(timeout=10)
    with psrt.Client(group.endpoints, 0, 2, config=cfg) as a, psrt.Client(group.endpoints, 1, 2, config=cfg) as b:
        a.init({"w": np.zeros(4, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        b.init({"w": np.ones(4, np.float32)}, optimizer=psrt.SGD(lr=1.0))  # first init wins: zeros
        a.push({"w": np.full(4, 2.0, np.float32)})        # round 1: accumulated, not applied
        early = a.push_pull_async({"w": np.full(4, 10.0, np.float32)})  # round 2: queued behind round 1
        pending_pull = a.pull_async()                      # after a's pushes: wants the round its last one joins
        assert not pending_pull.done()
        with pytest.raises(psrt.ShardTimeoutError):
            a.pull(timeout=0.3)
        stats = a.stats()[0]
        assert stats["deferred_pushes"] == 1 and stats["queued_pulls"] >= 1
        b.push({"w": np.full(4, 4.0, np.float32)})        # completes round 1: w = -(2+4)/2 = -3
        assert b.pull()["w"].tolist() == [-3.0] * 4        # b's pushes are all in round 1
        assert not pending_pull.done()                     # a's round-2 push is not applied yet
        b.push({"w": np.full(4, 0.0, np.float32)})        # completes round 2: w = -3 - (10+0)/2 = -8
        np.testing.assert_array_equal(pending_pull.wait()["w"], np.full(4, -8.0, np.float32))
        np.testing.assert_array_equal(early.wait()["w"], np.full(4, -8.0, np.float32))
        np.testing.assert_array_equal(b.pull()["w"], np.full(4, -8.0, np.float32))
        assert a.stats()[0]["rounds"] == 2


def test_init_conflicts_are_refused(shards):
    group = shards(1, workers=2)
    cfg = small()
    with psrt.Client(group.endpoints, 0, 2, config=cfg) as a, psrt.Client(group.endpoints, 1, 2, config=cfg) as b:
        a.init({"w": np.zeros(3, np.float32)}, optimizer=psrt.SGD(lr=0.1))
        with pytest.raises(psrt.ConfigError, match="different optimizer"):
            b.init({"w": np.zeros(3, np.float32)}, optimizer=psrt.Adam())
    with psrt.Client(group.endpoints, 0, 3, config=small()) as c:
        with pytest.raises(psrt.ConfigError, match="--workers 2"):
            c.init({"v": np.zeros(3, np.float32)})
    with psrt.Client(group.endpoints, 0, 2, config=small()) as d:
        with pytest.raises(psrt.ServerError, match="mismatch"):
            d.init({"w": np.zeros(5, np.float32)})


def test_client_argument_errors(shards):
    group = shards(1)
    with pytest.raises(psrt.ConfigError, match="rank"):
        psrt.Client(group.endpoints, rank=2, num_workers=2)
    with pytest.raises(psrt.ConfigError, match="endpoint"):
        psrt.Client(["localhost:5701"])
    with psrt.Client(group.endpoints, config=small()) as c:
        c.init({"w": np.zeros(3, np.float32)})
        with pytest.raises(psrt.PsrtTypeError, match="float32"):
            c.init({"i": np.zeros(3, np.int32)})
        with pytest.raises(TypeError, match="astype"):
            c.push({"w": np.zeros(3, np.float64)})
        with pytest.raises(ValueError, match="shape"):
            c.push({"w": np.zeros(4, np.float32)})
        with pytest.raises(psrt.ConfigError, match="never initialized"):
            c.push({"nope": np.zeros(3, np.float32)})
        np.testing.assert_array_equal(c.pull()["w"], np.zeros(3, np.float32))
    with pytest.raises(psrt.ConnectionLostError):
        c.pull()


def test_timeout_names_the_shard(shards):
    group = shards(2)
    with psrt.Client(group.endpoints, config=small(timeout=5)) as c:
        c.init({"a": np.zeros(1000, np.float32), "b": np.zeros(1000, np.float32)})
        group.procs[1].kill()
        group.procs[1].wait(10)
        with pytest.raises(psrt.ShardTimeoutError) as info:
            c.pull(timeout=0.5)
        assert group.endpoints[1] in str(info.value) and info.value.shard == group.endpoints[1]
        assert isinstance(info.value, TimeoutError)


# ---------------------------------------------------------------------------------------------- hostile input
MALFORMED = {
    "empty": [b""],
    "random-bytes": [os.urandom(64)],
    "truncated-header": [packed(push_header())[:-5], np.ones(4, np.float32).tobytes()],
    "not-a-map": [msgpack.packb([1, 2, 3])],
    "wrong-version": [packed(push_header(), version=99), np.ones(4, np.float32).tobytes()],
    "unknown-op": [packed(dict(op="explode", id=1))],
    "missing-field": [packed(dict(op="push", id=1, worker=0, tensors=[])), b""],
    "bool-as-int": [packed(push_header(seq=True)), np.ones(4, np.float32).tobytes()],
    "wrong-frame-count": [packed(push_header())],
    "extra-frame": [packed(push_header()), np.ones(4, np.float32).tobytes(), b"x"],
    "unknown-dtype": [packed(push_header(tensors=[["w", 0, "<i4", [4]]])), np.ones(4, np.int32).tobytes()],
    "object-dtype": [packed(push_header(tensors=[["w", 0, "O", [4]]])), b"\0" * 32],
    "big-endian-dtype": [packed(push_header(tensors=[["w", 0, ">f4", [4]]])), np.ones(4, ">f4").tobytes()],
    "wrong-byte-count": [packed(push_header()), np.ones(3, np.float32).tobytes()],
    "huge-shape": [packed(push_header(tensors=[["w", 0, "<f4", [2**40, 2**40, 2**40]]])), b"\0" * 16],
    "negative-dim": [packed(push_header(tensors=[["w", 0, "<f4", [-4]]])), b"\0" * 16],
    "bin-in-header": [packed({**push_header(), "x": b"\0" * 8})],
    "unknown-key": [packed(push_header(tensors=[["nope", 0, "<f4", [4]]])), np.ones(4, np.float32).tobytes()],
    "size-mismatch": [packed(push_header(tensors=[["w", 0, "<f4", [2]]])), np.ones(2, np.float32).tobytes()],
    "dtype-mismatch": [packed(push_header(tensors=[["w", 0, "<f8", [4]]])), np.ones(4, np.float64).tobytes()],
    "nan-gradient": [packed(push_header()), np.array([1, np.nan, 1, 1], np.float32).tobytes()],
    "inf-gradient": [packed(push_header()), np.array([1, 1, -np.inf, 1], np.float32).tobytes()],
    "bad-optimizer": [packed(dict(op="init", id=3, worker=0, session=1, optimizer={"name": "pickle"},
                                  tensors=[["z", 0, "<f4", [1]]])), np.ones(1, np.float32).tobytes()],
    "pull-unreachable": [packed(dict(op="pull", id=4, worker=0, clock=0, keys=[["w", 0, 99]]))],
    "pull-bad-keys": [packed(dict(op="pull", id=4, worker=0, clock=0, keys=[["w", "0", 0]]))],
}


def test_malformed_flood_leaves_shard_alive_and_parameters_unchanged(shards):
    group = shards(1, workers=1)
    w0 = np.arange(4, dtype=np.float32)
    with psrt.Client(group.endpoints, config=small()) as c:
        c.init({"w": w0}, optimizer=psrt.SGD(lr=1.0))
        peer = RawPeer(group.endpoints[0])
        try:
            for _ in range(3):  # a flood, not a single probe
                for name, frames in MALFORMED.items():
                    reply, rest = peer.ask(frames)
                    assert reply["op"] == "error", name
                    assert reply["message"], name
                    assert rest == [], name
                    if name not in ("empty", "random-bytes", "truncated-header", "not-a-map", "bin-in-header"):
                        assert reply["id"] in (1, 3, 4, 9), name
            assert group.alive() == [True]
            np.testing.assert_array_equal(c.pull()["w"], w0)
            stats = c.stats()[0]
            assert stats["errors"] == 3 * len(MALFORMED) and stats["rounds"] == 0
            # ... and it still serves good requests.
            np.testing.assert_array_equal(c.push_pull({"w": np.ones(4, np.float32)})["w"], w0 - 1)
        finally:
            peer.close()


def test_error_reply_says_what_was_wrong(shards):
    group = shards(1)
    with psrt.Client(group.endpoints, config=small()) as c:
        c.init({"w": np.zeros(4, np.float32)})
        peer = RawPeer(group.endpoints[0])
        try:
            reply, _ = peer.ask(MALFORMED["wrong-byte-count"])
            assert reply["code"] == "protocol" and "12 bytes" in reply["message"] and "needs 16" in reply["message"]
            reply, _ = peer.ask(MALFORMED["unknown-dtype"])
            assert "'<i4' is not allowed" in reply["message"]
            reply, _ = peer.ask(MALFORMED["nan-gradient"])
            assert reply["code"] == "nonfinite"
            reply, _ = peer.ask(MALFORMED["unknown-key"])
            assert reply["code"] == "unknown_key"
        finally:
            peer.close()


def test_duplicate_push_is_acknowledged_but_applied_once(shards):
    group = shards(1, workers=1, mode="async")
    with psrt.Client(group.endpoints, config=small()) as c:
        c.init({"w": np.zeros(4, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        peer = RawPeer(group.endpoints[0])
        try:
            frames = wire.encode(push_header(worker=5, session=77, seq=0), [np.ones(4, np.float32)])
            first, _ = peer.ask([bytes(f) for f in frames])
            again, _ = peer.ask([bytes(f) for f in frames])
            assert first["op"] == again["op"] == "ack"
            assert first["duplicate"] is False and again["duplicate"] is True
            np.testing.assert_array_equal(c.pull()["w"], -np.ones(4, np.float32))
            # A new session of the same worker (a restart) starts a fresh sequence.
            frames = wire.encode(push_header(worker=5, session=78, seq=0), [np.ones(4, np.float32)])
            restarted, _ = peer.ask([bytes(f) for f in frames])
            assert restarted["duplicate"] is False
            np.testing.assert_array_equal(c.pull()["w"], np.full(4, -2.0, np.float32))
            assert c.stats()[0]["duplicates"] == 1
        finally:
            peer.close()


def test_a_push_ack_says_when_the_push_was_taken_in_and_how_long_its_answer_was_held(shards):
    """A push's ack carries ``taken`` (the shard's clock when it took the message in) and ``held`` (how long until
    this answer), which a worker's pipeline paces its pushes by. An early sync push, held whole until its round
    opens, says when it came, not when it joined."""
    group = shards(1, workers=2, mode="sync")
    with psrt.Client(group.endpoints, config=small(), rank=0, num_workers=2) as c:
        c.init({"w": np.zeros(4, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        a, b = RawPeer(group.endpoints[0]), RawPeer(group.endpoints[0])
        try:
            ones = [np.ones(4, np.float32)]
            first, _ = a.ask([bytes(f) for f in wire.encode(push_header(worker=0, session=7, seq=0), ones)])
            assert first["op"] == "ack" and 0 <= first["held"] < 1e9 and first["taken"] > 0
            a.send([bytes(f) for f in wire.encode(push_header(id=10, worker=0, session=7, seq=1), ones)])
            assert not a.answered(0.3)  # round 2 waits for round 1, which waits for worker 1
            closing, _ = b.ask([bytes(f) for f in wire.encode(push_header(worker=1, session=8, seq=0), ones)])
            early, _ = a.recv()
            assert early["id"] == 10 and early["versions"] == [2]
            assert first["taken"] < early["taken"] < closing["taken"]
            assert early["held"] >= 0.3e9 and early["taken"] + early["held"] >= closing["taken"]
        finally:
            a.close()
            b.close()


def test_a_push_overtaken_by_a_later_one_is_applied_once_not_taken_for_a_duplicate(shards):
    """A push lost in a dying connection is sent again after the reconnect, behind a later one that sat queued
    in the DEALER's pipe: the shard sees seq 2 before seq 1. Seq 1 is applied (once), seq 2 sent again is not."""
    from psrt.shard.replay import REPLAY_WINDOW

    group = shards(1, workers=1, mode="async")
    with psrt.Client(group.endpoints, config=small()) as c:
        c.init({"w": np.zeros(4, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        peer = RawPeer(group.endpoints[0])
        try:
            def push(seq: int, value: float) -> dict:
                frames = wire.encode(push_header(worker=5, session=77, seq=seq), [np.full(4, value, np.float32)])
                return peer.ask([bytes(f) for f in frames])[0]

            assert [push(0, 1.0)["duplicate"], push(2, 4.0)["duplicate"]] == [False, False]
            assert push(1, 2.0)["duplicate"] is False  # below the highest applied, but never applied
            assert [push(1, 2.0)["duplicate"], push(2, 4.0)["duplicate"]] == [True, True]
            np.testing.assert_array_equal(c.pull()["w"], np.full(4, -7.0, np.float32))
            # Older than the window: refused with an error, neither applied nor acknowledged.
            assert push(REPLAY_WINDOW + 3, 8.0)["duplicate"] is False
            refused = push(3, 16.0)
            assert refused["op"] == "error" and refused["code"] == "replay_window", refused
            np.testing.assert_array_equal(c.pull()["w"], np.full(4, -15.0, np.float32))
            assert c.stats()[0]["duplicates"] == 2
        finally:
            peer.close()


def test_push_pull_async_overlaps(shards):
    group = shards(2, workers=1)
    with psrt.Client(group.endpoints, config=small(partition_bytes=1 << 16)) as c:
        c.init({"a": np.zeros(50_000, np.float32), "b": np.zeros(7, np.float32)}, optimizer=psrt.SGD(lr=0.5))
        handles = [c.push_pull_async({"a": np.ones(50_000, np.float32), "b": np.ones(7, np.float32)})
                   for _ in range(5)]
        results = [h.wait(timeout=10) for h in handles]
        for i, r in enumerate(results, start=1):
            np.testing.assert_array_equal(r["a"], np.full(50_000, -0.5 * i, np.float32))
            np.testing.assert_array_equal(r["b"], np.full(7, -0.5 * i, np.float32))


def test_pull_into_caller_arrays(shards):
    group = shards(2, workers=1)
    with psrt.Client(group.endpoints, config=small(partition_bytes=1 << 16)) as c:
        c.init({"a": np.zeros(50_000, np.float32), "b": np.zeros((3, 4))}, optimizer=psrt.SGD(lr=1.0))
        buf = {"a": np.full(50_000, 7, np.float32)}
        got = c.push_pull({"a": np.ones(50_000, np.float32), "b": np.ones((3, 4))}, out=buf)
        assert got["a"] is buf["a"]
        np.testing.assert_array_equal(buf["a"], -np.ones(50_000, np.float32))
        np.testing.assert_array_equal(got["b"], -np.ones((3, 4)))
        assert c.pull(out=got)["b"] is got["b"]
        with pytest.raises(psrt.ConfigError, match="shape"):
            c.pull(out={"a": np.zeros(10, np.float32)})
        with pytest.raises(psrt.ConfigError, match="writable"):
            ro = np.zeros(50_000, np.float32)
            ro.setflags(write=False)
            c.pull(out={"a": ro})


def test_a_pull_right_after_an_unacknowledged_push_waits_for_its_round(shards):
    """push_async then pull_async at once, before the ack is back: the pull still includes this worker's push."""
    group = shards(1, workers=2)
    with psrt.Client(group.endpoints, rank=0, num_workers=2) as a, \
            psrt.Client(group.endpoints, rank=1, num_workers=2) as b:
        for c in (a, b):
            c.init({"w": np.zeros(4, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        a.push_async({"w": np.full(4, 2.0, np.float32)})
        pulled = a.pull_async()  # sent before a has seen its push's ack
        assert not pulled.done()  # the round waits for worker 1
        b.push({"w": np.full(4, 4.0, np.float32)})
        np.testing.assert_array_equal(pulled.wait(timeout=20)["w"], np.full(4, -3.0, np.float32))
