"""The compiled kernels (psrt.kernels) against their NumPy twins (psrt.kernels.reference); the wrappers' checks."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _helpers import RTOL, assert_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from psrt import _core, kernels
from psrt.errors import KernelArgumentError, KernelTypeError
from psrt.kernels import reference

DTYPES = [np.float32, np.float64]
ODD_SIZES = [0, 1, 7, 1023, 65537]

HSETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def rand(rng: np.random.Generator, n: int, dtype, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(n) * scale).astype(dtype)


def values(dtype, n: int, lo: float = -100.0, hi: float = 100.0):
    width = 32 if np.dtype(dtype) == np.float32 else 64
    return hnp.arrays(np.dtype(dtype), n, elements=st.floats(lo, hi, width=width))


# Hyperparameter strategies, bounded to the ranges an optimizer is used in.
lrs = st.floats(0.0, 1.0)
scales = st.floats(0.0, 4.0)
decays = st.floats(0.0, 0.1)
momenta = st.floats(0.0, 0.99)
beta1s = st.floats(0.0, 0.99)
beta2s = st.floats(0.0, 0.9999)
epss = st.floats(1e-8, 1e-2)


# ---------------------------------------------------------------------------------------------------------------
# Kernel == reference, deterministic odd sizes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ODD_SIZES)
def test_accumulate_matches_reference(dtype, n):
    rng = np.random.default_rng(n)
    dst, src = rand(rng, n, dtype), rand(rng, n, dtype)
    want = dst.copy()
    reference.accumulate(want, src)
    src_before = src.copy()
    assert kernels.accumulate(dst, src) is None
    np.testing.assert_array_equal(dst, want)  # one IEEE add per element: exact
    np.testing.assert_array_equal(src, src_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ODD_SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_sgd_step_matches_reference(dtype, n, weight_decay):
    rng = np.random.default_rng(n + 1)
    param, grad = rand(rng, n, dtype), rand(rng, n, dtype)
    want = param.copy()
    for _ in range(3):
        kernels.sgd_step(param, grad, 0.1, 0.5, weight_decay)
        reference.sgd_step(want, grad, 0.1, 0.5, weight_decay)
        assert_close(param, want)
    if n:
        assert not np.array_equal(param, grad)  # something happened


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ODD_SIZES)
@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_step_matches_reference_over_steps(dtype, n, nesterov):
    rng = np.random.default_rng(n + 2)
    param = rand(rng, n, dtype)
    buf = np.zeros(n, dtype)
    want_p, want_b = param.copy(), buf.copy()
    for _ in range(4):
        grad = rand(rng, n, dtype)
        kernels.momentum_step(param, buf, grad, 0.05, 0.9, 0.5, 0.01, nesterov)
        reference.momentum_step(want_p, want_b, grad, 0.05, 0.9, 0.5, 0.01, nesterov)
        assert_close(param, want_p)
        assert_close(buf, want_b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ODD_SIZES)
@pytest.mark.parametrize(("weight_decay", "l2"), [(0.0, 0.0), (0.01, 0.0), (0.0, 0.01), (0.02, 0.005)])
def test_adam_step_matches_reference_over_steps(dtype, n, weight_decay, l2):
    rng = np.random.default_rng(n + 3)
    param = rand(rng, n, dtype)
    m, v = np.zeros(n, dtype), np.zeros(n, dtype)
    want = [param.copy(), m.copy(), v.copy()]
    for step in range(1, 6):
        grad = rand(rng, n, dtype)
        kernels.adam_step(param, m, v, grad, 1e-2, 0.9, 0.999, 1e-8, step, 1.0, weight_decay, l2)
        reference.adam_step(*want, grad, 1e-2, 0.9, 0.999, 1e-8, step, 1.0, weight_decay, l2)
        for got, exp in zip((param, m, v), want):
            assert_close(got, exp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ODD_SIZES)
def test_adagrad_step_matches_reference_over_steps(dtype, n):
    rng = np.random.default_rng(n + 4)
    param = rand(rng, n, dtype)
    acc = np.full(n, 0.1, dtype)
    want_p, want_a = param.copy(), acc.copy()
    for _ in range(4):
        grad = rand(rng, n, dtype)
        kernels.adagrad_step(param, acc, grad, 0.1, 1e-10, 0.5, 0.01)
        reference.adagrad_step(want_p, want_a, grad, 0.1, 1e-10, 0.5, 0.01)
        assert_close(param, want_p)
        assert_close(acc, want_a)


@pytest.mark.parametrize("dtype", DTYPES)
def test_multidimensional_contiguous_arrays_are_accepted(dtype):
    rng = np.random.default_rng(5)
    param = rand(rng, 24, dtype).reshape(2, 3, 4)
    grad = rand(rng, 24, dtype).reshape(4, 6)  # same element count, other shape
    want = param.copy()
    kernels.sgd_step(param, grad, 0.1)
    reference.sgd_step(want.reshape(-1), grad.reshape(-1), 0.1)
    assert param.shape == (2, 3, 4)
    assert_close(param, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_first_step_is_bias_corrected(dtype):
    # With step counting from 1, the first Adam step moves each parameter by lr * g / (|g| + eps): about lr.
    rng = np.random.default_rng(6)
    n = 101
    param, grad = rand(rng, n, dtype), rand(rng, n, dtype)
    start = param.copy()
    m, v = np.zeros(n, dtype), np.zeros(n, dtype)
    kernels.adam_step(param, m, v, grad, 0.01, 0.9, 0.999, 1e-8, 1)
    g = grad.astype(np.float64)
    expected = start.astype(np.float64) - 0.01 * g / (np.abs(g) + 1e-8)
    np.testing.assert_allclose(param, expected, rtol=RTOL[np.dtype(dtype)] * 10, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Kernel == reference, hypothesis
# ---------------------------------------------------------------------------------------------------------------


@st.composite
def sized(draw, dtype, k: int, max_n: int = 64, lo: float = -100.0, hi: float = 100.0):
    n = draw(st.integers(0, max_n))
    return [draw(values(dtype, n, lo, hi)) for _ in range(k)]


@HSETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_accumulate_hypothesis(data, dtype):
    dst, src = data.draw(sized(dtype, 2))
    want = dst.copy()
    reference.accumulate(want, src)
    kernels.accumulate(dst, src)
    np.testing.assert_array_equal(dst, want)


@HSETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES), lr=lrs, scale=scales, wd=decays)
def test_sgd_step_hypothesis(data, dtype, lr, scale, wd):
    param, grad = data.draw(sized(dtype, 2))
    want = param.copy()
    kernels.sgd_step(param, grad, lr, scale, wd)
    reference.sgd_step(want, grad, lr, scale, wd)
    assert_close(param, want)


@HSETTINGS
@given(
    data=st.data(), dtype=st.sampled_from(DTYPES), steps=st.integers(1, 4), lr=lrs, mu=momenta, scale=scales,
    wd=decays, nesterov=st.booleans(),
)
def test_momentum_step_hypothesis(data, dtype, steps, lr, mu, scale, wd, nesterov):
    param, *grads = data.draw(sized(dtype, 1 + steps))
    buf = np.zeros_like(param)
    want_p, want_b = param.copy(), buf.copy()
    for grad in grads:
        kernels.momentum_step(param, buf, grad, lr, mu, scale, wd, nesterov)
        reference.momentum_step(want_p, want_b, grad, lr, mu, scale, wd, nesterov)
        assert_close(param, want_p)
        assert_close(buf, want_b)


@HSETTINGS
@given(
    data=st.data(), dtype=st.sampled_from(DTYPES), steps=st.integers(1, 4), first=st.integers(1, 1000),
    lr=st.floats(0.0, 0.1), b1=beta1s, b2=beta2s, eps=epss, scale=scales, wd=decays, l2=decays,
)
def test_adam_step_hypothesis(data, dtype, steps, first, lr, b1, b2, eps, scale, wd, l2):
    param, *grads = data.draw(sized(dtype, 1 + steps, lo=-10.0, hi=10.0))
    state = [param, np.zeros_like(param), np.zeros_like(param)]
    want = [a.copy() for a in state]
    for step, grad in enumerate(grads, start=first):
        kernels.adam_step(*state, grad, lr, b1, b2, eps, step, scale, wd, l2)
        reference.adam_step(*want, grad, lr, b1, b2, eps, step, scale, wd, l2)
        for got, exp in zip(state, want):
            assert_close(got, exp)


@HSETTINGS
@given(
    data=st.data(), dtype=st.sampled_from(DTYPES), steps=st.integers(1, 4), lr=lrs, eps=st.floats(1e-10, 1e-2),
    scale=scales, wd=decays, init=st.floats(0.0, 1.0),
)
def test_adagrad_step_hypothesis(data, dtype, steps, lr, eps, scale, wd, init):
    param, *grads = data.draw(sized(dtype, 1 + steps, lo=-10.0, hi=10.0))
    acc = np.full_like(param, init)
    want_p, want_a = param.copy(), acc.copy()
    for grad in grads:
        kernels.adagrad_step(param, acc, grad, lr, eps, scale, wd)
        reference.adagrad_step(want_p, want_a, grad, lr, eps, scale, wd)
        assert_close(param, want_p)
        assert_close(acc, want_a)


@HSETTINGS
@given(n=st.integers(0, 70_000), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**32 - 1))
def test_accumulate_any_size(n, dtype, seed):
    rng = np.random.default_rng(seed)
    dst, src = rand(rng, n, dtype), rand(rng, n, dtype)
    want = dst + src
    kernels.accumulate(dst, src)
    np.testing.assert_array_equal(dst, want)


# ---------------------------------------------------------------------------------------------------------------
# Read-only inputs
# ---------------------------------------------------------------------------------------------------------------


def _readonly_variants(arr: np.ndarray) -> list[np.ndarray]:
    flagged = arr.copy()
    flagged.setflags(write=False)
    from_bytes = np.frombuffer(arr.tobytes(), dtype=arr.dtype)
    assert not flagged.flags.writeable and not from_bytes.flags.writeable
    return [flagged, from_bytes]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", [0, 1])
def test_readonly_inputs_are_accepted(dtype, variant):
    rng = np.random.default_rng(7)
    n = 257
    grad = rand(rng, n, dtype)
    ro = _readonly_variants(grad)[variant]
    base = rand(rng, n, dtype)

    dst, want = base.copy(), base.copy()
    kernels.accumulate(dst, ro)
    reference.accumulate(want, grad)
    np.testing.assert_array_equal(dst, want)

    p, want = base.copy(), base.copy()
    kernels.sgd_step(p, ro, 0.1, 1.0, 0.01)
    reference.sgd_step(want, grad, 0.1, 1.0, 0.01)
    assert_close(p, want)

    p, b = base.copy(), np.zeros(n, dtype)
    wp, wb = base.copy(), np.zeros(n, dtype)
    kernels.momentum_step(p, b, ro, 0.1, 0.9, nesterov=True)
    reference.momentum_step(wp, wb, grad, 0.1, 0.9, nesterov=True)
    assert_close(p, wp)

    st_ = [base.copy(), np.zeros(n, dtype), np.zeros(n, dtype)]
    want_ = [a.copy() for a in st_]
    kernels.adam_step(*st_, ro, 0.01, 0.9, 0.999, 1e-8, 1)
    reference.adam_step(*want_, grad, 0.01, 0.9, 0.999, 1e-8, 1)
    assert_close(st_[0], want_[0])

    p, a = base.copy(), np.zeros(n, dtype)
    wp, wa = base.copy(), np.zeros(n, dtype)
    kernels.adagrad_step(p, a, ro, 0.1, 1e-10)
    reference.adagrad_step(wp, wa, grad, 0.1, 1e-10)
    assert_close(p, wp)

    assert kernels.all_finite(ro) is True
    np.testing.assert_array_equal(ro, grad)  # inputs untouched


# ---------------------------------------------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------------------------------------------


def _workload(seed: int, dtype) -> list[np.ndarray]:
    """Several kernels, several steps, on arrays owned by this call; returns the final state."""
    rng = np.random.default_rng(seed)
    n = 50_001
    param = rand(rng, n, dtype)
    buf, m, v, acc = (np.zeros(n, dtype) for _ in range(4))
    total = np.zeros(n, dtype)
    for step in range(1, 4):
        grad = rand(rng, n, dtype)
        kernels.accumulate(total, grad)
        kernels.momentum_step(param, buf, grad, 0.01, 0.9, nesterov=bool(step % 2))
        kernels.adam_step(param, m, v, grad, 1e-3, 0.9, 0.999, 1e-8, step, 0.5, 0.01, 0.001)
        kernels.adagrad_step(param, acc, grad, 0.01, 1e-10)
        kernels.sgd_step(param, total, 1e-3)
    assert kernels.all_finite(param)
    return [param, buf, m, v, acc, total]


@pytest.mark.parametrize("dtype", DTYPES)
def test_threads_on_separate_arrays_match_sequential(dtype):
    seeds = list(range(8))
    sequential = [_workload(s, dtype) for s in seeds]
    barrier = threading.Barrier(4)

    def run(seed):
        if seed < 4:
            barrier.wait(timeout=30)  # start the first four together so they overlap
        return _workload(seed, dtype)

    with ThreadPoolExecutor(max_workers=4) as pool:
        concurrent = list(pool.map(run, seeds))
    for seq, conc in zip(sequential, concurrent):
        for a, b in zip(seq, conc):
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------------


def _calls(dtype=np.float32, n: int = 5):
    """name -> (callable taking a dict of arrays, the dict of arrays, output names) for each kernel."""
    z = lambda: np.zeros(n, dtype)  # noqa: E731
    return {
        "accumulate": (lambda a: kernels.accumulate(a["dst"], a["src"]), {"dst": z(), "src": z()}, ["dst"]),
        "sgd_step": (lambda a: kernels.sgd_step(a["param"], a["grad"], 0.1), {"param": z(), "grad": z()}, ["param"]),
        "momentum_step": (
            lambda a: kernels.momentum_step(a["param"], a["buf"], a["grad"], 0.1, 0.9),
            {"param": z(), "buf": z(), "grad": z()},
            ["param", "buf"],
        ),
        "adam_step": (
            lambda a: kernels.adam_step(a["param"], a["m"], a["v"], a["grad"], 0.1, 0.9, 0.999, 1e-8, 1),
            {"param": z(), "m": z(), "v": z(), "grad": z()},
            ["param", "m", "v"],
        ),
        "adagrad_step": (
            lambda a: kernels.adagrad_step(a["param"], a["acc"], a["grad"], 0.1, 1e-10),
            {"param": z(), "acc": z(), "grad": z()},
            ["param", "acc"],
        ),
    }


KERNEL_NAMES = list(_calls())
ARG_CASES = [(k, arg) for k, (_, arrays, _) in _calls().items() for arg in arrays]
OUT_CASES = [(k, arg) for k, (_, _, outs) in _calls().items() for arg in outs]


@pytest.mark.parametrize(("kernel", "arg"), ARG_CASES)
@pytest.mark.parametrize("bad", ["int32", "float16", "complex128", "int64", "object", ">f4", ">f8"])
def test_wrong_dtype_raises_kernel_type_error(kernel, arg, bad):
    fn, arrays, _ = _calls()[kernel]
    arrays[arg] = np.zeros(5, dtype=np.dtype(bad))
    with pytest.raises(KernelTypeError, match=arg) as info:
        fn(arrays)
    assert isinstance(info.value, TypeError)
    assert "float32 or float64" in str(info.value)


@pytest.mark.parametrize(("kernel", "arg"), ARG_CASES)
def test_not_an_array_raises_kernel_type_error(kernel, arg):
    fn, arrays, _ = _calls()[kernel]
    arrays[arg] = [0.0] * 5
    with pytest.raises(KernelTypeError, match=f"{arg} must be a numpy.ndarray"):
        fn(arrays)


@pytest.mark.parametrize(("kernel", "arg"), ARG_CASES)
def test_mixed_dtypes_raise_kernel_type_error(kernel, arg):
    fn, arrays, outs = _calls(np.float32)[kernel]
    arrays[arg] = np.zeros(5, np.float64)
    before = {k: a.copy() for k, a in arrays.items()}
    with pytest.raises(KernelTypeError, match="use one dtype") as info:
        fn(arrays)
    assert isinstance(info.value, TypeError)
    for k in outs:
        np.testing.assert_array_equal(arrays[k], before[k])


@pytest.mark.parametrize(("kernel", "arg"), ARG_CASES)
def test_non_contiguous_raises_kernel_argument_error(kernel, arg):
    fn, arrays, outs = _calls()[kernel]
    for a in arrays.values():
        a[:] = 1.0
    arrays[arg] = np.ones(10, np.float32)[::2]
    before = {k: a.copy() for k, a in arrays.items()}
    with pytest.raises(KernelArgumentError, match="not C-contiguous") as info:
        fn(arrays)
    assert isinstance(info.value, ValueError)
    for k in outs:  # refused before anything was written
        np.testing.assert_array_equal(arrays[k], before[k])


@pytest.mark.parametrize(("kernel", "arg"), ARG_CASES)
def test_fortran_order_raises_kernel_argument_error(kernel, arg):
    fn, arrays, _ = _calls()[kernel]
    for k in arrays:
        arrays[k] = np.zeros((2, 3), np.float32)
    arrays[arg] = np.asfortranarray(np.zeros((2, 3), np.float32))
    with pytest.raises(KernelArgumentError, match="ascontiguousarray"):
        fn(arrays)


@pytest.mark.parametrize(("kernel", "arg"), OUT_CASES)
def test_readonly_output_raises_kernel_argument_error(kernel, arg):
    fn, arrays, outs = _calls()[kernel]
    for a in arrays.values():
        a[:] = 1.0
    arrays[arg].setflags(write=False)
    before = {k: a.copy() for k, a in arrays.items()}
    with pytest.raises(KernelArgumentError, match=f"{arg} is read-only"):
        fn(arrays)
    for k in outs:  # refused before anything was written, the writable outputs too
        np.testing.assert_array_equal(arrays[k], before[k])
    arrays[arg] = np.frombuffer(bytes(20), dtype=np.float32)
    with pytest.raises(KernelArgumentError, match="read-only"):
        fn(arrays)


@pytest.mark.parametrize(("kernel", "arg"), ARG_CASES)
@pytest.mark.parametrize("length", [0, 4, 6])
def test_mismatched_lengths_raise_kernel_argument_error(kernel, arg, length):
    fn, arrays, outs = _calls(n=5)[kernel]
    for a in arrays.values():
        a[:] = 1.0
    arrays[arg] = np.ones(length, np.float32)
    before = {k: a.copy() for k, a in arrays.items()}
    with pytest.raises(KernelArgumentError, match="elements") as info:
        fn(arrays)
    assert isinstance(info.value, ValueError)
    assert "must be equal" in str(info.value)
    for k in outs:
        np.testing.assert_array_equal(arrays[k], before[k])


def _hyper_calls():
    p = lambda: np.ones(4)  # noqa: E731
    return {
        ("sgd_step", "lr"): lambda x: kernels.sgd_step(p(), p(), x),
        ("sgd_step", "scale"): lambda x: kernels.sgd_step(p(), p(), 0.1, scale=x),
        ("sgd_step", "weight_decay"): lambda x: kernels.sgd_step(p(), p(), 0.1, weight_decay=x),
        ("momentum_step", "lr"): lambda x: kernels.momentum_step(p(), p(), p(), x, 0.9),
        ("momentum_step", "momentum"): lambda x: kernels.momentum_step(p(), p(), p(), 0.1, x),
        ("momentum_step", "scale"): lambda x: kernels.momentum_step(p(), p(), p(), 0.1, 0.9, scale=x),
        ("momentum_step", "weight_decay"): lambda x: kernels.momentum_step(p(), p(), p(), 0.1, 0.9, weight_decay=x),
        ("adam_step", "lr"): lambda x: kernels.adam_step(p(), p(), p(), p(), x, 0.9, 0.999, 1e-8, 1),
        ("adam_step", "beta1"): lambda x: kernels.adam_step(p(), p(), p(), p(), 0.1, x, 0.999, 1e-8, 1),
        ("adam_step", "beta2"): lambda x: kernels.adam_step(p(), p(), p(), p(), 0.1, 0.9, x, 1e-8, 1),
        ("adam_step", "eps"): lambda x: kernels.adam_step(p(), p(), p(), p(), 0.1, 0.9, 0.999, x, 1),
        ("adam_step", "scale"): lambda x: kernels.adam_step(p(), p(), p(), p(), 0.1, 0.9, 0.999, 1e-8, 1, scale=x),
        ("adam_step", "decoupled_weight_decay"): lambda x: kernels.adam_step(
            p(), p(), p(), p(), 0.1, 0.9, 0.999, 1e-8, 1, decoupled_weight_decay=x
        ),
        ("adam_step", "l2"): lambda x: kernels.adam_step(p(), p(), p(), p(), 0.1, 0.9, 0.999, 1e-8, 1, l2=x),
        ("adagrad_step", "lr"): lambda x: kernels.adagrad_step(p(), p(), p(), x, 1e-10),
        ("adagrad_step", "eps"): lambda x: kernels.adagrad_step(p(), p(), p(), 0.1, x),
        ("adagrad_step", "scale"): lambda x: kernels.adagrad_step(p(), p(), p(), 0.1, 1e-10, scale=x),
        ("adagrad_step", "weight_decay"): lambda x: kernels.adagrad_step(p(), p(), p(), 0.1, 1e-10, weight_decay=x),
    }


@pytest.mark.parametrize("case", list(_hyper_calls()), ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), np.float32("nan")])
def test_non_finite_hyperparameter_raises(case, value):
    with pytest.raises(KernelArgumentError, match=f"{case[1]} must be a finite number") as info:
        _hyper_calls()[case](value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("step", [0, -1, -(2**70), 1.0, 2.5, True, False, "1", None, np.float64(3.0)])
def test_bad_step_raises_kernel_argument_error(step):
    param = np.ones(4)
    state = [param, np.zeros(4), np.zeros(4)]
    with pytest.raises(KernelArgumentError, match=r"step must be an integer in \[1, "):
        kernels.adam_step(*state, np.ones(4), 0.1, 0.9, 0.999, 1e-8, step)
    np.testing.assert_array_equal(param, np.ones(4))  # nothing applied


@pytest.mark.parametrize("step", [np.int64(3), np.int32(2), np.uint8(1), 2**31 - 1])
def test_numpy_and_large_integer_steps_are_accepted(step):
    state = [np.ones(4), np.zeros(4), np.zeros(4)]
    want = [a.copy() for a in state]
    grad = np.full(4, 0.5)
    kernels.adam_step(*state, grad, 0.1, 0.9, 0.999, 1e-8, step)
    reference.adam_step(*want, grad, 0.1, 0.9, 0.999, 1e-8, int(step))
    assert_close(state[0], want[0])


@pytest.mark.parametrize("step", [2**31, 2**63, 2**64 + 1])
def test_step_beyond_the_kernels_integer_range_raises_kernel_argument_error(step):
    # The wrapper accepts any Python int >= 1, but the compiled kernel takes a C long: a step it cannot represent
    # must be refused with the psrt error, not escape as a bare OverflowError.
    state = [np.ones(4), np.zeros(4), np.zeros(4)]
    with pytest.raises(KernelArgumentError, match="step"):
        kernels.adam_step(*state, np.ones(4), 0.1, 0.9, 0.999, 1e-8, step)


# ---------------------------------------------------------------------------------------------------------------
# all_finite
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ODD_SIZES)
def test_all_finite_true_on_finite_data(dtype, n):
    rng = np.random.default_rng(n)
    x = rand(rng, n, dtype, scale=1e3)
    if n >= 4:
        info = np.finfo(dtype)
        x[:4] = [info.max, -info.max, info.smallest_subnormal, -0.0]
    assert kernels.all_finite(x) is True
    assert reference.all_finite(x) is True


@HSETTINGS
@given(
    dtype=st.sampled_from(DTYPES), n=st.integers(1, 5000), data=st.data(),
    bad=st.sampled_from([np.nan, np.inf, -np.inf]),
)
def test_all_finite_detects_non_finite_at_any_position(dtype, n, data, bad):
    pos = data.draw(st.integers(0, n - 1))
    x = np.linspace(-1e3, 1e3, n).astype(dtype)
    x[pos] = bad
    assert kernels.all_finite(x) is False
    assert reference.all_finite(x) is False
    x[pos] = 0
    assert kernels.all_finite(x) is True


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1023, 65537])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_all_finite_detects_non_finite_first_and_last(dtype, n, bad):
    for pos in (0, n - 1, n // 2):
        x = np.ones(n, dtype)
        x[pos] = bad
        assert kernels.all_finite(x) is False, pos


@pytest.mark.parametrize(
    ("dtype", "bits"),
    [
        (np.float32, [0x7F800001, 0xFFC00000, 0x7FFFFFFF, 0xFF800000]),
        (np.float64, [0x7FF0000000000001, 0xFFF8000000000000, 0x7FFFFFFFFFFFFFFF, 0xFFF0000000000000]),
    ],
)
def test_all_finite_detects_every_nan_payload(dtype, bits):
    utype = np.uint32 if dtype is np.float32 else np.uint64
    for b in bits:
        x = np.array([1.0, 2.0, 3.0], dtype)
        x.view(utype)[1] = b
        assert kernels.all_finite(x) is False, hex(b)


def test_all_finite_validates_its_argument():
    assert kernels.all_finite(np.zeros((3, 4), np.float32)) is True
    with pytest.raises(KernelTypeError):
        kernels.all_finite(np.zeros(3, np.int32))
    with pytest.raises(KernelTypeError):
        kernels.all_finite([1.0, float("nan")])
    with pytest.raises(KernelArgumentError, match="C-contiguous"):
        kernels.all_finite(np.zeros(6)[::2])


# ---------------------------------------------------------------------------------------------------------------
# psrt._core directly: mismatched lengths process the common prefix and never overrun
# ---------------------------------------------------------------------------------------------------------------

SENTINEL = 12345.0


def _views(n_view: int, dtype, rng, fill=None) -> tuple[np.ndarray, np.ndarray]:
    """A view of the first n_view elements of a larger buffer whose tail holds a sentinel."""
    base = np.full(n_view + 16, SENTINEL, dtype)
    base[:n_view] = rand(rng, n_view, dtype) if fill is None else fill
    return base, base[:n_view]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("long", "short"), [(9, 4), (4, 9), (1, 0), (0, 3), (65537, 1023)])
def test_core_kernels_with_mismatched_lengths_touch_only_the_common_prefix(dtype, long, short):
    rng = np.random.default_rng(long * 31 + short)
    k = min(long, short)

    # accumulate: output longer or shorter than the input
    dbase, dst = _views(long, dtype, rng)
    src = rand(rng, short, dtype)
    want = dst.copy()
    want[:k] += src[:k]
    _core.accumulate(dst, src)
    np.testing.assert_array_equal(dst, want)
    assert np.all(dbase[long:] == SENTINEL)

    # sgd_step
    pbase, param = _views(long, dtype, rng)
    grad = rand(rng, short, dtype)
    want = param.copy()
    reference.sgd_step(want[:k], grad[:k], 0.1, 1.0, 0.01)
    _core.sgd_step(param, grad, 0.1, 1.0, 0.01)
    assert_close(param, want)
    assert np.all(pbase[long:] == SENTINEL)

    # momentum_step: the buffer is the short one
    pbase, param = _views(long, dtype, rng)
    bbase, buf = _views(short, dtype, rng, fill=0)
    grad = rand(rng, long, dtype)
    want_p, want_b = param.copy(), buf.copy()
    reference.momentum_step(want_p[:k], want_b[:k], grad[:k], 0.1, 0.9, 1.0, 0.0, True)
    _core.momentum_step(param, buf, grad, 0.1, 0.9, 1.0, 0.0, True)
    assert_close(param, want_p)
    assert_close(buf, want_b)
    assert np.all(pbase[long:] == SENTINEL) and np.all(bbase[short:] == SENTINEL)

    # adam_step: v is the short one, the rest long
    pbase, param = _views(long, dtype, rng)
    mbase, m = _views(long, dtype, rng, fill=0)
    vbase, v = _views(short, dtype, rng, fill=0)
    grad = rand(rng, long, dtype)
    want = [param.copy(), m.copy(), v.copy()]
    reference.adam_step(want[0][:k], want[1][:k], want[2][:k], grad[:k], 0.01, 0.9, 0.999, 1e-8, 1, 1.0, 0.0, 0.0)
    _core.adam_step(param, m, v, grad, 0.01, 0.9, 0.999, 1e-8, 1, 1.0, 0.0, 0.0)
    for got, exp in zip((param, m, v), want):
        assert_close(got, exp)
    for base, n in ((pbase, long), (mbase, long), (vbase, short)):
        assert np.all(base[n:] == SENTINEL)

    # adagrad_step: the gradient is the short one
    pbase, param = _views(long, dtype, rng)
    abase, acc = _views(long, dtype, rng, fill=0)
    grad = rand(rng, short, dtype)
    want_p, want_a = param.copy(), acc.copy()
    reference.adagrad_step(want_p[:k], want_a[:k], grad[:k], 0.1, 1e-10)
    _core.adagrad_step(param, acc, grad, 0.1, 1e-10, 1.0, 0.0)
    assert_close(param, want_p)
    assert_close(acc, want_a)
    assert np.all(pbase[long:] == SENTINEL) and np.all(abase[long:] == SENTINEL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("long", "short"), [(9, 4), (4, 9), (1, 0), (0, 3), (1027, 1027)])
def test_core_buffer_kernels_match_the_memoryview_kernels_and_touch_only_the_common_prefix(dtype, long, short):
    rng = np.random.default_rng(long * 17 + short)
    pbase, param = _views(long, dtype, rng)
    grad = rand(rng, short, dtype)
    want = param.copy()
    _core.sgd_step(want, grad, 0.1, 0.5, 0.01)
    _core.sgd_step_buffer(param, grad, 0.1, 0.5, 0.01)
    np.testing.assert_array_equal(param, want)  # the same C loop: bit for bit
    assert np.all(pbase[long:] == SENTINEL)
    x = rand(rng, long, dtype)
    assert _core.all_finite_buffer(x) is _core.all_finite(x) is True
    if long:
        x[long // 2] = np.nan
        assert _core.all_finite_buffer(x) is False
    # Any C-contiguous shape is its flat elements; a read-only input is fine.
    grid = rand(rng, 12, dtype).reshape(3, 4)
    flat = grid.reshape(-1).copy()
    g = np.frombuffer(rand(rng, 12, dtype).tobytes(), dtype).reshape(4, 3)
    _core.sgd_step_buffer(grid, g, 0.1, 1.0, 0.0)
    _core.sgd_step(flat, g.reshape(-1), 0.1, 1.0, 0.0)
    np.testing.assert_array_equal(grid.reshape(-1), flat)
    # A dtype that names the native byte order (NumPy then writes it into the buffer's format: "<f") is native.
    native = np.dtype(dtype).newbyteorder("<" if sys.byteorder == "little" else ">")
    named = rand(rng, 5, dtype).astype(native)
    assert memoryview(named).format[0] in "<>"
    want = named.astype(dtype)
    _core.sgd_step(want, np.ones(5, dtype), 0.1, 1.0, 0.0)
    _core.sgd_step_buffer(named, np.ones(5, native), 0.1, 1.0, 0.0)
    np.testing.assert_array_equal(named, want)
    assert _core.all_finite_buffer(named) is True


def test_core_buffer_kernels_refuse_what_they_do_not_take_and_touch_nothing():
    f32, f64 = np.ones(8, np.float32), np.ones(8, np.float64)
    readonly = np.frombuffer(f32.tobytes(), np.float32)
    swapped = f32.astype(f32.dtype.newbyteorder())
    for param, grad in [(f32, f64), (f64, f32), (f32[::2], f32[:4]), (f32, f32[::2]), (readonly, f32),
                        (np.ones(8, np.float16), np.ones(8, np.float16)), (swapped, f32), (np.ones(8, np.int32),) * 2,
                        (f32, b"\0" * 32), ([1.0], f32)]:
        before = param.copy() if isinstance(param, np.ndarray) else None
        with pytest.raises(ValueError):
            _core.sgd_step_buffer(param, grad, 0.1, 1.0, 0.0)
        if before is not None:
            np.testing.assert_array_equal(param, before)
    for x in [f32[::2], np.ones(4, np.float16), swapped, b"\0" * 8, object()]:
        with pytest.raises(ValueError):
            _core.all_finite_buffer(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_core_all_finite_on_empty_and_readonly(dtype):
    assert _core.all_finite(np.empty(0, dtype)) is True
    x = np.frombuffer(np.array([1.0, np.inf], dtype).tobytes(), dtype=dtype)
    assert _core.all_finite(x) is False
    assert _core.all_finite(x[:1]) is True


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ODD_SIZES + [3 * 8192 + 5])
@pytest.mark.parametrize("sources", [1, 2, 5, 70])  # 70: more than one call's MAX_SOURCES
@pytest.mark.parametrize("add", [False, True])
def test_sum_into_matches_reference_bit_for_bit(dtype, n, sources, add):
    rng = np.random.default_rng(n + sources)
    srcs = [rng.standard_normal(n).astype(dtype) for _ in range(sources)]
    for s in srcs:
        s.flags.writeable = False  # read-only inputs, as shared-memory or received gradients can be
    start = rng.standard_normal(n).astype(dtype)
    got, want = start.copy(), start.copy()
    kernels.sum_into(got, srcs, add)
    reference.sum_into(want, srcs, add)
    assert got.tobytes() == want.tobytes()


def test_sum_into_refuses_what_it_cannot_sum():
    dst = np.zeros(4, np.float32)
    with pytest.raises(KernelArgumentError, match="non-empty"):
        kernels.sum_into(dst, [])
    with pytest.raises((KernelArgumentError, KernelTypeError)):
        kernels.sum_into(dst, [np.zeros(5, np.float32)])
    with pytest.raises(KernelTypeError):
        kernels.sum_into(dst, [np.zeros(4, np.float64)])


def test_sequence_counters_match_their_twins_and_refuse_other_arrays():
    seq, twin = np.zeros(1, np.uint64), np.zeros(1, np.uint64)
    for _ in range(3):
        kernels.seq_bump(seq)
        reference.seq_bump(twin)
        assert kernels.seq_read(seq) == reference.seq_read(twin)
    assert kernels.seq_read(seq) == 3
    frozen = seq.copy()
    frozen.flags.writeable = False
    assert kernels.seq_read(frozen) == 3
    with pytest.raises(KernelArgumentError):
        kernels.seq_bump(frozen)
    with pytest.raises(KernelTypeError):
        kernels.seq_read(np.zeros(1, np.int64))
    with pytest.raises(KernelTypeError):
        kernels.seq_read(np.zeros(2, np.uint64))
