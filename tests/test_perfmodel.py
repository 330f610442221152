"""The performance model: its equations' consequences, and the load-test worker it is checked with."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from psrt import errors as psrt_errors
from psrt.control.process import parse_results
from psrt.emulation import models, perfmodel
from psrt.emulation.models import MODELS, model_tensors, parse_size

CAL = perfmodel.Calibration(agg_bytes_per_s=5e9, msg_overhead_s=50e-6, rtt_s=200e-6)
LINK = 1e9  # bits/s


def predict(workers, servers, model="1MB", mode="sync", cal=CAL, compute=0.01, partition=65536):
    sc = perfmodel.scenario_for(workers, servers, model_tensors(model, partition), LINK, compute, mode, partition)
    return perfmodel.predict(sc, cal), sc


def test_single_server_plateaus_and_shards_lift_it():
    ws = (1, 2, 4, 8, 16, 64, 1024)
    s1 = [predict(w, 1)[0].steps_per_s for w in ws]
    s4 = [predict(w, 4)[0].steps_per_s for w in ws]
    knee, plateau = perfmodel.saturation_point(predict(1, 1)[1], CAL)
    assert s1[-1] <= plateau * 1.0001 and s1[-1] > 0.95 * plateau  # approaches the plateau from below
    past = [x for w, x in zip(ws, s1) if w >= 4 * knee]
    assert len(past) >= 3 and min(past) > 0.8 * plateau            # flat past saturation
    # S shards lift the plateau about S-fold (less the pipelining a shard loses with fewer messages, k = 16 -> 4,
    # and the imbalance of 16 chunks over 4 shards).
    _, plateau4 = perfmodel.saturation_point(predict(1, 4)[1], CAL)
    assert s4[-1] == pytest.approx(plateau4, rel=0.02)
    assert 3.0 < plateau4 / plateau < 4.0
    assert all(b >= a * 0.999 for a, b in zip(s4, s4[1:]))          # S=4 keeps growing until its own plateau


def test_shards_beyond_the_chunk_count_do_not_help():
    # 1 MB in 64 KiB partitions is 16 chunks: 32 shards cannot do better than 16.
    assert predict(1024, 32)[0].steps_per_s == pytest.approx(predict(1024, 16)[0].steps_per_s, rel=0.01)


def test_bottlenecks_are_named():
    assert predict(1, 1, compute=5.0)[0].bottleneck == "compute"
    assert predict(16, 1)[0].bottleneck == "server link"
    assert predict(1, 4)[0].bottleneck == "worker link"
    slow_cpu = dataclasses.replace(CAL, agg_bytes_per_s=1e6)
    assert predict(16, 1, cal=slow_cpu)[0].bottleneck == "server CPU"


def test_async_does_not_wait_for_pulls_behind_pushes():
    assert predict(64, 1, mode="async")[0].steps_per_s > predict(64, 1, mode="sync")[0].steps_per_s


def test_reply_tail_round_trips_through_a_measured_rate():
    cal = dataclasses.replace(CAL, contended_tail=0.4)
    pred, sc = predict(6, 2, cal=cal)
    assert perfmodel.tail_from_run(sc, CAL, pred.steps_per_s) == pytest.approx(0.4, abs=1e-6)
    # A larger tail means a slower step, and W=1 is never affected.
    assert pred.steps_per_s < predict(6, 2)[0].steps_per_s
    assert predict(1, 2, cal=cal)[0].steps_per_s == predict(1, 2)[0].steps_per_s


def test_extrapolates_to_thousands_of_workers():
    pred, sc = predict(4096, 256, model="resnet50", partition=4 << 20)
    # Large tensors are cut over all 256 shards, so the busiest holds little more than an even share.
    assert pred.steps_per_s > 0 and sc.model_bytes / 256 <= sc.shard_bytes <= 1.5 * sc.model_bytes / 256


def test_shipped_models_and_sizes():
    assert set(MODELS) == {"resnet50", "vgg16", "bert-base"}
    counts = {m: models.model_bytes(m) // 4 for m in MODELS}
    assert counts == {"resnet50": 25557032, "vgg16": 138357544, "bert-base": 109482240}
    assert model_tensors("resnet50")[0] == ("conv1.weight", (64, 3, 7, 7))
    assert parse_size("100MB") == 100_000_000 and parse_size("4MiB") == 4 << 20 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="neither a shipped model"):
        model_tensors("resnet9000")


@pytest.mark.integration
def test_model_command_prints_a_table():
    proc = subprocess.run([sys.executable, "-m", "psrt.cli", "model", "--model", "vgg16", "--workers", "1,64,4096",
                           "--servers", "1,64"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "saturate at W" in proc.stdout and proc.stdout.count("server link") >= 2


@pytest.mark.integration
def test_load_worker_under_launch_reports_steps_per_second():
    proc = subprocess.run([sys.executable, "-m", "psrt.cli", "launch", "-s", "2", "-w", "2", "--", sys.executable,
                           "-m", "psrt.cli", "worker", "--model", "resnet50", "--steps", "3", "--warmup", "1"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = parse_results(proc.stdout)
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["steps_per_s"] > 0 and r["model_bytes"] == 4 * 25557032 and r["num_servers"] == 2 for r in results)


def test_emulated_cluster_needs_root(monkeypatch):
    from psrt.emulation import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(psrt_errors.ConfigError, match="needs root"):
        netns.check_available()
    with pytest.raises(psrt_errors.ConfigError, match="1gbit"):
        netns.parse_rate("fast")
    assert netns.parse_rate("1gbit") == 10**9 and netns.parse_rate("250mbit") == 250 * 10**6
