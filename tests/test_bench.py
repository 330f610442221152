"""The benchmark scripts: their shared helpers, and that each one starts."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402  (bench/ is not a package: its scripts import this module by path)


@pytest.mark.parametrize("text, multiple, value", [
    ("4096", 1, 4096), ("64K", 1, 64 << 10), ("1M", 1, 1 << 20), ("1g", 1, 1 << 30), ("1.5K", 1, 1536),
    ("4KiB", 4, 4096), ("16MiB", 4, 16 << 20), ("100MB", 4, 100_000_000), ("4 K", 4, 4096),
])
def test_parse_size(text, multiple, value):
    assert _common.parse_size(text, multiple) == value


@pytest.mark.parametrize("text, multiple", [("", 1), ("fast", 1), ("0", 1), ("-4K", 1), ("6", 4), ("1KX", 1)])
def test_parse_size_refuses_what_is_not_a_size(text, multiple):
    with pytest.raises(argparse.ArgumentTypeError):
        _common.parse_size(text, multiple)


def test_human_units():
    assert [_common.human(n) for n in (1 << 20, 64 << 10, 1 << 30, 1000)] == ["1M", "64K", "1G", "1000"]
    assert [_common.human_bytes(n) for n in (64 << 10, 4 << 20, 100)] == ["64 KiB", "4 MiB", "100 B"]


@pytest.mark.integration
@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")))
def test_every_bench_script_starts(script):
    proc = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:")


@pytest.mark.integration
def test_start_server_gives_a_ready_server_and_stops_it_cleanly():
    server = _common.start_server(1, timeout=30)
    try:
        assert server.endpoint.startswith("tcp://127.0.0.1:")
        assert server.poll() is None
    finally:
        assert server.stop() == 0  # SIGTERM: the server stops its loop and says what it served
    assert "psrt-server stopped" in server.output


def test_chaos_percentiles_and_table():
    import chaos

    assert chaos.percentile([], 50) != chaos.percentile([], 50)  # NaN: no samples
    values = [float(v) for v in range(1, 101)]
    assert (chaos.percentile(values, 50), chaos.percentile(values, 99), chaos.percentile(values, 100)) == (50, 99, 100)
    rows = [chaos.Row("s", "m", "1 s", "< 5 s", True), chaos.Row("s", "n", "2", "0", False), chaos.Row("s", "o", "x")]
    assert [r.verdict for r in rows] == ["PASS", "MISS", ""]
    assert chaos.table(rows).splitlines()[2] == "| s | m | 1 s | < 5 s | PASS |"


def test_convergence_lead_table_and_verdicts():
    import convergence

    assert convergence.max_lead([[1, 2, 3], [1.5, 2.5, 3.5]]) == 1  # lockstep
    assert convergence.max_lead([[1, 2, 3], [10, 11, 12]]) == 3  # one ran 3 steps ahead
    run = {"steps_per_s": 2.0, "time_to_95_s": None, "final_acc": 0.9, "bytes_per_push": 1000.0, "max_lead": 1}
    results = {name: {**run, "name": name} for name in convergence.RUNS}
    results["sync fp16"].update(bytes_per_push=500.0, steps_per_s=3.4)
    results["sync topk:0.01"].update(bytes_per_push=20.0, final_acc=0.85)
    results["ssp s=2"].update(max_lead=3)
    verdicts = [ok for ok, _ in convergence.judge(results)]
    assert verdicts == [True, True, True, True, False, True]
    assert "| sync fp16 | 3.40 | not reached | 90.0 % | 0.5 kB | 1 |" in convergence.table(results)


@pytest.mark.integration
def test_convergence_workers_train_on_loopback(shards):
    """The bench's worker, W = 4 of them against one local shard, one epoch with top-k pushes."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    group = shards(1, workers=4)
    procs = [subprocess.Popen([sys.executable, str(BENCH / "convergence.py"), "--role", "worker", "--server",
                               group.endpoints[0], "--rank", str(r), "--compression", "topk:0.01", "--epochs", "1"],
                              stdout=subprocess.PIPE, text=True) for r in range(4)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4
    from psrt.control.process import parse_results
    from psrt.examples.torch_digits import make_model

    r0 = parse_results(outs[0])[0]
    assert r0["steps"] == 11 and len(r0["ends"]) == 11 and r0["curve"][-1][0] == 11
    dense = 4 * sum(p.numel() for p in make_model(0).parameters())
    assert r0["bytes_per_push"] < 0.03 * dense


def run_bench(script: str, args: list[str], tmp_path: Path) -> dict:
    """Run ``bench/SCRIPT`` with ``args`` and ``--json``; its exit status must be 0; returns the JSON."""
    out = tmp_path / f"{script}.json"
    proc = subprocess.run([sys.executable, str(BENCH / script), *args, "--json", str(out)], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.integration
def test_peers_reports_every_psrt_row_with_bandwidths_and_checks(tmp_path):
    """peers.py end to end on a tiny workload, only the psrt rows (Ray and torch are an extra)."""
    report = run_bench("peers.py", ["--systems", "psrt,psrt-tuned,psrt-sockets", "--elements", "20000",
                                    "--workers", "2", "--servers", "2", "--steps", "3", "--timeout", "120"], tmp_path)
    (workload,) = report["workloads"]
    assert workload["workload"]["elements"] == 20000 and workload["workload"]["workers"] == 2
    assert list(workload["systems"]) == ["psrt", "psrt-tuned", "psrt-sockets"]
    for row in workload["systems"].values():
        assert row["status"] == "ok" and row["check_ok"] is True and row["max_err"] <= row["tol"]
        assert row["rate"] > 0 and row["gbps"] > 0
    assert workload["memcopy_gbps"] > 0 and workload["psrt_gbps"] == workload["systems"]["psrt"]["gbps"]
    assert workload["psrt_to_memcopy"] == pytest.approx(workload["psrt_gbps"] / workload["memcopy_gbps"])
    assert workload["target"]["verdict"] == "n/a"  # no Ray nor torch row to compare with


def test_peers_target_compares_plain_psrt_with_the_faster_baseline():
    import peers

    rows = {name: peers.Outcome(name, rate=rate, check_ok=True)
            for name, rate in (("psrt", 30.0), ("psrt-tuned", 90.0), ("ray", 10.0), ("torch", 20.0))}
    target = peers._target(rows)
    assert (target["verdict"], target["against"], target["ratio"]) == ("PASS", "torch", 1.5)
    rows["psrt"].rate = 29.0  # the tuned row does not count
    assert peers._target(rows)["verdict"] == "MISS"
    rows["psrt"].rate, rows["psrt"].check_ok = 300.0, False
    assert peers._target(rows)["verdict"] == "MISS"


@pytest.mark.integration
def test_pslite_pattern_runs_every_row_and_checks_exactly(tmp_path):
    """pslite.py end to end on tiny keys: every row's goodput is counted and its parameters are exact."""
    report = run_bench("pslite.py", ["--servers", "2", "--workers", "2", "--key-bytes", "4K", "--keys-per-server",
                                     "3", "--rounds", "2", "--timeout", "120"], tmp_path)
    (config,) = report["configs"]
    assert config["pattern"]["servers"] == 2 and config["pattern"]["key_bytes"] == 4096
    assert [r["variant"] for r in config["rows"]] == ["psrt", "psrt-tuned", "psrt-sockets"]
    for row in config["rows"]:
        assert row["status"] == "ok" and row["check_ok"] is True and row["max_err"] == 0.0
        assert row["push_bytes"] == 2 * 2 * (2 * 3) * 4096  # W x rounds x keys x bytes
        assert row["goodput_gbps"] > 0 and len(row["per_worker_gbps"]) == 2
    assert config["target"]["verdict"] == "n/a"  # targets are for the full-size pattern only


@pytest.mark.integration
def test_msgrate_times_every_side_and_checks_every_push(tmp_path):
    """msgrate.py end to end with tiny blocks: every side's rate and ratio, the latency, the exactness check."""
    report = run_bench("msgrate.py", ["--workers", "2", "--in-flight", "2", "--rounds", "1", "--seconds", "0.2",
                                      "--latency-count", "20", "--context-per-worker", "--timeout", "60"], tmp_path)
    res = report["results"]
    assert [s["name"] for s in res["sides"]] == ["psrt", "psrt shard", "raw", "psrt sockets (PSRT_SHM=0)",
                                                 "psrt, pipelined from the start", "raw, a context per worker"]
    assert res["fresh_rate_ratio"] == res["sides"][4]["ratio"] and res["fresh_vs_psrt"] > 0
    assert all(s["rate_median"] > 0 and s["blocks"] == 1 for s in res["sides"])
    assert res["sides"][2]["ratio"] == 1.0 and res["rate_ratio"] == res["sides"][0]["ratio"]
    assert res["sockets_rate_ratio"] == res["sides"][3]["ratio"] and res["sockets_p50_ratio"] > 0
    assert res["pushes_checked"] > 0 and res["latency_psrt"]["count"] == 20 and res["p50_ratio"] > 0
    # The 2 default clients took their local connections; the 2 shm=False ones never did.
    assert res["local_peers"] == 2 and res["local_messages"] > 0
    assert [t["target"] for t in report["targets"]] == ["rate ratio >= 0.6", "shard rate ratio >= 0.6",
                                                        "p50 ratio <= 1.5"]


@pytest.mark.integration
def test_embedding_bench_reports_the_targets_ratios_and_rows_per_shard_core():
    proc = subprocess.run([sys.executable, str(BENCH / "embedding.py"), "--rows", "20K", "--dims", "16", "--shards",
                           "2", "--seconds", "0.2", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (r,) = json.loads(proc.stdout)
    # The same optimizer on both sides; a ratio is the median of the rounds' ratios, inside their quartiles.
    assert r["optimizer"] == "adagrad" and r["rounds"] >= 15
    lo, hi = r["pull_vs_dense_iqr"]
    assert lo <= r["pull_vs_dense"] <= hi and r["push_vs_dense_iqr"][0] <= r["push_vs_dense"]
    assert "load average" in proc.stderr and "rounds" in proc.stderr
    assert r["pull_ok"] == (r["pull_vs_dense"] <= 1.5) and r["push_ok"] == (r["push_vs_dense"] <= 2.0)
    assert r["push_rows_per_s_per_shard_core"] == pytest.approx(r["push_rows_per_s"] / 2)
    assert ("ok" if r["pull_ok"] else "MISS") in proc.stderr and "per shard core" in proc.stderr
