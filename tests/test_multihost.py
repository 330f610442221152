"""A job spread over several hosts: each process in its own network namespace with its own address.

The namespaces, veth pairs and bridge are created by the test and removed after it. Needs root and iproute2
(CI installs it); skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional

import numpy as np
import pytest
from _helpers import worker_command

from psrt import transport
from psrt.control.process import SERVER_READY, Child, parse_results, psrt_command
from psrt.emulation.netns import VirtualCluster
from psrt.errors import ConfigError
from psrt.partition import PIPELINE_PIECES, PartitionMap, joined
from psrt.worker.pacing import JOINED, PACED, Pacing

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None,
                                 reason="needs root, iproute2 and unshare for network namespaces")]

PSRT = psrt_command()


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout


def standalone_shard(vc: VirtualCluster, endpoint: str, mode: str = "async", env: Optional[dict] = None) -> Child:
    """``psrt server --bind ENDPOINT --workers 1`` on host ``srv`` of ``vc`` (no scheduler), once it is ready."""
    server = vc.spawn("srv", [*PSRT, "server", "--bind", endpoint, "--workers", "1", "--mode", mode],
                      ready=SERVER_READY, env=env)
    server.wait_ready(30)
    return server


def test_job_across_namespaces():
    hosts = ["sched", "srv0", "srv1", "wrk0", "wrk1"]
    with VirtualCluster(hosts) as vc:
        assert all(vc.namespace(h) in namespaces() for h in hosts)
        endpoint = f"tcp://{vc.address('sched')}:5700"
        sched = vc.spawn("sched", [*PSRT, "scheduler", "--bind", endpoint, "--servers", "2", "--workers", "2",
                                   "--timeout", "60"])
        servers = [vc.spawn(h, [*PSRT, "server", "--scheduler", endpoint]) for h in ("srv0", "srv1")]
        workers = [vc.spawn(h, worker_command("scheduled", steps=3), env={"PSRT_SCHEDULER": endpoint})
                   for h in ("wrk0", "wrk1")]
        outs = [p.communicate(timeout=90) for p in workers]
        assert [p.returncode for p in workers] == [0, 0], outs
        res = sorted((r for out in outs for r in parse_results(out)), key=lambda r: r["rank"])
        assert [r["rank"] for r in res] == [0, 1]
        # Each server bound and announced the address of its own namespace, so all traffic crossed the bridge.
        hosts_seen = sorted(ep.split("//")[1].split(":")[0] for ep in res[0]["servers"])
        assert hosts_seen == sorted(vc.address(h) for h in ("srv0", "srv1"))
        assert all(r["w0"] == -4.5 for r in res)  # 3 rounds of the averaged gradient (1+2)/2
        assert [p.wait(30) for p in (sched, *servers)] == [0, 0, 0]
    assert not any(vc.namespace(h) in namespaces() for h in hosts), "namespaces were not removed"
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    assert vc.bridge not in links


#: Each host connects to every other's closed port and prints whether each refused it (it was reached).
_REACH_ALL = """
import socket, sys
reached = 0
for address in sys.argv[1:]:
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect((address, 9))
    except ConnectionRefusedError:
        reached += 1
    except OSError:
        pass
    finally:
        s.close()
print(reached)
"""


def test_every_host_of_a_cluster_larger_than_the_kernels_neighbour_table_reaches_every_other():
    """The kernel's neighbour table is one for all namespaces (``gc_thresh3`` entries, 1,024 by default): hosts
    learning each other's addresses by ARP filled it at 33 hosts all talking, and the later ones reached no one
    (a 49-host job never formed). Each host knows every other's address from the start instead."""
    with open("/proc/sys/net/ipv4/neigh/default/gc_thresh3") as f:
        limit = int(f.read())
    count = next((n for n in range(2, 255) if n * (n - 1) > limit + 16), None)
    if count is None:
        pytest.skip(f"the neighbour table holds {limit} entries: more than 254 hosts fill")
    hosts = [f"h{i}" for i in range(count)]
    with VirtualCluster(hosts) as vc:
        probes = [vc.popen(h, [sys.executable, "-c", _REACH_ALL, *(vc.address(o) for o in hosts if o != h)],
                           stdout=subprocess.PIPE, text=True) for h in hosts]
        reached = [int(p.communicate(timeout=120)[0]) for p in probes]
    assert reached == [count - 1] * count


