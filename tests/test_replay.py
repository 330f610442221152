"""The replay window that makes pushes exactly-once in any order of arrival (psrt.shard.replay)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psrt.errors import RequestRefused
from psrt.shard.replay import REPLAY_WINDOW, WorkerLog, check_window, is_duplicate, record
from psrt.shard.store import Store


def test_a_push_below_the_highest_that_was_not_applied_is_taken_once():
    s = Store("async", 1)
    s.record(0, 7, 2)  # seq 2 arrived first (seq 1 was lost in a dying connection, then sent again)
    assert s.is_duplicate(0, 7, 2)
    assert not s.is_duplicate(0, 7, 1) and not s.is_duplicate(0, 7, 0)
    s.record(0, 7, 1)
    assert s.is_duplicate(0, 7, 1) and not s.is_duplicate(0, 7, 0)
    s.record(0, 7, 0)
    assert all(s.is_duplicate(0, 7, q) for q in range(3)) and not s.is_duplicate(0, 7, 3)
    assert s.workers[0].holes == 0  # every one in: nothing left to remember
    assert not s.is_duplicate(0, 8, 0)  # another session: a fresh sequence


def test_a_push_older_than_the_window_is_refused_not_guessed():
    log = WorkerLog(1)
    log.take(REPLAY_WINDOW + 5)
    check_window(log, 1, 6, "push")  # the window's floor: still told
    assert not log.applied(6)
    with pytest.raises(RequestRefused) as err:
        check_window(log, 1, 5, "push of worker 0")
    assert err.value.code == "replay_window" and str(REPLAY_WINDOW) in str(err.value)
    check_window(log, 2, 5, "push")  # another session: nothing to refuse
    check_window(None, 1, 5, "push")


def test_settled_cuts_the_window_below_the_first_push_of_an_open_round():
    log = WorkerLog(1)
    for q in (0, 1, 3, 5, 6):
        log.take(q)
    assert log.settled() == (6, 0b0010100)  # 4 and 2 not applied
    last, holes = log.settled(5)  # 5 and after are in open rounds
    back = WorkerLog.restored(1, last, WorkerLog(1, last, holes).hole_runs())
    assert [q for q in range(8) if back.applied(q)] == [0, 1, 3]
    last, holes = log.settled(3)
    assert (last, holes) == (2, 1)  # 2 itself is a hole
    back = WorkerLog.restored(1, last, WorkerLog(1, last, holes).hole_runs())
    assert [q for q in range(8) if back.applied(q)] == [0, 1]


def test_holes_go_as_runs_and_come_back_cut_to_the_window():
    log = WorkerLog(1)
    for q in (0, 3, 4, 9):
        log.take(q)
    assert log.hole_runs() == [[1, 2], [5, 4]]
    assert WorkerLog.restored(1, 9, log.hole_runs()) == log
    cut = WorkerLog.restored(1, REPLAY_WINDOW + 2, [[0, 10], [REPLAY_WINDOW + 2, 5]])  # below the window, above last
    assert cut.hole_runs() == [[3, 7], [REPLAY_WINDOW + 2, 1]]


def test_a_log_without_holes_restores_as_before():
    log = WorkerLog.restored(3, 9)  # a checkpoint or copy of an older psrt: everything up to 9 applied
    assert log.hole_runs() == []
    assert all(log.applied(q) for q in range(10)) and not log.applied(10)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3 * 64), max_size=250), st.sampled_from([0, 1, 500, REPLAY_WINDOW - 64]))
def test_any_order_of_arrival_applies_each_push_once(seqs, offset):
    """Against a set of the seqs applied: each arrival is taken exactly when it was not applied before (the window
    is wider than the spread of these seqs, so nothing falls below it)."""
    logs: dict = {}
    applied: set[int] = set()
    for q in (offset + s for s in seqs):
        dup = is_duplicate(logs.get(0), 5, q)
        assert dup == (q in applied)
        if not dup:
            record(logs, 0, 5, q)
            applied.add(q)
    if applied:
        log = logs[0]
        assert log.last_seq == max(applied)
        again = WorkerLog.restored(5, log.last_seq, log.hole_runs())  # what copies and checkpoints carry
        lo = max(0, log.last_seq - REPLAY_WINDOW + 1)
        assert {q for q in range(lo, log.last_seq + 2) if again.applied(q)} == {q for q in applied if q >= lo}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 4 * REPLAY_WINDOW), max_size=60))
def test_far_apart_seqs_are_told_within_the_window_and_refused_below(seqs):
    log = WorkerLog(1)
    applied: set[int] = set()
    for q in seqs:
        if log.too_old(q):
            with pytest.raises(RequestRefused):
                check_window(log, 1, q, "push")
            continue
        assert log.applied(q) == (q in applied)
        if q not in applied:
            log.take(q)
            applied.add(q)
    assert log.holes < 1 << REPLAY_WINDOW
