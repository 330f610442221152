"""The row kernels (psrt.kernels.rows) against their NumPy twins (psrt.kernels.reference), and their validation."""

from __future__ import annotations

import numpy as np
import pytest

from psrt import _core as psrt_core
from psrt.errors import KernelArgumentError, KernelTypeError
from psrt.kernels import reference
from psrt.kernels import rows as rowkernels

DTYPES = [np.float32, np.float64]
RTOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}


def close(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=RTOL[a.dtype], atol=RTOL[a.dtype])


def setup(dtype, rows=50, dim=7, n=20, seed=0):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((rows, dim)).astype(dtype)
    slots = rng.choice(rows, n, replace=False).astype(np.int64)
    grad = rng.standard_normal((n, dim)).astype(dtype)
    return rng, table, slots, grad


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_and_scatter_add_with_duplicates(dtype):
    rng, table, _, _ = setup(dtype)
    slots = rng.integers(0, 50, 200).astype(np.int64)  # many repeats
    out = np.empty((200, 7), dtype)
    rowkernels.gather_rows(table, slots, out)
    close(out, reference.gather_rows(table, slots))
    dst, ref = table.copy(), table.copy()
    src = rng.standard_normal((200, 7)).astype(dtype)
    rowkernels.scatter_add_rows(dst, slots, src)
    reference.scatter_add_rows(ref, slots, src)
    close(dst, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [1, 3, 4, 8, 16, 32, 64, 128, 33])
@pytest.mark.parametrize("rows", [40, 20_000])
def test_row_copies_of_every_size_are_their_twins(dtype, dim, rows):
    """Rows of 32 to 512 bytes are copied by a copy of known size (psrt._core's psrt_copy_row), others by memcpy,
    and gather_rows asks for rows ahead only from tables of 1 MiB or more: every size, either side of that, exact."""
    rng = np.random.default_rng(dim)
    table = rng.standard_normal((rows, dim)).astype(dtype)
    slots = rng.integers(0, rows, 300).astype(np.int64)
    out = np.full((300, dim), 7, dtype)
    rowkernels.gather_rows(table, slots, out)
    np.testing.assert_array_equal(out, reference.gather_rows(table, slots))
    ids = rng.choice(1 << 40, rows, replace=False).astype(np.int64)
    cap = 1 << (2 * rows - 1).bit_length()
    cells = rowkernels.index_cells(cap)
    rowkernels.index_find(cells, ids, np.empty(rows, np.int64), np.zeros(rows, np.int64), 0, True)
    asked = np.concatenate([ids[slots], rng.integers(0, 1 << 40, 20)]).astype(np.int64)
    out, ref_out = np.full((len(asked), dim), 7, dtype), np.full((len(asked), dim), 7, dtype)
    missing = rowkernels.index_gather(cells, asked, table, out, np.empty(len(asked), np.int64))
    assert (missing, out.tobytes()) == (reference.index_gather(cells, asked, table, ref_out)[1], ref_out.tobytes())
    repeated = rng.integers(0, 50, 300).astype(np.int64)
    grads = rng.standard_normal((300, dim)).astype(dtype)
    distinct, summed = rowkernels.coalesce_rows(repeated, grads)
    want, want_summed = reference.coalesce_rows(repeated, grads)
    assert distinct.tolist() == want.tolist() and np.array_equal(summed, want_summed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [1, 7, 64])
