"""The round rules in the store: fixed sync rounds, and elastic membership (leave mid-round, join next round)."""

from __future__ import annotations

import numpy as np
import pytest

import psrt
from psrt.shard.store import Store

KEY = ("w", 0)


def store(mode: str = "sync", workers: int = 3) -> Store:
    s = Store(mode, workers)
    s.create(KEY, np.zeros(4, np.float64), psrt.SGD(lr=1.0))
    return s


def push(s: Store, worker: int, value: float) -> tuple[int, bool]:
    entry = s.entries[KEY]
    assert s.can_join(worker, [entry])
    targets, completed = s.apply_push(worker, [entry], [np.full(4, value)])
    return targets[0], bool(completed)


def test_a_fixed_round_steps_once_all_w_have_pushed_with_their_mean():
    s = store(workers=3)
    assert push(s, 0, 1.0) == (1, False)
    assert push(s, 1, 2.0) == (1, False)
    assert not s.can_join(0, [s.entries[KEY]])  # worker 0 is a round ahead: it must wait
    assert push(s, 2, 6.0) == (1, True)
    np.testing.assert_array_equal(s.entries[KEY].param, np.full(4, -3.0))  # lr 1 x mean(1, 2, 6)


def test_a_worker_leaving_mid_round_completes_it_with_the_mean_of_those_who_pushed():
    s = store(workers=3)
    s.set_members(frozenset({0, 1, 2}))
    push(s, 0, 1.0)
    push(s, 1, 3.0)
    assert s.entries[KEY].version == 0
    assert s.set_members(frozenset({0, 1})) == [KEY]  # worker 2 left: the round no longer waits for it
    entry = s.entries[KEY]
    assert entry.version == 1 and not entry.contributors
    np.testing.assert_array_equal(entry.param, np.full(4, -2.0))  # mean(1, 3), not (1 + 3) / 3
    assert push(s, 0, 1.0) == (2, False) and push(s, 1, 1.0) == (2, True)  # and rounds of two go on


def test_a_joining_worker_is_counted_from_the_next_round():
    s = store(workers=2)
    s.set_members(frozenset({0, 1}))
    push(s, 0, 1.0)  # a round is in progress, waiting for workers 0 and 1
    s.set_members(frozenset({0, 1, 5}))  # worker 5 joins
    assert push(s, 1, 3.0) == (1, True)  # the round in progress did not wait for worker 5
    np.testing.assert_array_equal(s.entries[KEY].param, np.full(4, -2.0))
    push(s, 0, 1.0)
    push(s, 1, 1.0)
    assert s.entries[KEY].version == 1  # the next round waits for worker 5 too
    assert push(s, 5, 4.0) == (2, True)
    np.testing.assert_array_equal(s.entries[KEY].param, np.full(4, -4.0))  # -2 - mean(1, 1, 4)


def test_only_members_may_push_in_an_elastic_job():
    s = store(workers=2)
    assert s.is_member(7)  # a fixed job does not know members
    s.set_members(frozenset({0}))
    assert s.is_member(0) and not s.is_member(1)


def test_the_last_member_alone_steps_every_push():
    s = store(workers=2)
    s.set_members(frozenset({0}))
    assert push(s, 0, 2.0) == (1, True)
    np.testing.assert_array_equal(s.entries[KEY].param, np.full(4, -2.0))


@pytest.mark.parametrize("mode", ["async"])
def test_async_applies_every_push_whatever_the_members(mode):
    s = store(mode, workers=3)
    s.set_members(frozenset({0, 1}))
    assert push(s, 0, 1.0) == (1, True)
    assert push(s, 0, 1.0) == (2, True)
