"""Validated entry points to the compiled kernels in :mod:`psrt._core`.

The kernels themselves never raise; these wrappers check what a kernel cannot (dtype, contiguity, equal
lengths, writable outputs) and raise :class:`~psrt.errors.KernelTypeError` or
:class:`~psrt.errors.KernelArgumentError` with a message that says what to pass instead. Each function works on
1-D views of its arguments (``reshape(-1)`` of a C-contiguous array is free), updates its outputs in place and
returns ``None``. :mod:`psrt.kernels.reference` holds the NumPy twin of each, used as the test oracle.
"""

from __future__ import annotations

import numpy as np

from psrt import _core, dtypes
from psrt.errors import KernelArgumentError, KernelTypeError

__all__ = ["accumulate", "sum_into", "sgd_step", "momentum_step", "adam_step", "adagrad_step", "all_finite",
           "seq_read", "seq_bump", "DTYPES"]

#: Largest step number: fits the kernels' C integer on every platform.
_MAX_STEP = 2**31 - 1

#: The dtypes the kernels are compiled for (the one table in :mod:`psrt.dtypes`).
DTYPES = dtypes.SUPPORTED


def _flat(name: str, a: object, *, writable: bool) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise KernelTypeError(f"{name} must be a numpy.ndarray, got {type(a).__name__}")
    if a.dtype not in DTYPES:
        raise KernelTypeError(f"{name} has dtype {a.dtype}; the kernels take {dtypes.describe()}")
    if not a.flags.c_contiguous:
        raise KernelArgumentError(f"{name} is not C-contiguous; pass numpy.ascontiguousarray({name})")
    if writable and not a.flags.writeable:
        raise KernelArgumentError(f"{name} is read-only but is updated in place; pass a writable array")
    if not a.dtype.isnative:
        raise KernelTypeError(f"{name} is not in native byte order; pass {name}.astype({name}.dtype.newbyteorder('='))")
    return a.reshape(-1)


def _check(outputs: dict[str, object], inputs: dict[str, object]) -> list[np.ndarray]:
    # The shard calls a kernel for every push: the common case (1-D, one native dtype, equal shapes,
    # contiguous, writable outputs) costs a few attribute reads; anything else takes the full validation,
    # which explains what is wrong.
    given = [*outputs.values(), *inputs.values()]
    first = given[0]
    if type(first) is np.ndarray and first.ndim == 1 and first.dtype in DTYPES:
        dtype, shape, fast = first.dtype, first.shape, True
        for a in given:
            if type(a) is not np.ndarray or a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous:
                fast = False
                break
        for a in outputs.values():
            if fast and not a.flags.writeable:
                fast = False
        if fast:
            return given
    arrays = [_flat(k, v, writable=True) for k, v in outputs.items()]
    arrays += [_flat(k, v, writable=False) for k, v in inputs.items()]
    names = list(outputs) + list(inputs)
    first = arrays[0]
    for name, a in zip(names[1:], arrays[1:]):
        if a.dtype != first.dtype:
            raise KernelTypeError(f"{name} has dtype {a.dtype} but {names[0]} has {first.dtype}; use one dtype")
        if a.shape[0] != first.shape[0]:
            raise KernelArgumentError(
                f"{name} has {a.shape[0]} elements but {names[0]} has {first.shape[0]}; they must be equal"
            )
    return arrays


def _kernel(table: dict[np.dtype, object], out: object, *ins: object) -> object:
    """``table``'s kernel for these arrays when they look like what it takes (1-D ndarrays of one shape and of a dtype
    it is compiled for), else None.

    The compiled kernel still refuses another dtype, a strided buffer or a read-only output (``ValueError``, before
    it touches anything); the callers then take :func:`_check`, which says what is wrong. So a step costs one
    kernel call where its arguments are right, as a shard's every push's are.
    """
    if type(out) is not np.ndarray or out.ndim != 1:
        return None
    shape = out.shape
    for a in ins:
        if type(a) is not np.ndarray or a.shape != shape:
            return None
    return table.get(out.dtype)


def _finite(name: str, value: float) -> float:
    # The common case first: a Python float that is finite (``v - v`` is NaN for NaN and for +-Inf).
    if type(value) is float and value - value == 0.0:
        return value
    if isinstance(value, bool):
        raise KernelArgumentError(f"{name} must be a number, got {value!r}")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise KernelArgumentError(f"{name} must be a number, got {value!r}") from None
    if not np.isfinite(value):
        raise KernelArgumentError(f"{name} must be a finite number, got {value}")
    return value


def _by_dtype(kernel: object) -> dict[np.dtype, object]:
    """A kernel specialised per dtype, so the hot path skips Cython's fused-type dispatch (which inspects every
    buffer argument again, costing more than a small kernel's work)."""
    return {np.dtype(np.float32): kernel["float"], np.dtype(np.float64): kernel["double"]}  # type: ignore[index]


