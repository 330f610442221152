"""Top-k gradient sparsification with error feedback: the codec, the bytes it saves, coverage over time, and the
shard's refusal of hostile top-k frames (an error reply, nothing changed)."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import RawPeer, packed, serving

import psrt
from psrt.config import ClientConfig
from psrt.wire import compression


def test_topk_sends_the_largest_entries_and_keeps_the_rest_as_residual():
    rng = np.random.default_rng(0)
    g = rng.standard_normal(1000).astype(np.float32)
    residuals: dict = {}
    name, packed = compression.encode("topk:0.01", g, residuals, ("w", 0))
    assert name == "topk" and packed.nbytes == 8 * 10
    index = packed[:10]
    assert np.all(np.diff(index) > 0)  # strictly increasing
    assert set(index.tolist()) == set(np.argsort(-np.abs(g))[:10].tolist())
    compression.check_frame(packed.tobytes(), 1000)
    dense = compression.decode("topk", packed.tobytes(), 1000)
    np.testing.assert_array_equal(dense + residuals[("w", 0)], g)  # nothing lost: sent + kept = gradient
    # The next push sends the top-k of gradient + residual.
    name, again = compression.encode("topk:0.01", g, residuals, ("w", 0))
    total = g + (g - dense)
    assert set(again[:10].tolist()) == set(np.argsort(-np.abs(total))[:10].tolist())


def test_topk_ratio_is_checked():
    assert compression.check("topk:0.01") == "topk:0.01"
    assert ClientConfig(compression="topk:1").compression == "topk:1"
    for bad in ("topk:0", "topk:1.5", "topk:-0.1", "topk:x", "topk:nan", "topk:", "topk"):
        with pytest.raises(psrt.ConfigError, match="topk:RATIO"):
            ClientConfig(compression=bad)


def test_a_nonfinite_chunk_goes_dense_and_drops_its_residual():
    residuals = {("w", 0): np.ones(4, np.float32)}
    assert compression.encode("topk:0.5", np.array([1, np.nan, 0, 0], np.float32), residuals, ("w", 0)) is None
    assert ("w", 0) not in residuals
    assert compression.encode("topk:0.5", np.ones(3, np.float64), residuals, ("w", 0)) is None


def _pushed_bytes(shards, codec, grads, n):
    group = shards(1, workers=1)
    # Bytes on the socket: full-precision pushes stay off shared memory here, as between hosts.
    with psrt.Client(group.endpoints, config=ClientConfig(compression=codec, shm=False)) as c:
        c.init({"w": np.zeros(n, np.float32)}, optimizer=psrt.SGD(lr=0.1))
        before = c.stats()[0]["bytes_in"]
        for g in grads:
            c.push({"w": g})
        return (c.stats()[0]["bytes_in"] - before) / len(grads), c.pull()["w"]


@pytest.mark.integration
def test_topk_001_sends_at_most_3_percent_of_the_bytes(shards):
    rng = np.random.default_rng(1)
    n = 100_000
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(5)]
    dense, _ = _pushed_bytes(shards, None, grads, n)
    sparse, w = _pushed_bytes(shards, "topk:0.01", grads, n)
    assert sparse <= 0.03 * dense, (sparse, dense)
    assert 0 < np.count_nonzero(w) <= 5 * 1000


@pytest.mark.integration
def test_topk_ratio_one_trains_exactly_like_float32(shards):
    rng = np.random.default_rng(2)
    grads = [rng.standard_normal(1000).astype(np.float32) for _ in range(5)]
    _, dense = _pushed_bytes(shards, None, grads, 1000)
    _, sparse = _pushed_bytes(shards, "topk:1", grads, 1000)
    np.testing.assert_array_equal(sparse, dense)


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_a_constant_gradient_reaches_half_the_parameters_within_200_steps(shards, mode):
    """Error feedback: entries too small to be sent grow in the residual until they are."""
    n = 10_000
    g = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    group = shards(1, workers=1, mode=mode)
    with psrt.Client(group.endpoints, compression="topk:0.01") as c:
        c.init({"w": np.zeros(n, np.float32)}, optimizer=psrt.SGD(lr=0.01))
        for _ in range(200):
            w = c.push_pull({"w": g})["w"]
    moved = np.count_nonzero(w) / n
    assert moved >= 0.5, moved
    assert np.all(np.sign(w[w != 0]) == -np.sign(g[w != 0]))  # every step went downhill


# ---------------------------------------------------------------------------------------------- hostile frames
def _frame(index, values) -> bytes:
    return np.asarray(index, "<i4").tobytes() + np.asarray(values, "<f4").tobytes()


def _push(dname="topk", shape=(8,), op="push", **extra) -> bytes:
    fields = dict(worker=0, session=1, seq=0, clock=1) if op == "push" else dict(worker=0, session=1, optimizer={})
    return packed({"op": op, "id": 7, **fields, "tensors": [["w", 0, dname, list(shape)]], **extra})


HOSTILE = {
    "unsorted": [_push(), _frame([3, 1], [1, 1])],
    "duplicate": [_push(), _frame([2, 2], [1, 1])],
    "out-of-range": [_push(), _frame([1, 8], [1, 1])],
    "negative-index": [_push(), _frame([-1, 2], [1, 1])],
    "length-not-8k": [_push(), _frame([1, 2], [1, 1]) + b"\0"],
    "k-over-count": [_push(shape=(1,)), _frame([0, 1], [1, 1])],
    "truncated": [_push(), _frame([1], [1])[:6]],
    "nan-value": [_push(), _frame([1, 2], [1, np.nan])],
    "topk-in-init": [_push(op="init"), _frame([1], [1])],
    "shape-mismatch": [_push(shape=(4,)), _frame([1], [1])],
}


@pytest.mark.integration
def test_hostile_topk_frames_are_refused_and_change_nothing(shards):
    group = shards(1, workers=1)
    w0 = np.arange(8, dtype=np.float32)
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=20)) as c:
        c.init({"w": w0}, optimizer=psrt.SGD(lr=1.0))
        peer = RawPeer(group.endpoints[0])
        try:
            for name, frames in HOSTILE.items():
                peer.send(frames)
                assert peer.answered(5.0), name
                reply, _ = peer.recv()
                assert reply["op"] == "error" and reply["message"], name
            np.testing.assert_array_equal(c.pull()["w"], w0)
            stats = c.stats()[0]
            assert stats["errors"] == len(HOSTILE) and stats["rounds"] == 0 and stats["pushes"] == 0
            # A well-formed top-k frame from the same peer is taken: entries 1 and 5 move, nothing else.
            assert peer.ask([_push(), _frame([1, 5], [1.0, -2.0])])[0]["op"] == "ack"
            np.testing.assert_array_equal(c.pull()["w"], w0 - np.array([0, 1, 0, 0, 0, -2, 0, 0], np.float32))
        finally:
            peer.close()


# ---------------------------------------------------------------------------------------------- the residual's life
def test_undo_takes_out_one_push_and_keeps_the_pushes_encoded_after_it():
    rng = np.random.default_rng(4)
    key, residuals = ("w", 0), {}
    compression.encode("topk:0.1", rng.standard_normal(100).astype(np.float32), residuals, key)
    start = residuals[key]
    first, second = [], []
    g1, g2 = (rng.standard_normal(100).astype(np.float32) for _ in range(2))
    compression.encode("topk:0.1", g1, residuals, key, first)
    _, sent = compression.encode("topk:0.1", g2, residuals, key, second)  # in flight behind the first
    compression.undo(residuals, first)  # the shard refused the first
    dense = compression.decode("topk", sent.tobytes(), 100)
    # What is owed: everything accepted (the start's residual, g2) less what was sent of it.
    np.testing.assert_allclose(residuals[key], start + g2 - dense, rtol=1e-6, atol=1e-6)
    compression.undo(residuals, second)
    np.testing.assert_allclose(residuals[key], start, rtol=1e-6, atol=1e-6)


@pytest.mark.integration
def test_a_refused_push_gives_back_what_it_took_from_the_residuals(shards):
    group = shards(1, workers=1)  # --nonfinite reject: a push holding a NaN is refused whole
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=20, compression="topk:0.5")) as c:
        c.init({"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        first = np.array([1, 2, 3, 4], np.float32)
        c.push({"a": first, "b": first})  # sends 3 and 4 of each; 1 and 2 are owed
        with pytest.raises(psrt.ServerError, match="nonfinite"):
            # a: top-k of [11, 12, 10, 10], which took 11 and 12 from the residual; b: NaN, sent dense
            c.push({"a": np.full(4, 10, np.float32), "b": np.array([np.nan, 0, 0, 0], np.float32)})
        got = c.push_pull({"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)})
    # The refused push changed nothing, on the shard or in the residuals: the zero push sends what is owed, 1 and 2.
    for name in ("a", "b"):
        np.testing.assert_array_equal(got[name], -first, err_msg=name)


def test_a_topk_frame_over_the_shards_frame_limit_goes_dense():
    from psrt.config import ServerConfig, WireLimits

    limit = 1 << 16
    limits = WireLimits(max_header_bytes=4096, max_tensor_bytes=limit)  # sockets: MAXMSGSIZE of limit + 1 KiB
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", limits=limits)) as server:
        n = limit // 4  # its dense chunk is exactly the limit; at topk:1 its frame would be twice that
        config = ClientConfig(timeout=5, compression="topk:1", limits=limits, partition_bytes=limit)
        with psrt.Client([server.endpoint], config=config) as c:
            c.init({"w": np.zeros(n, np.float32)}, optimizer=psrt.SGD(lr=1.0))
            g = np.arange(n, dtype=np.float32)
            got = c.push_pull({"w": g})  # the socket used to cut the 2x frame off: a timeout
        np.testing.assert_array_equal(got["w"], -g)


@pytest.mark.integration
def test_a_restarted_shard_gets_no_residual_owed_to_its_earlier_life(tmp_path):
    import signal

    from psrt.control.process import SERVER_READY, Child, psrt_command

    serve = ("server", "--workers", "1", "--mode", "async", "--checkpoint-dir", str(tmp_path))
    shard = Child(psrt_command(*serve, "--bind", "tcp://127.0.0.1:*"), label="shard", ready=SERVER_READY)
    restarted = None
    try:
        endpoint = shard.wait_ready(30).group(1)
        with psrt.Client([endpoint], config=ClientConfig(timeout=20, compression="topk:0.5")) as c:
            c.init({"w": np.zeros(4, np.float32)}, optimizer=psrt.SGD(lr=1.0))
            c.push({"w": np.array([1, 2, 3, 4], np.float32)})  # 1 and 2 owed
            c.checkpoint()
            shard.signal(signal.SIGKILL)
            shard.wait(10)
            restarted = Child(psrt_command(*serve, "--bind", endpoint, "--restore"), label="shard",
                              ready=SERVER_READY)
            restarted.wait_ready(30)
            c.stats()  # the client sees the shard come back
            got = c.push_pull({"w": np.zeros(4, np.float32)})
        # The residual was reset with the shard: a zero push moves nothing (it used to send the 1 and 2).
        np.testing.assert_array_equal(got["w"], np.array([0, 0, -3, -4], np.float32))
    finally:
        for child in (shard, restarted):
            if child is not None:
                child.stop()
