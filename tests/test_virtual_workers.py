"""Virtual workers: ``psrt worker --clients N`` runs N full peers in one process, ``psrt launch --clients N``
starts ceil(W/N) such processes; every worker keeps its own rank, pushes and result line."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections import Counter

import msgpack
import numpy as np
import pytest
import zmq
from _helpers import NAMED_WITHIN_S, launched_results, worker_command

from psrt import wire
from psrt.cluster.launch import worker_copies
from psrt.config import ClusterConfig
from psrt.control.link import HeartbeatThread
from psrt.control.process import psrt_command
from psrt.emulation import loadgen
from psrt.errors import ConfigError, PeerFailedError

PSRT = psrt_command()


@pytest.mark.integration
def test_a_launched_job_of_virtual_workers_ends_exact_and_sees_every_peer():
    proc = subprocess.run([*PSRT, "launch", "-s", "2", "-w", "5", "--clients", "2", "--", *PSRT, "worker",
                           "--model", "64KB", "--steps", "3", "--warmup", "1", "--lr", "0.5"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = launched_results(proc.stdout)
    assert [r["rank"] for r in results] == [0, 1, 2, 3, 4]
    assert all(r["num_workers"] == 5 for r in results)
    # Three processes (2 + 2 + 1 workers), each worker's own line, labelled by the ranks its process hosts.
    assert sorted(Counter(r["pid"] for r in results).values()) == [1, 2, 2]
    for label in ("[workers 0-1]", "[workers 2-3]", "[worker 4]"):
        assert label in proc.stdout
    # Sync SGD: every gradient element is 1e-3, so each of the 4 rounds moves every parameter by lr * 1e-3, the
    # same on every worker to the bit (the shard steps once per round, whatever process its peers live in).
    expected = np.float32(0)
    for _ in range(4):
        expected = expected - np.float32(0.5) * np.float32(1e-3)
    assert {r["param0"] for r in results} == {float(expected)}
    # Every worker pushed each round: the shard counted W peers' pushes, not one per process.
    shard_pushes = sum(int(line.rsplit("pushes=", 1)[1].split()[0]) for line in proc.stdout.splitlines()
                       if "psrt-server stopped" in line)
    assert shard_pushes == 5 * 4


def test_a_job_is_split_into_copies_of_at_most_n_workers():
    assert worker_copies(5, 2) == [(0, 2), (2, 2), (4, 1)]
    assert worker_copies(4, 1) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert worker_copies(1000, 250) == [(0, 250), (250, 250), (500, 250), (750, 250)]
    assert worker_copies(3, 8) == [(0, 3)]


def test_the_number_of_clients_comes_from_the_environment_and_is_checked():
    assert ClusterConfig.from_env({}).clients == 1
    assert ClusterConfig.from_env({"PSRT_CLIENTS": "250"}).clients == 250
    for bad in ("0", "-1", "two"):
        with pytest.raises(ConfigError, match="PSRT_CLIENTS|clients"):
            ClusterConfig.from_env({"PSRT_CLIENTS": bad})
    with pytest.raises(ConfigError, match="--clients must be a whole number of workers >= 1"):
        loadgen.run_worker("64KB", 0, 1, clients=0, servers=["tcp://127.0.0.1:1"])
    with pytest.raises(ConfigError, match="need --workers >= 4"):
        loadgen.run_worker("64KB", 0, 1, clients=2, servers=["tcp://127.0.0.1:1"], rank=2, num_workers=3)


def test_the_first_error_of_the_workers_of_a_process_is_the_one_raised():
    def fails_late() -> dict:
        time.sleep(0.3)
        raise RuntimeError("late")

    def fails_first() -> dict:
        raise ValueError("first")

    with pytest.raises(ValueError, match="first"):
        loadgen._run_together([fails_late, fails_first, lambda: {"rank": 2}])
    assert loadgen._run_together([lambda: {"rank": 0}, lambda: {"rank": 1}]) == [{"rank": 0}, {"rank": 1}]


@pytest.mark.integration
def test_the_worker_command_rejects_a_bad_count_of_clients():
    proc = subprocess.run([*PSRT, "worker", "--model", "64KB", "--clients", "0"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PSRT_SCHEDULER": "tcp://127.0.0.1:1"})
    assert proc.returncode == 2 and "--clients" in proc.stderr and "must be >= 1" in proc.stderr


@pytest.mark.integration
def test_a_virtual_worker_that_raises_ends_its_process_and_the_job():
    start = time.monotonic()
    proc = subprocess.run([*PSRT, "launch", "-s", "1", "-w", "4", "--clients", "2", "--",
                           *worker_command("virtual_crash", fail_rank=1)], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "psrt launch: workers 0-1 exited with code 1" in proc.stdout, out
    assert "RuntimeError: worker 1 fails on purpose" in out
    print(f"psrt launch returned 1 {took:.2f}s after it started")
    assert took < 20.0


@pytest.mark.integration
def test_a_virtual_worker_that_goes_silent_is_named_to_the_others_while_its_process_lives():
    """One of three workers of a process stops heartbeating (its process and its siblings go on): the scheduler
    judges each rank's silence on its own, even when one message carries the process's beats."""
    proc = subprocess.run([*PSRT, "launch", "-s", "1", "-w", "3", "--clients", "3", "--",
                           *worker_command("virtual_vanish", vanish_rank=1)], capture_output=True, text=True,
                          timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    vanished_at = float(out.split("vanished ", 1)[1].split()[0])
    survivors = [r for r in launched_results(proc.stdout) if r["rank"] in (0, 2)]
    assert sorted(r["rank"] for r in survivors) == [0, 2], out
    for r in survivors:
        assert r["error"] == "PeerFailedError" and "worker 1 " in r["message"], r
        assert "stopped heartbeating" in r["message"], r
        print(f"worker {r['rank']} heard of worker 1 {r['at'] - vanished_at:.2f}s after it went silent")
        assert r["at"] - vanished_at < NAMED_WITHIN_S, r


def _heartbeat_threads() -> int:
    return sum(t.name == "psrt-heartbeat" and t.is_alive() for t in threading.enumerate())


def test_the_workers_of_a_process_beat_in_one_message_from_one_thread_and_hear_their_own_news():
    """Three workers' heartbeats to one scheduler (a bare ROUTER here): one thread, one socket, one ``beats`` per
    interval naming all three; a ``not_members`` reply fails only the ranks it names; an abort fails the rest."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    before = _heartbeat_threads()
    beats = [HeartbeatThread(None, endpoint, rank, interval=0.2, timeout=30.0) for rank in (4, 7, 9)]
    try:
        assert _heartbeat_threads() == before + 1
        senders, seen = set(), set()
        deadline = time.monotonic() + 10
        while seen != {4, 7, 9} and time.monotonic() < deadline:
            if router.poll(1000):
                identity, frame = router.recv_multipart()
                header = msgpack.unpackb(frame)
                assert header["op"] == "beats" and header["pid"] == os.getpid(), header
                senders.add(identity)
                seen = set(header["ranks"])
        assert seen == {4, 7, 9} and len(senders) == 1
        (identity,) = senders
        router.send_multipart([identity, *wire.encode_not_members(0, [7], "worker 7 left the job")])
        deadline = time.monotonic() + 10
        while beats[1].failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(PeerFailedError, match="no longer counts worker 7"):
            beats[1].check()
        beats[0].check(), beats[2].check()  # the others are unaffected
        # Rank 7 is no longer named in the beats that follow (one may have left before the reply came).
        ranks = [4, 7, 9]
        deadline = time.monotonic() + 10
        while 7 in ranks and time.monotonic() < deadline:
            if router.poll(1000):
                identity, frame = router.recv_multipart()
                ranks = sorted(msgpack.unpackb(frame)["ranks"])
        assert ranks == [4, 9]
        router.send_multipart([identity, *wire.encode_abort("peer_failed", "worker 3 died")])
        deadline = time.monotonic() + 10
        while beats[2].failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        for b in (beats[0], beats[2]):
            with pytest.raises(PeerFailedError, match="worker 3 died"):
                b.check()
        # The aborted thread ended; a worker that comes later beats from a fresh one.
        deadline = time.monotonic() + 10
        while _heartbeat_threads() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        beats.append(HeartbeatThread(None, endpoint, 11, interval=0.2, timeout=30.0))
        ranks = []
        deadline = time.monotonic() + 10
        while ranks != [11] and time.monotonic() < deadline:
            if router.poll(1000):
                fresh, frame = router.recv_multipart()
                ranks = msgpack.unpackb(frame)["ranks"]
        assert ranks == [11] and fresh != identity
        beats[-1].check()
    finally:
        for b in beats:
            b.stop()
        router.close()
        ctx.term()
    assert _heartbeat_threads() == before  # the thread ends with its last worker


