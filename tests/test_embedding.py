"""The shard-side row store (psrt.shard.embedding): growth, the id index, deterministic rows, row-wise steps."""

from __future__ import annotations

import numpy as np
import pytest

from psrt.errors import ConfigError
from psrt.kernels import reference
from psrt.optim import SGD, AdaGrad, Adam
from psrt.shard.embedding import RowTable, coalesce
from psrt.tablespec import TableSpec


def table(**kw) -> RowTable:
    max_rows = kw.pop("max_rows", 1 << 20)
    spec = dict(dim=8, dtype=np.dtype(np.float32), optimizer=SGD(lr=0.1), init="normal", a=0.0, b=0.1, seed=3)
    spec.update(kw)
    return RowTable(TableSpec(**spec), max_rows=max_rows)


def test_rows_are_made_on_first_touch_from_seed_and_id_and_grow():
    t = table()
    ids = np.random.default_rng(0).integers(-(2**62), 2**62, 5000)
    rows = t.gather(ids)
    assert t.used == len(np.unique(ids)) and t.capacity >= t.used
    np.testing.assert_allclose(rows, reference.init_rows(ids, 8, np.float32, 3, 2, 0.0, 0.1), rtol=1e-6)
    again = t.gather(ids[::-1].copy())
    assert np.array_equal(again, rows[::-1])
    assert t.used == len(np.unique(ids))  # nothing created twice
    other = table()  # another shard or a restarted job: the same rows
    assert np.array_equal(other.gather(ids[:10].copy()), rows[:10])


def test_growth_is_geometric_and_slack_small():
    t = table(dim=4)
    caps = set()
    for start in range(0, 200_000, 1000):
        t.slots_of(np.arange(start, start + 1000, dtype=np.int64))
        caps.add(t.capacity)
    assert len(caps) < 40  # geometric, not one resize per batch
    assert t.capacity <= 1.21 * t.used + 1
    assert np.array_equal(t.find(np.array([5, 199_999, 10**9], np.int64))[:2], t.slots_of(np.array([5, 199_999])))
    assert t.find(np.array([10**9], np.int64))[0] == -1


def test_coalesce_matches_numpy():
    slots = np.array([2, 2, 1], np.int64)
    u, s = coalesce(slots, np.ones((3, 2), np.float32))
    assert u.tolist() == [1, 2] and s.tolist() == [[1, 1], [2, 2]]


def test_coalesce_sums_duplicates():
    slots = np.array([3, 1, 3, 3, 0], np.int64)
    rows = np.arange(10, dtype=np.float32).reshape(5, 2)
    u, s = coalesce(slots, rows)
    assert u.tolist() == [0, 1, 3]
    assert s.tolist() == [[8, 9], [2, 3], [0 + 4 + 6, 1 + 5 + 7]]


@pytest.mark.parametrize("opt", [SGD(lr=0.1), SGD(lr=0.1, momentum=0.9), AdaGrad(lr=0.05, lr_decay=0.01,
                                                                                  initial_accumulator_value=0.1),
                                 Adam(lr=0.01)])
def test_steps_touch_only_the_pushed_rows(opt):
    t = table(optimizer=opt)
    t.gather(np.arange(100, dtype=np.int64))
    before = t.param[:100].copy()
    slots, grads = t.push(np.array([5, 7, 5], np.int64), np.ones((3, 8), np.float32))
    t.apply(slots, grads, 0.5)
    changed = np.flatnonzero(np.any(t.param[:100] != before, axis=1))
    assert changed.tolist() == [5, 7] and t.version == 1
    if isinstance(opt, AdaGrad):
        assert t.slots["sum"][0, 0] == pytest.approx(0.1) and t.slots["sum"][5, 0] == pytest.approx(0.1 + 1.0)


def test_set_missing_keeps_existing_rows():
    t = table(num_rows=10)
    t.gather(np.array([1], np.int64))
    first = t.param[0].copy()
    t.set_missing(np.arange(10, dtype=np.int64), np.full((10, 8), 7.0, np.float32))
    got = t.gather(np.arange(10, dtype=np.int64))
    assert np.array_equal(got[1], first) and np.all(got[[0, *range(2, 10)]] == 7.0)


