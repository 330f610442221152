"""Validated entry points to the row kernels of :mod:`psrt._core`: embedding tables' gather, scatter-add,
row-wise optimizer steps, the id index and the deterministic row initializer.

As in :mod:`psrt.kernels`, the compiled kernels never raise; these wrappers check dtypes, shapes, contiguity,
writability and that every slot lies inside the table, and raise :class:`~psrt.errors.KernelTypeError` or
:class:`~psrt.errors.KernelArgumentError`. Tables are 2-D ``(rows, dim)`` C-contiguous arrays; slots and ids
are 1-D C-contiguous int64 arrays. :mod:`psrt.kernels.reference` holds the NumPy twin of each kernel.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from psrt import _core, dtypes
from psrt.errors import KernelArgumentError, KernelTypeError

__all__ = ["gather_rows", "move_rows", "scatter_add_rows", "sgd_rows", "momentum_rows", "adagrad_rows", "adam_rows",
           "index_cells", "index_find", "index_gather", "index_remove", "index_set", "unique_first", "coalesce_rows",
           "touch_rows", "shard_of", "shard_order", "unique_by_shard", "init_rows", "INIT_KINDS", "INITIALIZERS"]

#: Initializer names and their kernel codes (see :func:`init_rows`).
#: The row initializers and the parameters each takes; the kernel knows each by its position here.
INITIALIZERS: dict[str, tuple[str, ...]] = {"zeros": (), "uniform": ("low", "high"), "normal": ("std",)}
INIT_KINDS = {kind: code for code, kind in enumerate(INITIALIZERS)}

_I64 = np.dtype(np.int64)


def _table(name: str, a: object, writable: bool = True) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise KernelTypeError(f"{name} must be a numpy.ndarray, got {type(a).__name__}")
    if a.dtype not in dtypes.SUPPORTED or not a.dtype.isnative:
        raise KernelTypeError(f"{name} has dtype {a.dtype}; the kernels take {dtypes.describe()} (native order)")
    if a.ndim != 2 or not a.flags.c_contiguous:
        raise KernelArgumentError(f"{name} must be a 2-D C-contiguous (rows, dim) array, got shape {a.shape}")
    if writable and not a.flags.writeable:
        raise KernelArgumentError(f"{name} is read-only but is updated in place; pass a writable array")
    return a


def _ids(name: str, a: object, writable: bool = False) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != _I64 or a.ndim != 1 or not a.flags.c_contiguous:
        raise KernelTypeError(f"{name} must be a 1-D C-contiguous int64 array")
    if writable and not a.flags.writeable:
        raise KernelArgumentError(f"{name} is read-only but is written; pass a writable array")
    return a


def _slots(slots: object, rows: int, n: int) -> np.ndarray:
    s = _ids("slots", slots)
    if len(s) != n:
        raise KernelArgumentError(f"slots has {len(s)} entries but there are {n} rows of values")
    if len(s) and _core.first_outside(s, rows) >= 0:  # (one pass: min() and max() make two)
        raise KernelArgumentError(f"slots must lie in [0, {rows}): the table has {rows} rows")
    return s


def _same(table: np.ndarray, *others: tuple[str, np.ndarray], rows: bool = True) -> None:
    for name, a in others:
        if a.dtype != table.dtype:
            raise KernelTypeError(f"{name} has dtype {a.dtype} but the table has {table.dtype}; use one dtype")
        if a.shape[1] != table.shape[1] or (rows and a.shape[0] != table.shape[0]):
            raise KernelArgumentError(f"{name} has shape {a.shape}, which does not fit the table's {table.shape}")


def _num(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise KernelArgumentError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise KernelArgumentError(f"{name} must be a finite number, got {value}")
    return value


def gather_rows(table: np.ndarray, slots: np.ndarray, out: np.ndarray, checked: bool = False) -> None:
    """``out[i] = table[slots[i]]``.

    Parameters
    ----------
    table : numpy.ndarray
        ``(rows, dim)`` table (may be read-only).
    slots : numpy.ndarray
        int64 slots, each in ``[0, rows)``; repeats allowed.
    out : numpy.ndarray
        Writable ``(len(slots), dim)`` array of the table's dtype.
    checked : bool
        The slots come from a kernel of this module that puts them in range (:func:`unique_first`'s inverse,
        :func:`shard_order`'s order): the pass that looks for one outside is skipped (10 us of the ~490 us a
        4-shard ``pull_rows`` cost its worker, when its rows were gathered this way). The kernel never reads
        outside the table either way; a slot outside leaves its row as it is.
    """
    t, o = _table("table", table, writable=False), _table("out", out)
    _same(t, ("out", o), rows=False)
    if checked:
        s = _ids("slots", slots)
        if len(s) != o.shape[0]:
            raise KernelArgumentError(f"slots has {len(s)} entries but there are {o.shape[0]} rows of values")
    else:
        s = _slots(slots, t.shape[0], o.shape[0])
    _core.gather_rows(t, s, o)


def move_rows(src: np.ndarray, src_rows: np.ndarray, dst: np.ndarray, dst_rows: np.ndarray,
              checked: bool = False) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for every i, in one pass: rows answered once per distinct id, put
    in every place they were asked for (a ``pull_rows`` answer, straight from its shared-memory area).

    Parameters
    ----------
    src : numpy.ndarray
        ``(rows, dim)`` rows (may be read-only).
    src_rows, dst_rows : numpy.ndarray
        int64, as many of each: rows of ``src``, each in ``[0, len(src))`` (repeats allowed), and of ``dst``,
        each in ``[0, len(dst))`` (a repeated one gets the last row moved to it).
    dst : numpy.ndarray
        Writable ``(rows, dim)`` array of ``src``'s dtype and dim.
    checked : bool
        The rows come from a kernel of this module that puts them in range (:func:`unique_by_shard`'s
        inverse and order): the passes that look for one outside are skipped. The kernel never reads
        or writes outside either way; a pair with a row outside is skipped.
    """
    s, d = _table("src", src, writable=False), _table("dst", dst)
    _same(s, ("dst", d), rows=False)
    a, b = _ids("src_rows", src_rows), _ids("dst_rows", dst_rows)
    if len(a) != len(b):
        raise KernelArgumentError(f"src_rows has {len(a)} entries and dst_rows {len(b)}; give one of each per row")
    if not checked:
        for name, rows, n in (("src_rows", a, len(s)), ("dst_rows", b, len(d))):
            if len(rows) and _core.first_outside(rows, n) >= 0:
                raise KernelArgumentError(f"{name} must lie in [0, {n}): the array has {n} rows")
    _core.move_rows(s, a, d, b)


