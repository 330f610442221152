"""A checkpoint belongs to the shard's rank, not its address: restarted anywhere, a shard takes back its state."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _helpers import finish_worker, run_workers, start_worker, stop_workers

import psrt
from psrt import wire
from psrt.config import ClientConfig, ServerConfig
from psrt.control.process import SCHEDULER_READY, SERVER_READY, Child, psrt_command
from psrt.partition import PartitionMap
from psrt.shard import checkpoint
from psrt.shard.server import Server
from psrt.shard.store import Store


def saved(directory: Path, prefix: str, value: float, mode: str = "sync", workers: int = 1) -> Path:
    """A checkpoint of one key ``w`` = [value] * 4, at version 3, under ``prefix``."""
    store = Store(mode, workers)
    entry = store.create(("w", 0), np.full(4, value, np.float32), psrt.SGD(lr=0.1))
    entry.version = 3
    return checkpoint.save(store, directory, prefix, {})


def server(directory: Path, **kw: object) -> Server:
    return Server(ServerConfig(bind="tcp://127.0.0.1:*", checkpoint_dir=str(directory), **kw))


def restored_value(s: Server) -> float:
    return float(s.store.entries[("w", 0)].param[0])


def psrt_error(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(psrt_command(*args), capture_output=True, text=True, timeout=60)


# ---------------------------------------------------------------------------------------------- by hand
def test_by_hand_restore_takes_the_directory_s_only_shard_or_the_rank_named(tmp_path):
    saved(tmp_path, checkpoint.file_prefix(3), 3.0)
    s = server(tmp_path, restore=True)  # no --rank: the only shard there, whichever rank it was
    try:
        assert restored_value(s) == 3.0 and s._ckpt.rank == 3
        assert Path(s.checkpoint()).name.startswith("rank-3-")  # and it goes on writing as rank 3
    finally:
        s.close()
    saved(tmp_path, checkpoint.file_prefix(1), 1.0)
    for rank in (1, 3):
        s = server(tmp_path, restore=True, rank=rank)
        try:
            assert restored_value(s) == rank
        finally:
            s.close()


@pytest.mark.integration
def test_by_hand_a_directory_without_this_shard_s_checkpoint_exits_2_naming_what_it_holds(tmp_path):
    saved(tmp_path, checkpoint.file_prefix(1), 1.0)
    saved(tmp_path, checkpoint.file_prefix(3), 3.0)
    serve = ("server", "--bind", "tcp://127.0.0.1:*", "--checkpoint-dir", str(tmp_path), "--restore")
    for extra, advice in (((), "--rank R"), (("--rank", "2"), "no checkpoint of rank 2")):
        proc = psrt_error(*serve, *extra)
        assert proc.returncode == 2, proc
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("psrt: error: "), proc.stderr
        assert "rank 1, rank 3" in lines[0] and advice in lines[0] and str(tmp_path) in lines[0]
        assert "ready" not in proc.stdout


def test_an_empty_directory_is_a_first_run_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, "psrt.checkpoint"):
        s = server(tmp_path / "new", restore=True, rank=2)
    try:
        assert s.restored_from is None and not s.store.entries
        assert any("starts fresh" in r.getMessage() for r in caplog.records)
    finally:
        s.close()


def test_two_running_shards_never_write_the_same_rank(tmp_path):
    first = server(tmp_path)
    try:
        with pytest.raises(checkpoint.CheckpointError, match=f"pid {os.getpid()}.*rank 0.*--rank R"):
            server(tmp_path)
        server(tmp_path, rank=1).close()  # another rank is fine
    finally:
        first.close()
    server(tmp_path).close()  # once the first let go, rank 0 is free again


def test_an_older_psrt_s_endpoint_named_checkpoint_is_restored_and_then_replaced(tmp_path):
    old = saved(tmp_path, checkpoint.endpoint_prefix("tcp://127.0.0.1:5701"), 7.0)
    s = server(tmp_path, restore=True)
    try:
        assert restored_value(s) == 7.0 and s._ckpt.rank == 0
        new = Path(s.checkpoint())
        assert new.name.startswith("rank-0-") and not old.exists()
        assert checkpoint.holdings(tmp_path) == {"rank-0": 1}
    finally:
        s.close()


# ---------------------------------------------------------------------------------------------- the W warning
def test_the_restore_warning_compares_with_the_job_the_scheduler_gave(tmp_path, caplog):
    saved(tmp_path, checkpoint.file_prefix(0), 1.0, workers=2)
    for job_workers, warned in ((2, False), (3, True)):
        s = Server(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, checkpoint_dir=str(tmp_path),
                                restore=True), scheduled=True)
        try:
            assert s.checkpoint_claim() == (0, True)
            caplog.clear()
            with caplog.at_level(logging.WARNING, "psrt.checkpoint"):
                s.join(wire.Table(1, 0, 1, job_workers, "sync", ["tcp://127.0.0.1:1"]))
            warnings = [r.getMessage() for r in caplog.records if "was taken in" in r.getMessage()]
            assert bool(warnings) == warned, warnings
            if warned:
                assert "W=2" in warnings[0] and f"the job (from the scheduler) says sync mode with W={job_workers}" \
                    in warnings[0] and "W=1" not in warnings[0]
            assert (s.store.num_workers, s.config.num_workers, restored_value(s)) == (job_workers, job_workers, 1.0)
        finally:
            s.close()


# ---------------------------------------------------------------------------------------------- scheduler
def _workers(scheduler: str, workers: int, steps: int, plain: bool = False) -> list[subprocess.Popen]:
    return [start_worker("ride", env={"PSRT_SCHEDULER": scheduler, "PSRT_WORKER_ID": str(r)}, servers=None, rank=r,
                         workers=workers, steps=steps, step_s=0.02, plain=plain) for r in range(workers)]


@pytest.mark.integration
@pytest.mark.parametrize("plain", [False, True], ids=["push_pull", "push_then_pull"])
def test_a_shard_restarted_on_another_endpoint_takes_back_its_rank_and_the_workers_ride_through(tmp_path, plain):
    """SIGKILL of a checkpointing shard in sync training; restarted at once with --restore on a new port. With a
    push then a pull each step, a push is acknowledged as it arrives: the shard may die having taken one worker's
    push of a round and not the other's (psrt.shard.realign keeps every worker losing the same rounds)."""
    workers, steps, every = 2, 150, 5
    sched = Child(psrt_command("scheduler", "--bind", "tcp://127.0.0.1:*", "--servers", "2", "--workers",
                               str(workers)), label="scheduler", ready=SCHEDULER_READY)
    children = [sched]
    procs: list[subprocess.Popen] = []
    try:
        scheduler = sched.wait_ready(30).group(1)
        serve = ("server", "--scheduler", scheduler, "--checkpoint-dir", str(tmp_path), "--checkpoint-every",
                 str(every))  # both shards in one directory; each binds an ephemeral port
        children += [Child(psrt_command(*serve), label=f"shard {i}", ready=SERVER_READY) for i in range(2)]
        procs = _workers(scheduler, workers, steps, plain)
        ready = [c.wait_ready(30) for c in children[1:]]
        for p in procs:
            assert p.stdout.readline().strip() == "training"
        # The shard holding w (smaller than a partition: one shard has it all).
        shape = ((workers * steps,), np.dtype(np.float32))
        (chunk,) = PartitionMap(2, ClientConfig().partition_bytes).add({"w": shape})
        victim = next(i for i, m in enumerate(ready) if f"rank={chunk.shard}" in m.string) + 1
        old = ready[victim - 1].group(1)
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob(f"rank-{chunk.shard}-*")) and time.monotonic() < deadline:
            time.sleep(0.05)  # its first checkpoint (before one, a restart would have nothing to take back)
        time.sleep(0.3)  # and some rounds after it, to lose
        children[victim].signal(signal.SIGKILL)
        children[victim].wait(10)
        restarted = Child(psrt_command(*serve, "--restore"), label="restarted", ready=SERVER_READY)
        children.append(restarted)
        again = restarted.wait_ready(30)
        assert f"rank={chunk.shard}" in again.string and again.group(1) != old
        results = []
        for p in procs:
            result, err = finish_worker(p)
            assert f"moved from {old} to {again.group(1)}" in err, err
            results.append(result)
        assert sched.wait(30) == 0, sched.output
    finally:
        stop_workers(procs)
        for c in children:
            c.stop()
    assert f"rejoined the job (was {old})" in sched.output, sched.output
    assert "was taken in" not in restarted.output, restarted.output  # W=2 is the job's W: no false warning
    lost = results[0]["lost"]["0"]
    for res in results:
        counts = res["counts"]
        assert set(counts) <= {"0.0", "-1.0"}, counts  # never -2: no push applied twice
        assert counts.get("0.0", 0) + counts["-1.0"] == workers * steps
        # Exactly the rounds since the checkpoint are lost: the same steps of every worker, a run that starts at
        # a multiple of the checkpoint interval and lasts at most one interval.
        assert all(res["lost"][str(r)] == lost for r in range(workers)), res
        assert lost == list(range(lost[0], lost[0] + len(lost))) if lost else True
        assert not lost or (lost[0] % every == 0 and len(lost) <= every), lost
        assert res["max_gap"] < 15.0, res  # heartbeat timeout + restart; a generous "does not hang" bound
    print(f"restart on another endpoint: {len(lost)} rounds lost, longest step "
          f"{max(r['max_gap'] for r in results):.2f}s")