_ACCUMULATE = _by_dtype(_core.accumulate)
_SGD = _by_dtype(_core.sgd_step)
_MOMENTUM = _by_dtype(_core.momentum_step)
_ADAM = _by_dtype(_core.adam_step)
_ADAGRAD = _by_dtype(_core.adagrad_step)
_ALL_FINITE = _by_dtype(_core.all_finite)


def accumulate(dst: np.ndarray, src: np.ndarray) -> None:
    """Add ``src`` into ``dst`` in place (``dst += src``).

    Parameters
    ----------
    dst : numpy.ndarray
        Writable, C-contiguous float32 or float64 array.
    src : numpy.ndarray
        C-contiguous array of the same dtype and size; may be read-only.
    """
    kernel = _kernel(_ACCUMULATE, dst, src)
    if kernel is not None:
        try:
            kernel(dst, src)
            return
        except ValueError:
            pass  # not what the kernel takes: the checks below say why
    d, s = _check({"dst": dst}, {"src": src})
    _ACCUMULATE[d.dtype](d, s)


def sgd_step(param: np.ndarray, grad: np.ndarray, lr: float, scale: float = 1.0, weight_decay: float = 0.0) -> None:
    """One plain SGD step in place: ``param -= lr * (scale*grad + weight_decay*param)``.

    Parameters
    ----------
    param : numpy.ndarray
        Parameters, updated in place.
    grad : numpy.ndarray
        Gradient (or the sum of W gradients, with ``scale=1/W`` to average them).
    lr, scale, weight_decay : float
        Learning rate, gradient scale, L2 weight decay (torch.optim.SGD semantics).
    """
    # A shard's every push: written out rather than through _kernel and _finite (a call each costs more than
    # checking), and the kernel taking the buffers as they are (sgd_step_buffer: no typed memoryviews, whose set-up
    # costs more than a small tensor's step). Finite floats have a finite sum, unless it overflows, which only
    # sends it the long way.
    if type(param) is np.ndarray and type(grad) is np.ndarray and param.size == grad.size \
            and type(lr) is float and type(scale) is float and type(weight_decay) is float:
        total = lr + scale + weight_decay
        if total - total == 0.0:
            try:
                # Refuses (touching nothing) another dtype, two dtypes, a strided or a read-only parameter.
                _core.sgd_step_buffer(param, grad, lr, scale, weight_decay)
                return
            except ValueError:
                pass  # not what the kernel takes: the checks below say why
    p, g = _check({"param": param}, {"grad": grad})
    _SGD[p.dtype](p, g, _finite("lr", lr), _finite("scale", scale), _finite("weight_decay", weight_decay))