def scatter_add_rows(dst: np.ndarray, slots: np.ndarray, src: np.ndarray) -> None:
    """``dst[slots[i]] += src[i]`` in order, so that rows of repeated slots are summed.

    Parameters
    ----------
    dst : numpy.ndarray
        Writable ``(rows, dim)`` table.
    slots : numpy.ndarray
        int64 slots in ``[0, rows)``; repeats allowed.
    src : numpy.ndarray
        ``(len(slots), dim)`` values of the table's dtype (may be read-only).
    """
    d, s = _table("dst", dst), _table("src", src, writable=False)
    _same(d, ("src", s), rows=False)
    _core.scatter_add_rows(d, _slots(slots, d.shape[0], s.shape[0]), s)


def sgd_rows(param: np.ndarray, slots: np.ndarray, grad: np.ndarray, lr: float, scale: float = 1.0,
             weight_decay: float = 0.0) -> None:
    """Plain SGD on the rows ``param[slots]`` with ``grad`` (distinct slots: coalesce first).

    Parameters
    ----------
    param : numpy.ndarray
        ``(rows, dim)`` parameters, updated in place.
    slots : numpy.ndarray
        Distinct int64 slots.
    grad : numpy.ndarray
        ``(len(slots), dim)`` gradient rows.
    lr, scale, weight_decay : float
        As :func:`psrt.kernels.sgd_step`.
    """
    p, g = _table("param", param), _table("grad", grad, writable=False)
    _same(p, ("grad", g), rows=False)
    _core.sgd_rows(p, _slots(slots, p.shape[0], g.shape[0]), g, _num("lr", lr), _num("scale", scale),
                   _num("weight_decay", weight_decay))


