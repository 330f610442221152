"""Gradient compression on the wire: fp16 and bf16 pushes, widened to float32 on the shard."""

from __future__ import annotations

import numpy as np
import pytest

import psrt
from psrt.config import ClientConfig
from psrt.wire import compression


@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_encode_decode_round_trip_within_the_format_precision(codec):
    rng = np.random.default_rng(0)
    g = (rng.standard_normal(10_000) * 10.0 ** rng.integers(-3, 3, 10_000)).astype(np.float32)
    name, packed = compression.encode(codec, g)
    assert name == compression.WIRE_NAMES[codec] and packed.nbytes == g.nbytes // 2
    back = compression.decode(codec, packed.tobytes())
    assert back.dtype == np.float32 and back.flags.writeable
    rel = 2.0 ** -11 if codec == "fp16" else 2.0 ** -8  # half a unit in the last place, relative
    big = np.abs(g) > 1e-4  # fp16 loses relative precision among its subnormals
    assert np.all(np.abs(back[big] - g[big]) <= rel * np.abs(g[big]))


def test_bf16_rounds_to_nearest_even_and_keeps_nan():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, np.inf, -np.inf, np.nan], np.float32)
    back = compression.decode("bf16", compression.encode("bf16", x)[1].tobytes())
    assert back[:6].tolist() == [1.0, 1.0, 1.0 + 2**-6, -2.5, np.inf, -np.inf]  # ties go to the even mantissa
    assert np.isnan(back[6])


def test_fp16_never_turns_a_large_gradient_into_inf():
    assert compression.encode("fp16", np.array([1.0, 70_000.0], np.float32)) is None  # sent as float32
    assert compression.encode("fp16", np.array([1.0, np.nan], np.float32)) is None
    assert compression.encode("fp16", np.ones(3, np.float64)) is None  # float64 is never compressed
    assert compression.encode("fp16", np.ones(3, np.float32))[0] == "<f2"


@pytest.mark.integration
@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_compressed_pushes_halve_the_bytes_and_train_like_float32(shards, codec):
    """The same gradients pushed at full precision and compressed: fp16 ends within 1e-3 of float32 (the target);
    bf16, with 8 bits of mantissa against fp16's 11, within 5e-3."""
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(50_000).astype(np.float32) * 0.01 for _ in range(20)]
    finals, pushed = {}, {}
    for mode in (None, codec):
        group = shards(1, workers=1)
        # Bytes on the socket: float32 pushes stay off shared memory here, as between hosts.
        with psrt.Client(group.endpoints, config=ClientConfig(compression=mode, shm=False)) as c:
            c.init({"w": np.ones(50_000, np.float32)}, optimizer=psrt.SGD(lr=0.5, momentum=0.9))
            before = c.stats()[0]["bytes_in"]
            for g in grads:
                c.push({"w": g})
            pushed[mode] = (c.stats()[0]["bytes_in"] - before) / len(grads)
            finals[mode] = c.pull()["w"]
    assert pushed[codec] <= 0.55 * pushed[None], pushed
    np.testing.assert_allclose(finals[codec], finals[None], rtol=1e-3 if codec == "fp16" else 5e-3)


@pytest.mark.integration
def test_a_gradient_out_of_fp16_range_travels_at_full_precision(shards):
    group = shards(1, workers=1)
    with psrt.Client(group.endpoints, compression="fp16") as c:
        c.init({"w": np.zeros(4, np.float32), "small": np.zeros(4, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        out = c.push_pull({"w": np.array([1e6, 1.0, 2.0, 3.0], np.float32), "small": np.full(4, 0.5, np.float32)})
    np.testing.assert_array_equal(out["w"], [-1e6, -1.0, -2.0, -3.0])  # exact: not Inf, not rounded
    np.testing.assert_array_equal(out["small"], [-0.5] * 4)


def test_an_unknown_compression_is_refused():
    with pytest.raises(psrt.ConfigError, match="compression must be one of"):
        ClientConfig(compression="zstd")


@pytest.mark.integration
@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_a_16_bit_push_pull_gets_16_bit_parameters_back_and_pull_gets_full_precision(shards, codec):
    group = shards(1, workers=1)
    w0 = np.random.default_rng(2).standard_normal(20_000).astype(np.float32)
    with psrt.Client(group.endpoints, compression=codec) as c:
        c.init({"w": w0}, optimizer=psrt.SGD(lr=0.0))  # lr 0: the parameters stay w0
        before = c.stats()[0]["bytes_out"]
        got = c.push_pull({"w": np.zeros(20_000, np.float32)})["w"]
        sent = c.stats()[0]["bytes_out"] - before
        assert got.dtype == np.float32
        assert sent < 0.55 * w0.nbytes  # the reply carried 2 bytes a value
        rel = 2.0 ** -11 if codec == "fp16" else 2.0 ** -8
        big = np.abs(w0) > 1e-3
        assert np.all(np.abs(got[big] - w0[big]) <= rel * np.abs(w0[big]))
        np.testing.assert_array_equal(c.pull()["w"], w0)  # a plain pull: full precision
