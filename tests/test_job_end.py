"""How a job ends: a training script that raises (or exits, or just returns) ends its process and the job promptly
with its code; a worker that finishes early in a sync job is named to the others; nothing psrt starts keeps a
process alive.

Real jobs on loopback: a ``psrt scheduler``, a ``psrt server`` and worker processes (``tests/_workers.py crash``),
or ``psrt launch``; and the scheduler's words to its peers, with the scheduler on a thread.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
from _helpers import LIVENESS, NAMED_WITHIN_S, NEWS_HELD_S, bound, scheduling, worker_command

import psrt
from psrt import wire
from psrt.config import ClientConfig
from psrt.control.link import SchedulerLink
from psrt.control.process import SCHEDULER_READY, Child, stop_children

PSRT = [sys.executable, "-m", "psrt.cli"]
#: A worker's end reaches the others, by the design, once the scheduler has held the news (NEWS_HELD_S) and the
#: notice has passed the polls of a heartbeat interval; the bound allows a loaded host, capped by the issue's
#: "named within 5 s".
TOLD_WITHIN_S = bound(NEWS_HELD_S + LIVENESS.heartbeat_interval, NAMED_WITHIN_S)


class Job:
    """A scheduler, one server and W crash workers started by hand, as a multi-host job would be."""

    def __init__(self, workers: int, how: str, mode: str = "sync", tensors: str = "dense", steps: int = 1000) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PSRT_TIMEOUT": "60"}
        self.children: list[Child] = []
        self.scheduler = self._start([*PSRT, "scheduler", "--bind", "tcp://127.0.0.1:*", "--servers", "1",
                                      "--workers", str(workers), "--mode", mode, "--timeout", "60"], env)
        endpoint = self.scheduler.wait_ready(30).group(1)
        env["PSRT_SCHEDULER"] = endpoint
        self.server = self._start([*PSRT, "server", "--scheduler", endpoint], env)
        self.workers = [self._start(worker_command("crash", steps=steps, how=how, tensors=tensors),
                                    {**env, "PSRT_WORKER_ID": str(r)}) for r in range(workers)]

    def _start(self, cmd: list[str], env: dict[str, str]) -> Child:
        ready = SCHEDULER_READY if "scheduler" in cmd else None
        self.children.append(Child(cmd, env=env, **({"ready": ready} if ready else {})))
        return self.children[-1]

    def close(self) -> None:
        stop_children(self.children, grace=0.0)


@pytest.fixture
def job():
    jobs: list[Job] = []

    def start(*args, **kw) -> Job:
        jobs.append(Job(*args, **kw))
        return jobs[-1]

    yield start
    for j in jobs:
        j.close()


def _waited(child: Child, timeout: float) -> tuple[int, float]:
    start = time.monotonic()
    code = child.wait(timeout)
    return code, time.monotonic() - start


@pytest.mark.integration
@pytest.mark.parametrize("what", ["raise", "raise-with", "raise-with-torch", "exit-7"])
def test_a_script_that_fails_ends_its_process_and_the_job_promptly(job, what):
    # Worker 1 fails after 3 steps: with its client left open (raise, exit-7), or inside `with psrt.Client()`, or
    # inside `with psrt.torch.DistributedOptimizer(...)`.
    if what == "raise-with-torch":
        pytest.importorskip("torch")
    j = job(2, f"1:3:{what}")
    code, took = _waited(j.workers[1], 30)
    assert code == (7 if what == "exit-7" else 1), j.workers[1].output
    if what.startswith("raise"):
        assert "RuntimeError: user bug in the training script" in j.workers[1].output
    # The other worker, waiting for a round worker 1 never pushes, is told at once, naming it (and how it raised:
    # not that it finished); so is everyone.
    code0, took0 = _waited(j.workers[0], 10)
    assert code0 != 0 and "PeerFailedError" in j.workers[0].output and "worker 1" in j.workers[0].output, \
        j.workers[0].output
    if what.startswith("raise"):
        assert "failed: RuntimeError: user bug in the training script" in j.workers[0].output, j.workers[0].output
    assert j.scheduler.wait(10) != 0 and j.server.wait(10) != 0
    print(f"{what}: worker 1 exited {took:.2f}s after the start, worker 0 {took0:.2f}s after it")
    assert took0 < TOLD_WITHIN_S
    # The user's traceback starts at the user's line, not in psrt's close().
    assert "in close" not in j.workers[0].output and "in __exit__" not in j.workers[0].output, j.workers[0].output


@pytest.mark.integration
def test_a_script_that_returns_without_closing_its_client_exits_and_says_done(job):
    j = job(1, "0:5:return")
    code, took = _waited(j.workers[0], 20)
    assert code == 0, j.workers[0].output
    assert took < 10.0
    assert j.scheduler.wait(10) == 0 and j.server.wait(10) == 0  # its client said done: the job ended cleanly


@pytest.mark.integration
@pytest.mark.parametrize("tensors", ["dense", "rows"])
def test_a_worker_that_finishes_early_in_a_sync_job_is_named_to_the_others(job, tensors):
    j = job(2, "1:4:finish", tensors=tensors)
    assert j.workers[1].wait(20) == 0
    finished_at = time.monotonic()
    code, _ = _waited(j.workers[0], 20)
    took = time.monotonic() - finished_at
    out = j.workers[0].output
    assert code != 0 and "PeerFailedError" in out and "worker 1 finished" in out and "--elastic" in out, out
    print(f"{tensors}: the early finish named to worker 0 after {took:.2f}s")
    assert took < TOLD_WITHIN_S
    assert "ShardTimeoutError" not in out


@pytest.mark.integration
def test_in_ssp_a_finished_worker_does_not_hold_the_others_back(job):
    j = job(2, "1:4:finish", mode="ssp", steps=40)
    assert j.workers[1].wait(20) == 0
    assert j.workers[0].wait(60) == 0, j.workers[0].output
    assert "done 40" in j.workers[0].output


@pytest.mark.integration
@pytest.mark.parametrize(("what", "code"), [("raise", 1), ("exit-3", 3)])
def test_launch_exits_with_the_failing_workers_code(what, code):
    start = time.monotonic()
    proc = subprocess.run([*PSRT, "launch", "-s", "1", "-w", "2", "--", *worker_command("crash", steps=1000,
                                                                                         how=f"1:3:{what}")],
                          capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert f"psrt launch: worker 1 exited with code {code}" in proc.stdout, proc.stdout
    print(f"psrt launch returned {code} {took:.2f}s after it started")
    assert took < 20.0


@pytest.mark.integration
def test_a_normal_job_end_logs_no_dropped_control_message():
    proc = subprocess.run([*PSRT, "launch", "-s", "2", "-w", "3", "--", *worker_command("crash", steps=20)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("done 20") == 3
    assert "departed peer" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------- the scheduler's words
def test_a_registration_is_taken_at_once_and_the_wait_says_the_job_is_forming(caplog):
    with scheduling(1, 2, start_timeout=3.0) as sched:
        ctx = psrt.transport.new_context()
        link = SchedulerLink(ctx, sched.endpoint, warn_after=0.5)
        try:
            with caplog.at_level(logging.WARNING, logger="psrt.scheduler"):
                with pytest.raises(psrt.ServerError, match="did not form"):
                    link.register("worker", timeout=10.0)
        finally:
            link.close()
            ctx.term()
    assert "job forming: 0 of 1 servers and 1 of 2 workers registered" in caplog.text, caplog.text
    assert "is a psrt scheduler running there" not in caplog.text  # it is, and it answered


def _form(links: list[SchedulerLink]) -> None:
    """Register ``links`` at once, as a server and then workers, so that the job forms."""
    roles = [("server", "tcp://127.0.0.1:1")] + [("worker", "")] * (len(links) - 1)
    threads = [threading.Thread(target=link.register, args=(role, ep)) for link, (role, ep) in zip(links, roles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)


def test_the_last_heartbeat_of_a_worker_that_said_done_gets_no_answer():
    with scheduling(1, 2) as sched:
        ctx = psrt.transport.new_context()
        links = [SchedulerLink(ctx, sched.endpoint) for _ in range(3)]
        try:
            _form(links)
            worker = links[1]
            worker.done()
            # As a closing client's heartbeat thread may still send one: nobody listens there any more.
            worker.channel.send(wire.encode_heartbeat(0, "worker", worker.rank, os.getpid()), 1.0)
            assert not worker.channel.poll(0.5)
        finally:
            for link in links:
                link.close()
            ctx.term()


@pytest.mark.parametrize("pause", [0.0, 0.5], ids=["at-once", "after-a-pause"])
def test_a_client_given_the_schedulers_address_as_a_shard_is_told_at_once(pause: float):
    """After a pause the first handshake is done before the first call, and the first send takes it in: the
    client must still count it, or the connection's first drop looks like its first connection."""
    with scheduling(1, 1) as sched:
        # (The cut set: a client left at auto would first send the large tensor's init check, a small message the
        # scheduler answers as the first init's, and this test's second init is about a large message.)
        config = ClientConfig(timeout=30.0, pipeline="off")
        with psrt.Client(servers=[sched.endpoint], config=config) as client:
            time.sleep(pause)
            start = time.monotonic()
            with pytest.raises(psrt.ConfigError, match="is a psrt scheduler, not a shard server"):
                client.init({"w": np.zeros(4, np.float32)})
            assert time.monotonic() - start < 5.0
            # A message over the control plane's frame limit is dropped with the connection, not answered:
            # the client stops resending after a few reconnections instead of waiting its whole timeout.
            start = time.monotonic()
            with pytest.raises(psrt.ConnectionLostError, match="not a psrt shard"):
                client.init({"big": np.zeros(1 << 20, np.float32)})
            assert time.monotonic() - start < 20.0


