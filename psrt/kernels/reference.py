"""NumPy twins of the kernels in :mod:`psrt._core`: the test oracle and the benchmarks' baseline.

Each function is the straightforward NumPy form of its kernel, updates its outputs in place, and computes in the
arrays' own dtype, as the kernels do.
"""

from __future__ import annotations

import numpy as np

__all__ = ["accumulate", "sgd_step", "momentum_step", "adam_step", "adagrad_step", "all_finite", "mix64", "shard_of",
           "shard_order", "init_rows", "gather_rows", "scatter_add_rows", "sgd_rows", "momentum_rows", "adagrad_rows",
           "adam_rows", "unique_first", "move_rows", "coalesce_rows", "touch_rows", "index_gather", "first_outside"]


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


# ---------------------------------------------------------------------------------------------- row kernels
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic, as in C)."""
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard of each id: ``mix64(id) % num_shards``."""
    return (mix64(ids.astype(np.int64).view(np.uint64)) % np.uint64(num_shards)).astype(np.int64)



def shard_order(ids: np.ndarray, num_shards: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ids sorted by shard, stably: ``(order, offsets, where)``, shard s's indices in
    ``order[offsets[s]:offsets[s + 1]]`` and ``where`` the inverse permutation of ``order``."""
    shards = shard_of(ids, num_shards)
    offsets = np.zeros(num_shards + 1, np.int64)
    np.cumsum(np.bincount(shards, minlength=num_shards), out=offsets[1:])
    order = np.argsort(shards, kind="stable").astype(np.int64)
    where = np.empty(len(order), np.int64)
    where[order] = np.arange(len(order))
    return order, offsets, where


def unique_by_shard(ids: np.ndarray, num_shards: int, by_shard: bool = False) -> tuple:
    """The distinct ids (in the order they first appear) sorted stably by shard, each shard's range, and each
    id's position among them; with ``by_shard``, the ids by shard and each one's index among its shard's distinct
    ids: ``(distinct, starts, gather, order, offsets, inverse)``."""
    firsts, inv = unique_first(ids)
    by, starts, where = shard_order(firsts, num_shards)
    distinct, gather = firsts[by], where[inv]
    if not by_shard:
        return distinct, starts, gather, None, None, None
    order, offsets, _ = shard_order(ids, num_shards)
    inverse = gather[order] - starts[shard_of(ids[order], num_shards)]
    return distinct, starts, gather, order, offsets, inverse


def init_rows(ids: np.ndarray, dim: int, dtype, seed: int, kind: int, a: float, b: float) -> np.ndarray:
    """The initial rows of ``ids`` (see :func:`psrt._core.init_rows` for the definition)."""
    ids = np.asarray(ids, dtype=np.int64)
    out = np.zeros((len(ids), dim), dtype)
    if kind == 0 or dim == 0:
        return out
    k = mix64(np.uint64(seed) ^ mix64(ids.view(np.uint64)))[:, None]
    cols = np.arange(1, dim + 2, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        u = (mix64(k + cols * _GOLDEN) >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)
    if kind == 1:
        out[:] = a + (b - a) * u[:, :dim]
        return out
    u0, u1 = u[:, 0:dim:2], u[:, 1:dim + 1:2]
    r = np.sqrt(-2.0 * np.log(1.0 - u0))
    t = 2.0 * np.pi * u1
    out[:, 0::2] = a + b * r * np.cos(t)
    out[:, 1::2] = (a + b * r * np.sin(t))[:, :dim // 2]
    return out


def unique_first(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ids in the order they first appear, and each id's index among them."""
    uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    return uniq[order].astype(np.int64), rank[inverse.reshape(-1)]


def coalesce_rows(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ids in the order they first appear, and each one's rows summed in the order they come."""
    distinct, inverse = unique_first(ids)
    summed = np.zeros((len(distinct), rows.shape[1]), rows.dtype)
    np.add.at(summed, inverse, rows)
    return distinct, summed


def touch_rows(last: np.ndarray, when: np.ndarray, dirty: np.ndarray, slots: np.ndarray, tick: int,
               now: float) -> None:
    """``last[slots], when[slots], dirty[slots] = tick, now, True``."""
    last[slots], when[slots], dirty[slots] = tick, now, True


def index_gather(cells: np.ndarray, ids: np.ndarray, table: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, int]:
    """The slot of each id in the index's ``(id, slot)`` cells (-1: missing), the rows of those found written into
    ``out``, and how many were missing."""
    held = cells[:, 1] >= 0
    where = dict(zip(cells[held, 0].tolist(), cells[held, 1].tolist()))
    slots = np.array([where.get(i, -1) for i in ids.tolist()], np.int64)
    found = slots >= 0
    out[found] = table[slots[found]]
    return slots, int((~found).sum())


def first_outside(slots: np.ndarray, rows: int) -> int:
    """The index of the first slot outside ``[0, rows)``, or -1."""
    bad = np.flatnonzero((slots < 0) | (slots >= rows))
    return int(bad[0]) if len(bad) else -1


def gather_rows(table: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``table[slots]``."""
    return table[slots]


def move_rows(src: np.ndarray, src_rows: np.ndarray, dst: np.ndarray, dst_rows: np.ndarray) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` in order (a repeated destination row gets the last)."""
    for i, j in zip(src_rows.tolist(), dst_rows.tolist()):
        dst[j] = src[i]


def scatter_add_rows(dst: np.ndarray, slots: np.ndarray, src: np.ndarray) -> None:
    """``dst[slots[i]] += src[i]``, duplicates summed."""
    np.add.at(dst, slots, src)


def sgd_rows(param, slots, grad, lr, scale=1.0, weight_decay=0.0) -> None:
    """Plain SGD on the rows ``param[slots]`` (distinct slots)."""
    rows = param[slots]
    sgd_step(rows, grad, lr, scale, weight_decay)
    param[slots] = rows


def momentum_rows(param, buf, slots, grad, lr, momentum, scale=1.0, weight_decay=0.0, nesterov=False) -> None:
    """SGD with momentum on the touched rows and their buffers."""
    rows, b = param[slots], buf[slots]
    momentum_step(rows, b, grad, lr, momentum, scale, weight_decay, nesterov)
    param[slots], buf[slots] = rows, b


def adagrad_rows(param, acc, slots, grad, lr, eps, scale=1.0, weight_decay=0.0) -> None:
    """Adagrad on the touched rows and their sums."""
    rows, a = param[slots], acc[slots]
    adagrad_step(rows, a, grad, lr, eps, scale, weight_decay)
    param[slots], acc[slots] = rows, a


def adam_rows(param, m, v, slots, grad, lr, beta1, beta2, eps, step, scale=1.0) -> None:
    """torch.optim.SparseAdam on the touched rows: ``lr*sqrt(1-beta2**t)/(1-beta1**t) * m / (sqrt(v) + eps)``."""
    t = param.dtype.type
    rows, mm, vv = param[slots], m[slots], v[slots]
    g = t(scale) * grad
    mm *= t(beta1)
    mm += t(1.0 - beta1) * g
    vv *= t(beta2)
    vv += t(1.0 - beta2) * g * g
    step_size = t(lr * np.sqrt(1.0 - beta2**step) / (1.0 - beta1**step))
    rows -= step_size * mm / (np.sqrt(vv) + t(eps))
    param[slots], m[slots], v[slots] = rows, mm, vv


def seq_read(seq: np.ndarray) -> int:
    """NumPy twin of :func:`psrt.kernels.seq_read` (no fences: one process)."""
    return int(seq[0])


def seq_bump(seq: np.ndarray) -> None:
    """NumPy twin of :func:`psrt.kernels.seq_bump`."""
    seq[0] += np.uint64(1)


def sum_into(dst: np.ndarray, srcs: list, add: bool = False) -> None:
    """NumPy twin of :func:`psrt.kernels.sum_into`."""
    if not add:
        np.copyto(dst, srcs[0])
        srcs = srcs[1:]
    for src in srcs:
        np.add(dst, src, out=dst)
