# cython: language_level=3
"""The compiled kernels of psrt's shard server.

Each kernel is one fused pass over contiguous float32 or float64 buffers and runs with the GIL released, so a
server can apply an optimizer step while other threads (or ZeroMQ's I/O threads) keep moving bytes.

Kernels never raise and never validate: :mod:`psrt.kernels` checks dtypes, contiguity, lengths and
writability and is the API to call. As a last line of defence against a caller that bypasses it, every
kernel only touches the first ``min(len(a), len(b), ...)`` elements, so mismatched lengths cannot overrun a
buffer. Inputs are ``const`` because frames received from ZeroMQ with ``copy=False`` are read-only.

The loops are plain C (below) so that, on x86-64 Linux with GCC or Clang, each is compiled twice, for the
baseline ISA and for AVX2, and the dynamic loader picks the variant the CPU supports (``target_clones``). The
binary stays portable (no ``-march`` flag); :func:`simd_target` says which variant runs. Every operation
rounds in the arrays' own dtype, and the build disables floating-point contraction (``-ffp-contract=off``), so
both variants give bit-identical results.
"""

from libc.math cimport sqrt, pow
from libc.stdint cimport uint32_t, uint64_t

cdef extern from *:
    r"""
    #include <math.h>
    #include <stdint.h>

    #if defined(__GNUC__) && defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute) \
        && !defined(PSRT_NO_DISPATCH)
    #  if __has_attribute(target_clones)
    #    define PSRT_DISPATCH __attribute__((target_clones("avx2", "default")))
    #    define PSRT_HAVE_DISPATCH 1
    #  endif
    #endif
    #ifndef PSRT_DISPATCH
    #  define PSRT_DISPATCH
    #endif

    static const char *psrt_simd_target(void) {
    #ifdef PSRT_HAVE_DISPATCH
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2")) return "avx2";
    #endif
        return "baseline";
    }

    #define PSRT_KERNELS(T, SFX, SQRT)                                                                   \
    static PSRT_DISPATCH void psrt_accumulate_##SFX(T *dst, const T *src, Py_ssize_t n) {                \
        for (Py_ssize_t i = 0; i < n; i++) dst[i] += src[i];                                             \
    }                                                                                                     \
    static PSRT_DISPATCH void psrt_sgd_##SFX(T *param, const T *grad, Py_ssize_t n, T lr, T s, T wd) {   \
        if (wd == 0) {                                                                                    \
            for (Py_ssize_t i = 0; i < n; i++) param[i] -= lr * (s * grad[i]);                           \
        } else {                                                                                          \
            for (Py_ssize_t i = 0; i < n; i++) {                                                          \
                T g = s * grad[i] + wd * param[i];                                                        \
                param[i] -= lr * g;                                                                       \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    static PSRT_DISPATCH void psrt_momentum_##SFX(T *param, T *buf, const T *grad, Py_ssize_t n, T lr,   \
                                                  T mu, T s, T wd, int nesterov) {                        \
        if (nesterov) {                                                                                   \
            for (Py_ssize_t i = 0; i < n; i++) {                                                          \
                T d = s * grad[i] + wd * param[i];                                                        \
                T b = mu * buf[i] + d;                                                                    \
                buf[i] = b;                                                                               \
                param[i] -= lr * (d + mu * b);                                                            \
            }                                                                                             \
        } else {                                                                                          \
            for (Py_ssize_t i = 0; i < n; i++) {                                                          \
                T d = s * grad[i] + wd * param[i];                                                        \
                T b = mu * buf[i] + d;                                                                    \
                buf[i] = b;                                                                               \
                param[i] -= lr * b;                                                                       \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    static PSRT_DISPATCH void psrt_adam_##SFX(T *param, T *m, T *v, const T *grad, Py_ssize_t n,         \
                                              T step_size, T inv_bc2_sqrt, T b1, T b2, T omb1, T omb2,    \
                                              T eps, T s, T decay, T l2) {                                \
        for (Py_ssize_t i = 0; i < n; i++) {                                                              \
            T p = param[i];                                                                               \
            T g = s * grad[i] + l2 * p;                                                                   \
            p = p * decay;                                                                                \
            T mi = b1 * m[i] + omb1 * g;                                                                  \
            T vi = b2 * v[i] + omb2 * g * g;                                                              \
            m[i] = mi;                                                                                    \
            v[i] = vi;                                                                                    \
            param[i] = p - step_size * mi / (SQRT(vi) * inv_bc2_sqrt + eps);                              \
        }                                                                                                 \
    }                                                                                                     \
    static PSRT_DISPATCH void psrt_adagrad_##SFX(T *param, T *acc, const T *grad, Py_ssize_t n, T lr,    \
                                                 T eps, T s, T wd) {                                      \
        for (Py_ssize_t i = 0; i < n; i++) {                                                              \
            T g = s * grad[i] + wd * param[i];                                                            \
            T a = acc[i] + g * g;                                                                         \
            acc[i] = a;                                                                                   \
            param[i] -= lr * g / (SQRT(a) + eps);                                                         \
        }                                                                                                 \
    }

    PSRT_KERNELS(float, f32, sqrtf)
    PSRT_KERNELS(double, f64, sqrt)

    /* Non-finite means all exponent bits set. float32: |bits| >= 0x7f800000, found with a running maximum (an AND
       and a MAX per vector); float64: an OR of exponent tests. Branch-free, so both loops vectorise. */
    static PSRT_DISPATCH int psrt_all_finite_f32(const uint32_t *x, Py_ssize_t n) {
        uint32_t top = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t a = x[i] & 0x7fffffffu;
            top = a > top ? a : top;
        }
        return top < 0x7f800000u;
    }
    static PSRT_DISPATCH int psrt_all_finite_f64(const uint64_t *x, Py_ssize_t n) {
        uint64_t bad = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            bad |= (uint64_t)((x[i] & 0x7ff0000000000000ull) == 0x7ff0000000000000ull);
        return bad == 0;
    }
    """
    const char *psrt_simd_target() noexcept nogil
    void psrt_accumulate_f32(float *dst, const float *src, Py_ssize_t n) noexcept nogil
    void psrt_accumulate_f64(double *dst, const double *src, Py_ssize_t n) noexcept nogil
    void psrt_sgd_f32(float *param, const float *grad, Py_ssize_t n, float lr, float s, float wd) noexcept nogil
    void psrt_sgd_f64(double *param, const double *grad, Py_ssize_t n, double lr, double s,
                      double wd) noexcept nogil
    void psrt_momentum_f32(float *param, float *buf, const float *grad, Py_ssize_t n, float lr, float mu,
                           float s, float wd, int nesterov) noexcept nogil
    void psrt_momentum_f64(double *param, double *buf, const double *grad, Py_ssize_t n, double lr, double mu,
                           double s, double wd, int nesterov) noexcept nogil
    void psrt_adam_f32(float *param, float *m, float *v, const float *grad, Py_ssize_t n, float step_size,
                       float inv_bc2_sqrt, float b1, float b2, float omb1, float omb2, float eps, float s,
                       float decay, float l2) noexcept nogil
    void psrt_adam_f64(double *param, double *m, double *v, const double *grad, Py_ssize_t n, double step_size,
                       double inv_bc2_sqrt, double b1, double b2, double omb1, double omb2, double eps, double s,
                       double decay, double l2) noexcept nogil
    void psrt_adagrad_f32(float *param, float *acc, const float *grad, Py_ssize_t n, float lr, float eps,
                          float s, float wd) noexcept nogil
    void psrt_adagrad_f64(double *param, double *acc, const double *grad, Py_ssize_t n, double lr, double eps,
                          double s, double wd) noexcept nogil
    int psrt_all_finite_f32(const uint32_t *x, Py_ssize_t n) noexcept nogil
    int psrt_all_finite_f64(const uint64_t *x, Py_ssize_t n) noexcept nogil