_TERMINATED = """
import signal, sys, time
from psrt.emulation.netns import VirtualCluster
with VirtualCluster(["a", "b"]) as vc:
    vc.popen("a", ["sleep", "60"])
    print(" ".join(vc.namespace(h) for h in vc.hosts), vc.bridge, flush=True)
    time.sleep(60)
"""


def test_a_process_terminated_with_its_cluster_alive_removes_the_namespaces():
    """SIGTERM (a timeout, a job cancelled) unwinds a bench as Ctrl-C does: its hosts' processes, namespaces and
    bridge are gone when it has exited, not left for the next run to remove; the handler is put back at close."""
    proc = subprocess.Popen([sys.executable, "-c", _TERMINATED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    *names, bridge = proc.stdout.readline().split()
    assert names and all(n in namespaces() for n in names)
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert not any(n in namespaces() for n in names)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    assert bridge not in links
    before = signal.getsignal(signal.SIGTERM)  # (a test runner may have its own handler: left alone)
    with VirtualCluster(["a"]):
        assert (signal.getsignal(signal.SIGTERM) is not before) == (before is signal.SIG_DFL)
    assert signal.getsignal(signal.SIGTERM) is before


_CLOSED_ELSEWHERE = """
import signal, threading, time
from psrt.emulation.netns import VirtualCluster

def close_elsewhere(vc):
    t = threading.Thread(target=vc.close)
    t.start()
    t.join()

close_elsewhere(VirtualCluster(["a"]))  # (no thread but the main one may set a handler: ours stays)
with VirtualCluster(["a"]):  # taken again
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back on the main thread
close_elsewhere(VirtualCluster(["a"]))
print("ready", flush=True)
time.sleep(60)
"""


def test_sigterm_does_what_it_did_before_once_the_last_cluster_was_closed_from_another_thread():
    """The last cluster closed from another thread cannot put the handler back; SIGTERM, when it comes, still ends
    the process as it would have without clusters (not a KeyboardInterrupt the program may catch)."""
    proc = subprocess.Popen([sys.executable, "-c", _CLOSED_ELSEWHERE], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM and "KeyboardInterrupt" not in err, err


def test_a_tensor_crossing_a_network_travels_in_pieces_and_on_one_host_in_one_message():
    """Over a network a split tensor's pieces travel apart, joined two or three to a message for a call that is
    not paced (an async shard's; the shard answers each message as it lands); from the shard's own host, over
    loopback, they share one; the parameters are exact either way."""
    size = 1_000_000  # 4 MB: PIPELINE_PIECES pieces of 250 KB on one shard, two to a message
    pmap = PartitionMap(1, 4 << 20)
    assert len(pmap.add({"w": ((size,), np.dtype(np.float32))})) == PIPELINE_PIECES
    pieces = len(joined(pmap.messages(pmap.chunks_of(["w"]))[0], 4 << 20))
    assert pieces == PIPELINE_PIECES // 2
    with VirtualCluster(["srv", "wrk"]) as vc:
        for where, endpoint in (("wrk", f"tcp://{vc.address('srv')}:5710"), ("srv", "tcp://127.0.0.1:5711")):
            server = standalone_shard(vc, endpoint, env={"PSRT_SHM": "0"})  # sockets, even beside the shard
            probe = vc.spawn(where, worker_command("lane_probe", servers=[endpoint], size=size, steps=3,
                                                   value=2.0), env={"PSRT_SHM": "0"})
            out = probe.communicate(timeout=120)
            assert probe.returncode == 0, out
            messages = 3 * pieces if where == "wrk" else 3
            assert parse_results(out) == [{"first": -6.0, "last": -6.0, "shm_bytes_in": 0, "pushes": messages}]
            assert server.stop() in (0, -15)


def test_pipeline_off_sends_a_tensor_crossing_a_network_in_one_message():
    """``PSRT_PIPELINE=off`` (for links so fast that the shard's CPU is the bottleneck): a worker on another host
    keeps the tensor whole, one message a step, as on the shard's own host; the parameters are exact."""
    size = 1_000_000
    with VirtualCluster(["srv", "wrk"]) as vc:
        endpoint = f"tcp://{vc.address('srv')}:5712"
        server = standalone_shard(vc, endpoint)
        probe = vc.spawn("wrk", worker_command("lane_probe", servers=[endpoint], size=size, steps=3, value=2.0),
                         env={"PSRT_PIPELINE": "off"})
        out = probe.communicate(timeout=120)
        assert probe.returncode == 0, out
        assert parse_results(out) == [{"first": -6.0, "last": -6.0, "shm_bytes_in": 0, "pushes": 3}]
        assert server.stop() in (0, -15)


def test_a_checkpoint_written_on_the_shards_host_is_restored_across_a_network(tmp_path):
    """A job whose worker shared the shard's host cut its 40 MB tensor for one host (10 parts of 4 MB); its
    checkpoint, restored by a shard that workers now reach across a network, holds those parts. A worker left at
    PSRT_PIPELINE=auto asks the shard first, cuts the tensor as the shard holds it, says so, and goes on from the
    restored values; the cut for a network (16 parts of 2.5 MB) leaves no part on the shard (sent and refused
    message by message, its last 6 parts, new keys there, would have been taken)."""
    size = 10_000_000
    serve = ["server", "--workers", "1", "--mode", "sync", "--checkpoint-dir", str(tmp_path),
             "--checkpoint-every", "1"]
    with VirtualCluster(["srv", "wrk"]) as vc:
        local = "tcp://127.0.0.1:5715"
        server = vc.spawn("srv", [*PSRT, *serve, "--bind", local], ready=SERVER_READY)
        server.wait_ready(30)
        probe = vc.spawn("srv", worker_command("lane_probe", servers=[local], size=size, steps=3, value=2.0,
                                               keys=True))
        out = probe.communicate(timeout=120)
        assert probe.returncode == 0, out
        assert [(r["last"], r["keys"]) for r in parse_results(out)] == [(-6.0, 10)]
        assert server.stop() in (0, -15)
        endpoint = f"tcp://{vc.address('srv')}:5716"
        restored = vc.spawn("srv", [*PSRT, *serve, "--bind", endpoint, "--restore"], ready=SERVER_READY)
        restored.wait_ready(30)
        probe = vc.spawn("wrk", worker_command("lane_probe", servers=[endpoint], size=size, steps=3, value=2.0,
                                               keys=True))
        out = probe.communicate(timeout=180)
        assert probe.returncode == 0, out
        # Three more rounds from the restored -6, in the shard's 10 parts and no others.
        assert parse_results(out) == [{"first": -12.0, "last": -12.0, "shm_bytes_in": 0, "pushes": 30, "keys": 10}]
        assert "cut for one host (restored from a checkpoint" in out, out
        assert restored.stop() in (0, -15)


def test_a_message_slower_to_cross_its_link_than_a_heartbeat_timeout_is_not_taken_for_a_dead_connection():
    """A slow or congested link: a tensor kept whole (``PSRT_PIPELINE=off``) takes ~15 s each way over the shard
    host's 1 Mbit/s link (``init`` and its answer, the parameters). Its bytes keep flowing and the peer's kernel
    acknowledges them, so the connection lives: it is neither dropped nor sent again, and the values are exact.
    (ZeroMQ's heartbeat timeout dropped it 10 s after a ping whose answer queued behind the message; sent again,
    the message never got through, and after four tries the client gave up with ConnectionLostError.)"""
    size = 500_000  # 2 MB: ~15 s each way at 1 Mbit/s, longer than a heartbeat interval and timeout (12 s)
    with VirtualCluster(["srv", "wrk"], links={"srv": "1mbit", "wrk": None}, queueing="fifo") as vc:
        endpoint = f"tcp://{vc.address('srv')}:5713"
        server = standalone_shard(vc, endpoint)
        worker = vc.spawn("wrk", worker_command("slow_link", servers=[endpoint], size=size),
                          env={"PSRT_PIPELINE": "off"})
        out = worker.communicate(timeout=240)
        assert worker.returncode == 0, out
        [res] = parse_results(out)
        assert res["exact"], res
        assert res["init_s"] > 2 * 12.0, res  # the premise: each way outlasted a heartbeat interval and timeout
        assert "reconnected" not in out, out
        assert server.stop() in (0, -15)
        assert "errors=0" in server.output, server.output


def test_a_link_cut_for_longer_than_the_transport_waits_is_ridden_through_once_it_is_back():
    """A worker's link cut (its veth down) for longer than :data:`psrt.transport.DEAD_AFTER_S` while it trains
    against a standalone shard: their bytes stay unacknowledged, so both ends drop the connection; once the link is
    back ZeroMQ connects anew and the client sends again what the shard had not answered (a push keeps its sequence
    number, so one the shard applied before its answer was lost is not applied twice). Every push is applied once:
    each step's push moves its own element of the tensor by exactly -1."""
    steps = 30
    with VirtualCluster(["srv", "wrk"]) as vc:
        endpoint = f"tcp://{vc.address('srv')}:5714"
        server = standalone_shard(vc, endpoint, "sync")
        worker = vc.spawn("wrk", worker_command("ride", servers=[endpoint], rank=0, workers=1, steps=steps,
                                                step_s=0.1))
        deadline = time.monotonic() + 60
        while "training" not in worker.output and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "training" in worker.output, worker.output
        subprocess.run(["ip", "link", "set", vc.veth("wrk"), "down"], check=True, timeout=10)
        try:
            time.sleep(transport.DEAD_AFTER_S + 4)
        finally:
            subprocess.run(["ip", "link", "set", vc.veth("wrk"), "up"], check=True, timeout=10)
        out = worker.communicate(timeout=120)
        assert worker.returncode == 0, out
        [res] = parse_results(out)
        assert res["counts"] == {"-1.0": steps}, res  # every push applied once, none lost
        assert res["max_gap"] > transport.DEAD_AFTER_S, res  # the premise: one step waited out the cut
        assert "sending again" in out, out
        assert server.stop() in (0, -15)
        assert f"pushes={steps} " in server.output, server.output


@pytest.mark.parametrize("compression", ["none", "fp16"])
@pytest.mark.parametrize("calls", ["push_pull", "push_then_pull"])
def test_sync_rounds_of_tensors_cut_for_the_network_are_exact(calls, compression):
    """Two shards and two workers, each on its own host: a tensor cut into pieces (and a small tensor beside
    it), with and without fp16 gradients, by push_pull or by push then pull, the blocking calls paced (a piece a
    message) or not (joined) as the client's pacing schedule says. Every read after round k is exactly
    -1.5 k everywhere (the mean of the gradients 1 and 2, SGD lr=1), and each shard counts each message of each
    worker and round."""
    size, steps = 600_000, 4  # 2.4 MB: 18 pieces of 133 KB, 9 on each shard
    pmap = PartitionMap(2, 4 << 20)
    pmap.add({"big": ((size,), np.dtype(np.float32)), "small": ((1000,), np.dtype(np.float32))})
    messages = pmap.messages(pmap.chunks_of(["big", "small"]))
    paced_messages = sum(map(len, messages.values()))
    assert paced_messages == 19 and len(pmap.chunks["big"]) == 18
    two_by_two = sum(len(joined(m, 4 << 20)) for m in messages.values())
    assert two_by_two == 9, "on each shard 3 pairs and a triple, and the small tensor"
    schedule, key = Pacing(), "a set of tensors"
    ways = []
    for step in range(steps):
        ways.append(schedule.way(key))
        schedule.ended(key, ways[-1], float(step))
    assert ways == [JOINED, JOINED, PACED, PACED], "warm-up calls joined, then a trial's first block paced"
    env = {"PSRT_COMPRESSION": "" if compression == "none" else compression}
    with VirtualCluster(["s0", "s1", "w0", "w1"]) as vc:
        endpoints = [f"tcp://{vc.address(h)}:5720" for h in ("s0", "s1")]
        servers = [vc.spawn(h, [*PSRT, "server", "--bind", ep, "--workers", "2", "--mode", "sync"],
                            ready=SERVER_READY) for h, ep in zip(("s0", "s1"), endpoints)]
        for server in servers:
            server.wait_ready(30)
        workers = [vc.spawn(f"w{r}", worker_command("split_steps", servers=endpoints, rank=r, workers=2, size=size,
                                                    steps=steps, calls=calls), env=env) for r in range(2)]
        outs = [w.communicate(timeout=120) for w in workers]
        assert [w.returncode for w in workers] == [0, 0], outs
        for out in outs:
            (res,) = parse_results(out)
            assert res["reads"] == [{n: [-1.5 * k, -1.5 * k, True] for n in ("big", "small")}
                                    for k in range(1, steps + 1)]
            assert res["pushes"] == 2 * sum(paced_messages if w == PACED else two_by_two for w in ways), \
                "a message per piece (paced) or per two (not), per worker and round"
        for server in servers:
            assert "Traceback" not in server.output


def test_each_emulated_host_has_its_own_shared_memory():
    """A worker shares memory with a shard on its own emulated host, never with one on another host."""
    with VirtualCluster(["a", "b"]) as vc:
        endpoint = f"tcp://{vc.address('a')}:5800"
        server = vc.spawn("a", [*PSRT, "server", "--bind", endpoint, "--workers", "1", "--mode", "async"],
                          ready=SERVER_READY)
        server.wait_ready(30)
        got = {}
        for host in ("b", "a"):  # across the bridge first, then beside the shard
            worker = vc.spawn(host, worker_command("lane_probe", servers=[endpoint], size=300_000))
            out = worker.communicate(timeout=60)
            assert worker.returncode == 0, out
            (probe,) = parse_results(out)
            got[host] = (probe["first"], probe["shm_bytes_in"])
        assert got == {"b": (-1.0, 0), "a": (-2.0, 1_200_000)}
        beacons = os.listdir(vc._shm["a"])  # the shard's beacon, on its own host only
        assert len(beacons) == 1 and beacons[0].split("-")[2] == str(server.pid), beacons
        assert os.listdir(vc._shm["b"]) == [] and beacons[0] not in os.listdir("/dev/shm")


def test_leftovers_of_a_crashed_run_are_removed_at_the_next_start():
    dead = 4_000_000  # beyond any live pid here (pid_max is at most 4194304): its owner is surely gone
    while True:
        try:
            os.kill(dead, 0)
            dead -= 1
        except ProcessLookupError:
            break
        except PermissionError:
            dead -= 1
    name = f"psrt{dead}-ghost"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        with VirtualCluster(["a", "b"], link="100mbit") as vc:
            assert name not in namespaces()
            probe = f"import socket; socket.create_connection(('{vc.address('b')}', 9), 2)"
            ping = vc.run("a", [sys.executable, "-c", probe])
            assert "refused" in ping.stderr.lower()  # the link works: b answered with a reset
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def test_shaped_links_carry_the_configured_rate():
    with VirtualCluster(["a", "b"], link="50mbit") as vc:
        assert vc.rate_bits == 50_000_000
        qdisc = subprocess.run(["ip", "netns", "exec", vc.namespace("a"), "tc", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True, timeout=10).stdout
        assert "tbf" in qdisc and "50Mbit" in qdisc


def test_only_the_hosts_given_a_link_are_shaped_and_a_lossless_fifo_cluster_is_set_up_as_said():
    with VirtualCluster(["shard", "workers"], links={"shard": "20mbit", "workers": None}, queueing="fifo",
                        lossless=True, tcp_window=64 << 10) as vc:
        assert vc.rates == {"shard": 20_000_000, "workers": None}
        assert vc.burst_of("shard") == 128 << 10 and vc.burst_of("workers") == 0

        def inside(host: str, *cmd: str) -> str:
            return vc.run(host, list(cmd)).stdout

        qdisc = inside("shard", "tc", "qdisc", "show", "dev", "eth0")
        assert "htb" in qdisc and "bfifo" in qdisc and "tbf" not in qdisc
        outer = subprocess.run(["tc", "qdisc", "show", "dev", vc.veth("shard")], capture_output=True, text=True,
                               timeout=10).stdout
        assert "htb" in outer  # both directions
        assert "htb" not in inside("workers", "tc", "qdisc", "show", "dev", "eth0")  # unshaped
        filters = inside("shard", "tc", "filter", "show", "dev", "eth0")
        assert "flowid 1:2 " in filters  # the bare acknowledgements' class
        for host in ("shard", "workers"):
            route = inside(host, "ip", "route", "show")
            assert "window 65536" in route and "rto_min" in route
            assert inside(host, "sysctl", "-n", "net.ipv4.tcp_early_retrans").strip() == "0"
            assert int(inside(host, "cat", "/sys/class/net/eth0/queues/rx-0/rps_cpus").strip(), 16) != 0
        assert vc.dropped("shard") == 0 and vc.dropped("workers") == 0
        assert vc.retransmitted("workers") >= 0
        probe = f"import socket; socket.create_connection(('{vc.address('workers')}', 9), 2)"
        assert "refused" in vc.run("shard", [sys.executable, "-c", probe]).stderr.lower()  # the link works


def test_cluster_options_are_checked_before_anything_is_made():
    before = namespaces()
    with pytest.raises(ConfigError, match="queueing must be tbf or fifo"):
        VirtualCluster(["a"], link="1gbit", queueing="red")
    with pytest.raises(ConfigError, match="links names hosts that are not in the cluster: b"):
        VirtualCluster(["a"], links={"b": "1gbit"})
    with pytest.raises(ConfigError, match="tcp_window"):
        VirtualCluster(["a"], tcp_window=100)
    assert namespaces() == before
