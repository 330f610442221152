"""NumPy twins of the kernels in :mod:`psrt._core`: the test oracle and the benchmarks' baseline.

Each function is the straightforward NumPy form of its kernel, updates its outputs in place, and computes in the
arrays' own dtype, as the kernels do.
"""

from __future__ import annotations

import numpy as np

__all__ = ["accumulate", "sgd_step", "momentum_step", "adam_step", "adagrad_step", "all_finite"]


def accumulate(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst += src``."""
    np.add(dst, src, out=dst)


def sgd_step(param: np.ndarray, grad: np.ndarray, lr: float, scale: float = 1.0, weight_decay: float = 0.0) -> None:
    """``param -= lr * (scale*grad + weight_decay*param)``."""
    t = param.dtype.type
    g = t(scale) * grad
    if weight_decay:
        g = g + t(weight_decay) * param
    param -= t(lr) * g


def momentum_step(param, buf, grad, lr, momentum, scale=1.0, weight_decay=0.0, nesterov=False) -> None:
    """torch.optim.SGD with momentum, dampening 0."""
    t = param.dtype.type
    d = t(scale) * grad + t(weight_decay) * param
    buf *= t(momentum)
    buf += d
    param -= t(lr) * (d + t(momentum) * buf if nesterov else buf)


def adam_step(param, m, v, grad, lr, beta1, beta2, eps, step, scale=1.0, decoupled_weight_decay=0.0,
              l2=0.0) -> None:
    """torch.optim.AdamW (``decoupled_weight_decay``), with torch.optim.Adam's coupled ``l2``."""
    t = param.dtype.type
    g = t(scale) * grad + t(l2) * param
    param *= t(1.0 - lr * decoupled_weight_decay)
    m *= t(beta1)
    m += t(1.0 - beta1) * g
    v *= t(beta2)
    v += t(1.0 - beta2) * g * g
    step_size = t(lr / (1.0 - beta1**step))
    denom = np.sqrt(v) * t(1.0 / np.sqrt(1.0 - beta2**step)) + t(eps)
    param -= step_size * m / denom


def adagrad_step(param, acc, grad, lr, eps, scale=1.0, weight_decay=0.0) -> None:
    """torch.optim.Adagrad with ``lr`` already decayed."""
    t = param.dtype.type
    g = t(scale) * grad + t(weight_decay) * param
    acc += g * g
    param -= t(lr) * g / (np.sqrt(acc) + t(eps))


def all_finite(x: np.ndarray) -> bool:
    """True when ``x`` has no NaN or infinity."""
    return bool(np.isfinite(x).all())