def test_memory_is_reported_and_specs_are_checked():
    t = table()
    t.gather(np.arange(1000, dtype=np.int64))
    mem = t.memory()
    assert mem["rows"] == t.capacity * 8 * 4 and mem["slots"] == 0 and mem["index"] > 0
    with pytest.raises(ConfigError, match="SparseAdam"):
        TableSpec(dim=4, dtype=np.dtype(np.float32), optimizer=Adam(weight_decay=0.1))
    with pytest.raises(ConfigError):
        TableSpec(dim=0, dtype=np.dtype(np.float32), optimizer=SGD())


def test_a_table_steps_a_new_optimizer_through_its_own_class():
    # A new optimizer is its class and its kernels: the table needs no change to step it.
    from dataclasses import dataclass
    from typing import ClassVar

    from psrt import optim
    from psrt.kernels import rows as rowkernels

    @dataclass(frozen=True)
    class HalfSGD(optim.Optimizer):
        lr: float = 0.1
        name: ClassVar[str] = "half_sgd"
        slots: ClassVar[tuple[str, ...]] = ("seen",)

        def slot_fill(self, slot: str) -> float:
            return 2.0

        def step_rows(self, param, slots, rows, grad, scale, step) -> None:
            rowkernels.sgd_rows(param, rows, grad, self.lr / 2, scale)
            slots["seen"][rows] += step

    t = table(optimizer=HalfSGD(), init="zeros")
    slots, grads = t.push(np.array([4, 9], np.int64), np.ones((2, 8), np.float32))
    t.apply(slots, grads, 1.0)
    t.apply(slots, grads, 1.0)
    assert np.array_equal(t.gather(np.array([4, 9, 1], np.int64))[:, 0], np.float32([-0.1, -0.1, 0]))
    assert t.slots["seen"][t.find(np.array([4, 1], np.int64)), 0].tolist() == [2 + 1 + 2, 2]


def test_a_table_checkpointed_by_an_older_psrt_is_read_back():
    """The record and arrays a table's checkpoint held before rows could be evicted (no layout field; rows,
    slots, ids, then the round by slot) still restore: rows, slots, version and the round in progress."""
    spec = TableSpec(dim=3, dtype=np.dtype(np.float32), optimizer=AdaGrad(lr=0.1))
    ids = np.array([7, -2, 40], np.int64)
    param = np.arange(9, dtype=np.float32).reshape(3, 3)
    record = {"name": "t", "dim": 3, "dtype": "<f4", "optimizer": spec.optimizer.to_wire(), "init": "normal",
              "a": 0.0, "b": 0.01, "seed": 0, "num_rows": None, "max_rows": 1000, "used": 3, "version": 5,
              "contributors": [1], "expected": [0, 1], "slots": ["sum"]}
    round_slots, round_acc = np.array([2], np.int64), np.ones((1, 3), np.float32)
    t = RowTable.from_state(record, [param.reshape(-1), np.full(9, 0.5, np.float32), ids, round_slots,
                                     round_acc.reshape(-1)])
    np.testing.assert_array_equal(t.gather(np.array([40, 7, -2], np.int64)), param[[2, 0, 1]])
    assert t.version == 5 and t.round.contributors == {1} and t.row_ids[t.round.slots[0]] == 40
    np.testing.assert_array_equal(t.slots["sum"][:3], np.full((3, 3), 0.5, np.float32))


def _huge_page_bytes(array: np.ndarray) -> int:
    """Bytes of ``array``'s buffer that this process's mappings back with transparent huge pages."""
    lo, hi = array.ctypes.data, array.ctypes.data + array.nbytes
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < hi and end > lo
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) << 10
    return total


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "none"


@pytest.mark.skipif(_thp_mode() != "madvise", reason="huge pages only on advice (THP 'madvise') tells them apart")
def test_a_grown_table_lies_in_huge_pages_with_the_same_rows():
    # Rows are touched at random: the table asks for 2 MiB pages, so a batch's rows do not each miss the TLB.
    t = table(dim=64, optimizer=AdaGrad(lr=0.1), max_rows=1 << 20)
    ids = np.arange(300_000, dtype=np.int64)
    rows = t.gather(ids)
    assert _huge_page_bytes(t.param) > 0 and _huge_page_bytes(t.slots["sum"]) > 0
    assert _huge_page_bytes(t._index) > 0
    fresh = table(dim=64, optimizer=AdaGrad(lr=0.1), max_rows=1 << 20)
    np.testing.assert_array_equal(fresh.gather(ids[::-7].copy()), rows[::-7])  # (a pure function of seed and id)
