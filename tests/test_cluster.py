"""The cluster: scheduler, daemons, launcher, role dispatch from the environment, stats and metrics."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
import uuid

import numpy as np
import pytest
from _helpers import launched_results, worker_command

import psrt
from psrt.cluster.launch import THREAD_VARIABLES, compute_threads
from psrt.config import ClusterConfig
from psrt.control.process import SCHEDULER_READY, SERVER_READY, Child, parse_results, psrt_command, stop_children

PSRT = psrt_command()


def processes_with_marker(marker: str) -> list[int]:
    """Pids whose environment holds ``marker`` (to prove nothing outlived a job)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def launch(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, str]:
    marker = f"PSRT_TEST_MARK={uuid.uuid4().hex}"
    key, value = marker.split("=")
    proc = subprocess.run([*PSRT, "launch", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, key: value})
    return proc, marker


@pytest.mark.integration
def test_launch_runs_a_job_and_leaves_nothing_behind():
    proc, marker = launch("-s", "2", "-w", "3", "--", *worker_command("scheduled", steps=4))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = launched_results(proc.stdout)
    assert [r["rank"] for r in res] == [0, 1, 2]
    # Sync mode, SGD lr=1, 4 rounds of the averaged gradient (1+2+3)/3 = 2 on w and 1 on b.
    assert all(r["w0"] == -8.0 and r["b0"] == -4.0 and r["num_workers"] == 3 for r in res)
    assert all(r["servers"] == res[0]["servers"] and len(r["servers"]) == 2 for r in res)
    # Three worker processes share this machine's cores: each sizes its thread pools to its share (unless the
    # environment already says how).
    threads = {**{name: os.environ.get(name) for name in THREAD_VARIABLES}, **compute_threads(3, os.environ)}
    assert all(r["threads"] == threads for r in res), (threads, res)
    for label in ("[scheduler]", "[server 0]", "[server 1]", "[worker 2]"):
        assert label in proc.stdout
    assert "psrt-scheduler stopped code=0" in proc.stdout
    assert processes_with_marker(marker) == []


def test_launched_workers_share_the_cores_out_among_their_thread_pools_unless_told(monkeypatch):
    from psrt.cluster import launch as launcher

    for cores, processes, each in [(2, 2, "1"), (2, 5, "1"), (16, 3, "5"), (8, 2, "4")]:
        monkeypatch.setattr(launcher, "_cores", lambda cores=cores: cores)
        assert compute_threads(processes, {}) == dict.fromkeys(THREAD_VARIABLES, each)
    assert compute_threads(1, {}) == {}  # one process has every core anyway
    for name in THREAD_VARIABLES:  # any of them set: the user's choice stands, and none is added beside it
        assert compute_threads(2, {name: "3"}) == {}
    monkeypatch.setattr(launcher, "_cores", lambda: 8)
    assert compute_threads(2, {"OMP_NUM_THREADS": ""}) == dict.fromkeys(THREAD_VARIABLES, "4")  # (set empty: unset)


@pytest.mark.integration
def test_launch_stops_everything_when_a_worker_fails():
    proc, marker = launch("-s", "1", "-w", "3", "--timeout", "20", "--", *worker_command("scheduled", steps=2,
                                                                                         exit_code=7))
    assert proc.returncode == 7
    assert "worker 1 exited with code 7" in proc.stdout
    assert processes_with_marker(marker) == []


KILL_SELF = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"


@pytest.mark.integration
def test_launch_exits_128_plus_n_for_a_worker_killed_by_signal_n():
    proc, marker = launch("-s", "1", "-w", "2", "--timeout", "20", "--", sys.executable, "-c", KILL_SELF)
    assert proc.returncode == 128 + 9, proc.stdout + proc.stderr  # as a shell reports it, not 247
    assert "was killed by signal 9 (SIGKILL)" in proc.stdout
    assert processes_with_marker(marker) == []


@pytest.mark.integration
def test_psrt_run_exits_128_plus_n_for_a_worker_killed_by_signal_n():
    env = {**os.environ, "PSRT_ROLE": "worker", "PSRT_SCHEDULER": "tcp://127.0.0.1:5700"}
    proc = subprocess.run([*PSRT, "run", "--", sys.executable, "-c", KILL_SELF], capture_output=True, text=True,
                          env=env, timeout=30)
    assert proc.returncode == 137, proc.stderr