def test_row_optimizers_match_their_twins_and_touch_only_their_rows(dtype, dim):
    rng, table, slots, grad = setup(dtype, dim=dim)
    untouched = np.setdiff1d(np.arange(50), slots)
    cases = [
        (rowkernels.sgd_rows, reference.sgd_rows, 0, dict(lr=0.1, scale=0.5, weight_decay=0.01)),
        (rowkernels.momentum_rows, reference.momentum_rows, 1,
         dict(lr=0.1, momentum=0.9, scale=0.5, weight_decay=0.01, nesterov=True)),
        (rowkernels.adagrad_rows, reference.adagrad_rows, 1, dict(lr=0.1, eps=1e-10, scale=0.5)),
        (rowkernels.adam_rows, reference.adam_rows, 2, dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, step=3,
                                                            scale=0.5)),
    ]
    for fast, slow, nslots, kw in cases:
        p1, p2 = table.copy(), table.copy()
        s1 = [np.abs(rng.standard_normal(table.shape)).astype(dtype) for _ in range(nslots)]
        s2 = [s.copy() for s in s1]
        for _ in range(2):
            fast(p1, *s1, slots, grad, **kw)
            slow(p2, *s2, slots, grad, **kw)
        close(p1, p2)
        for a, b in zip(s1, s2):
            close(a, b)
        assert np.array_equal(p1[untouched], table[untouched])