def momentum_rows(param: np.ndarray, buf: np.ndarray, slots: np.ndarray, grad: np.ndarray, lr: float,
                  momentum: float, scale: float = 1.0, weight_decay: float = 0.0, nesterov: bool = False) -> None:
    """SGD with momentum on the touched rows; only their momentum buffers change (distinct slots).

    Parameters are those of :func:`sgd_rows`, plus ``buf`` (the ``(rows, dim)`` momentum buffers), ``momentum``
    and ``nesterov`` as :func:`psrt.kernels.momentum_step`.
    """
    p, b, g = _table("param", param), _table("buf", buf), _table("grad", grad, writable=False)
    _same(p, ("buf", b))
    _same(p, ("grad", g), rows=False)
    _core.momentum_rows(p, b, _slots(slots, p.shape[0], g.shape[0]), g, _num("lr", lr), _num("momentum", momentum),
                        _num("scale", scale), _num("weight_decay", weight_decay), bool(nesterov))


def adagrad_rows(param: np.ndarray, acc: np.ndarray, slots: np.ndarray, grad: np.ndarray, lr: float, eps: float,
                 scale: float = 1.0, weight_decay: float = 0.0) -> None:
    """Adagrad on the touched rows and their sums: torch.optim.Adagrad with a sparse gradient (distinct slots).

    Parameters are those of :func:`sgd_rows`, plus ``acc`` (the ``(rows, dim)`` sums of squares) and ``eps``.
    """
    p, a, g = _table("param", param), _table("acc", acc), _table("grad", grad, writable=False)
    _same(p, ("acc", a))
    _same(p, ("grad", g), rows=False)
    _core.adagrad_rows(p, a, _slots(slots, p.shape[0], g.shape[0]), g, _num("lr", lr), _num("eps", eps),
                       _num("scale", scale), _num("weight_decay", weight_decay))


def adam_rows(param: np.ndarray, m: np.ndarray, v: np.ndarray, slots: np.ndarray, grad: np.ndarray, lr: float,
              beta1: float, beta2: float, eps: float, step: int, scale: float = 1.0) -> None:
    """torch.optim.SparseAdam on the touched rows and their moments (distinct slots).

    The update is ``param -= lr*sqrt(1-beta2**step)/(1-beta1**step) * m / (sqrt(v) + eps)``, SparseAdam's
    placement of ``eps``; ``step`` is the table's step count, from 1.
    """
    p, mm, vv = _table("param", param), _table("m", m), _table("v", v)
    g = _table("grad", grad, writable=False)
    _same(p, ("m", mm), ("v", vv))
    _same(p, ("grad", g), rows=False)
    if type(step) is bool or not isinstance(step, (int, np.integer)) or step < 1:
        raise KernelArgumentError(f"step must be a positive integer, got {step!r}")
    b1, b2 = _num("beta1", beta1), _num("beta2", beta2)
    step_size = _num("lr", lr) * math.sqrt(1.0 - b2 ** int(step)) / (1.0 - b1 ** int(step))
    _core.adam_rows(p, mm, vv, _slots(slots, p.shape[0], g.shape[0]), g, step_size, 1.0, b1, b2, _num("eps", eps),
                    _num("scale", scale))