ctypedef fused real:
    float
    double


cdef inline Py_ssize_t _min2(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return a if a < b else b


def simd_target():
    """The instruction set the kernels run with on this CPU: ``"avx2"`` or ``"baseline"``."""
    return psrt_simd_target().decode()


def accumulate(real[::1] dst, const real[::1] src):
    """dst += src, elementwise."""
    cdef Py_ssize_t n = _min2(dst.shape[0], src.shape[0])
    if n == 0:
        return
    with nogil:
        if real is float:
            psrt_accumulate_f32(&dst[0], &src[0], n)
        else:
            psrt_accumulate_f64(&dst[0], &src[0], n)


def sgd_step(real[::1] param, const real[::1] grad, double lr, double scale, double weight_decay):
    """Plain SGD: ``g = scale*grad + weight_decay*param; param -= lr*g`` (torch.optim.SGD, momentum 0)."""
    cdef Py_ssize_t n = _min2(param.shape[0], grad.shape[0])
    cdef real lr_ = <real>lr, s = <real>scale, wd = <real>weight_decay
    if n == 0:
        return
    with nogil:
        if real is float:
            psrt_sgd_f32(&param[0], &grad[0], n, lr_, s, wd)
        else:
            psrt_sgd_f64(&param[0], &grad[0], n, lr_, s, wd)


def momentum_step(real[::1] param, real[::1] buf, const real[::1] grad, double lr, double momentum,
                  double scale, double weight_decay, bint nesterov):
    """SGD with momentum as torch.optim.SGD (dampening 0); ``buf`` starts at zero.

    ``d = scale*grad + weight_decay*param; buf = momentum*buf + d;
    param -= lr * (d + momentum*buf if nesterov else buf)``.
    """
    cdef Py_ssize_t n = _min2(_min2(param.shape[0], buf.shape[0]), grad.shape[0])
    cdef real lr_ = <real>lr, mu = <real>momentum, s = <real>scale, wd = <real>weight_decay
    if n == 0:
        return
    with nogil:
        if real is float:
            psrt_momentum_f32(&param[0], &buf[0], &grad[0], n, lr_, mu, s, wd, nesterov)
        else:
            psrt_momentum_f64(&param[0], &buf[0], &grad[0], n, lr_, mu, s, wd, nesterov)


def adam_step(real[::1] param, real[::1] m, real[::1] v, const real[::1] grad, double lr, double beta1,
              double beta2, double eps, long step, double scale, double decoupled_weight_decay,
              double l2=0.0):
    """One Adam/AdamW step as torch.optim.AdamW, with bias correction; ``step`` counts from 1.

    ``decoupled_weight_decay`` is AdamW's (``param *= 1 - lr*decoupled_weight_decay``); ``l2`` is
    torch.optim.Adam's coupled decay (``g += l2*param``).
    """
    cdef Py_ssize_t n = _min2(_min2(param.shape[0], m.shape[0]), _min2(v.shape[0], grad.shape[0]))
    cdef double bc1 = 1.0 - pow(beta1, <double>step)
    cdef double bc2 = 1.0 - pow(beta2, <double>step)
    cdef real step_size = <real>(lr / bc1) if bc1 != 0 else <real>0
    cdef real inv_bc2_sqrt = <real>(1.0 / sqrt(bc2)) if bc2 > 0 else <real>0
    cdef real b1 = <real>beta1, b2 = <real>beta2, omb1 = <real>(1.0 - beta1), omb2 = <real>(1.0 - beta2)
    cdef real eps_ = <real>eps, s = <real>scale, decay = <real>(1.0 - lr * decoupled_weight_decay), l2_ = <real>l2
    if n == 0:
        return
    with nogil:
        if real is float:
            psrt_adam_f32(&param[0], &m[0], &v[0], &grad[0], n, step_size, inv_bc2_sqrt, b1, b2, omb1, omb2,
                          eps_, s, decay, l2_)
        else:
            psrt_adam_f64(&param[0], &m[0], &v[0], &grad[0], n, step_size, inv_bc2_sqrt, b1, b2, omb1, omb2,
                          eps_, s, decay, l2_)


def adagrad_step(real[::1] param, real[::1] acc, const real[::1] grad, double lr, double eps, double scale,
                 double weight_decay):
    """One Adagrad step as torch.optim.Adagrad (the caller folds ``lr_decay`` into ``lr``).

    ``g = scale*grad + weight_decay*param; acc += g*g; param -= lr * g / (sqrt(acc) + eps)``.
    """
    cdef Py_ssize_t n = _min2(_min2(param.shape[0], acc.shape[0]), grad.shape[0])
    cdef real lr_ = <real>lr, eps_ = <real>eps, s = <real>scale, wd = <real>weight_decay
    if n == 0:
        return
    with nogil:
        if real is float:
            psrt_adagrad_f32(&param[0], &acc[0], &grad[0], n, lr_, eps_, s, wd)
        else:
            psrt_adagrad_f64(&param[0], &acc[0], &grad[0], n, lr_, eps_, s, wd)


def all_finite(const real[::1] x):
    """True when no element is NaN or +-Inf (a branch-free test of the exponent bits, so the loop vectorises)."""
    cdef Py_ssize_t n = x.shape[0]
    cdef int ok
    if n == 0:
        return True
    with nogil:
        if real is float:
            ok = psrt_all_finite_f32(<const uint32_t*> &x[0], n)
        else:
            ok = psrt_all_finite_f64(<const uint64_t*> &x[0], n)
    return ok != 0
