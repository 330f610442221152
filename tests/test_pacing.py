"""Pacing: a blocking sync call's pieces over a network go a few at a time, or all at once, as timing says.

The schedule (:class:`psrt.worker.pacing.Pacing`) is checked on given times; the pacing itself on real sockets,
with the tensors cut for a network over loopback (``pipeline="on"``) and the shard counting every message.
"""

from __future__ import annotations

import random
import threading
from typing import Callable, Optional

import numpy as np
import pytest
from _helpers import check_named_setting, serving

import psrt
from psrt.config import ClientConfig, ServerConfig
from psrt.errors import ConfigError
from psrt.partition import PIPELINE_PIECES
from psrt.worker.pacing import (
    BLOCK,
    CLEAR_SAMPLES,
    EXPLORE_EVERY,
    FIRST_SAMPLES,
    GROUPED,
    JOINED,
    MARGIN,
    PACED,
    SAMPLES,
    WARM_UP_CALLS,
    Pacing,
)


def schedule(pacing: Pacing, calls: int, times: tuple[float, float, float], key: str = "k",
             jitter: Optional[Callable[[], float]] = None) -> list[int]:
    """The ways of ``calls`` calls on ``key``, each ending ``times[way]`` after the one before (on a clock of the
    pacing's own, kept from call to call), give or take ``jitter()`` on when this worker sees it end."""
    ways = []
    for _ in range(calls):
        way = pacing.way(key)
        ways.append(way)
        step = _STEPS[id(pacing)] = _STEPS.get(id(pacing), 0.0) + times[way]
        pacing.ended(key, way, step + (jitter() if jitter is not None else 0.0))
    return ways


_STEPS: dict[int, float] = {}  # each pacing's clock: when its job's last step ended
TRIAL = 2 * FIRST_SAMPLES * BLOCK  # calls of one trial: blocks of two ways, alternating


def blocks(*ways: int) -> list[int]:
    """The calls of blocks of these ways."""
    return [w for way in ways for w in [way] * BLOCK]


def test_a_link_bound_job_is_paced_after_one_trial():
    """Paced blocks take half what joined ones do, every one of them: the trial ends after CLEAR_SAMPLES of each."""
    p = Pacing()
    ways = schedule(p, WARM_UP_CALLS + 2 * CLEAR_SAMPLES * BLOCK, (1.0, 2.0, 3.0))
    assert ways == [JOINED] * WARM_UP_CALLS + blocks(PACED, JOINED) * CLEAR_SAMPLES
    assert p.chosen("k") == PACED
    later = schedule(p, 3 * EXPLORE_EVERY * BLOCK, (1.0, 2.0, 3.0))
    assert later.count(JOINED) == 3 * BLOCK and GROUPED not in later, \
        "one block in EXPLORE_EVERY tries the way next to it"


def test_a_trial_whose_times_overlap_runs_to_its_end_and_the_medians_decide():
    """Paced calls take 1.0 or 1.3 a call, by turns, and joined ones 1.2: no way is MARGIN below the other in every
    sample, so the trial runs until each has FIRST_SAMPLES, and the medians (1.15 against 1.2) choose paced."""
    p = Pacing()
    turns = iter([1.0, 1.3] * 64)
    ways = []
    for _ in range(WARM_UP_CALLS + TRIAL):
        way = p.way("k")
        ways.append(way)
        step = _STEPS[id(p)] = _STEPS.get(id(p), 0.0) + (next(turns) if way == PACED else 1.2)
        p.ended("k", way, step)
        if len(ways) == WARM_UP_CALLS + 2 * CLEAR_SAMPLES * BLOCK:
            assert p.chosen("k") is None, "a trial whose times overlap does not end early"
    assert ways == [JOINED] * WARM_UP_CALLS + blocks(PACED, JOINED) * FIRST_SAMPLES
    assert p.chosen("k") == PACED


def test_a_cpu_bound_job_climbs_to_grouped_messages():
    """Joined beat paced, so joined and grouped are tried next, and grouped kept; its neighbour is explored."""
    p = Pacing()
    ways = schedule(p, WARM_UP_CALLS + 4 * CLEAR_SAMPLES * BLOCK, (2.0, 1.0, 0.5))
    first = WARM_UP_CALLS + 2 * CLEAR_SAMPLES * BLOCK  # (joined has its times from the first trial)
    assert ways[first:] == blocks(GROUPED, JOINED) * (CLEAR_SAMPLES - 1) + blocks(GROUPED, GROUPED)
    assert p.chosen("k") == GROUPED
    assert schedule(p, EXPLORE_EVERY * BLOCK, (2.0, 1.0, 0.5)).count(JOINED) == BLOCK
    q = Pacing()
    schedule(q, WARM_UP_CALLS + 2 * TRIAL, (2.0, 1.0, 1.5))
    assert q.chosen("k") == JOINED, "grouped slower than joined: joined kept"


def test_the_choice_follows_a_clear_change_of_load_and_not_noise():
    """The newest SAMPLES times of each way decide, and a way is left only for one MARGIN faster."""
    p = Pacing()
    schedule(p, WARM_UP_CALLS + TRIAL, (1.0, 2.0, 3.0))
    schedule(p, EXPLORE_EVERY * SAMPLES * BLOCK, (1.0, 1.0 - MARGIN / 2, 3.0))
    assert p.chosen("k") == PACED, "joined only a little faster: paced kept"
    schedule(p, EXPLORE_EVERY * SAMPLES * BLOCK, (3.0, 2.0, 4.0))
    assert p.chosen("k") == JOINED, "paced got slower: the explored joined calls found it so"