def test_notices_a_servers_dropped_connection_missed_come_after_its_next_heartbeat():
    """A server whose connection dropped as the scheduler told it news (its socket connecting anew) gets the news
    after its next heartbeat, over the new connection: a membership change mid-job, and the shutdown at the job's
    end, for which the scheduler serves on until it is delivered."""
    with scheduling(1, 2, elastic=True, heartbeat_interval=5.0, heartbeat_timeout=30.0) as sched:
        ctx = psrt.transport.new_context()
        links = [SchedulerLink(ctx, sched.endpoint) for _ in range(3)]
        again: list[SchedulerLink] = []
        try:
            _form(links)
            server, leaving, staying = links

            def reconnected() -> SchedulerLink:
                """The server's process, its connection gone: a new socket, beating as server 0."""
                link = SchedulerLink(ctx, sched.endpoint, heartbeat_interval=5.0, heartbeat_timeout=30.0)
                link.role, link.rank = "server", server.rank
                again.append(link)
                return link

            server.close()
            time.sleep(0.5)  # the scheduler's socket has seen the connection go
            leaving.done()  # an elastic job's members change: the notice finds no connection to the server
            link = reconnected()
            members: list[list[int]] = []
            deadline = time.monotonic() + 10
            while not members and time.monotonic() < deadline:
                link.tick(on_members=members.append)
                time.sleep(0.05)
            assert members == [[staying.rank]]

            link.close()
            time.sleep(0.5)
            staying.done()  # the last worker: the job ends, and the shutdown finds no connection either
            link = reconnected()
            ended = False
            deadline = time.monotonic() + 10
            while not ended and time.monotonic() < deadline:
                ended = link.tick()
                time.sleep(0.05)
            assert ended, "the server never heard the job end"
        finally:
            for link in [*links, *again]:
                link.close()
            ctx.term()
    assert sched.exit_code == 0