def test_adagrad_rows_is_torch_sparse_adagrad():
    torch = pytest.importorskip("torch")
    rng, table, _, _ = setup(np.float32, rows=30, dim=5)
    ids = rng.integers(0, 30, 40)
    grads = rng.standard_normal((40, 5)).astype(np.float32)
    emb = torch.nn.Embedding(30, 5, sparse=True)
    emb.weight.data[:] = torch.from_numpy(table)
    opt = torch.optim.Adagrad(emb.parameters(), lr=0.05)
    param, acc = table.copy(), np.zeros_like(table)
    for _ in range(3):
        opt.zero_grad()
        emb(torch.from_numpy(ids)).backward(torch.from_numpy(grads))
        with torch.sparse.check_sparse_tensor_invariants():  # (opted into: torch warns when nobody chose)
            opt.step()
        uniq, inv = np.unique(ids, return_inverse=True)
        coalesced = np.zeros((len(uniq), 5), np.float32)
        rowkernels.scatter_add_rows(coalesced, inv.astype(np.int64), grads)
        rowkernels.adagrad_rows(param, acc, uniq.astype(np.int64), coalesced, 0.05, 1e-10)
    np.testing.assert_allclose(param, emb.weight.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_index_find_inserts_once_and_finds_again():
    cap = 64
    cells = rowkernels.index_cells(cap)
    row_ids = np.empty(40, np.int64)
    ids = np.array([5, -3, 2**62, 5, 7, -3], np.int64)
    out = np.empty(len(ids), np.int64)
    used = rowkernels.index_find(cells, ids, out, row_ids, 0, True)
    assert used == 4 and out.tolist() == [0, 1, 2, 0, 3, 1]
    assert row_ids[:4].tolist() == [5, -3, 2**62, 7]
    out2 = np.empty(3, np.int64)
    assert rowkernels.index_find(cells, np.array([7, 8, 5], np.int64), out2, row_ids, used, False) == used
    assert out2.tolist() == [3, -1, 0]
    with pytest.raises(KernelArgumentError):
        rowkernels.index_find(cells, np.arange(70, dtype=np.int64), np.empty(70, np.int64), row_ids, 4, True)


@pytest.mark.parametrize("seed", range(6))
def test_unique_first_is_its_twin_and_np_unique_up_to_order(seed):
    rng = np.random.default_rng(seed)
    ids = ((rng.zipf(1.1, rng.integers(0, 3000)) - 1) * (1 if seed % 2 else -(2**40))).astype(np.int64)
    distinct, inverse = rowkernels.unique_first(ids)
    want, want_inverse = reference.unique_first(ids)
    assert distinct.tolist() == want.tolist() and inverse.tolist() == want_inverse.tolist()
    assert (distinct[inverse] == ids).all() and sorted(distinct.tolist()) == np.unique(ids).tolist()
    with pytest.raises(KernelTypeError):
        rowkernels.unique_first(ids.astype(np.int32))


@pytest.mark.parametrize("seed", range(6))
def test_index_remove_and_set_agree_with_a_dict(seed):
    """Random inserts, removals (backward shift, clustered ids) and slot changes, checked against a dict after
    every batch: every id left is found at its slot, every removed one is gone."""
    rng = np.random.default_rng(seed)
    cap = 64
    cells = rowkernels.index_cells(cap)
    row_ids = np.empty(cap, np.int64)
    oracle: dict[int, int] = {}
    for _ in range(60):
        ids = rng.integers(-40, 40, rng.integers(1, 12)).astype(np.int64)  # small range: long probe clusters
        if rng.random() < 0.5 and len(oracle) + len(ids) < cap // 2:
            out = np.empty(len(ids), np.int64)
            rowkernels.index_find(cells, ids, out, row_ids, len(oracle), True)  # slots may repeat: no matter
            for i, o in zip(ids.tolist(), out.tolist()):
                assert oracle.setdefault(i, o) == o
        elif rng.random() < 0.7:
            out = np.empty(len(ids), np.int64)
            rowkernels.index_remove(cells, ids, out)
            for i, o in zip(ids.tolist(), out.tolist()):
                assert o == oracle.pop(i, -1)
        elif oracle:
            some = np.array(list(oracle)[:3], np.int64)
            new = rng.integers(100, 200, len(some)).astype(np.int64)
            assert rowkernels.index_set(cells, np.append(some, 999), np.append(new, 5)) == len(some)
            oracle.update(zip(some.tolist(), new.tolist()))
        probe = np.arange(-45, 45, dtype=np.int64)
        got = np.empty(len(probe), np.int64)
        rowkernels.index_find(cells, probe, got, row_ids, 0, False)
        assert got.tolist() == [oracle.get(i, -1) for i in probe.tolist()]
        assert int((cells[:, 1] >= 0).sum()) == len(oracle)


def test_index_remove_and_set_check_their_arguments():
    cells = rowkernels.index_cells(8)
    with pytest.raises(KernelArgumentError, match="power of two"):
        rowkernels.index_remove(cells[:6], np.zeros(1, np.int64), np.empty(1, np.int64))
    with pytest.raises(KernelArgumentError, match="entries"):
        rowkernels.index_remove(cells, np.zeros(2, np.int64), np.empty(1, np.int64))
    with pytest.raises(KernelArgumentError, match=">= 0"):
        rowkernels.index_set(cells, np.zeros(1, np.int64), np.full(1, -1, np.int64))


def test_an_id_index_is_one_array_of_id_and_slot_cells():
    """``index_cells`` makes what every index kernel takes; anything else is refused with what to pass."""
    cells = rowkernels.index_cells(16)
    assert cells.shape == (16, 2) and cells.dtype == np.int64 and (cells[:, 1] == -1).all()
    used = rowkernels.index_find(cells, np.array([9, 4], np.int64), np.empty(2, np.int64), np.empty(2, np.int64),
                                 0, True)
    assert used == 2 and sorted(map(tuple, cells[cells[:, 1] >= 0].tolist())) == [(4, 1), (9, 0)]
    for bad in (12, 0, -4, 2.0):
        with pytest.raises(KernelArgumentError, match="power of two"):
            rowkernels.index_cells(bad)
    ids, out = np.zeros(1, np.int64), np.empty(1, np.int64)
    with pytest.raises(KernelArgumentError, match=r"\(cells, 2\)"):
        rowkernels.index_remove(np.full(16, -1, np.int64), ids, out)  # the old two-array form's keys alone
    with pytest.raises(KernelArgumentError, match=r"\(cells, 2\)"):
        rowkernels.index_remove(np.asfortranarray(rowkernels.index_cells(16)), ids, out)
    with pytest.raises(KernelTypeError, match="int64"):
        rowkernels.index_remove(rowkernels.index_cells(16).astype(np.int32), ids, out)


@pytest.mark.parametrize("kind,a,b", [("zeros", 0, 0), ("uniform", -0.5, 0.5), ("normal", 0.0, 0.1)])
@pytest.mark.parametrize("dim", [1, 6, 7])
def test_init_rows_is_a_pure_function_of_seed_and_id(kind, a, b, dim):
    ids = np.array([0, 1, -1, 2**63 - 1, 12345, 0], np.int64)
    t = np.empty((len(ids), dim), np.float32)
    rowkernels.init_rows(t, 0, ids, 7, kind, a, b)
    close(t, reference.init_rows(ids, dim, np.float32, 7, {"zeros": 0, "uniform": 1, "normal": 2}[kind], a, b))
    assert np.array_equal(t[0], t[-1])  # same id, same row
    if kind != "zeros":
        other = np.empty_like(t)
        rowkernels.init_rows(other, 0, ids, 8, kind, a, b)
        assert not np.array_equal(t[:5], other[:5])  # another seed, other rows


def test_normal_init_has_the_documented_moments():
    t = np.empty((20000, 16), np.float64)
    rowkernels.init_rows(t, 0, np.arange(20000, dtype=np.int64), 1, "normal", 0.0, 0.1)
    assert abs(t.mean()) < 2e-3 and abs(t.std() - 0.1) < 2e-3


def test_shard_of_spreads_strided_ids_evenly():
    ids = np.arange(0, 4 * 100000, 4, dtype=np.int64)  # id % 4 would put them all on one shard
    s = rowkernels.shard_of(ids, 4)
    assert np.array_equal(s, reference.shard_of(ids, 4))
    counts = np.bincount(s, minlength=4)
    assert counts.min() > 0.95 * counts.max()



@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7, 64])
def test_shard_order_is_a_stable_sort_by_shard(num_shards):
    rng = np.random.default_rng(num_shards)
    for ids in (np.empty(0, np.int64), np.array([5], np.int64), rng.integers(-2**63, 2**63 - 1, 5000),
                (rng.zipf(1.1, 8192) - 1) % 1000):  # (any int64: negative, huge, repeated)
        ids = ids.astype(np.int64)
        order, offsets, where = rowkernels.shard_order(ids, num_shards)
        want = reference.shard_order(ids, num_shards)
        for got, expected in zip((order, offsets, where), want):
            assert got.dtype == np.int64 and np.array_equal(got, expected)
        shards = rowkernels.shard_of(ids, num_shards)
        for s in range(num_shards):  # each shard's range holds its ids, in the order they came
            mine = order[offsets[s]:offsets[s + 1]]
            assert np.array_equal(mine, np.flatnonzero(shards == s))
        assert np.array_equal(order[where], np.arange(len(ids)))
    with pytest.raises(KernelArgumentError):
        rowkernels.shard_order(np.arange(3, dtype=np.int64), 0)
    with pytest.raises(KernelTypeError):
        rowkernels.shard_order(np.arange(3, dtype=np.int32), num_shards)