def test_sets_of_tensors_are_timed_apart():
    p = Pacing()
    schedule(p, WARM_UP_CALLS + TRIAL, (1.0, 2.0, 3.0), key="a")
    schedule(p, WARM_UP_CALLS + 2 * TRIAL, (2.0, 1.0, 0.5), key="b")
    assert (p.chosen("a"), p.chosen("b"), p.chosen("c")) == (PACED, GROUPED, None)


def test_the_workers_of_a_job_choose_alike_though_each_sees_the_steps_end_a_little_apart():
    """The job's steps take 10 grouped and 12 joined (paced 20), but each worker sees a step end up to 3 earlier
    or later than the others do (the shards answer the W workers one after another, in an order that changes from
    round to round): blocks of BLOCK calls timed from end to end see that jitter a quarter as much, and every
    worker of 16 jobs chooses grouped."""
    rng = random.Random(7)
    for _ in range(16):
        workers = [Pacing() for _ in range(4)]
        for p in workers:
            schedule(p, WARM_UP_CALLS + 2 * TRIAL, (20.0, 12.0, 10.0), jitter=lambda: rng.uniform(-3.0, 3.0))
        assert [p.chosen("k") for p in workers] == [GROUPED] * 4


def test_in_flight_must_be_a_whole_number_of_zero_or_more(monkeypatch):
    assert ClientConfig().in_flight == 2
    assert ClientConfig(in_flight=0).in_flight == 0
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="in_flight must be a whole number >= 0"):
            ClientConfig(in_flight=bad)
    monkeypatch.setenv("PSRT_IN_FLIGHT", "-3")
    with pytest.raises(ConfigError, match=r"got -3 \(PSRT_IN_FLIGHT\)"):
        ClientConfig()
    monkeypatch.setenv("PSRT_IN_FLIGHT", "4")
    assert ClientConfig().in_flight == 4


def test_a_fixed_pacing_is_every_calls_way_and_times_nothing(monkeypatch):
    assert ClientConfig().pacing == "auto" and Pacing.named("auto").fixed is None
    for name, way in (("paced", PACED), ("joined", JOINED), ("grouped", GROUPED)):
        p = Pacing.named(ClientConfig(pacing=name).pacing)
        assert schedule(p, WARM_UP_CALLS + 3 * TRIAL, (3.0, 2.0, 1.0)) == [way] * (WARM_UP_CALLS + 3 * TRIAL)
        assert p.chosen("k") is None, "nothing timed, nothing chosen"
    check_named_setting(monkeypatch, "pacing", "PSRT_PACING", "'auto', 'paced', 'joined' or 'grouped'",
                        ("fast", "slow"), "grouped")


def _train(endpoint: str, rank: int, names: list[str], steps: int, in_flight: int, size: int,
           out: dict) -> None:
    config = ClientConfig(timeout=15, shm=False, pipeline="on", in_flight=in_flight)
    with psrt.Client([endpoint], rank=rank, num_workers=2, config=config) as c:
        c.init({n: np.zeros(size, np.float32) for n in names}, optimizer=psrt.SGD(lr=1.0))
        reads = []
        for _ in range(steps):
            got = c.push_pull({n: np.full(size, rank * 2 + 1, np.float32) for n in names})
            reads.append({n: (float(a.min()), float(a.max())) for n, a in got.items()})
        out[rank] = (reads, c._pacing is not None, c.stats()[0]["pushes"])


@pytest.mark.parametrize("second", [0, 1], ids=["paced-and-at-once", "both-paced"])
def test_workers_naming_tensors_in_other_orders_stay_exact_paced_or_not(second):
    """Worker 0 paces (one piece in flight), worker 1 sends everything at once or paces too, and they name the
    two tensors in opposite orders: no round waits on the other worker's held-back pieces (a paced worker holds a
    piece back only behind pieces before it, in the order of their keys), and every round is exact: -2 k after
    round k (the mean of 1 and 3, SGD lr=1). The shard counts worker 0's pieces a message each in its trial's
    paced calls, joined two to a message in the others."""
    size, steps = 1 << 19, 2 * 6  # 2 MiB a tensor: PIPELINE_PIECES pieces of 128 KiB on one shard, two a message
    out: dict = {}
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=2, mode="sync")) as server:
        threads = [threading.Thread(target=_train, args=(server.endpoint, 0, ["a", "b"], steps, 1, size, out)),
                   threading.Thread(target=_train, args=(server.endpoint, 1, ["b", "a"], steps, second, size, out))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a worker waits on the other's held-back pieces"
        pushes = server.counters.pushes
    assert sorted(out) == [0, 1], out
    for rank in (0, 1):
        reads, paced, _ = out[rank]
        assert reads == [{n: (-2.0 * k, -2.0 * k) for n in ("a", "b")} for k in range(1, steps + 1)]
        assert paced is (rank == 0 or second > 0), "in_flight=0: never paced"
    if second:
        return
    paced_call, joined_call = 2 * PIPELINE_PIECES, PIPELINE_PIECES  # a call's messages: a piece, or two, each
    worker_1 = steps * joined_call  # never paced: joined
    worker_0 = pushes - worker_1
    assert worker_0 >= FIRST_SAMPLES * paced_call + (steps - FIRST_SAMPLES), "its trial paced calls"
    assert worker_0 <= steps * paced_call - (WARM_UP_CALLS + FIRST_SAMPLES) * (paced_call - joined_call), \
        "its warm-up and its trial sent calls joined"
