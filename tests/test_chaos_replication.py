"""bench/chaos.py's replication scenario, end to end in a small configuration: real scheduler, shard and worker
processes (loopback), and the overhead part on an emulated cluster where root and iproute2 allow it.

Only what does not depend on the machine's speed is asserted (every step completed, no worker error, parameters
bit-identical to a failure-free run's, no acknowledged push lost or applied twice, the copy bytes per round); the
times and the throughput cost are figures the bench reports, not assertions.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import chaos  # noqa: E402  (bench/ is not a package: its scripts import each other by path)

from psrt.partition import PIPELINE_PIECES  # noqa: E402

needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None or shutil.which("unshare") is None,
    reason="needs root, iproute2 and unshare for network namespaces")


def small() -> argparse.Namespace:
    opts = chaos.replication_options(argparse.Namespace(), quick=True)
    opts.repl_steps, opts.repl_kill_at, opts.repl_async_steps = 40, 12, 60
    opts.repl_model, opts.repl_overhead_steps, opts.repl_settle, opts.repl_window = "1MB", 40, 1.0, 1.5
    return opts


def by_measure(rows: list, text: str) -> list:
    found = [r for r in rows if text in r.measure]
    assert found, [r.measure for r in rows]
    return found


@pytest.mark.integration
def test_the_replication_scenario_kills_a_shard_and_loses_nothing(monkeypatch):
    monkeypatch.setattr(chaos, "_overhead", lambda opts, raw: [])  # the emulated part: the test below
    raw: dict = {}
    rows = chaos.scenario_replication(small(), raw)
    assert all(r.scenario == "replication" for r in rows)
    for label in ("(default)", "TIMEOUT 1 s"):
        runs = [r for r in rows if label in r.measure and r.measure.startswith("sync")]
        assert len(runs) == 4, [r.measure for r in rows]
        completed, promoted, identical, across = runs
        assert completed.ok and completed.value.startswith("80 of 80; none"), completed
        assert promoted.ok, promoted
        assert identical.ok and identical.value == "yes; 0", identical
        assert across.value.endswith(" s") and across.target.startswith("< ")  # a figure, not asserted
    (lossless,) = by_measure(rows, "acknowledged pushes / applied once / lost / twice")
    assert lossless.ok and lossless.value == "120 / 120 / 0 / 0", lossless
    assert raw["replication"]["async"]["promoted"]
    assert set(raw["replication"]["sync"]) == {"clean", "default", "fast"}


@pytest.mark.integration
@needs_namespaces
def test_the_replication_overhead_runs_r0_and_r1_side_by_side_on_an_emulated_cluster():
    raw: dict = {}
    rows = chaos._overhead(small(), raw)
    points = raw["replication"]["overhead"]
    assert [p["replicas"] for p in points] == [0, 1]
    assert all(p["steps_per_s"] > 0 for p in points)
    assert all(s["copy_bytes_sent"] == 0 for s in points[0]["shards"])  # R=0 copies nothing
    for s in points[1]["shards"]:  # R=1: each shard copies its rounds to the other, which takes them
        assert s["rounds"] > 0 and s["copy_bytes_sent"] > 0
    sent = sum(s["copy_bytes_sent"] for s in points[1]["shards"])
    taken = sum(s["copy_bytes_taken"] for s in points[1]["shards"])
    one_round = max(s["copy_bytes_sent"] / s["rounds"] for s in points[1]["shards"])
    # The shards are read one after the other while the job runs, and sync copies are pipelined: at either
    # reading, the copies of up to a step's rounds (a round a piece, PIPELINE_PIECES a shard) may be in flight.
    assert abs(sent - taken) <= PIPELINE_PIECES * one_round, (sent, taken, one_round)
    (throughput,) = by_measure(rows, "worker-steps/s R=0 / R=1")
    assert "R=1 costs" in throughput.value  # a figure; the machine's load decides it, so it is not asserted
    (copies,) = by_measure(rows, "copy bytes sent / bytes in")
    # Plain SGD: a round's copy is its parameters once, 1/W of the pushes and a header (the bench's target); here,
    # with a few rounds whose counters are read one shard after the other, only far below a copy of each worker's
    # gradient (which would be all of the pushes): replication after aggregation.
    ratio = sent / sum(s["bytes_in"] for s in points[1]["shards"])
    assert ratio < 2 / 4, (ratio, copies)