@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7, 64])
def test_unique_by_shard_is_its_twin(num_shards):
    """The pull's one kernel call: the distinct ids, shard by shard in the order they first appear, and where
    each id is among them; what unique_first, then shard_order of the distinct ids, give. With by_shard, also the
    ids by shard (shard_order's) and each one's index among its shard's distinct ids."""
    rng = np.random.default_rng(num_shards)
    for ids in (np.empty(0, np.int64), np.array([5], np.int64), np.array([9, 9, 9], np.int64),
                rng.integers(-2**63, 2**63 - 1, 5000), (rng.zipf(1.1, 8192) - 1) % 1000,
                (rng.zipf(1.1, 8192) - 1) * -(2**40)):
        ids = ids.astype(np.int64)
        plain = rowkernels.unique_by_shard(ids, num_shards)
        got = rowkernels.unique_by_shard(ids, num_shards, by_shard=True)
        assert plain[3:] == (None, None, None)
        for g, p, expected in zip(got, plain, reference.unique_by_shard(ids, num_shards, by_shard=True)):
            assert g.dtype == np.int64 and np.array_equal(g, expected)
            assert p is None or np.array_equal(p, expected)
        distinct, starts, gather, order, offsets, inverse = got
        assert np.array_equal(distinct[gather], ids) and len(np.unique(distinct)) == len(distinct)
        shards = rowkernels.shard_of(ids, num_shards)
        for s in range(num_shards):
            assert (rowkernels.shard_of(distinct[starts[s]:starts[s + 1]], num_shards) == s).all()
            part = order[offsets[s]:offsets[s + 1]]
            assert np.array_equal(part, np.flatnonzero(shards == s))
            assert np.array_equal(distinct[starts[s]:starts[s + 1]][inverse[offsets[s]:offsets[s + 1]]], ids[part])
    with pytest.raises(KernelArgumentError):
        rowkernels.unique_by_shard(np.arange(3, dtype=np.int64), 0)
    with pytest.raises(KernelTypeError):
        rowkernels.unique_by_shard(np.arange(3, dtype=np.int32), num_shards)


