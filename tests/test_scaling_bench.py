"""bench/scaling.py's verdicts: the shaped-link targets, and loopback runs, which measure the CPUs instead."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "scaling.py"


@pytest.fixture(scope="module")
def scaling() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_scaling", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


def records(rates: dict[tuple[int, int], float], error: float = 5.0) -> list[dict]:
    """Sync records ``{(S, W): steps/s}``, each ``error`` percent off the model."""
    return [{"mode": "sync", "servers": s, "workers": w, "steps_per_s": x, "error_percent": error}
            for (s, w), x in rates.items()]


# A knee: S=1 grows from W=1 to W=2, then flattens; S=4 keeps growing to W=16.
KNEE = {(1, 1): 10.0, (1, 2): 16.0, (1, 4): 20.0, (1, 8): 22.0, (1, 16): 23.0,
        (4, 1): 10.0, (4, 2): 20.0, (4, 4): 38.0, (4, 8): 60.0, (4, 16): 76.0}
# What a CPU-bound loopback run looks like: one server saturated from W=1, shards barely help, the model far off.
CPU_BOUND = {(1, 1): 40.0, (1, 2): 42.0, (1, 4): 41.0, (1, 8): 40.0, (1, 16): 39.0,
             (4, 1): 35.0, (4, 2): 50.0, (4, 4): 55.0, (4, 8): 56.0, (4, 16): 55.0}


def test_a_knee_passes_every_target(scaling):
    verdicts = scaling.check_targets(records(KNEE))
    assert len(verdicts) == 5 and all(ok for _, ok, _ in verdicts), verdicts
    lines, status = scaling.target_report(records(KNEE), loopback=False)
    assert status == 0 and len(lines) == 5 and all(line.startswith("PASS") for line in lines)


def test_shaped_links_report_each_missed_target(scaling):
    lines, status = scaling.target_report(records(CPU_BOUND, error=81.0), loopback=False)
    assert status == 1
    missed = [line for line in lines if line.startswith("MISS")]
    # Both model-error targets, S=1's growth from W=1 to W=2, and the sharding gain at W=16 (x1.41 < 3.2);
    # a flat S=1 line does meet "plateaus".
    assert len(missed) == 4, lines
    assert any("S=4 >= 3.2x S=1: 1.41x" in line for line in missed)
    assert any(line.startswith("PASS") and "plateaus" in line for line in lines)


def test_loopback_measures_the_cpus_and_does_not_miss_shaped_link_targets(scaling):
    # The issue: `bench/scaling.py --loopback --quick` exited 1 with MISS lines for targets of shaped links.
    lines, status = scaling.target_report(records(CPU_BOUND, error=81.0), loopback=True)
    assert status == 0
    assert not any(line.startswith(("PASS", "MISS")) for line in lines)
    text = " ".join(lines)
    assert "only to shaped links" in text and "measure the CPUs" in text


def test_model_error_is_judged_by_its_median_and_its_worst_point(scaling):
    rows = records(KNEE, error=10.0)
    rows[0]["error_percent"] = -29.0  # one bad point: the median holds, the worst is still inside 30 %
    assert all(ok for _, ok, _ in scaling.check_targets(rows))
    rows[1]["error_percent"] = 31.0
    verdicts = {name: ok for name, ok, _ in scaling.check_targets(rows)}
    assert verdicts["model error, worst point <= 30%"] is False
    assert verdicts["model error, median of the 10 points <= 15%"] is True


def test_targets_need_their_points(scaling):
    # Custom sweeps without W=16 or S=4 get only the targets they measured.
    partial = {k: v for k, v in KNEE.items() if k[1] <= 4 and k[0] == 1}
    names = [name for name, _, _ in scaling.check_targets(records(partial))]
    assert len(names) == 3 and any("grows first" in n for n in names)
    assert not any("plateaus" in n or "S=4" in n for n in names)
    # Async records are compared with the model but are not judged on the sync knee.
    asyncs = [{**r, "mode": "async"} for r in records(CPU_BOUND)]
    assert len(scaling.check_targets(asyncs)) == 2


@pytest.mark.integration
def test_loopback_run_exits_0_and_says_why_it_judges_nothing():
    # The bench end to end on plain loopback, tiny: two jobs of a few steps (no namespaces, no root needed).
    proc = subprocess.run([sys.executable, str(BENCH), "--loopback", "--workers", "1,2", "--servers", "1",
                           "--model", "64KB", "--compute-ms", "1", "--seconds", "0.3", "--ideal-pipelining"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum(1 for line in lines if line.startswith(" sync   1 ")) == 2  # both jobs ran and were reported
    assert not any(line.startswith(("PASS", "MISS")) for line in lines)
    assert "apply only to shaped links" in proc.stdout and "measure the CPUs, not links" in proc.stdout


# ------------------------------------------------------------------------------------------------ --paper's plan

def paper_records(rates: dict[tuple[int, int], float], error: float = 5.0) -> list[dict]:
    return [{"servers": s, "workers": w, "steps_per_s": x, "error_percent": error, "mode": "sync"}
            for (s, w), x in rates.items()]


# The paper's shape: S=1 linear to W=16, then flat; S=4 and S=16 lift the plateau 4- and 16-fold.
PAPER_SHAPE = {(1, 1): 1.0, (1, 16): 12.0, (1, 64): 13.0, (1, 256): 14.0, (4, 64): 48.0, (16, 256): 180.0}


def test_the_paper_grid_has_every_point_the_issue_names(scaling):
    grid = set(scaling.PAPER_GRID)
    for s in (1, 4):
        assert {(s, w) for w in (1, 2, 4, 8, 16, 32, 64, 128, 256)} <= grid
    assert {(16, 64), (16, 256)} <= grid
    # S = 1 first, and within an S the workers in order.
    assert scaling.paper_points(None, None) == sorted(grid, key=lambda p: (p[0], p[1]))
    assert scaling.paper_points("16,64", "1,16") == [(1, 16), (1, 64), (16, 16), (16, 64)]
    with pytest.raises(ValueError, match="no point of the --paper grid"):
        scaling.paper_points("3", None)


def test_the_paper_hosts_shape_only_the_shards_links(scaling):
    hosts, shaped = scaling.paper_hosts(list(scaling.PAPER_GRID), 16)
    assert hosts[0] == "sched"
    assert hosts[1:17] == [f"s{i}" for i in range(16)] and shaped == set(hosts[1:17])
    assert hosts[17:] == [f"h{i}" for i in range(16)]  # 256 workers, 16 to a host
    hosts, shaped = scaling.paper_hosts([(1, 40), (4, 8)], 16)
    assert hosts == ["sched", "s0", "s1", "s2", "s3", "h0", "h1", "h2"]
    assert scaling.worker_groups(40, 16) == [16, 16, 8]
    assert scaling.worker_groups(16, 16) == [16] and scaling.worker_groups(1, 16) == [1]


def test_the_model_is_sized_so_that_a_shard_link_carries_knee_workers_in_one_compute_time(scaling):
    from psrt.emulation.perfmodel import TCP_OVERHEAD

    nbytes = scaling.size_model(20e6, 3.0, 18, 32)
    assert nbytes % (4 * 32) == 0  # whole float32 values in 32 equal pieces
    # knee * M * h = C * B_s, to within the rounding down to whole pieces.
    link_s = 18 * nbytes * TCP_OVERHEAD / (20e6 / 8)
    assert 3.0 - 18 * 4 * 32 * TCP_OVERHEAD / (20e6 / 8) < link_s <= 3.0
    setup = scaling.PaperSetup()
    assert setup.model_bytes == scaling.size_model(setup.link_bits, setup.compute_ms / 1000, setup.knee,
                                                    setup.layers * setup.chunks_per_layer)
    assert setup.layer_bytes * setup.layers == setup.model_bytes
    assert setup.partition_bytes * setup.chunks_per_layer == setup.layer_bytes  # equal chunks
    assert setup.window == setup.window_layers * setup.layer_bytes
    with pytest.raises(ValueError, match="leave no model bytes"):
        scaling.size_model(1000, 0.001, 16, 32)


def test_every_shard_holds_an_equal_part_of_every_layer(scaling):
    setup = scaling.PaperSetup()
    for servers in (1, 4):
        sc = scaling.paper_scenario(setup, servers, 8, 0)
        assert len(sc.layout) == setup.layers
        for messages in sc.layout:  # each layer: its chunks, one message each, spread over the shards
            assert len(messages) == setup.chunks_per_layer
            assert {b for _, b in messages} == {setup.partition_bytes}
            assert len({shard for shard, _ in messages}) == min(servers, setup.chunks_per_layer)
    sc = scaling.paper_scenario(setup, 16, 8, 0)
    per_shard = [sum(b for layer in sc.layout for s, b in layer if s == shard) for shard in range(16)]
    assert set(per_shard) == {setup.model_bytes // 16}
    assert sc.hosted == 8 and scaling.paper_scenario(setup, 16, 256, 0).hosted == setup.per_host
    assert math.isinf(sc.worker_link) and sc.overlap


def test_paper_steps_time_about_the_budget(scaling):
    assert scaling.paper_steps(3.0) == (4, 1)
    assert scaling.paper_steps(5.0) == (2, 1)
    assert scaling.paper_steps(12.0) == (1, 1)
    assert scaling.paper_steps(60.0) == (1, 0)  # a step longer than the budget is its own warm-up


def test_the_paper_shape_passes_every_paper_target(scaling):
    verdicts = scaling.check_paper_targets(paper_records(PAPER_SHAPE))
    assert len(verdicts) == 7 and all(ok for _, ok, _ in verdicts), verdicts


def test_each_missed_paper_target_is_named_with_its_figures(scaling):
    rates = {**PAPER_SHAPE, (1, 16): 9.0, (1, 256): 12.0, (16, 256): 100.0}
    verdicts = {name: (ok, detail) for name, ok, detail in scaling.check_paper_targets(paper_records(rates))}
    assert verdicts["S=1 grows near-linearly to the knee, W=16 >= 10x W=1"] == (False, "x9.00 (1.00 -> 9.00 steps/s)")
    assert verdicts["S=1 then plateaus, W=256 <= 1.25x W=16"][0] is False  # 12 / 9 = 1.33
    assert verdicts["S=1 then plateaus, W=64 <= 1.25x W=16"][0] is False  # 13 / 9 = 1.44
    assert verdicts["shards move the knee, at W=64 S=4 >= 3.5x S=1"] == (True, "3.69x (13.00 -> 48.00 steps/s)")
    assert verdicts["shards move the knee, at W=256 S=16 >= 12x S=1"] == (False, "8.33x (12.00 -> 100.00 steps/s)")
    rows = paper_records(PAPER_SHAPE, error=9.0)
    rows[0]["error_percent"] = -26.0  # the median holds, the worst does not
    verdicts = {name: ok for name, ok, _ in scaling.check_paper_targets(rows)}
    assert verdicts["model error, median of the 6 points <= 10%"] is True
    assert verdicts["model error, worst point <= 25%"] is False
    # A part of the grid gets only the targets whose points it measured.
    names = [n for n, _, _ in scaling.check_paper_targets(paper_records({(1, 1): 1.0, (1, 16): 12.0}))]
    assert len(names) == 3 and "W=16 >= 10x W=1" in names[2]


def test_a_part_of_the_paper_grid_has_the_hosts_of_its_calibration_job(scaling):
    """`--paper --workers 1 --servers 1` still runs the calibration job (S=2, W=48): its hosts are made too."""
    jobs = scaling.paper_jobs([(1, 1)], calibrate=True)
    assert jobs == [(1, 1), scaling.PAPER_CALIBRATION]
    hosts, shaped = scaling.paper_hosts(jobs, 16)
    s_cal, w_cal = scaling.PAPER_CALIBRATION
    assert shaped == {f"s{i}" for i in range(s_cal)}
    assert [h for h in hosts if h.startswith("h")] == [f"h{i}" for i in range(-(-w_cal // 16))]
    assert scaling.paper_jobs([(1, 1)], calibrate=False) == [(1, 1)]