@pytest.mark.integration
def test_a_checkpoint_of_tensors_cut_for_a_network_is_restored_by_workers_on_the_shards_host(tmp_path, caplog):
    """Workers across hosts cut a tensor for a network (psrt.partition); its checkpoint, restored where the shards
    are on the workers' host, holds those parts. A client left at PSRT_PIPELINE=auto asks the shard first (an init
    check, which makes nothing) and cuts its first tensors as the restored shard holds them (and every worker would,
    meeting the same shard); one whose cut is set, or whose tensor fits neither cut, is refused with the reason,
    and nothing changes."""
    serve = ("server", "--workers", "1", "--checkpoint-dir", str(tmp_path))
    x = np.arange(1 << 20, dtype=np.float32)  # 4 MB: 16 parts for a network, one for one host
    shard = Child(psrt_command(*serve, "--bind", "tcp://127.0.0.1:*"), label="shard", ready=SERVER_READY)
    restored = None
    try:
        endpoint = shard.wait_ready(30).group(1)
        with psrt.Client([endpoint], config=ClientConfig(pipeline="on")) as c:  # as across hosts
            c.init({"w": x}, optimizer=psrt.SGD(lr=1.0))
            assert len(c.partition.chunks_of(["w"])) == 16
            before = c.push_pull({"w": np.ones_like(x)})["w"].copy()
            c.checkpoint()
        shard.stop()
        restored = Child(psrt_command(*serve, "--bind", endpoint, "--restore"), label="restored",
                         ready=SERVER_READY)
        restored.wait_ready(30)
        with psrt.Client([endpoint], config=ClientConfig(pipeline="off")) as c:
            with pytest.raises(psrt.ServerError, match="checkpoint this shard restored") as refused:
                c.init({"w": x}, optimizer=psrt.SGD(lr=1.0))
            assert refused.value.code == "mismatch" and not c.partition.tensors
            assert c.stats()[0]["keys"] == 16
        with psrt.Client([endpoint]) as c:  # another size: neither cut is taken, and the client's own is refused
            with pytest.raises(psrt.ServerError, match="holds 65536 x float32 but the message has 1048576") as other:
                c.init({"w": np.zeros(2 << 20, np.float32)}, optimizer=psrt.SGD(lr=1.0))
            assert other.value.code == "mismatch" and not c.partition.network and not c.partition.tensors
            assert c.stats()[0]["keys"] == 16  # (the init checks made nothing)
        with caplog.at_level(logging.WARNING, logger="psrt.client"), psrt.Client([endpoint]) as c:
            assert not c.partition.network  # loopback endpoints: cut for one host ...
            got = c.init({"w": x}, optimizer=psrt.SGD(lr=1.0))["w"]
            assert c.partition.network and len(c.partition.chunks_of(["w"])) == 16  # ... as the shard holds it
            np.testing.assert_array_equal(got, before)
            np.testing.assert_array_equal(c.push_pull({"w": np.ones_like(x)})["w"], before - 1)
            np.testing.assert_array_equal(c.pull(["w"])["w"], before - 1)
            assert c.stats()[0]["keys"] == 16
        assert "cut for a network (restored from a checkpoint" in caplog.text, caplog.text
    finally:
        for child in (shard, restored):
            if child is not None:
                child.stop()