def index_cells(cells: int) -> np.ndarray:
    """A fresh, empty id index of ``cells`` cells (a power of two): ``(cells, 2)`` int64, each cell an id and its
    slot side by side (slot -1: empty), the array :func:`index_find` and the other index kernels take."""
    if type(cells) is not int or cells < 1 or cells & (cells - 1):
        raise KernelArgumentError(f"an index has a power of two of cells, got {cells!r}")
    index = np.empty((cells, 2), _I64)
    index[:, 1] = -1
    return index


def index_find(cells: np.ndarray, ids: np.ndarray, out: np.ndarray, row_ids: np.ndarray, used: int,
               insert: bool) -> int:
    """Look ids up in an open-addressing id index; with ``insert``, give missing ids the next slots.

    ``cells`` is the index (:func:`index_cells`: ``(capacity, 2)`` int64, capacity a power of two, a cell an id
    and its slot, slot < 0 empty), which must keep room for ``len(ids)`` more inserts below full; ``row_ids``
    (slot to id) must have room for them. Returns the new number of slots in use; ``out[i]`` is the slot of
    ``ids[i]`` (-1 for a missing id without ``insert``).
    """
    c = _cells(cells)
    i, o, r = _ids("ids", ids), _ids("out", out, writable=True), _ids("row_ids", row_ids, writable=True)
    cap = len(c)
    if len(o) != len(i):
        raise KernelArgumentError(f"out has {len(o)} entries for {len(i)} ids")
    if insert and (used + len(i) >= cap or used + len(i) > len(r)):
        raise KernelArgumentError("the index or row_ids has no room for the inserts; grow them first")
    return int(_core.index_find(c, i, o, r, int(used), bool(insert)))


def index_gather(cells: np.ndarray, ids: np.ndarray, table: np.ndarray, out: np.ndarray, slots: np.ndarray) -> int:
    """Look ids up in an id index (:func:`index_find`'s cells, inserting nothing) and gather the rows of those
    found, in one call: ``slots[i]`` is the slot of ``ids[i]`` (-1: missing), and ``out[i] = table[slots[i]]``
    for each id found (a missing id's row of ``out`` is left as it is). Returns how many ids were missing.

    Parameters
    ----------
    cells : numpy.ndarray
        The index (:func:`index_cells`); every slot it holds must lie in ``[0, len(table))``.
    ids : numpy.ndarray
        int64 ids.
    table : numpy.ndarray
        ``(rows, dim)`` rows (may be read-only).
    out : numpy.ndarray
        Writable ``(len(ids), dim)`` array of the table's dtype.
    slots : numpy.ndarray
        Writable int64, ``len(ids)`` entries.
    """
    c = _cells(cells)
    i, s = _ids("ids", ids), _ids("slots", slots, writable=True)
    t, o = _table("table", table, writable=False), _table("out", out)
    _same(t, ("out", o), rows=False)
    if len(o) != len(i) or len(s) != len(i):
        raise KernelArgumentError(f"out has {len(o)} rows and slots {len(s)} entries for {len(i)} ids")
    return int(_core.index_gather(c, i, t, o, s))