@pytest.mark.parametrize("dtype", DTYPES)
def test_move_rows_is_its_twin_and_moves_nothing_outside(dtype):
    """Each shard's answer moved to every place it was asked for: the twin's rows, every place written once;
    a pair with a row outside either array is skipped when checked, and refused, naming the range, when not."""
    rng = np.random.default_rng(5)
    ids = ((rng.zipf(1.1, 3000) - 1) % 500).astype(np.int64)
    distinct, starts, _, order, offsets, inverse = rowkernels.unique_by_shard(ids, 3, by_shard=True)
    table = rng.standard_normal((500, 9)).astype(dtype)
    out, want = np.full((3000, 9), np.nan, dtype), np.full((3000, 9), np.nan, dtype)
    for s in range(3):
        answer = table[distinct[starts[s]:starts[s + 1]]]  # one row per distinct id of the shard
        part, inv = order[offsets[s]:offsets[s + 1]], inverse[offsets[s]:offsets[s + 1]]
        rowkernels.move_rows(answer, inv, out, part, checked=bool(s % 2))
        reference.move_rows(answer, inv, want, part)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(out, table[ids])
    src = rng.standard_normal((4, 9)).astype(dtype)
    got = np.zeros((5, 9), dtype)
    rowkernels.move_rows(src, np.array([0, 4, 3, -1, 1], np.int64), got, np.array([4, 0, 5, 1, 2], np.int64),
                         checked=True)
    np.testing.assert_array_equal(got[4], src[0])
    np.testing.assert_array_equal(got[2], src[1])
    np.testing.assert_array_equal(got[[0, 1, 3]], 0)
    for bad_src, bad_dst in ((np.array([4], np.int64), np.array([0], np.int64)),
                             (np.array([0], np.int64), np.array([5], np.int64))):
        with pytest.raises(KernelArgumentError, match=r"must lie in \[0, "):
            rowkernels.move_rows(src, bad_src, got, bad_dst)
    with pytest.raises(KernelArgumentError):
        rowkernels.move_rows(src, np.array([0, 1], np.int64), got, np.array([0], np.int64))
    with pytest.raises(KernelTypeError):
        rowkernels.move_rows(src, np.array([0], np.int64), got.astype(np.float16), np.array([0], np.int64))
    with pytest.raises(KernelArgumentError):
        rowkernels.move_rows(src, np.array([0], np.int64), np.zeros((5, 8), dtype), np.array([0], np.int64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 40, 2000])
