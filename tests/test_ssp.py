"""Bounded staleness (``--mode ssp --staleness s``): a fast worker runs ahead of a slow one, by at most s."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import run_workers

import psrt
from psrt.shard.store import Store


def run_pair(shards, staleness: int, steps: int = 16, what: str = "dense") -> tuple[dict, dict]:
    group = shards(1, workers=2, mode="ssp", extra=("--staleness", str(staleness)))
    # Worker 0 is fast (no pause between steps), worker 1 slow (0.1 s).
    fast, slow = run_workers("ssp", [dict(servers=group.endpoints, rank=r, workers=2, steps=steps, step_s=pause,
                                          pattern=what) for r, pause in ((0, 0.0), (1, 0.1))])
    return fast, slow


@pytest.mark.integration
@pytest.mark.parametrize("what", ["dense", "rows"])
@pytest.mark.parametrize("staleness", [2, 0])
def test_a_fast_worker_runs_at_most_staleness_pushes_ahead(shards, staleness, what):
    fast, slow = run_pair(shards, staleness, what=what)
    steps = len(fast["after"])
    for i in range(staleness, steps):
        # The fast worker's push_pull at clock i+1 returned only after the slow one had sent push i+1-staleness.
        assert fast["after"][i] >= slow["before"][i - staleness], (i, staleness)
    # Every push applied exactly once, on arrival (scale 1): the slow worker, last to finish, pulls
    # w = -(16 x 1 + 16 x 2) exactly; the fast one's last pull may miss at most `staleness` slow pushes.
    assert slow["w"]["a"] == [-3.0 * steps] * 8
    assert -3.0 * steps <= fast["w"]["a"][0] <= -3.0 * steps + 2.0 * staleness
    ahead = sum(fast["after"][i] < slow["before"][i] for i in range(steps))
    if staleness == 0:
        assert ahead == 0  # lockstep: never a step ahead
    else:
        assert ahead >= steps // 2, ahead  # not sync: the fast worker finishes most steps before the slow one starts


@pytest.mark.integration
@pytest.mark.parametrize("pattern", ["apart", "backward", "subset", "async"])
def test_the_bound_holds_and_nothing_hangs_whatever_the_push_pattern(shards, pattern):
    # Clocks are per tensor: a worker that pushes its tensors in separate calls (as psrt.torch does) is not
    # counted k times per step, so it neither waits for pushes nobody makes nor runs further ahead than s.
    staleness, steps = 1, 8
    fast, slow = run_pair(shards, staleness, steps=steps, what=pattern)
    for i in range(staleness, steps):
        assert fast["after"][i] >= slow["before"][i - staleness], (pattern, i)
    pushes_b = (steps + 1) // 2 if pattern == "subset" else steps
    assert slow["w"] == {"a": [-3.0 * steps] * 8, "b": [-3.0 * pushes_b] * 8}  # each push applied once


@pytest.mark.integration
def test_one_worker_pushing_tensors_apart_with_no_staleness_does_not_wait_on_itself(shards):
    group = shards(1, workers=1, mode="ssp", extra=("--staleness", "0"))
    (out,) = run_workers("ssp", [dict(servers=group.endpoints, rank=0, workers=1, steps=5, step_s=0.0,
                                      pattern="apart")], timeout=60)
    assert out["w"] == {"a": [-5.0] * 8, "b": [-5.0] * 8}


def test_the_slowest_clock_counts_every_worker_and_only_members():
    s = Store("ssp", 3)
    e = s.create(("w", 0), np.zeros(2), psrt.SGD())
    for worker, pushes in ((0, 5), (1, 4)):
        for _ in range(pushes):
            s.tick_clocks(worker, [e])
    assert s.slowest_clock(e) == 0  # worker 2 has not pushed
    for _ in range(3):
        s.tick_clocks(2, [e])
    assert s.slowest_clock(e) == 3
    s.set_members(frozenset({0, 1}))  # worker 2 left an elastic job: nobody waits for it
    assert s.slowest_clock(e) == 4
    s.set_members(frozenset({0, 1, 3}))  # a worker joins at the slowest clock, not at 0
    assert e.clocks[3] == 4 and s.slowest_clock(e) == 4
    s.finished = frozenset({1})  # a finished worker's pushes are all in: it no longer bounds the others
    assert s.slowest_clock(e) == 4
    s.tick_clocks(3, [e])
    assert s.slowest_clock(e) == 5


def test_staleness_must_be_a_whole_number():
    with pytest.raises(psrt.ConfigError, match="staleness"):
        psrt.config.ServerConfig(mode="ssp", staleness=-1)