@pytest.mark.integration
def test_launch_rejects_a_missing_command():
    proc = subprocess.run([*PSRT, "launch", "-s", "1", "-w", "1"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "no worker command" in proc.stderr


def start(cmd: list[str], env: dict | None = None, ready: re.Pattern | None = None) -> Child:
    return Child(cmd, env=env, ready=ready, label=" ".join(cmd[3:5]))


@pytest.mark.integration
def test_missing_processes_are_named_at_the_start_deadline():
    # The deadline leaves a loaded machine ample time to start the one server that does come.
    procs = [start([*PSRT, "scheduler", "--bind", "tcp://127.0.0.1:*", "--servers", "2", "--workers", "2",
                    "--timeout", "6"], ready=SCHEDULER_READY)]
    try:
        endpoint = procs[0].wait_ready(30).group(1)
        procs.append(start([*PSRT, "server", "--scheduler", endpoint], env={"PSRT_START_TIMEOUT": "6"}))
        cluster = ClusterConfig(scheduler=endpoint, start_timeout=6)
        with pytest.raises(psrt.ServerError, match=r"missing 1 of 2 servers and 1 of 2 workers"):
            psrt.Client(cluster=cluster)
        assert procs[0].wait(10) == 1
        assert procs[1].wait(10) == 2  # the server was told too, and said why
        assert "did not form" in procs[1].output
    finally:
        stop_children(procs)


@pytest.mark.integration
def test_daemons_by_hand_with_stats_and_metrics(tmp_path):
    procs = [start([*PSRT, "scheduler", "--bind", "tcp://127.0.0.1:*", "--servers", "2", "--workers", "1"],
                   ready=SCHEDULER_READY)]
    try:
        endpoint = procs[0].wait_ready(30).group(1)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs.append(start([*PSRT, "server", "--scheduler", endpoint, "--metrics-port", str(port)],
                           ready=SERVER_READY))
        procs.append(start([*PSRT, "server", "--scheduler", endpoint], ready=SERVER_READY))
        with psrt.Client(scheduler=endpoint) as client:
            assert (client.rank, client.num_workers, len(client.servers)) == (0, 1, 2)
            client.init({"w": np.zeros(10, np.float32)})
            client.push_pull({"w": np.ones(10, np.float32)})
            client.barrier()
            for p in procs[1:]:
                p.wait_ready(30)
            stats = subprocess.run([*PSRT, "stats", endpoint, "--count", "2", "--interval", "0.2"],
                                   capture_output=True, text=True, timeout=30)
            assert stats.returncode == 0, stats.stderr
            assert "pushes" in stats.stdout and "MB/s in" in stats.stdout
            assert sum(client.servers[0] in line or client.servers[1] in line
                       for line in stats.stdout.splitlines()) == 4
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            m = re.search(r'psrt_server_pushes_total\{endpoint="([^"]+)"\} (\d+)\.0', body)
            assert m, body
            holds_w = client.servers.index(m.group(1)) == client.partition.chunks["w"][0].shard
            assert int(m.group(2)) == (1 if holds_w else 0)
        # The worker is done: the scheduler ends the job and every daemon exits cleanly.
        assert [p.wait(15) for p in procs] == [0, 0, 0]
    finally:
        stop_children(procs)


@pytest.mark.integration
def test_psrt_run_takes_roles_from_dmlc_environment():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port), "DMLC_NUM_SERVER": "1",
            "DMLC_NUM_WORKER": "2", "DMLC_NODE_HOST": "127.0.0.1"}
    procs = [start([*PSRT, "run"], env={**base, "DMLC_ROLE": "scheduler"}),
             start([*PSRT, "run"], env={**base, "DMLC_ROLE": "server"})]
    procs += [start([*PSRT, "run", "--", *worker_command("scheduled", steps=2)],
                    env={**base, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(i)}) for i in (1, 0)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
        res = [r for out in outs[2:] for r in parse_results(out)]
        assert sorted(r["rank"] for r in res) == [0, 1]
        assert {r["rank"] for r in res if r["servers"]} == {0, 1}
        assert [r["rank"] for r in res] == [1, 0]  # DMLC_WORKER_ID was honoured
        assert all(r["w0"] == -3.0 for r in res)  # 2 rounds of the averaged gradient (1+2)/2
    finally:
        stop_children(procs)


@pytest.mark.parametrize("env, role, worker_id, workers", [
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "7", "PSRT_NUM_SERVERS": "2"}, "scheduler", None, 4),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "7", "PSRT_NUM_SERVERS": "2"}, "server", None, 4),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "PSRT_NUM_SERVERS": "2"}, "worker", 2, 4),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "DMLC_NUM_SERVER": "1"}, "worker", 1, 2),
    ({"PMI_RANK": "1", "PMI_SIZE": "3", "PSRT_NUM_SERVERS": "1"}, "server", None, 1),
    ({"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "4", "DMLC_NUM_WORKER": "8"}, "worker", 4, 8),
])
def test_roles_from_launcher_environment(env, role, worker_id, workers):
    cfg = ClusterConfig.from_env({**env, "PSRT_SCHEDULER": "tcp://10.0.0.1:5700"})
    assert (cfg.role, cfg.worker_id, cfg.num_workers) == (role, worker_id, workers)


def test_cluster_environment_errors_say_what_to_set():
    with pytest.raises(psrt.ConfigError, match="PSRT_NUM_SERVERS"):
        ClusterConfig.from_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "4"})
    with pytest.raises(psrt.ConfigError, match="DMLC_PS_ROOT_PORT"):
        ClusterConfig.from_env({"DMLC_PS_ROOT_URI": "10.0.0.1"})
    with pytest.raises(psrt.ConfigError, match="PSRT_ROLE"):
        ClusterConfig.from_env({"PSRT_ROLE": "boss"})
    with pytest.raises(psrt.ConfigError, match="PSRT_SCHEDULER"):
        psrt.Client(cluster=ClusterConfig())
    cfg = ClusterConfig.from_env({"DMLC_PS_ROOT_URI": "10.1.2.3", "DMLC_PS_ROOT_PORT": "9000"})
    assert cfg.scheduler == "tcp://10.1.2.3:9000"
