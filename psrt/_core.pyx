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

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.math cimport cos, log, pow, sin, sqrt
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy
import sys

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


# A shard's every push: the gradient's finiteness check and the SGD step of a small tensor cost less than setting up
# a typed memoryview per argument does (a memoryview object each, its format parsed and checked); the buffer
# protocol's own view is enough for a flat pass over one C-contiguous buffer.
cdef char _NATIVE_ORDER = b'<' if sys.byteorder == "little" else b'>'


cdef int _real_size(const Py_buffer *view) noexcept:
    """4 for a buffer of native float32 (format ``f``), 8 for float64 (``d``), 0 for any other.

    The format may name the byte order, as NumPy's does for some dtypes of native order (``=f``, ``<f``).
    """
    cdef const char *f = view.format
    if f == NULL:
        return 0
    if f[0] == b'@' or f[0] == b'=' or f[0] == _NATIVE_ORDER:
        f += 1
    if f[0] == 0 or f[1] != 0:
        return 0
    if f[0] == b'f' and view.itemsize == 4:
        return 4
    if f[0] == b'd' and view.itemsize == 8:
        return 8
    return 0


cdef int _get_buffer(object obj, Py_buffer *view, int flags, str name) except -1:
    """``obj``'s C-contiguous buffer of float32 or float64 (released by the caller), else ``ValueError``."""
    try:
        PyObject_GetBuffer(obj, view, flags | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
    except (BufferError, TypeError):
        raise ValueError(f"{name} must be a C-contiguous{' writable' if flags else ''} buffer") from None
    if _real_size(view) == 0:
        PyBuffer_Release(view)
        raise ValueError(f"{name} must be a buffer of native float32 or float64")
    return 0


def sgd_step_buffer(param, grad, double lr, double scale, double weight_decay):
    """:func:`sgd_step` of C-contiguous buffers of any shape, both native float32 or both float64, taken through
    the buffer protocol (no typed memoryviews: cheaper to call). ``ValueError``, touching nothing, for anything
    else; only the first ``min(len(param), len(grad))`` elements are stepped."""
    cdef Py_buffer p, g
    cdef Py_ssize_t n
    cdef int size
    _get_buffer(param, &p, PyBUF_WRITABLE, "param")
    try:
        _get_buffer(grad, &g, 0, "grad")
        try:
            size = _real_size(&p)
            if _real_size(&g) != size:
                raise ValueError("param and grad must have one dtype")
            n = _min2(p.len, g.len) // size
            if n:
                with nogil:
                    if size == 4:
                        psrt_sgd_f32(<float*> p.buf, <const float*> g.buf, n, <float> lr, <float> scale,
                                     <float> weight_decay)
                    else:
                        psrt_sgd_f64(<double*> p.buf, <const double*> g.buf, n, lr, scale, weight_decay)
        finally:
            PyBuffer_Release(&g)
    finally:
        PyBuffer_Release(&p)


def all_finite_buffer(x):
    """:func:`all_finite` of a C-contiguous buffer of any shape of native float32 or float64, taken through the
    buffer protocol (no typed memoryview: cheaper to call); ``ValueError`` for any other."""
    cdef Py_buffer v
    cdef int ok = 1
    cdef Py_ssize_t n
    _get_buffer(x, &v, 0, "x")
    try:
        n = v.len // v.itemsize
        if n:
            with nogil:
                if v.itemsize == 4:
                    ok = psrt_all_finite_f32(<const uint32_t*> v.buf, n)
                else:
                    ok = psrt_all_finite_f64(<const uint64_t*> v.buf, n)
    finally:
        PyBuffer_Release(&v)
    return ok != 0


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


cdef enum:
    _SUM_BLOCK = 8192  # elements summed per block: the block of dst stays in cache while every source is added
    _MAX_SOURCES = 64

#: Most sources one :func:`sum_into` call adds.
MAX_SOURCES = _MAX_SOURCES


def sum_into(real[::1] dst, srcs, bint add):
    """``dst = [dst +] srcs[0] + srcs[1] + ...`` in that order, elementwise, one cache-sized block of ``dst`` at a
    time, so memory is read once per source and ``dst`` written once (sequential accumulates would read and write
    ``dst`` once per source). Rounds exactly as those accumulates would. At most :data:`MAX_SOURCES` sources."""
    cdef const real *p[_MAX_SOURCES]
    cdef const real[::1] v
    cdef Py_ssize_t k = len(srcs), n = dst.shape[0], j, j0, b, m
    if k > _MAX_SOURCES:
        k = _MAX_SOURCES
    for j in range(k):
        v = srcs[j]
        n = _min2(n, v.shape[0])
        if v.shape[0] == 0:
            return
        p[j] = &v[0]
    if k == 0 or n == 0:
        return
    with nogil:
        b = 0
        while b < n:
            m = _min2(<Py_ssize_t> _SUM_BLOCK, n - b)
            j0 = 0
            if not add:
                memcpy(&dst[b], p[0] + b, m * sizeof(real))
                j0 = 1
            for j in range(j0, k):
                if real is float:
                    psrt_accumulate_f32(&dst[b], p[j] + b, m)
                else:
                    psrt_accumulate_f64(&dst[b], p[j] + b, m)
            b += m


# ---------------------------------------------------------------------------------------------- sequence counters
# A seqlock between a shard (the one writer) and workers mapping its parameters from shared memory: the writer
# makes the counter odd, writes, and makes it even again; a reader reads the counter, copies, and reads it again,
# and keeps the copy only if both reads agree (and are even). The fences keep the counter's loads and stores on
# the right side of the data's on every CPU (x86 alone would not need them).

cdef extern from *:
    r"""
    static inline uint64_t psrt_seq_read(const uint64_t *p) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        uint64_t v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        return v;
    }
    static inline void psrt_seq_bump(uint64_t *p) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        __atomic_store_n(p, __atomic_load_n(p, __ATOMIC_RELAXED) + 1, __ATOMIC_RELEASE);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
    }
    """
    uint64_t psrt_seq_read(const uint64_t *p) noexcept nogil
    void psrt_seq_bump(uint64_t *p) noexcept nogil


def seq_read(const uint64_t[::1] seq):
    """The counter ``seq[0]``, read between full memory fences (0 for an empty view)."""
    cdef uint64_t v = 0
    if seq.shape[0] == 0:
        return 0
    with nogil:
        v = psrt_seq_read(&seq[0])
    return v


def seq_bump(uint64_t[::1] seq):
    """``seq[0] += 1``, between full memory fences (nothing for an empty view)."""
    if seq.shape[0] == 0:
        return
    with nogil:
        psrt_seq_bump(&seq[0])


# ---------------------------------------------------------------------------------------------- row kernels
# Embedding tables: rows of a 2-D table addressed by slot numbers. The dense per-element loops above are reused
# for each row, so a row step rounds exactly as a dense step of the same row would. Slots outside the table are
# skipped (the wrappers in psrt.kernels.rows refuse them first; this only keeps a bypassing caller in bounds).

cdef extern from *:
    r"""
    /* splitmix64's finaliser: a bijective, well-mixed 64-bit hash (Steele, Lea and Flood, 2014). */
    static inline uint64_t psrt_mix64(uint64_t z) {
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        return z ^ (z >> 31);
    }
    /* The rows a batch touches lie far apart in a large table, so each is a cache miss. A row kernel asks for
       the row it will touch PSRT_AHEAD rows from now, so that the misses of several rows overlap instead of
       following one another (its first lines: the hardware prefetcher follows a row on from there). A hint:
       results do not change. */
    enum { PSRT_AHEAD = 8 };
    #if defined(__GNUC__)
    #  define PSRT_PREFETCH_LINES(p, nbytes, rw)                                                           \
        do {                                                                                              \
            uintptr_t q_ = (uintptr_t)(p) & ~(uintptr_t)63, end_ = (uintptr_t)(p) + (uintptr_t)(nbytes);  \
            for (int k_ = 0; k_ < 4 && q_ < end_; k_++, q_ += 64) __builtin_prefetch((const void *)q_, rw, 3); \
        } while (0)
    #else
    #  define PSRT_PREFETCH_LINES(p, nbytes, rw) do { (void)(p); (void)(nbytes); } while (0)
    #endif
    static inline void psrt_prefetch_r(const void *p, Py_ssize_t nbytes) { PSRT_PREFETCH_LINES(p, nbytes, 0); }
    static inline void psrt_prefetch_w(const void *p, Py_ssize_t nbytes) { PSRT_PREFETCH_LINES(p, nbytes, 1); }
    /* One row's bytes. A copy of a size known when compiled is a few moves; one whose size is a variable is a
       call into libc, which for a 64-byte row (an embedding of 16 float32) costs more than the copy: the usual
       sizes get their own. */
    static inline void psrt_copy_row(void *dst, const void *src, Py_ssize_t nbytes) {
        switch (nbytes) {
        case 32: memcpy(dst, src, 32); break;
        case 64: memcpy(dst, src, 64); break;
        case 128: memcpy(dst, src, 128); break;
        case 256: memcpy(dst, src, 256); break;
        case 512: memcpy(dst, src, 512); break;
        default: memcpy(dst, src, (size_t)nbytes);
        }
    }
    /* A table smaller than this is most likely in cache (a buffer just written): no row of it is asked for ahead. */
    enum { PSRT_PREFETCH_MIN_BYTES = 1 << 20 };
    """
    uint64_t psrt_mix64(uint64_t z) noexcept nogil
    enum: PSRT_AHEAD
    void psrt_prefetch_r(const void *p, Py_ssize_t nbytes) noexcept nogil
    void psrt_prefetch_w(const void *p, Py_ssize_t nbytes) noexcept nogil
    void psrt_copy_row(void *dst, const void *src, Py_ssize_t nbytes) noexcept nogil
    enum: PSRT_PREFETCH_MIN_BYTES

cdef uint64_t _GOLDEN = 0x9E3779B97F4A7C15ULL


cdef inline uint64_t _cell(const int64_t *cells, uint64_t mask, int64_t key) noexcept nogil:
    """The cell of an id index holding ``key``, or the empty cell its linear probe from its home cell ends on.

    A cell is two int64, ``cells[2j]`` an id and ``cells[2j + 1]`` its slot (< 0: empty), side by side: a table's
    index is large and cold, and a lookup is one cache miss, not one for the id and another for its slot."""
    cdef uint64_t j = psrt_mix64(<uint64_t>key) & mask
    while cells[2 * j + 1] >= 0 and cells[2 * j] != key:
        j = (j + 1) & mask
    return j


cdef inline void _ahead(const int64_t *cells, uint64_t mask, int64_t key, bint write) noexcept nogil:
    """Prefetch the home cell of ``key``, whose probe starts there PSRT_AHEAD ids on (see PSRT_AHEAD)."""
    cdef uint64_t j = psrt_mix64(<uint64_t>key) & mask
    if write:
        psrt_prefetch_w(&cells[2 * j], 2 * sizeof(int64_t))
    else:
        psrt_prefetch_r(&cells[2 * j], 2 * sizeof(int64_t))


cdef inline Py_ssize_t _index_cap(const int64_t[:, ::1] cells) noexcept nogil:
    """The cells of an id index (a power of two of them, two int64 each), 0 for an array that is none."""
    cdef Py_ssize_t cap = cells.shape[0]
    if cap == 0 or (cap & (cap - 1)) != 0 or cells.shape[1] != 2:
        return 0
    return cap


def gather_rows(const real[:, ::1] table, const int64_t[::1] slots, real[:, ::1] out):
    """``out[i] = table[slots[i]]`` for every i (rows whose slot is out of range are left as they are)."""
    cdef Py_ssize_t n = _min2(slots.shape[0], out.shape[0]), i, s, t
    cdef Py_ssize_t dim = _min2(table.shape[1], out.shape[1]), rows = table.shape[0]
    cdef Py_ssize_t nbytes = dim * sizeof(real)
    if n == 0 or dim == 0:
        return
    cdef bint ahead = rows * table.shape[1] * sizeof(real) >= PSRT_PREFETCH_MIN_BYTES
    with nogil:
        for i in range(n):
            if ahead and i + PSRT_AHEAD < n:
                t = slots[i + PSRT_AHEAD]
                if 0 <= t < rows:
                    psrt_prefetch_r(&table[t, 0], nbytes)
            s = slots[i]
            if 0 <= s < rows:
                psrt_copy_row(&out[i, 0], &table[s, 0], nbytes)


def move_rows(const real[:, ::1] src, const int64_t[::1] src_rows, real[:, ::1] dst, const int64_t[::1] dst_rows):
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for every i: a gather and a scatter in one pass, so that rows
    answered for distinct ids go straight to every place the caller asked for them (a pair with a row out of
    range is skipped)."""
    cdef Py_ssize_t n = _min2(src_rows.shape[0], dst_rows.shape[0]), i, s, d
    cdef Py_ssize_t dim = _min2(src.shape[1], dst.shape[1]), src_count = src.shape[0], dst_count = dst.shape[0]
    cdef Py_ssize_t nbytes = dim * sizeof(real)
    if n == 0 or dim == 0:
        return
    with nogil:
        for i in range(n):
            # The rows written lie scattered through dst, which the caller's other work has just pushed out of
            # cache: each is fetched before it is written, and asked for ahead, those fetches overlap.
            if i + PSRT_AHEAD < n:
                d = dst_rows[i + PSRT_AHEAD]
                if 0 <= d < dst_count:
                    psrt_prefetch_w(&dst[d, 0], nbytes)
            s = src_rows[i]
            d = dst_rows[i]
            if 0 <= s < src_count and 0 <= d < dst_count:
                psrt_copy_row(&dst[d, 0], &src[s, 0], nbytes)


def scatter_add_rows(real[:, ::1] dst, const int64_t[::1] slots, const real[:, ::1] src):
    """``dst[slots[i]] += src[i]`` for every i, in order, so duplicate slots sum (coalescing a sparse gradient)."""
    cdef Py_ssize_t n = _min2(slots.shape[0], src.shape[0]), i, s
    cdef Py_ssize_t dim = _min2(dst.shape[1], src.shape[1]), rows = dst.shape[0]
    if n == 0 or dim == 0:
        return
    with nogil:
        for i in range(n):
            s = slots[i]
            if 0 <= s < rows:
                if real is float:
                    psrt_accumulate_f32(&dst[s, 0], &src[i, 0], dim)
                else:
                    psrt_accumulate_f64(&dst[s, 0], &src[i, 0], dim)


def sgd_rows(real[:, ::1] param, const int64_t[::1] slots, const real[:, ::1] grad, double lr, double scale,
             double weight_decay):
    """:func:`sgd_step` on the rows ``param[slots[i]]`` with ``grad[i]``; slots must be distinct."""
    cdef Py_ssize_t n = _min2(slots.shape[0], grad.shape[0]), i, s, t
    cdef Py_ssize_t dim = _min2(param.shape[1], grad.shape[1]), rows = param.shape[0]
    cdef real lr_ = <real>lr, sc = <real>scale, wd = <real>weight_decay
    if n == 0 or dim == 0:
        return
    with nogil:
        for i in range(n):
            if i + PSRT_AHEAD < n:
                t = slots[i + PSRT_AHEAD]
                if 0 <= t < rows:
                    psrt_prefetch_w(&param[t, 0], dim * sizeof(real))
            s = slots[i]
            if 0 <= s < rows:
                if real is float:
                    psrt_sgd_f32(&param[s, 0], &grad[i, 0], dim, lr_, sc, wd)
                else:
                    psrt_sgd_f64(&param[s, 0], &grad[i, 0], dim, lr_, sc, wd)


def momentum_rows(real[:, ::1] param, real[:, ::1] buf, const int64_t[::1] slots, const real[:, ::1] grad,
                  double lr, double momentum, double scale, double weight_decay, bint nesterov):
    """:func:`momentum_step` on the touched rows (their momentum buffers only); slots must be distinct."""
    cdef Py_ssize_t n = _min2(slots.shape[0], grad.shape[0]), i, s, t
    cdef Py_ssize_t dim = _min2(_min2(param.shape[1], buf.shape[1]), grad.shape[1])
    cdef Py_ssize_t rows = _min2(param.shape[0], buf.shape[0])
    cdef real lr_ = <real>lr, mu = <real>momentum, sc = <real>scale, wd = <real>weight_decay
    if n == 0 or dim == 0:
        return
    with nogil:
        for i in range(n):
            if i + PSRT_AHEAD < n:
                t = slots[i + PSRT_AHEAD]
                if 0 <= t < rows:
                    psrt_prefetch_w(&param[t, 0], dim * sizeof(real))
                    psrt_prefetch_w(&buf[t, 0], dim * sizeof(real))
            s = slots[i]
            if 0 <= s < rows:
                if real is float:
                    psrt_momentum_f32(&param[s, 0], &buf[s, 0], &grad[i, 0], dim, lr_, mu, sc, wd, nesterov)
                else:
                    psrt_momentum_f64(&param[s, 0], &buf[s, 0], &grad[i, 0], dim, lr_, mu, sc, wd, nesterov)


def adagrad_rows(real[:, ::1] param, real[:, ::1] acc, const int64_t[::1] slots, const real[:, ::1] grad,
                 double lr, double eps, double scale, double weight_decay):
    """:func:`adagrad_step` on the touched rows and their sums (torch.optim.Adagrad with a sparse gradient)."""
    cdef Py_ssize_t n = _min2(slots.shape[0], grad.shape[0]), i, s, t
    cdef Py_ssize_t dim = _min2(_min2(param.shape[1], acc.shape[1]), grad.shape[1])
    cdef Py_ssize_t rows = _min2(param.shape[0], acc.shape[0])
    cdef real lr_ = <real>lr, eps_ = <real>eps, sc = <real>scale, wd = <real>weight_decay
    if n == 0 or dim == 0:
        return
    with nogil:
        for i in range(n):
            if i + PSRT_AHEAD < n:
                t = slots[i + PSRT_AHEAD]
                if 0 <= t < rows:
                    psrt_prefetch_w(&param[t, 0], dim * sizeof(real))
                    psrt_prefetch_w(&acc[t, 0], dim * sizeof(real))
            s = slots[i]
            if 0 <= s < rows:
                if real is float:
                    psrt_adagrad_f32(&param[s, 0], &acc[s, 0], &grad[i, 0], dim, lr_, eps_, sc, wd)
                else:
                    psrt_adagrad_f64(&param[s, 0], &acc[s, 0], &grad[i, 0], dim, lr_, eps_, sc, wd)


def adam_rows(real[:, ::1] param, real[:, ::1] m, real[:, ::1] v, const int64_t[::1] slots,
              const real[:, ::1] grad, double step_size, double inv_bc2_sqrt, double beta1, double beta2,
              double eps, double scale):
    """The Adam update on the touched rows and their moments; the caller computes the step factors."""
    cdef Py_ssize_t n = _min2(slots.shape[0], grad.shape[0]), i, s, t
    cdef Py_ssize_t dim = _min2(_min2(param.shape[1], m.shape[1]), _min2(v.shape[1], grad.shape[1]))
    cdef Py_ssize_t rows = _min2(param.shape[0], _min2(m.shape[0], v.shape[0]))
    cdef real ss = <real>step_size, ib = <real>inv_bc2_sqrt, b1 = <real>beta1, b2 = <real>beta2
    cdef real omb1 = <real>(1.0 - beta1), omb2 = <real>(1.0 - beta2), eps_ = <real>eps, sc = <real>scale
    cdef real one = 1, zero = 0
    if n == 0 or dim == 0:
        return
    with nogil:
        for i in range(n):
            if i + PSRT_AHEAD < n:
                t = slots[i + PSRT_AHEAD]
                if 0 <= t < rows:
                    psrt_prefetch_w(&param[t, 0], dim * sizeof(real))
                    psrt_prefetch_w(&m[t, 0], dim * sizeof(real))
                    psrt_prefetch_w(&v[t, 0], dim * sizeof(real))
            s = slots[i]
            if 0 <= s < rows:
                if real is float:
                    psrt_adam_f32(&param[s, 0], &m[s, 0], &v[s, 0], &grad[i, 0], dim, ss, ib, b1, b2, omb1, omb2,
                                  eps_, sc, one, zero)
                else:
                    psrt_adam_f64(&param[s, 0], &m[s, 0], &v[s, 0], &grad[i, 0], dim, ss, ib, b1, b2, omb1, omb2,
                                  eps_, sc, one, zero)


def index_find(int64_t[:, ::1] cells, const int64_t[::1] ids, int64_t[::1] out, int64_t[::1] row_ids,
               Py_ssize_t used, bint insert):
    """Look ids up in an open-addressing table (linear probing; ``cells[j] = (id, slot)``, ``slot < 0`` marks an
    empty cell).

    ``out[i]`` gets the slot of ``ids[i]``; a missing id gets slot ``used`` (then ``used + 1``, ...) when
    ``insert``, recorded in ``row_ids[slot]``, else -1. The capacity (``len(cells)``, a power of two) must keep
    the load under 1 after the inserts, and ``row_ids`` must have room: the wrapper grows both first. Returns
    the new number of slots in use.
    """
    cdef Py_ssize_t n = _min2(ids.shape[0], out.shape[0]), cap = _index_cap(cells), i
    cdef uint64_t mask = <uint64_t>cap - 1, j
    cdef int64_t key
    cdef int64_t *c
    cdef Py_ssize_t room = row_ids.shape[0]
    if cap == 0:
        return used
    c = &cells[0, 0]
    with nogil:
        for i in range(n):
            if i + PSRT_AHEAD < n:
                _ahead(c, mask, ids[i + PSRT_AHEAD], True)
            key = ids[i]
            j = _cell(c, mask, key)
            if c[2 * j + 1] >= 0:
                out[i] = c[2 * j + 1]
            elif insert and used < room:
                c[2 * j] = key
                c[2 * j + 1] = used
                row_ids[used] = key
                out[i] = used
                used += 1
            else:
                out[i] = -1
    return used


cdef inline bint _scratch_fits(int32_t[::1] index, Py_ssize_t n) noexcept nogil:
    """Whether ``index`` is a scratch index that can take ``n`` ids (a power of two of cells, above ``n``)."""
    cdef Py_ssize_t cap = index.shape[0]
    return cap > 0 and (cap & (cap - 1)) == 0 and n < cap and n <= 0x7fffffff


cdef inline int64_t _first_index(int32_t *index, uint64_t mask, int64_t key, int64_t *distinct, Py_ssize_t *used,
                                 bint *new) noexcept nogil:
    """``key``'s index among the distinct ids of a scratch index, in the order they first appear: a key not seen
    before is added (``distinct[used]``, ``used`` counted on, ``new`` set)."""
    return _first_index_at(index, mask, key, psrt_mix64(<uint64_t>key), distinct, used, new)


cdef inline int64_t _first_index_at(int32_t *index, uint64_t mask, int64_t key, uint64_t h, int64_t *distinct,
                                    Py_ssize_t *used, bint *new) noexcept nogil:
    """:func:`_first_index`, for a caller that has ``key``'s hash ``h`` already (and uses it again).

    A scratch index's cells hold only where a key is among the distinct ones (int32; < 0: empty), and the key
    is read there: four bytes a cell, not a key and its value's sixteen. A batch's index is fresh memory every
    call, in a process whose caches the others on its core have just filled (a worker's, the shards it woke):
    its size, not the probing, is what the call costs (8,192 ids: a 64 KiB index instead of 256 KiB)."""
    cdef uint64_t j = h & mask
    cdef int64_t k = index[j]
    while k >= 0 and distinct[k] != key:
        j = (j + 1) & mask
        k = index[j]
    new[0] = k < 0
    if k < 0:
        k = used[0]
        index[j] = <int32_t>k
        distinct[k] = key
        used[0] = k + 1
    return k


def unique_ids(int32_t[::1] index, const int64_t[::1] ids, int64_t[::1] inverse, int64_t[::1] distinct):
    """The distinct ids in the order they first appear (``distinct[:k]``) and each id's index among them
    (``inverse``); returns k. ``index`` is a fresh scratch index (every cell < 0; its length a power of two
    above ``len(ids)``, and ``len(ids)`` below 2**31)."""
    cdef Py_ssize_t n = _min2(_min2(ids.shape[0], inverse.shape[0]), distinct.shape[0]), i, used = 0
    cdef bint new
    if not _scratch_fits(index, n):
        return 0
    cdef uint64_t mask = <uint64_t>index.shape[0] - 1
    with nogil:
        for i in range(n):
            inverse[i] = _first_index(&index[0], mask, ids[i], &distinct[0], &used, &new)
    return used


def coalesce_rows(int32_t[::1] index, const int64_t[::1] ids, const real[:, ::1] rows, int64_t[::1] distinct,
                  real[:, ::1] summed):
    """Sum the rows of repeated ids in one pass: ``distinct[k]`` is the k-th distinct id in the order they first
    appear and ``summed[k]`` the sum of its rows, in the order they come (the first copied, the next added).

    ``index`` is a fresh scratch index, as :func:`unique_ids` takes. Returns the number of distinct ids. What
    :func:`unique_ids` followed by :func:`scatter_add_rows` into zeroed rows gives, without zeroing the rows or a
    second pass over the ids.
    """
    cdef Py_ssize_t n = _min2(_min2(ids.shape[0], rows.shape[0]), _min2(distinct.shape[0], summed.shape[0]))
    cdef Py_ssize_t dim = _min2(rows.shape[1], summed.shape[1]), i, used = 0
    cdef int64_t k
    cdef bint new
    if not _scratch_fits(index, n):
        return 0
    cdef uint64_t mask = <uint64_t>index.shape[0] - 1
    if dim == 0:
        with nogil:
            for i in range(n):
                _first_index(&index[0], mask, ids[i], &distinct[0], &used, &new)
        return used
    with nogil:
        for i in range(n):
            k = _first_index(&index[0], mask, ids[i], &distinct[0], &used, &new)
            if new:
                psrt_copy_row(&summed[k, 0], &rows[i, 0], dim * sizeof(real))
            elif real is float:
                psrt_accumulate_f32(&summed[k, 0], &rows[i, 0], dim)
            else:
                psrt_accumulate_f64(&summed[k, 0], &rows[i, 0], dim)
    return used


def touch_rows(int64_t[::1] last, double[::1] when, uint8_t[::1] dirty, const int64_t[::1] slots, int64_t tick,
               double now):
    """``last[s], when[s], dirty[s] = tick, now, 1`` for every slot ``s`` in ``slots`` (slots outside the arrays
    are skipped): a push's marks on its rows, in one pass where three fancy assignments make three."""
    cdef Py_ssize_t n = slots.shape[0], i, s
    cdef Py_ssize_t rows = _min2(_min2(last.shape[0], when.shape[0]), dirty.shape[0])
    with nogil:
        for i in range(n):
            s = slots[i]
            if 0 <= s < rows:
                last[s] = tick
                when[s] = now
                dirty[s] = 1


def first_outside(const int64_t[::1] slots, int64_t rows):
    """The index of the first slot outside ``[0, rows)``, or -1 when every one lies inside: one pass, where a
    check by ``slots.min()`` and ``slots.max()`` makes two."""
    cdef Py_ssize_t n = slots.shape[0], i
    cdef Py_ssize_t found = -1
    with nogil:
        for i in range(n):
            if slots[i] < 0 or slots[i] >= rows:
                found = i
                break
    return found


def index_gather(const int64_t[:, ::1] cells, const int64_t[::1] ids, const real[:, ::1] table, real[:, ::1] out,
                 int64_t[::1] slots):
    """:func:`index_find` without inserts, then :func:`gather_rows`, in one call: ``slots[i]`` gets the slot of
    ``ids[i]`` (-1: missing) and ``out[i] = table[slots[i]]`` for each id found (a missing id's row is left as it
    is). Returns how many ids were missing."""
    cdef Py_ssize_t n = _min2(_min2(ids.shape[0], out.shape[0]), slots.shape[0]), cap = _index_cap(cells)
    cdef Py_ssize_t dim = _min2(table.shape[1], out.shape[1]), rows = table.shape[0], i, s, t
    cdef Py_ssize_t missing = 0
    cdef uint64_t mask = <uint64_t>cap - 1, j
    cdef const int64_t *c
    if cap == 0:
        return n
    c = &cells[0, 0]
    with nogil:
        for i in range(n):
            if i + PSRT_AHEAD < n:
                _ahead(c, mask, ids[i + PSRT_AHEAD], False)
            j = _cell(c, mask, ids[i])
            slots[i] = c[2 * j + 1] if c[2 * j + 1] >= 0 else -1
        for i in range(n):
            if i + PSRT_AHEAD < n:
                t = slots[i + PSRT_AHEAD]
                if 0 <= t < rows:
                    psrt_prefetch_r(&table[t, 0], dim * sizeof(real))
            s = slots[i]
            if s < 0:
                missing += 1
            elif s < rows and dim:
                psrt_copy_row(&out[i, 0], &table[s, 0], dim * sizeof(real))
    return missing


def index_remove(int64_t[:, ::1] cells, const int64_t[::1] ids, int64_t[::1] out):
    """Remove ids from the open-addressing table of :func:`index_find`; ``out[i]`` gets the slot ``ids[i]`` had
    (-1: absent, or removed by an earlier repeat).

    Linear probing's deletion by backward shift (Knuth's Algorithm R): each entry after the freed cell whose home
    cell does not lie cyclically in ``(freed, entry]`` moves back into the hole, so no tombstone is left and every
    remaining key is still found from its home cell. Slots are not renumbered: the caller moves rows and says so
    with :func:`index_set`.
    """
    cdef Py_ssize_t n = _min2(ids.shape[0], out.shape[0]), cap = _index_cap(cells), i
    cdef uint64_t mask = <uint64_t>cap - 1, j, hole, home
    cdef int64_t *c
    if cap == 0:
        return
    c = &cells[0, 0]
    with nogil:
        for i in range(n):
            if i + PSRT_AHEAD < n:
                _ahead(c, mask, ids[i + PSRT_AHEAD], True)
            j = _cell(c, mask, ids[i])
            if c[2 * j + 1] < 0:
                out[i] = -1
                continue
            out[i] = c[2 * j + 1]
            hole = j
            while True:
                j = (j + 1) & mask
                if c[2 * j + 1] < 0:
                    break
                home = psrt_mix64(<uint64_t>c[2 * j]) & mask
                if (hole < j and hole < home and home <= j) or (hole > j and (home > hole or home <= j)):
                    continue  # its home lies between the hole and it: it stays
                c[2 * hole] = c[2 * j]
                c[2 * hole + 1] = c[2 * j + 1]
                hole = j
            c[2 * hole + 1] = -1


def index_set(int64_t[:, ::1] cells, const int64_t[::1] ids, const int64_t[::1] slots):
    """Give each of ``ids`` (already in the table) the slot ``slots[i]``; returns how many were found."""
    cdef Py_ssize_t n = _min2(ids.shape[0], slots.shape[0]), cap = _index_cap(cells), i
    cdef Py_ssize_t found = 0
    cdef uint64_t mask = <uint64_t>cap - 1, j
    cdef int64_t *c
    if cap == 0:
        return 0
    c = &cells[0, 0]
    with nogil:
        for i in range(n):
            if i + PSRT_AHEAD < n:
                _ahead(c, mask, ids[i + PSRT_AHEAD], True)
            j = _cell(c, mask, ids[i])
            if c[2 * j + 1] >= 0:
                c[2 * j + 1] = slots[i]
                found += 1
    return found


cdef inline Py_ssize_t _shard(uint64_t h, uint64_t num_shards) noexcept nogil:
    """``h % num_shards``; a power of two of shards by a mask, the same value without the division (tens of
    cycles an id)."""
    if (num_shards & (num_shards - 1)) == 0:
        return <Py_ssize_t>(h & (num_shards - 1))
    return <Py_ssize_t>(h % num_shards)


def shard_of(const int64_t[::1] ids, int64_t[::1] out, int64_t num_shards):
    """``out[i] = mix64(ids[i]) % num_shards``: the shard of each id (a stable hash, so any id pattern spreads)."""
    cdef Py_ssize_t n = _min2(ids.shape[0], out.shape[0]), i
    if num_shards <= 0:
        return
    with nogil:
        for i in range(n):
            out[i] = _shard(psrt_mix64(<uint64_t>ids[i]), <uint64_t>num_shards)


cdef inline void _places(int64_t *offsets, Py_ssize_t num_shards, int64_t *place, Py_ssize_t count) noexcept nogil:
    """A counting sort's placing: ``offsets[s + 1]`` holds shard s's count and ``place[k]`` item k's shard; then
    ``offsets[s]`` is where shard s starts and ``place[k]`` item k's position, a shard's items in their order."""
    cdef Py_ssize_t s, k
    cdef int64_t pos
    for s in range(num_shards):  # offsets[s]: where shard s starts
        offsets[s + 1] += offsets[s]
    for k in range(count):  # offsets[s] serves as shard s's cursor: it ends where shard s + 1 starts
        s = place[k]
        pos = offsets[s]
        place[k] = pos
        offsets[s] = pos + 1
    for s in range(num_shards, 0, -1):  # back to the starts
        offsets[s] = offsets[s - 1]
    offsets[0] = 0


def unique_by_shard(int32_t[::1] index, const int64_t[::1] ids, int64_t num_shards, int64_t[::1] firsts,
                    int64_t[::1] place, int64_t[::1] distinct, int64_t[::1] starts, int64_t[::1] gather,
                    int64_t[::1] order, int64_t[::1] offsets, int64_t[::1] inverse):
    """The distinct ids sorted by shard, and where each id's row comes back: :func:`unique_ids`, then
    :func:`shard_order` of the distinct ids, then each id's position, in a pass over the ids, one over the
    distinct ones and one more over the ids (each id hashed once: its scratch cell and its shard come from the
    same ``mix64``).

    ``distinct[:k]`` gets the k distinct ids, shard s's in ``distinct[starts[s]:starts[s + 1]]`` in the order
    they first appear in ``ids``; ``gather[i]`` the position of ``ids[i]`` in ``distinct``. Unless ``offsets`` is
    empty, also the ids by shard, as :func:`shard_order` gives them (``order``, ``offsets``), and ``inverse[m]``,
    the index of ``ids[order[m]]`` among its shard's distinct ids: each shard's answer can then be moved to its
    places as it comes (two passes more over the ids). ``index`` is a fresh scratch index (as :func:`unique_ids`
    takes); ``firsts`` and ``place`` are scratch of ``len(ids)`` entries. Returns k (0, and nothing written,
    unless every array has its size).
    """
    cdef Py_ssize_t n = ids.shape[0], i, m, s, used = 0
    cdef uint64_t h, mask, shards = <uint64_t>num_shards
    cdef int64_t k, key
    cdef int32_t *c
    cdef int64_t *first
    cdef bint new, by_shard = offsets.shape[0] != 0
    if (num_shards <= 0 or starts.shape[0] != num_shards + 1 or firsts.shape[0] != n or place.shape[0] != n
            or distinct.shape[0] != n or gather.shape[0] != n or not _scratch_fits(index, n)
            or (by_shard and (order.shape[0] != n or offsets.shape[0] != num_shards + 1 or inverse.shape[0] != n))):
        return 0
    c, mask = &index[0], <uint64_t>index.shape[0] - 1
    first = &firsts[0] if n else NULL
    with nogil:
        for s in range(num_shards + 1):
            starts[s] = 0
        for i in range(n):  # each id's index among the distinct ones; each new one's shard, counted one entry on
            key = ids[i]
            h = psrt_mix64(<uint64_t>key)
            k = _first_index_at(c, mask, key, h, first, &used, &new)
            if new:
                s = _shard(h, shards)
                place[k] = s
                starts[s + 1] += 1
            gather[i] = k
        if n:
            _places(&starts[0], num_shards, &place[0], used)
            for k in range(used):
                distinct[place[k]] = firsts[k]
            for i in range(n):
                gather[i] = place[gather[i]]
        if by_shard:
            for s in range(num_shards + 1):
                offsets[s] = 0
            for i in range(n):  # each id's shard (held in inverse until the order is made), counted one entry on
                s = _shard(psrt_mix64(<uint64_t>ids[i]), shards)
                inverse[i] = s
                offsets[s + 1] += 1
            if n:
                _places(&offsets[0], num_shards, &inverse[0], n)
                for i in range(n):
                    order[inverse[i]] = i
            for s in range(num_shards):
                for m in range(offsets[s], offsets[s + 1]):
                    inverse[m] = gather[order[m]] - starts[s]
    return used


def shard_order(const int64_t[::1] ids, int64_t num_shards, int64_t[::1] order, int64_t[::1] offsets,
                int64_t[::1] where):
    """Sort ids by shard (``mix64(id) % num_shards``, as :func:`shard_of`) in one counting sort.

    ``offsets`` (``num_shards + 1`` entries): shard s's range of ``order`` is ``offsets[s]:offsets[s + 1]``;
    ``order`` lists each shard's indices into ``ids`` in ascending order, which is what a stable argsort of the
    shards gives, in O(n) instead of O(n log n); ``where[i]``: the position of ``i`` in ``order`` (it holds the
    shards until then). Does nothing unless every array has its size.
    """
    cdef Py_ssize_t n = ids.shape[0], i, s
    if num_shards <= 0 or order.shape[0] != n or where.shape[0] != n or offsets.shape[0] != num_shards + 1:
        return
    with nogil:
        for s in range(num_shards + 1):
            offsets[s] = 0
        for i in range(n):  # each shard's count, one entry on: offsets[s + 1]
            s = _shard(psrt_mix64(<uint64_t>ids[i]), <uint64_t>num_shards)
            where[i] = s
            offsets[s + 1] += 1
        if n:
            _places(&offsets[0], num_shards, &where[0], n)
            for i in range(n):
                order[where[i]] = i


def init_rows(real[:, ::1] table, Py_ssize_t start, const int64_t[::1] ids, uint64_t seed, int kind, double a,
              double b):
    """Fill ``table[start + i]`` with the initial row of ``ids[i]``: a pure function of ``(seed, id, column)``.

    Element j of the row of ``id`` draws ``u_j = (mix64(k + (j+1)*GOLDEN) >> 11) * 2**-53`` in [0, 1) with
    ``k = mix64(seed ^ mix64(id))``. ``kind`` 0: zeros; 1: uniform, ``a + (b - a)*u_j``; 2: normal with mean
    ``a`` and deviation ``b``, by Box-Muller on pairs ``(u_{2p}, u_{2p+1})``: ``r = sqrt(-2 log(1 - u_{2p}))``,
    elements ``2p`` and ``2p+1`` get ``a + b*r*cos(2 pi u_{2p+1})`` and ``a + b*r*sin(2 pi u_{2p+1})``.
    """
    cdef Py_ssize_t n = ids.shape[0], dim = table.shape[1], i, j, row
    cdef uint64_t k
    cdef double u0, u1, r, t
    cdef double scale53 = 1.0 / 9007199254740992.0, two_pi = 6.283185307179586
    if start < 0:
        return
    n = _min2(n, table.shape[0] - start)
    with nogil:
        for i in range(n):
            row = start + i
            k = psrt_mix64(seed ^ psrt_mix64(<uint64_t>ids[i]))
            if kind == 0:
                for j in range(dim):
                    table[row, j] = 0
            elif kind == 1:
                for j in range(dim):
                    u0 = <double>(psrt_mix64(k + <uint64_t>(j + 1) * _GOLDEN) >> 11) * scale53
                    table[row, j] = <real>(a + (b - a) * u0)
            else:
                j = 0
                while j < dim:
                    u0 = <double>(psrt_mix64(k + <uint64_t>(j + 1) * _GOLDEN) >> 11) * scale53
                    u1 = <double>(psrt_mix64(k + <uint64_t>(j + 2) * _GOLDEN) >> 11) * scale53
                    r = sqrt(-2.0 * log(1.0 - u0))
                    t = two_pi * u1
                    table[row, j] = <real>(a + b * r * cos(t))
                    if j + 1 < dim:
                        table[row, j + 1] = <real>(a + b * r * sin(t))
                    j += 2
