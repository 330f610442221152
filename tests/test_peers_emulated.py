"""``bench/peers.py --emulated``: psrt and its peers with every process on an emulated host of its own.

The end-to-end tests need root, iproute2 and unshare (network namespaces, tc); the torch row needs torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import peers  # noqa: E402  (bench/ is not a package: its scripts import each other by path)

from psrt.emulation.perfmodel import TCP_OVERHEAD  # noqa: E402
from psrt.worker.pacing import JOINED, PACED, Pacing  # noqa: E402

needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None or shutil.which("unshare") is None,
    reason="needs root, iproute2 and unshare for network namespaces")


def test_link_floor_is_the_shard_links_payload_at_the_link_rate():
    # 1M float32 (4 MB), W = 4, S = 2: each shard link carries 4 * 2 MB in and as much out per step.
    floor = peers.link_floor(1_000_000, 4, 2, 1e9)
    assert floor["shard_bytes_per_step"] == 8e6
    assert floor["step_s"] == pytest.approx(8e6 * 8 * TCP_OVERHEAD / 1e9)  # in and out overlap: full duplex
    assert floor["rate"] == pytest.approx(4 / floor["step_s"])  # about 59.8 worker-steps/s
    assert floor["serialized_step_s"] == pytest.approx(2 * floor["step_s"])
    assert floor["serialized_rate"] == pytest.approx(floor["rate"] / 2)
    # Ten times the link, ten times the floor; twice the shards, half of each link's bytes.
    assert peers.link_floor(1_000_000, 4, 2, 1e10)["rate"] == pytest.approx(10 * floor["rate"])
    assert peers.link_floor(1_000_000, 4, 4, 1e9)["rate"] == pytest.approx(2 * floor["rate"])


@pytest.mark.integration
@pytest.mark.parametrize("args, message", [
    (["--link", "1gbit"], "--link applies only with --emulated"),
    (["--emulated", "--link", "fast"], "is not a rate such as 1gbit"),
    (["--emulated", "--systems", "psrt-tuned"], "subset of psrt,psrt-whole,torch,ray,zmq with --emulated"),
    (["--emulated", "--torch-transport", "tcp"], "--emulated always limits TensorPipe to TCP"),
])
def test_emulated_options_are_checked(args, message):
    proc = subprocess.run([sys.executable, str(BENCH / "peers.py"), *args], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr.splitlines()[-1]


def namespaces_of(pid: int) -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(f"psrt{pid}-")]


def pids_in(namespace: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10).stdout.split()


@pytest.mark.integration
@needs_namespaces
def test_emulated_psrt_and_torch_cross_the_links_and_train_correctly(tmp_path):
    """psrt (cut for the network: 1 MiB in 8 pieces, 4 on each shard, a message each in a paced call, joined two
    to a message in one sent at once, as the client's pacing schedule has it), psrt-whole (``PSRT_PIPELINE=off``: a
    piece per shard) and torch RPC, each over the shaped links, each exact."""
    pytest.importorskip("torch")
    out = tmp_path / "emulated.json"
    proc = subprocess.Popen([sys.executable, str(BENCH / "peers.py"), "--emulated", "--link", "1gbit",
                             "--elements", "256K", "--workers", "2", "--servers", "2", "--steps", "3",
                             "--systems", "psrt,psrt-whole,torch", "--timeout", "120", "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.communicate(timeout=280)[0]
    assert proc.returncode == 0, output[-4000:]
    assert namespaces_of(proc.pid) == [], "the emulated hosts were not removed"
    report = json.loads(out.read_text())
    assert report["mode"] == "emulated" and report["link_bits"] == 10**9
    (workload,) = report["workloads"]
    elements, steps = 256 << 10, 3
    assert (workload["workload"]["elements"], workload["workload"]["workers"]) == (elements, 2)
    floor = peers.link_floor(elements, 2, 2, 1e9)
    assert workload["floor"] == pytest.approx(floor)
    assert list(workload["systems"]) == ["psrt", "psrt-whole", "torch"]
    schedule, paced = Pacing(), 0
    for step in range(steps + 1):  # the warm-up call and the timed ones, as the client's schedule has them
        way = schedule.way("k")
        schedule.ended("k", way, float(step))
        paced += {PACED: 4, JOINED: 2}[way]
    for name, per_worker in (("psrt", paced), ("psrt-whole", steps + 1)):  # each shard's messages, per worker
        served = re.findall(r"pushes=(\d+)", workload["systems"][name]["detail"])
        assert served == [str(2 * per_worker)] * 2, (name, workload["systems"][name]["detail"])
    for name, row in workload["systems"].items():
        assert row["status"] == "ok", row["message"]
        assert row["check_ok"] is True and row["max_err"] <= row["tol"]
        assert row["rate"] > 0 and row["to_floor"] == pytest.approx(row["rate"] / floor["rate"])
        assert row["to_serialized_floor"] == pytest.approx(row["rate"] / floor["serialized_rate"])
        # Every worker's pushes and pulled parameters crossed the shard hosts' shaped links (warm-up included).
        links = row["shard_link_bytes"]
        assert set(links) == {"s0", "s1"}
        tensor_bytes = (steps + 1) * 2 * 4 * elements
        assert sum(c["in"] for c in links.values()) >= tensor_bytes, (name, links)
        assert sum(c["out"] for c in links.values()) >= tensor_bytes, (name, links)
        assert f"[{name}] shard links carried (tbf byte counters" in output
    assert workload["psrt_to_best_peer"] == pytest.approx(workload["systems"]["psrt"]["rate"]
                                                          / workload["systems"]["torch"]["rate"])
    assert "plain psrt / the faster peer (torch)" in output


@pytest.mark.integration
@needs_namespaces
def test_the_transport_alone_echoes_every_byte_across_the_links(tmp_path):
    """The ``zmq`` row (the transport's ceiling, not a peer): every echo is what was sent, the bytes crossed the
    shard hosts' shaped links both ways, and it is never taken for the faster peer."""
    out = tmp_path / "emulated.json"
    proc = subprocess.run([sys.executable, str(BENCH / "peers.py"), "--emulated", "--link", "1gbit",
                           "--elements", "256K", "--workers", "2", "--servers", "2", "--steps", "3",
                           "--systems", "psrt,zmq", "--timeout", "120", "--json", str(out)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (workload,) = json.loads(out.read_text())["workloads"]
    row = workload["systems"]["zmq"]
    assert row["status"] == "ok" and row["check_ok"] is True and row["rate"] > 0, row
    tensor_bytes = (3 + 1) * 2 * 4 * (256 << 10)  # warm-up and timed steps, both workers, the whole tensor
    for way in ("in", "out"):
        assert sum(c[way] for c in row["shard_link_bytes"].values()) >= tensor_bytes, row["shard_link_bytes"]
    assert workload["psrt_to_best_peer"] is None and workload["best_peer"] is None
    assert "plain psrt / the transport alone (zmq)" in proc.stdout


@pytest.mark.integration
@needs_namespaces
def test_ctrl_c_stops_the_hosts_processes_and_removes_the_hosts():
    # A terminal's Ctrl-C reaches a process whose SIGINT is not ignored. A suite started in the background by a
    # non-interactive shell (`pytest &` in a script) ignores SIGINT, and a child inherits that; a handler of this
    # process's own while the bench starts leaves the child SIGINT's default instead (exec resets a caught signal).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, str(BENCH / "peers.py"), "--emulated", "--link", "100mbit",
                                 "--elements", "1M", "--workers", "2", "--servers", "1", "--steps", "10000",
                                 "--systems", "psrt", "--timeout", "120"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the workers are starting on their hosts
            if "starting 2 workers" in line:
                break
        time.sleep(2.0)
        inside = [pid for ns in namespaces_of(proc.pid) for pid in pids_in(ns)]
        assert inside, "no process ran on the emulated hosts"
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, rest[-3000:]
    assert "interrupted" in rest
    assert namespaces_of(proc.pid) == []
    assert [pid for pid in inside if os.path.exists(f"/proc/{pid}")] == []
