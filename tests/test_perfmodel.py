"""The performance model: its equations' consequences, and the load-test worker it is checked with."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from psrt import cli
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


def test_a_workers_reply_tail_is_one_message_whatever_s():
    # A lone worker pushing 1 MB to 16 shards, one 64 KiB message each: the first shards answer while it still
    # pushes to the others, so after its push it waits for one message's reply, as with one shard of 16 messages.
    one, _ = predict(1, 1)
    many, sc = predict(1, 16)
    assert (sc.shard_bytes, sc.messages) == (65536, 1)
    assert many.t_pull == pytest.approx(65536 * perfmodel.TCP_OVERHEAD / (LINK / 8))
    assert many.steps_per_s == pytest.approx(one.steps_per_s, rel=0.01)
    assert predict(1, 16, mode="async")[0].steps_per_s == pytest.approx(predict(1, 1, mode="async")[0].steps_per_s,
                                                                        rel=0.01)


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


def brute_efficiencies(workers, max_servers, model="1MB", partition=65536, compute=0.01, mode="sync", cal=CAL,
                       server_link=None):
    """Efficiency at S = 1..max_servers straight from scenario_for and predict, as docs/perfmodel.md defines it."""
    tensors = model_tensors(model, partition)

    def rate(w, s):
        sc = perfmodel.scenario_for(w, s, tensors, LINK, compute, mode, partition, server_link)
        return perfmodel.predict(sc, cal).steps_per_s

    alone = perfmodel.predict(perfmodel.scenario_for(1, 1, tensors, LINK, compute, mode, partition), cal).steps_per_s
    return [rate(workers, s) / (workers * alone) for s in range(1, max_servers + 1)]


def plan(workers, target, model="1MB", partition=65536, compute=0.01, mode="sync", cal=CAL, max_servers=32,
         server_link=None):
    return perfmodel.smallest_servers(workers, target, model_tensors(model, partition), cal, LINK, compute, mode,
                                      partition, server_link, max_servers=max_servers)


@pytest.mark.parametrize(("workers", "target", "model", "partition", "compute", "mode"), [
    (4, 0.9, "1MB", 65536, 0.01, "sync"),
    (16, 0.85, "1MB", 65536, 0.05, "sync"),
    (12, 0.8, "resnet50", 4 << 20, 0.5, "sync"),
    (16, 0.8, "4MB", 262144, 0.05, "async"),
])
def test_smallest_servers_is_the_first_s_to_reach_the_target(workers, target, model, partition, compute, mode):
    effs = brute_efficiencies(workers, 100, model, partition, compute, mode)
    expected = next(s for s, e in enumerate(effs, 1) if e >= target)
    got = plan(workers, target, model, partition, compute, mode, max_servers=100)
    assert got.reached and got.servers == got.link_servers == expected
    assert got.efficiency == pytest.approx(effs[expected - 1], rel=1e-12)
    assert perfmodel.efficiency(workers, expected, model_tensors(model, partition), CAL, LINK, compute, mode,
                                partition) == pytest.approx(got.efficiency, rel=1e-12)
    # The shard link it needs: the S found reaches the target there, and no longer just below it (the target
    # stays W x one worker's throughput at the given links).
    at = [brute_efficiencies(workers, expected, model, partition, compute, mode, server_link=link * 8)[-1]
          for link in (got.server_link, got.server_link * (1 - 1e-3))]
    assert at[0] >= target > at[1]
    assert got.server_link <= LINK / 8 and got.matched_servers == workers  # equal links: S = W by bandwidth


def test_the_search_does_not_assume_efficiency_grows_with_s():
    # 1 MB in 64 KiB tensors is 15 of 64 KiB and one of 17 kB. W=8: more shards relieve the shard links, but
    # S=15 beats S=16 and all beyond: its busiest shard holds 64 KiB + 17 kB in two messages, which pipeline,
    # where S >= 16 leaves every shard one message of 64 KiB whose replies wait for the whole push. A bisection
    # over 1..32 would try S=16, see it fail, and answer "none".
    effs = brute_efficiencies(8, 32)
    assert effs[14] >= 0.85 > max(effs[15:]) and max(effs[:14]) < 0.85
    got = plan(8, 0.85)
    assert (got.servers, got.reached) == (15, True)
    # W=4: S=5 reaches 0.93, S=6 to 14 do not, S=15 does again.
    effs = brute_efficiencies(4, 32)
    assert [s for s, e in enumerate(effs, 1) if e >= 0.93] == [5, 15]
    assert plan(4, 0.93).servers == 5
    # ResNet-50 over 1 Gbit/s links, W=12, 500 ms of compute: its large tensors are cut into pieces that pipeline
    # at any S (psrt.partition.PIPELINE_PIECES), so efficiency climbs to ~0.98 by S=13 and stays; the plan is the
    # first S to reach the target.
    effs = brute_efficiencies(12, 32, "resnet50", 4 << 20, 0.5)
    assert min(effs[12:]) > 0.97 and max(effs[:9]) < 0.85 <= effs[9]
    assert plan(12, 0.85, "resnet50", 4 << 20, 0.5).servers == 10


def test_an_unreachable_target_says_what_limits_it_and_the_link_that_would_reach_it():
    effs = brute_efficiencies(8, 32)
    got = plan(8, 0.9)
    assert not got.reached and got.limit == "shard link"
    assert (got.servers, got.efficiency) == (effs.index(max(effs)) + 1, max(effs))  # the best S at these links
    # With shard links of server_link, link_servers is the smallest S to reach 0.9; just below it none of 1..32.
    faster = brute_efficiencies(8, 32, server_link=got.server_link * 8)
    assert next(s for s, e in enumerate(faster, 1) if e >= 0.9) == got.link_servers
    assert max(brute_efficiencies(8, 32, server_link=got.server_link * 8 * (1 - 1e-3))) < 0.9
    assert got.server_link > LINK / 8
    # Shards that take 5 ms per message: 64 workers' messages keep a shard busy 320 ms a step however many
    # shards there are (each gets at least one message per worker); no shard link helps, and the plan says so.
    slow = dataclasses.replace(CAL, msg_overhead_s=5e-3)
    got = plan(64, 0.9, cal=slow)
    assert (got.reached, got.server_link, got.link_servers, got.limit) == (False, None, None, "shard CPU")
    assert got.efficiency == max(brute_efficiencies(64, 32, cal=slow))


def test_the_planner_covers_ten_thousand_workers_and_a_thousand_servers():
    got = plan(10_000, 0.5, model="resnet50", partition=4 << 20, compute=0.15, max_servers=1000)
    resnet = dict(model="resnet50", partition=4 << 20, compute=0.15)
    effs = brute_efficiencies(10_000, 1000, **resnet)
    assert max(effs) < 0.5 and not got.reached and got.matched_servers == 10_000
    assert (got.servers, got.efficiency) == (effs.index(max(effs)) + 1, max(effs))
    # 10,000 workers on 1 Gbit/s links: faster shard links would do it (their CPU is not the limit yet), about as
    # much bandwidth over all shards as over all workers, as BytePS's rule has it (docs/perfmodel.md).
    assert got.limit == "shard link" and got.server_link > 10 * LINK / 8
    assert 0.5 < got.link_servers * got.server_link / (10_000 * LINK / 8) < 2
    faster = brute_efficiencies(10_000, got.link_servers, **resnet, server_link=got.server_link * 8)
    assert faster[-1] >= 0.5 > max(faster[:-1])


@pytest.mark.parametrize(("workers", "target", "max_servers", "message"), [
    (8, 0.0, 32, r"target efficiency must be in \(0, 1\]"),
    (8, 1.5, 32, r"target efficiency must be in \(0, 1\]"),
    (8, float("nan"), 32, r"target efficiency must be in \(0, 1\]"),
    (10_001, 0.9, 32, "1 to 10,000 workers"),
    (0, 0.9, 32, "1 to 10,000 workers"),
    (8, 0.9, 1001, "1 to 1,000 servers"),
])
def test_the_planner_refuses_what_it_does_not_cover(workers, target, max_servers, message):
    with pytest.raises(psrt_errors.ConfigError, match=message):
        plan(workers, target, max_servers=max_servers)


MODEL_ARGS = ["model", "--model", "1MB", "--partition-bytes", "65536", "--link", "1gbit", "--compute-ms", "10",
              "--agg-rate", "5e9", "--msg-overhead-us", "50", "--rtt-us", "200"]


def test_model_command_plans_capacity(capsys):
    assert cli.main([*MODEL_ARGS, "--workers", "4,8", "--target-efficiency", "0.85"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["4"], ["8"])}
    assert rows["8"][1:3] == ["15", f"{plan(8, 0.85).efficiency:.3f}"]
    assert rows["4"][1] == str(plan(4, 0.85).servers)
    assert "target: efficiency >= 0.85" in out and "saturate at W" not in out  # the plan replaces the tables
    assert cli.main([*MODEL_ARGS, "--workers", "8", "--target-efficiency", "0.9"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert "none of S <= 1000 reaches it at 1gbit" in line and "limit: shard link" in line


@pytest.mark.parametrize(("args", "message"), [
    (["--target-efficiency", "0"], "target efficiency must be in (0, 1]"),
    (["--target-efficiency", "1.01"], "target efficiency must be in (0, 1]"),
    (["--workers", "8,10001", "--target-efficiency", "0.9"], "1 to 10,000 workers, got 10,001"),
])
def test_model_command_refuses_a_bad_plan_in_one_line(capsys, args, message):
    assert cli.main([*MODEL_ARGS, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before anything was printed
    (line,) = captured.err.splitlines()
    assert line.startswith("psrt: error: ") and message in line


def test_model_command_draws_efficiency_against_w(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "eff.png"
    assert cli.main([*MODEL_ARGS, "--workers", "1,8,64", "--servers", "1,4,16", "--target-efficiency", "0.8",
                     "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert f"wrote {path}" in capsys.readouterr().out
    assert cli.main([*MODEL_ARGS, "--plot", str(tmp_path / "missing" / "eff.png")]) == 2
    assert "cannot write the plot to" in capsys.readouterr().err


def test_model_command_without_matplotlib_says_what_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert cli.main([*MODEL_ARGS, "--plot", str(tmp_path / "eff.png")]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert "needs matplotlib: pip install 'psrt[plot]'" in line and captured.out == ""
    assert not (tmp_path / "eff.png").exists()


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
