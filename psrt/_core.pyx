# cython: language_level=3
"""The compiled kernels of psrt's shard server.

Each kernel is one fused pass over contiguous float32 or float64 buffers and runs with the GIL released, so a
server can apply an optimizer step while other threads (or ZeroMQ's I/O threads) keep moving bytes.

Kernels never raise and never validate: :mod:`psrt.kernels` checks dtypes, contiguity, lengths and
writability and is the API to call. As a last line of defence against a caller that bypasses it, every
kernel only touches the first ``min(len(a), len(b), ...)`` elements, so mismatched lengths cannot overrun a
buffer. Inputs are ``const`` because frames received from ZeroMQ with ``copy=False`` are read-only.
"""

from libc.math cimport sqrt, pow
from libc.stdint cimport uint32_t, uint64_t

ctypedef fused real:
    float
    double


cdef inline Py_ssize_t _min2(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return a if a < b else b


def accumulate(real[::1] dst, const real[::1] src):
    """dst += src, elementwise."""
    cdef Py_ssize_t i, n = _min2(dst.shape[0], src.shape[0])
    with nogil:
        for i in range(n):
            dst[i] += src[i]


def sgd_step(real[::1] param, const real[::1] grad, double lr, double scale, double weight_decay):
    """Plain SGD: ``g = scale*grad + weight_decay*param; param -= lr*g`` (torch.optim.SGD, momentum 0)."""
    cdef Py_ssize_t i, n = _min2(param.shape[0], grad.shape[0])
    cdef real lr_ = <real>lr, s = <real>scale, wd = <real>weight_decay, g
    with nogil:
        if wd == 0:
            for i in range(n):
                param[i] -= lr_ * (s * grad[i])
        else:
            for i in range(n):
                g = s * grad[i] + wd * param[i]
                param[i] -= lr_ * g


def momentum_step(real[::1] param, real[::1] buf, const real[::1] grad, double lr, double momentum,
                  double scale, double weight_decay, bint nesterov):
    """SGD with momentum as torch.optim.SGD (dampening 0); ``buf`` starts at zero.

    ``d = scale*grad + weight_decay*param; buf = momentum*buf + d;
    param -= lr * (d + momentum*buf if nesterov else buf)``.
    """
    cdef Py_ssize_t i, n = _min2(_min2(param.shape[0], buf.shape[0]), grad.shape[0])
    cdef real lr_ = <real>lr, mu = <real>momentum, s = <real>scale, wd = <real>weight_decay, d, b
    with nogil:
        if nesterov:
            for i in range(n):
                d = s * grad[i] + wd * param[i]
                b = mu * buf[i] + d
                buf[i] = b
                param[i] -= lr_ * (d + mu * b)
        else:
            for i in range(n):
                d = s * grad[i] + wd * param[i]
                b = mu * buf[i] + d
                buf[i] = b
                param[i] -= lr_ * b


def adam_step(real[::1] param, real[::1] m, real[::1] v, const real[::1] grad, double lr, double beta1,
              double beta2, double eps, long step, double scale, double weight_decay, double l2=0.0):
    """One Adam/AdamW step as torch.optim.AdamW, with bias correction; ``step`` counts from 1.

    ``weight_decay`` is decoupled (AdamW: ``param *= 1 - lr*weight_decay``); ``l2`` is torch.optim.Adam's
    coupled decay (``g += l2*param``).
    """
    cdef Py_ssize_t i, n = _min2(_min2(param.shape[0], m.shape[0]), _min2(v.shape[0], grad.shape[0]))
    cdef double bc1 = 1.0 - pow(beta1, <double>step)
    cdef double bc2 = 1.0 - pow(beta2, <double>step)
    cdef real step_size = <real>(lr / bc1) if bc1 != 0 else <real>0
    cdef real inv_bc2_sqrt = <real>(1.0 / sqrt(bc2)) if bc2 > 0 else <real>0
    cdef real b1 = <real>beta1, b2 = <real>beta2, omb1 = <real>(1.0 - beta1), omb2 = <real>(1.0 - beta2)
    cdef real eps_ = <real>eps, s = <real>scale, decay = <real>(1.0 - lr * weight_decay), l2_ = <real>l2
    cdef real g, p, mi, vi
    with nogil:
        for i in range(n):
            p = param[i]
            g = s * grad[i] + l2_ * p
            p = p * decay
            mi = b1 * m[i] + omb1 * g
            vi = b2 * v[i] + omb2 * g * g
            m[i] = mi
            v[i] = vi
            param[i] = p - step_size * mi / (sqrt(vi) * inv_bc2_sqrt + eps_)


def adagrad_step(real[::1] param, real[::1] acc, const real[::1] grad, double lr, double eps, double scale,
                 double weight_decay):
    """One Adagrad step as torch.optim.Adagrad (the caller folds ``lr_decay`` into ``lr``).

    ``g = scale*grad + weight_decay*param; acc += g*g; param -= lr * g / (sqrt(acc) + eps)``.
    """
    cdef Py_ssize_t i, n = _min2(_min2(param.shape[0], acc.shape[0]), grad.shape[0])
    cdef real lr_ = <real>lr, eps_ = <real>eps, s = <real>scale, wd = <real>weight_decay, g, a
    with nogil:
        for i in range(n):
            g = s * grad[i] + wd * param[i]
            a = acc[i] + g * g
            acc[i] = a
            param[i] -= lr_ * g / (sqrt(a) + eps_)


def all_finite(const real[::1] x):
    """True when no element is NaN or +-Inf (an exponent-bits test, so the loop vectorises)."""
    cdef Py_ssize_t i, n = x.shape[0]
    cdef const uint32_t* p32
    cdef const uint64_t* p64
    cdef uint32_t bad32 = 0
    cdef uint64_t bad64 = 0
    if n == 0:
        return True
    with nogil:
        if real is float:
            p32 = <const uint32_t*> &x[0]
            for i in range(n):
                bad32 |= <uint32_t>((p32[i] & 0x7f800000u) == 0x7f800000u)
        else:
            p64 = <const uint64_t*> &x[0]
            for i in range(n):
                bad64 |= <uint64_t>((p64[i] & 0x7ff0000000000000ull) == 0x7ff0000000000000ull)
    return bad32 == 0 and bad64 == 0