def test_index_gather_is_index_find_then_gather_rows(dtype, n):
    rng = np.random.default_rng(n)
    held = rng.choice(1 << 40, 500, replace=False).astype(np.int64)
    cells = rowkernels.index_cells(2048)
    row_ids = np.zeros(500, np.int64)
    rowkernels.index_find(cells, held, np.empty(500, np.int64), row_ids, 0, True)
    table = rng.standard_normal((500, 5)).astype(dtype)
    ids = np.where(rng.random(n) < 0.7, rng.choice(held, n), rng.integers(0, 1 << 40, n)).astype(np.int64)
    out, slots = np.full((n, 5), 7, dtype), np.empty(n, np.int64)
    missing = rowkernels.index_gather(cells, ids, table, out, slots)
    ref_out = np.full((n, 5), 7, dtype)
    ref_slots, ref_missing = reference.index_gather(cells, ids, table, ref_out)
    assert missing == ref_missing
    np.testing.assert_array_equal(slots, ref_slots)
    np.testing.assert_array_equal(out, ref_out)  # rows of missing ids left as they were
    found = np.empty(n, np.int64)
    rowkernels.index_find(cells, ids, found, row_ids, 500, False)
    np.testing.assert_array_equal(slots, found)


@pytest.mark.parametrize("seed", range(4))
def test_first_outside_is_its_twin(seed):
    rng = np.random.default_rng(seed)
    slots = rng.integers(-3, 60, rng.integers(0, 40)).astype(np.int64)
    for rows in (0, 1, 30, 60, 100):
        assert psrt_core.first_outside(slots, rows) == reference.first_outside(slots, rows)


