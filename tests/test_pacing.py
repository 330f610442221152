"""Pacing: a blocking sync call's pieces over a network go a few at a time, or all at once, as timing says.

The schedule (:class:`psrt.worker.pacing.Pacing`) is checked on given times; the pacing itself on real sockets,
with the tensors cut for a network over loopback (``pipeline="on"``) and the shard counting every message.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from _helpers import serving

import psrt
from psrt.config import ClientConfig, ServerConfig
from psrt.errors import ConfigError
from psrt.partition import PIPELINE_PIECES
from psrt.worker.pacing import EXPLORE_EVERY, FIRST_SAMPLES, SAMPLES, WARM_UP_CALLS, Pacing


def schedule(pacing: Pacing, calls: int, paced_s: float, at_once_s: float, key: str = "k") -> list[bool]:
    ways = []
    for _ in range(calls):
        way = pacing.paced(key)
        ways.append(way)
        pacing.took(key, way, paced_s if way else at_once_s)
    return ways


def test_warm_up_calls_go_at_once_then_a_trial_alternates_then_the_faster_way_is_kept():
    p = Pacing()
    ways = schedule(p, WARM_UP_CALLS + 2 * FIRST_SAMPLES, paced_s=1.0, at_once_s=2.0)
    assert ways == [False] * WARM_UP_CALLS + [True, False] * FIRST_SAMPLES
    assert p.chosen("k") is True
    later = schedule(p, 3 * EXPLORE_EVERY, paced_s=1.0, at_once_s=2.0)
    assert later.count(False) == 3, "one call in EXPLORE_EVERY goes the other way"
    q = Pacing()
    schedule(q, WARM_UP_CALLS + 2 * FIRST_SAMPLES, paced_s=2.0, at_once_s=1.0)
    assert q.chosen("k") is False
    assert schedule(q, EXPLORE_EVERY, paced_s=2.0, at_once_s=1.0).count(True) == 1


def test_the_choice_follows_a_change_of_load():
    """The newest SAMPLES times of each way decide: once pacing gets slower, the next explored calls find it so."""
    p = Pacing()
    schedule(p, WARM_UP_CALLS + 2 * FIRST_SAMPLES, paced_s=1.0, at_once_s=2.0)
    assert p.chosen("k") is True
    schedule(p, EXPLORE_EVERY * SAMPLES, paced_s=3.0, at_once_s=2.0)
    assert p.chosen("k") is False


def test_sets_of_tensors_are_timed_apart():
    p = Pacing()
    schedule(p, WARM_UP_CALLS + 2 * FIRST_SAMPLES, paced_s=1.0, at_once_s=2.0, key="a")
    schedule(p, WARM_UP_CALLS + 2 * FIRST_SAMPLES, paced_s=2.0, at_once_s=1.0, key="b")
    assert (p.chosen("a"), p.chosen("b"), p.chosen("c")) == (True, False, None)


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
    paced calls."""
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
    paced_call, at_once_call = 2 * PIPELINE_PIECES, PIPELINE_PIECES  # a call's messages: a piece or two each
    worker_1 = steps * at_once_call
    worker_0 = pushes - worker_1
    extra = paced_call - at_once_call
    assert worker_0 >= steps * at_once_call + FIRST_SAMPLES * extra, "its trial paced calls"
    assert worker_0 <= steps * paced_call - (WARM_UP_CALLS + FIRST_SAMPLES) * extra, "some calls went at once"