def test_a_worker_that_fails_in_a_fixed_job_fails_the_other_workers_of_its_process_at_once():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    beats = [HeartbeatThread(None, endpoint, rank, interval=0.2, timeout=30.0) for rank in (0, 1)]
    try:
        beats[0].stop(failure="RuntimeError: boom")
        with pytest.raises(PeerFailedError, match=r"worker 0 \(in this process\) failed: RuntimeError: boom"):
            beats[1].check()
    finally:
        for b in beats:
            b.stop()
        router.close()
        ctx.term()


def test_running_out_of_sockets_says_which_limit_and_what_to_change():
    from psrt import transport
    from psrt.errors import ResourceLimitError

    ctx = transport.new_context()
    ctx.set(zmq.MAX_SOCKETS, 2)  # a DEALER and its handshake monitor take three
    try:
        with pytest.raises(ResourceLimitError, match=r"Too many open files.*ulimit -n.*--clients") as info:
            transport.DealerChannel(ctx, "tcp://127.0.0.1:1", hwm=10)
        assert isinstance(info.value, OSError)
    finally:
        ctx.term()


def test_a_process_of_many_workers_raises_its_soft_open_file_limit():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip("the hard limit leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        loadgen._allow_open_files()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] in (hard, 256 if hard == resource.RLIM_INFINITY else hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