def test_index_gather_checks_its_arguments():
    cells, table = rowkernels.index_cells(8), np.zeros((4, 3), np.float32)
    ids = np.array([1, 2], np.int64)
    with pytest.raises(KernelArgumentError, match="power of two"):
        rowkernels.index_gather(cells[:6], ids, table, np.empty((2, 3), np.float32), np.empty(2, np.int64))
    with pytest.raises(KernelArgumentError, match="for 2 ids"):
        rowkernels.index_gather(cells, ids, table, np.empty((3, 3), np.float32), np.empty(2, np.int64))
    with pytest.raises(KernelTypeError):
        rowkernels.index_gather(cells, ids, table, np.empty((2, 3), np.float64), np.empty(2, np.int64))
    with pytest.raises(KernelArgumentError):
        rowkernels.index_gather(cells, ids, table, np.empty((2, 2), np.float32), np.empty(2, np.int64))
    with pytest.raises(KernelTypeError):
        rowkernels.index_gather(cells, ids.astype(np.int32), table, np.empty((2, 3), np.float32),
                                np.empty(2, np.int64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_coalesce_rows_is_its_twin_exactly(dtype, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 3000))
    ids = ((rng.zipf(1.1, n) - 1) * (1 if seed % 2 else -(2**40))).astype(np.int64)
    rows = rng.standard_normal((n, 5)).astype(dtype)
    distinct, summed = rowkernels.coalesce_rows(ids, rows)
    want, want_summed = reference.coalesce_rows(ids, rows)
    assert distinct.tolist() == want.tolist() and summed.dtype == rows.dtype
    # Each id's rows summed in the order they come, as np.add.at sums them: the same floats, bit for bit.
    assert np.array_equal(summed, want_summed)
    empty, none = rowkernels.coalesce_rows(np.empty(0, np.int64), np.empty((0, 5), dtype))
    assert empty.shape == (0,) and none.shape == (0, 5)
    with pytest.raises(KernelArgumentError, match="rows for"):
        rowkernels.coalesce_rows(ids[:-1] if n else np.zeros(1, np.int64), rows)
    with pytest.raises(KernelTypeError):
        rowkernels.coalesce_rows(ids.astype(np.int32), rows)


def test_touch_rows_is_its_twin_and_checks_its_arguments():
    rng = np.random.default_rng(3)
    last, when, dirty = np.zeros(100, np.int64), np.zeros(100), np.zeros(100, bool)
    ref = (last.copy(), when.copy(), dirty.copy())
    for tick in range(1, 4):
        slots = rng.choice(100, 30, replace=False).astype(np.int64)
        rowkernels.touch_rows(last, when, dirty, slots, tick, 1.5 * tick)
        reference.touch_rows(*ref, slots, tick, 1.5 * tick)
    assert np.array_equal(last, ref[0]) and np.array_equal(when, ref[1]) and np.array_equal(dirty, ref[2])
    with pytest.raises(KernelArgumentError, match=r"\[0, 100\)"):
        rowkernels.touch_rows(last, when, dirty, np.array([100], np.int64), 1, 0.0)
    with pytest.raises(KernelTypeError):
        rowkernels.touch_rows(last, when.astype(np.float32), dirty, np.array([0], np.int64), 1, 0.0)
    with pytest.raises(KernelTypeError):
        rowkernels.touch_rows(last, when, dirty.astype(np.uint8), np.array([0], np.int64), 1, 0.0)
    with pytest.raises(KernelArgumentError, match="one length"):
        rowkernels.touch_rows(last, when[:50], dirty, np.array([0], np.int64), 1, 0.0)
    with pytest.raises(KernelArgumentError):
        rowkernels.touch_rows(last, when, dirty, np.array([0], np.int64), 1, float("inf"))


def test_wrappers_refuse_what_the_kernels_cannot_check():
    table = np.zeros((4, 3), np.float32)
    with pytest.raises(KernelArgumentError, match=r"\[0, 4\)"):
        rowkernels.gather_rows(table, np.array([4], np.int64), np.empty((1, 3), np.float32))
    with pytest.raises(KernelTypeError):
        rowkernels.gather_rows(table, np.array([0], np.int32), np.empty((1, 3), np.float32))
    with pytest.raises(KernelTypeError):
        rowkernels.sgd_rows(table, np.array([0], np.int64), np.zeros((1, 3)), 0.1)
    with pytest.raises(KernelArgumentError):
        rowkernels.sgd_rows(table, np.array([0], np.int64), np.zeros((1, 2), np.float32), 0.1)
    ro = table.copy()
    ro.flags.writeable = False
    with pytest.raises(KernelArgumentError, match="read-only"):
        rowkernels.scatter_add_rows(ro, np.array([0], np.int64), np.zeros((1, 3), np.float32))
    with pytest.raises(KernelArgumentError):
        rowkernels.adagrad_rows(table, table.copy(), np.array([0], np.int64), np.zeros((1, 3), np.float32),
                                float("nan"), 1e-10)


def test_gather_rows_of_slots_a_kernel_checked_skips_the_scan_and_still_reads_nothing_outside():
    """``checked=True`` (slots from unique_first or shard_order) gives the same rows without the scan for a slot
    outside the table; one that is outside anyway leaves its row as it is, as the kernel always does."""
    rng = np.random.default_rng(11)
    table = rng.standard_normal((30, 5)).astype(np.float32)
    ids = ((rng.zipf(1.1, 400) - 1) % (1 << 40)).astype(np.int64)
    distinct, inverse = rowkernels.unique_first(ids)
    rows = rng.standard_normal((len(distinct), 5)).astype(np.float32)
    out, again = np.empty((400, 5), np.float32), np.empty((400, 5), np.float32)
    rowkernels.gather_rows(rows, inverse, out)
    rowkernels.gather_rows(rows, inverse, again, checked=True)
    np.testing.assert_array_equal(again, out)
    np.testing.assert_array_equal(out, reference.gather_rows(rows, inverse))
    outside = np.array([2, 30, -1, 29], np.int64)
    got = np.full((4, 5), 7, np.float32)
    rowkernels.gather_rows(table, outside, got, checked=True)
    np.testing.assert_array_equal(got[[0, 3]], table[[2, 29]])
    np.testing.assert_array_equal(got[[1, 2]], 7)
    with pytest.raises(KernelArgumentError):
        rowkernels.gather_rows(table, outside, got)  # (unchecked: refused, naming the range)
    with pytest.raises(KernelArgumentError):
        rowkernels.gather_rows(table, outside[:3], got, checked=True)