@pytest.mark.integration
def test_a_restarted_server_cannot_take_the_slot_of_a_live_one(tmp_path):
    sched = Child(psrt_command("scheduler", "--bind", "tcp://127.0.0.1:*", "--servers", "1", "--workers", "1"),
                  label="scheduler", ready=SCHEDULER_READY)
    children = [sched]
    procs: list[subprocess.Popen] = []
    try:
        scheduler = sched.wait_ready(30).group(1)
        serve = ("server", "--scheduler", scheduler, "--checkpoint-every", "5")
        live = tmp_path / "live"
        children.append(Child(psrt_command(*serve, "--checkpoint-dir", str(live)), label="shard", ready=SERVER_READY))
        procs = _workers(scheduler, 1, 400)
        endpoint = children[1].wait_ready(30).group(1)
        assert procs[0].stdout.readline().strip() == "training"
        deadline = time.monotonic() + 30
        while not list(live.glob("rank-0-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        # In the live shard's directory: its lock says at once that rank 0 is taken.
        proc = psrt_error(*serve, "--checkpoint-dir", str(live), "--restore")
        assert proc.returncode == 2 and "another running shard" in proc.stderr and "rank 0" in proc.stderr, proc
        # With a copy of its checkpoint elsewhere: the scheduler refuses, naming the live server.
        copy = tmp_path / "copy"
        copy.mkdir()
        newest = max(live.glob("rank-0-*"))
        (copy / newest.name).write_bytes(newest.read_bytes())
        proc = psrt_error(*serve, "--checkpoint-dir", str(copy), "--restore")
        assert proc.returncode == 2, proc
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith("psrt: error: ") and "rank_alive" in line, proc.stderr
        assert f"server 0 ({endpoint}) is alive" in line, proc.stderr
        assert finish_worker(procs[0])[0]["counts"] == {"-1.0": 400}  # the job goes on, untouched
        assert sched.wait(30) == 0, sched.output
    finally:
        stop_workers(procs)
        for c in children:
            c.stop()


def _job(directory: Path, steps: int, restore: bool) -> dict:
    """A whole job: scheduler, 2 shards checkpointing into ``directory`` (only at their clean shutdown), one
    worker that takes ``steps`` SGD-momentum steps; returns what the worker saw."""
    sched = Child(psrt_command("scheduler", "--bind", "tcp://127.0.0.1:*", "--servers", "2", "--workers", "1"),
                  label="scheduler", ready=SCHEDULER_READY)
    children = [sched]
    try:
        scheduler = sched.wait_ready(30).group(1)
        serve = ("server", "--scheduler", scheduler, "--checkpoint-dir", str(directory)) + (("--restore",) * restore)
        children += [Child(psrt_command(*serve), label=f"shard {i}", ready=SERVER_READY) for i in range(2)]
        (seen,) = run_workers("momentum", [dict(steps=steps)], env={"PSRT_SCHEDULER": scheduler})
        assert sched.wait(30) == 0, sched.output
        for c in children[1:]:
            assert c.wait(30) == 0, c.output
            assert "final checkpoint" in c.output, c.output
        return seen
    finally:
        for c in children:
            c.stop()


@pytest.mark.integration
def test_a_finished_job_restarted_from_its_final_checkpoints_resumes_exactly(tmp_path):
    first = _job(tmp_path, 3, restore=False)
    # SGD lr=0.5, momentum=0.5 (torch semantics, W=1): buf = 0.5 buf + g; p -= 0.5 buf. Exact in binary.
    expected = {}
    for name, g in (("a", 1.0), ("b", 2.0)):
        p, buf, trace = 0.0, 0.0, []
        for _ in range(5):
            buf = 0.5 * buf + g
            p -= 0.5 * buf
            trace.append(p)
        expected[name] = trace
        assert first[name] == [0.0, trace[2], True]
    assert set(checkpoint.holdings(tmp_path)) == {"rank-0", "rank-1"}
    # The same job again from the same directory: each shard restores its rank, with the momentum buffers.
    second = _job(tmp_path, 2, restore=True)
    for name in ("a", "b"):
        assert second[name] == [expected[name][2], expected[name][4], True]


@pytest.mark.integration
def test_a_standalone_shard_that_hangs_keeps_its_connections_and_is_waited_for(caplog):
    """A shard without a scheduler stopped (SIGSTOP: swapped out, a debugger, a frozen VM) while both workers of a
    sync round wait on it, for longer than a ZMTP heartbeat timeout would have allowed (10 s, past which ZeroMQ
    dropped the connections and the clients sent everything again). Its kernel still acknowledges what the workers
    send, so their connections live (psrt's liveness is the kernel's acknowledgement, not a pong the stopped
    process cannot send); once it runs again it answers them: every round is exact (-k after round k, the mean of
    two pushes of 1 with SGD lr=1), every push applied once, counted by the shard, and nothing was sent again."""
    shard = Child(psrt_command("server", "--bind", "tcp://127.0.0.1:*", "--workers", "2", "--mode", "sync"),
                  label="shard", ready=SERVER_READY)
    steps, waiting = 6, threading.Event()
    reads: dict[int, list[float]] = {}

    def train(rank: int) -> None:
        with psrt.Client([endpoint], rank=rank, num_workers=2, config=ClientConfig(timeout=60)) as c:
            c.init({"w": np.zeros(1 << 18, np.float32)}, optimizer=psrt.SGD(lr=1.0))
            got = []
            for step in range(steps):
                if step == 3:
                    if rank == 0:
                        waiting.set()  # its push of round 4 goes out, and waits for worker 1's
                    else:
                        hung.wait(30)  # worker 1 pushes round 4 while the shard is stopped
                got.append(float(c.push_pull({"w": np.ones(1 << 18, np.float32)})["w"][0]))
            reads[rank] = got

    try:
        endpoint = shard.wait_ready(30).group(1)
        hung = threading.Event()
        threads = [threading.Thread(target=train, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        assert waiting.wait(30)
        time.sleep(0.2)
        shard.signal(signal.SIGSTOP)
        hung.set()
        time.sleep(13.0)  # past the 10 s a ZMTP heartbeat timeout allowed
        shard.signal(signal.SIGCONT)
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a worker still waits on the shard"
        assert reads == {r: [-float(k) for k in range(1, steps + 1)] for r in (0, 1)}, reads
        assert not any("sending again" in rec.getMessage() for rec in caplog.records), caplog.text
    finally:
        shard.signal(signal.SIGCONT)
        shard.stop()
    assert re.search(r"pushes=12 pulls=\d+ rounds=6 errors=0", shard.output), shard.output