def _replicated_pair(sched, ranks: int) -> tuple[list[SchedulerLink], list[tuple[str, str]], list[SchedulerLink], Any]:
    """Form a job of two servers (R = 1: each announces a replication and a standby endpoint) and ``ranks``
    workers, each registered on a link of its own; returns the server links and what each announced in rank order
    (the scheduler ranks servers as they register), the worker links and the context."""
    ctx = psrt.transport.new_context()
    servers = [SchedulerLink(ctx, sched.endpoint, heartbeat_interval=0.5, heartbeat_timeout=30.0) for _ in range(2)]
    announced = [(f"tcp://127.0.0.1:{10 + k}", f"tcp://127.0.0.1:{20 + k}") for k in range(2)]
    workers = [SchedulerLink(ctx, sched.endpoint) for _ in range(ranks)]
    calls = [(s.register, ("server", f"tcp://127.0.0.1:{1 + k}", "", -1, 130.0, False, False, announced[k]))
             for k, s in enumerate(servers)]
    calls += [(w.register, ("worker",)) for w in workers]
    threads = [threading.Thread(target=fn, args=args) for fn, args in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    order = sorted(range(2), key=lambda k: servers[k].rank)
    return [servers[k] for k in order], [announced[k] for k in order], workers, ctx


def _beating(link: SchedulerLink, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            link.tick()
            time.sleep(0.1)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("holder_leaves", [False, True], ids=["reconnects", "holder-said-done"])
def test_a_moved_notice_a_workers_process_missed_comes_after_its_next_heartbeat(holder_leaves: bool):
    """The workers of a process whose heartbeat connection was down when a dead shard's range moved to its replica
    hear where it went after their next heartbeat, over the new connection: also when the worker the notice was
    kept for said done meanwhile (the notice goes once per process, kept for one of its workers)."""
    from psrt.control.link import HeartbeatThread

    # A worker beating every 2.5 s may be silent 2 x 2.5 s (capped at the 4 s timeout) once its connection closed:
    # past the failover of server 0, silent since it registered.
    with scheduling(2, 2, replicas=1, heartbeat_interval=0.5, heartbeat_timeout=4.0) as sched:
        stop = threading.Event()
        servers, announced, workers, ctx = _replicated_pair(sched, 2)
        beats: list[HeartbeatThread] = []
        try:
            _beating(servers[1], stop)  # server 1 heartbeats; server 0 never again
            formed = time.monotonic()
            process = [HeartbeatThread(ctx, sched.endpoint, w.rank, interval=2.5, timeout=30.0) for w in workers]
            beats += process
            # Its connection goes after a beat that came well after server 0's last word.
            deadline = time.monotonic() + 10
            while min(sched._members[("worker", w.rank)].last_seen for w in workers) < formed + 1.0:
                assert time.monotonic() < deadline, "the workers' heartbeat never came"
                time.sleep(0.05)
            for beat in process:
                beat.stop()
            standby = announced[1][1]  # server 1's standby endpoint for range 0

            def holders() -> list[int]:
                """The workers a notice is kept for (read from this thread: a copy of the scheduler's table)."""
                return [rank for (role, rank), m in list(sched._members.items()) if role == "worker" and m.undelivered]

            deadline = time.monotonic() + 10
            while not holders():  # server 0's range moved, and the notice found the process's connection gone
                assert time.monotonic() < deadline and sched.exit_code is None, "no moved notice was kept"
                time.sleep(0.02)
            assert sched.servers[0][1] == standby and len(holders()) == 1  # once per process
            assert all(not beat.moves for beat in process)
            staying = workers
            if holder_leaves:
                holder, = holders()
                next(w for w in workers if w.rank == holder).done()
                staying = [w for w in workers if w.rank != holder]
            again = [HeartbeatThread(ctx, sched.endpoint, w.rank, interval=2.5, timeout=30.0) for w in staying]
            beats += again
            deadline = time.monotonic() + 5
            while not all(beat.moves for beat in again) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [beat.moves for beat in again] == [{0: (standby, True)}] * len(again)
            assert sched.exit_code is None
        finally:
            stop.set()
            for beat in beats:
                beat.stop()
            for link in [*servers, *workers]:
                link.close()
            ctx.term()