def momentum_step(
    param: np.ndarray,
    buf: np.ndarray,
    grad: np.ndarray,
    lr: float,
    momentum: float,
    scale: float = 1.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> None:
    """One SGD-with-momentum step in place, as torch.optim.SGD with dampening 0.

    Parameters
    ----------
    param, buf : numpy.ndarray
        Parameters and momentum buffer (zero before the first step), updated in place.
    grad : numpy.ndarray
        Gradient; ``scale*grad`` is used.
    lr, momentum, scale, weight_decay : float
        Hyperparameters.
    nesterov : bool
        Use Nesterov momentum.
    """
    kernel = _kernel(_MOMENTUM, param, buf, grad)
    if kernel is not None:
        try:
            kernel(param, buf, grad, _finite("lr", lr), _finite("momentum", momentum), _finite("scale", scale),
                   _finite("weight_decay", weight_decay), bool(nesterov))
            return
        except ValueError:
            pass  # not what the kernel takes, or a number that is not one: the checks below say which
    p, b, g = _check({"param": param, "buf": buf}, {"grad": grad})
    _MOMENTUM[p.dtype](
        p, b, g, _finite("lr", lr), _finite("momentum", momentum), _finite("scale", scale),
        _finite("weight_decay", weight_decay), bool(nesterov),
    )


def adam_step(
    param: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    grad: np.ndarray,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    scale: float = 1.0,
    decoupled_weight_decay: float = 0.0,
    l2: float = 0.0,
) -> None:
    """One Adam step in place, as torch.optim.AdamW (decoupled weight decay, bias correction).

    Parameters
    ----------
    param, m, v : numpy.ndarray
        Parameters and first/second moment estimates (zero before the first step), updated in place.
    grad : numpy.ndarray
        Gradient; ``scale*grad`` is used.
    lr, beta1, beta2, eps : float
        Adam hyperparameters.
    step : int
        The step number, counting from 1 (used for bias correction).
    scale : float
        Gradient scale.
    decoupled_weight_decay : float
        AdamW's weight decay, applied to the parameters apart from the gradient: ``param *= 1 - lr*wd``
        (torch.optim.AdamW's ``weight_decay``).
    l2 : float
        Coupled L2 decay added to the gradient (torch.optim.Adam's ``weight_decay``).
    """
    kernel = _kernel(_ADAM, param, m, v, grad)
    if kernel is not None and type(step) is int and 1 <= step <= _MAX_STEP:
        try:
            kernel(param, m, v, grad, _finite("lr", lr), _finite("beta1", beta1), _finite("beta2", beta2),
                   _finite("eps", eps), step, _finite("scale", scale),
                   _finite("decoupled_weight_decay", decoupled_weight_decay), _finite("l2", l2))
            return
        except ValueError:
            pass  # not what the kernel takes, or a number that is not one: the checks below say which
    p, mm, vv, g = _check({"param": param, "m": m, "v": v}, {"grad": grad})
    if type(step) is bool or not isinstance(step, (int, np.integer)) or not 1 <= step <= _MAX_STEP:
        raise KernelArgumentError(f"step must be an integer in [1, {_MAX_STEP}] (the step number), got {step!r}")
    _ADAM[p.dtype](
        p, mm, vv, g, _finite("lr", lr), _finite("beta1", beta1), _finite("beta2", beta2), _finite("eps", eps),
        int(step), _finite("scale", scale), _finite("decoupled_weight_decay", decoupled_weight_decay),
        _finite("l2", l2),
    )


def adagrad_step(
    param: np.ndarray,
    acc: np.ndarray,
    grad: np.ndarray,
    lr: float,
    eps: float,
    scale: float = 1.0,
    weight_decay: float = 0.0,
) -> None:
    """One Adagrad step in place, as torch.optim.Adagrad (fold ``lr_decay`` into ``lr`` before calling).

    Parameters
    ----------
    param, acc : numpy.ndarray
        Parameters and the running sum of squared gradients, updated in place.
    grad : numpy.ndarray
        Gradient; ``scale*grad`` is used.
    lr, eps, scale, weight_decay : float
        Hyperparameters.
    """
    kernel = _kernel(_ADAGRAD, param, acc, grad)
    if kernel is not None:
        try:
            kernel(param, acc, grad, _finite("lr", lr), _finite("eps", eps), _finite("scale", scale),
                   _finite("weight_decay", weight_decay))
            return
        except ValueError:
            pass  # not what the kernel takes, or a number that is not one: the checks below say which
    p, a, g = _check({"param": param, "acc": acc}, {"grad": grad})
    _ADAGRAD[p.dtype](
        p, a, g, _finite("lr", lr), _finite("eps", eps), _finite("scale", scale), _finite("weight_decay", weight_decay)
    )


def all_finite(x: np.ndarray) -> bool:
    """Return True when ``x`` holds no NaN or infinity.

    Parameters
    ----------
    x : numpy.ndarray
        C-contiguous float32 or float64 array (may be read-only).
    """
    # The shard checks every received gradient: a native float array skips the checks that explain errors, and
    # the kernel takes its buffer as it is (all_finite_buffer: no typed memoryview, whose set-up costs more than
    # a small gradient's check).
    if type(x) is np.ndarray:
        try:
            return _core.all_finite_buffer(x)  # (a bool) refuses another dtype or a strided array
        except ValueError:
            pass  # the checks below take it
    x = _flat("x", x, writable=False)
    return bool(_ALL_FINITE[x.dtype](x))


def sum_into(dst: np.ndarray, srcs: list[np.ndarray], add: bool = False) -> None:
    """``dst = [dst +] srcs[0] + srcs[1] + ...`` in that order: what ``accumulate`` called once per source gives,
    in one pass over memory (``dst`` stays in cache block by block).

    Parameters
    ----------
    dst : numpy.ndarray
        C-contiguous, writable float32 or float64.
    srcs : list of numpy.ndarray
        At least one array of ``dst``'s dtype and size (may be read-only).
    add : bool
        Add to what ``dst`` holds; False: overwrite it.
    """
    if not isinstance(srcs, (list, tuple)) or not srcs:
        raise KernelArgumentError("srcs must be a non-empty list of arrays")
    arrays = _check({"dst": dst}, {f"srcs[{i}]": a for i, a in enumerate(srcs)})
    out, inputs = arrays[0], arrays[1:]
    limit = int(_core.MAX_SOURCES)
    for start in range(0, len(inputs), limit):
        _core.sum_into(out, inputs[start:start + limit], add or start > 0)


def _counter(seq: object, writable: bool) -> np.ndarray:
    if not isinstance(seq, np.ndarray) or seq.dtype != np.uint64 or seq.shape != (1,):
        raise KernelTypeError("a sequence counter is a numpy.ndarray of one uint64")
    if not seq.flags.c_contiguous or not seq.dtype.isnative or (writable and not seq.flags.writeable):
        raise KernelArgumentError("a sequence counter must be contiguous, in native byte order, and writable "
                                  "to be bumped")
    return seq


def seq_read(seq: np.ndarray) -> int:
    """Read a seqlock counter (one uint64) between full memory fences.

    A reader of data another process updates under the counter reads it before and after copying the data, and
    keeps the copy only when both reads are equal and even (:mod:`psrt.shm.lanes`).
    """
    return int(_core.seq_read(_counter(seq, writable=False)))


def seq_bump(seq: np.ndarray) -> None:
    """Add one to a seqlock counter between full memory fences (the writer: odd while it writes, even after)."""
    _core.seq_bump(_counter(seq, writable=True))