def unique_first(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ids in the order they first appear, and where each id went: ``distinct[inverse] == ids``.

    What ``np.unique(ids, return_inverse=True)`` gives, up to the order of the distinct ids, without a sort: the
    ids are inserted into a fresh scratch index (:func:`psrt._core.unique_ids`, a few ns an id; a sort of 8,192
    ids costs ~0.3 ms).
    """
    i = _ids("ids", ids)
    n = len(i)
    distinct, inverse = np.empty(n, _I64), np.empty(n, _I64)
    used = int(_core.unique_ids(_scratch(n), i, inverse, distinct))
    return distinct[:used], inverse


#: The most ids a scratch index takes (its cells are int32 positions).
_MAX_SCRATCH_IDS = (1 << 31) - 1


def _scratch(n: int) -> np.ndarray:
    """A fresh scratch id index for ``n`` ids (:func:`psrt._core.unique_ids`): int32 cells, all empty.

    A cell holds where an id is among the distinct ones, so positions must fit int32: at most 2**31 - 1 ids a
    call (16 GiB of them; a shard's message limit is far below).
    """
    if n > _MAX_SCRATCH_IDS:
        raise KernelArgumentError(f"{n} ids in one call; at most {_MAX_SCRATCH_IDS} (split the call)")
    index = np.empty(1 << max(4, (2 * n - 1).bit_length()), np.int32)  # load at most 1/2, as a table's index
    index.fill(-1)  # (np.full costs a few calls more)
    return index


def coalesce_rows(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum the rows of repeated ids: ``(distinct, summed)``, the distinct ids in the order they first appear and
    each one's rows summed in the order they come (``summed[k]`` is the sum of ``rows[i]`` over ``ids[i] ==
    distinct[k]``).

    What :func:`unique_first` then :func:`scatter_add_rows` into zeroed rows give, in one pass over the ids: a
    sparse gradient coalesced, as torch's ``coalesce()`` does, without the sort.

    Parameters
    ----------
    ids : numpy.ndarray
        1-D int64 ids.
    rows : numpy.ndarray
        ``(len(ids), dim)`` C-contiguous rows (may be read-only).
    """
    i, r = _ids("ids", ids), _table("rows", rows, writable=False)
    n = len(i)
    if r.shape[0] != n:
        raise KernelArgumentError(f"rows has {r.shape[0]} rows for {n} ids")
    distinct, summed = np.empty(n, _I64), np.empty((n, r.shape[1]), r.dtype)
    used = int(_core.coalesce_rows(_scratch(n), i, r, distinct, summed))
    return distinct[:used], summed[:used]


def touch_rows(last: np.ndarray, when: np.ndarray, dirty: np.ndarray, slots: np.ndarray, tick: int,
               now: float) -> None:
    """Mark the rows ``slots`` pushed: ``last[slots] = tick``, ``when[slots] = now``, ``dirty[slots] = True``.

    Parameters
    ----------
    last : numpy.ndarray
        1-D int64, per row: the push clock of its last push.
    when : numpy.ndarray
        1-D float64, per row: the time of its last push.
    dirty : numpy.ndarray
        1-D bool, per row: changed since the last checkpoint.
    slots : numpy.ndarray
        int64 slots, each in ``[0, len(last))``.
    tick : int
        The push clock.
    now : float
        The time.
    """
    lst = _ids("last", last, writable=True)
    if not isinstance(when, np.ndarray) or when.dtype != np.float64 or when.ndim != 1 \
            or not when.flags.c_contiguous or not when.flags.writeable:
        raise KernelTypeError("when must be a writable 1-D C-contiguous float64 array")
    if not isinstance(dirty, np.ndarray) or dirty.dtype != np.bool_ or dirty.ndim != 1 \
            or not dirty.flags.c_contiguous or not dirty.flags.writeable:
        raise KernelTypeError("dirty must be a writable 1-D C-contiguous bool array")
    rows = len(lst)
    if len(when) != rows or len(dirty) != rows:
        raise KernelArgumentError(f"last, when and dirty must have one length, got {rows}, {len(when)}, {len(dirty)}")
    s = _ids("slots", slots)
    if len(s) and _core.first_outside(s, rows) >= 0:
        raise KernelArgumentError(f"slots must lie in [0, {rows}): there are {rows} rows")
    if type(tick) is not int and not isinstance(tick, np.integer):
        raise KernelArgumentError(f"tick must be an integer, got {tick!r}")
    _core.touch_rows(lst, when, dirty.view(np.uint8), s, int(tick), _num("now", now))


def _cells(cells: object) -> np.ndarray:
    if not isinstance(cells, np.ndarray) or cells.dtype != _I64 or not cells.dtype.isnative:
        raise KernelTypeError("an id index is an int64 numpy.ndarray (psrt.kernels.rows.index_cells)")
    if cells.ndim != 2 or cells.shape[1] != 2 or not cells.flags.c_contiguous or not cells.flags.writeable:
        raise KernelArgumentError(f"an id index is a writable C-contiguous (cells, 2) array, got shape {cells.shape}")
    cap = cells.shape[0]
    if cap == 0 or cap & (cap - 1):
        raise KernelArgumentError(f"an id index has a power of two of cells, got {cap}")
    return cells


def index_remove(cells: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """Remove ids from an id index (:func:`index_find`'s cells); ``out[i]`` is the slot ``ids[i]`` had, -1 when
    it was not there (or a repeat removed it first). Other ids keep their slots; no tombstones are left."""
    c = _cells(cells)
    i, o = _ids("ids", ids), _ids("out", out, writable=True)
    if len(o) != len(i):
        raise KernelArgumentError(f"out has {len(o)} entries for {len(i)} ids")
    _core.index_remove(c, i, o)


def index_set(cells: np.ndarray, ids: np.ndarray, slots: np.ndarray) -> int:
    """Give ids already in an id index new slots (``slots[i]`` for ``ids[i]``, each >= 0); returns how many of
    them were found (the rest are left out)."""
    c = _cells(cells)
    i, s = _ids("ids", ids), _ids("slots", slots)
    if len(s) != len(i):
        raise KernelArgumentError(f"slots has {len(s)} entries for {len(i)} ids")
    if len(s) and int(s.min()) < 0:
        raise KernelArgumentError("slots must be >= 0 (a negative value marks an empty cell)")
    return int(_core.index_set(c, i, s))


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard of each id, ``mix64(id) % num_shards``: a stable hash, so hot or strided ids spread evenly.

    Parameters
    ----------
    ids : numpy.ndarray
        1-D int64 ids.
    num_shards : int
        S, positive.
    """
    i = _ids("ids", ids)
    _check_shards(num_shards)
    out = np.empty(len(i), np.int64)
    _core.shard_of(i, out, num_shards)
    return out


def _check_shards(num_shards: int) -> None:
    if type(num_shards) is not int or num_shards < 1:
        raise KernelArgumentError(f"num_shards must be a positive integer, got {num_shards!r}")


def shard_order(ids: np.ndarray, num_shards: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ids sorted by shard (:func:`shard_of`), in one O(n) counting sort: ``(order, offsets, where)``.

    Shard s's ids are ``ids[order[offsets[s]:offsets[s + 1]]]``, in the order they come in ``ids``: what
    ``np.argsort(shard_of(ids, num_shards), kind="stable")`` and the shards' counts give, without the sort (a
    stable argsort of 8,192 ids costs several times the hashing). ``where`` is the inverse permutation:
    ``order[where[i]] == i``.

    Parameters
    ----------
    ids : numpy.ndarray
        1-D int64 ids.
    num_shards : int
        S, positive.

    Returns
    -------
    order : numpy.ndarray
        int64 indices into ``ids``, shard by shard.
    offsets : numpy.ndarray
        int64, ``num_shards + 1`` entries: each shard's range of ``order``.
    where : numpy.ndarray
        int64, each id's position in ``order``.
    """
    i = _ids("ids", ids)
    _check_shards(num_shards)
    n = len(i)
    order, offsets, where = np.empty(n, _I64), np.empty(num_shards + 1, _I64), np.empty(n, _I64)
    _core.shard_order(i, num_shards, order, offsets, where)
    return order, offsets, where


def unique_by_shard(ids: np.ndarray, num_shards: int, by_shard: bool = False) -> tuple[
        np.ndarray, np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray], Optional[np.ndarray]]:
    """The distinct ids sorted by shard, and where each id's row is among theirs: ``(distinct, starts, gather,
    order, offsets, inverse)``.

    Shard s's distinct ids are ``distinct[starts[s]:starts[s + 1]]``, in the order they first appear in ``ids``,
    and ``distinct[gather[i]] == ids[i]``: a pull asks each shard for its distinct ids once and gathers the
    caller's rows back with ``gather``. With ``by_shard``, also the ids by shard as :func:`shard_order` gives them
    (``order``, ``offsets``) and ``inverse[m]``, the index of ``ids[order[m]]`` among its shard's distinct ids: a
    pull then moves each shard's answer to its places as it comes (:func:`move_rows` of a shard's part of
    ``inverse`` and ``order``); without it, these three are None. What :func:`unique_first`, :func:`shard_order`
    of the distinct ids and the two lookups between them give, in one kernel call
    (:func:`psrt._core.unique_by_shard`: each id hashed once, no sort, no array between the steps).

    Parameters
    ----------
    ids : numpy.ndarray
        1-D int64 ids, repeats allowed.
    num_shards : int
        S, positive (the shards of :func:`shard_of`).
    by_shard : bool
        Also give ``order``, ``offsets`` and ``inverse``.

    Returns
    -------
    distinct : numpy.ndarray
        The distinct ids (int64), shard s's in ``distinct[starts[s]:starts[s + 1]]``.
    starts : numpy.ndarray
        The S + 1 shard boundaries of ``distinct`` (int64).
    gather : numpy.ndarray
        Each id's position in ``distinct`` (int64, one per id).
    order, offsets, inverse : numpy.ndarray or None
        With ``by_shard``: :func:`shard_order`'s order and offsets of ``ids``, and (int64, one per id)
        ``distinct[starts[s] + inverse[m]] == ids[order[m]]`` for m in shard s's range.
    """
    i = _ids("ids", ids)
    _check_shards(num_shards)
    n = len(i)
    # (Arrays of their own: the rows of one (3, n) array lie a multiple of 64 KiB apart at n = 8,192, in the same
    # cache sets, and the kernel reads them side by side: four times slower.)
    firsts, place, distinct = np.empty(n, _I64), np.empty(n, _I64), np.empty(n, _I64)
    starts, gather = np.empty(num_shards + 1, _I64), np.empty(n, _I64)
    m = n if by_shard else 0
    order, offsets, inverse = np.empty(m, _I64), np.empty(num_shards + 1 if by_shard else 0, _I64), np.empty(m, _I64)
    used = int(_core.unique_by_shard(_scratch(n), i, num_shards, firsts, place, distinct, starts, gather, order,
                                     offsets, inverse))
    if not by_shard:
        return distinct[:used], starts, gather, None, None, None
    return distinct[:used], starts, gather, order, offsets, inverse


def init_rows(table: np.ndarray, start: int, ids: np.ndarray, seed: int, kind: str, a: float, b: float) -> None:
    """Fill ``table[start:start+len(ids)]`` with the initial rows of ``ids``, a pure function of (seed, id).

    Parameters
    ----------
    table : numpy.ndarray
        Writable ``(rows, dim)`` table.
    start : int
        First row to fill; ``start + len(ids)`` must not pass the table's end.
    ids : numpy.ndarray
        int64 ids.
    seed : int
        The table's seed, in ``[0, 2**64)``.
    kind : str
        ``"zeros"``, ``"uniform"`` (on ``[a, b)``) or ``"normal"`` (mean ``a``, deviation ``b``); the exact
        definition is in :func:`psrt._core.init_rows`.
    a, b : float
        The initializer's parameters.
    """
    t, i = _table("table", table), _ids("ids", ids)
    if kind not in INIT_KINDS:
        raise KernelArgumentError(f"kind must be one of {sorted(INIT_KINDS)}, got {kind!r}")
    if type(start) is not int or start < 0 or start + len(i) > t.shape[0]:
        raise KernelArgumentError(f"rows [{start}, {start}+{len(i)}) do not fit a table of {t.shape[0]} rows")
    if type(seed) is not int or not 0 <= seed < 1 << 64:
        raise KernelArgumentError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    _core.init_rows(t, start, i, seed, INIT_KINDS[kind], _num("a", a), _num("b", b))
