"""bench/scaling.py's verdicts: the shaped-link targets, and loopback runs, which measure the CPUs instead."""

from __future__ import annotations

import importlib.util
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
    spec.loader.exec_module(module)
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
