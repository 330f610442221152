"""Liveness: a process that dies, stops or goes silent is named to every other process within seconds.

Each test runs a real job (``psrt scheduler``, ``psrt server`` and worker processes on loopback), hurts one
process with a signal, and checks who learned what, and when.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from _helpers import LIVENESS, NAMED_AFTER_S, NAMED_WITHIN_S, bound, launched_results, worker_command

from psrt.control.process import RESULT_PREFIX, Child, parse_results, stop_children

pytestmark = pytest.mark.integration

PSRT = [sys.executable, "-m", "psrt.cli"]
#: Every waiting process hears of a death within NAMED_WITHIN_S (the issue's 5 s, the ceiling of what the
#: heartbeat settings allow a loaded host: tests/_helpers.py).
#: The issue's bound on an elastic survivor's longest stall across a death is 8 s; by the design the stall is the
#: time the dead worker takes to be named (the round waits for it until it leaves).
STALL_WITHIN_S = bound(NAMED_AFTER_S, promised_s=8.0)
#: Long enough for the survivors to train on without the dead worker: past its naming, and two beats more.
WITHOUT_IT_S = NAMED_AFTER_S + 2 * LIVENESS.heartbeat_interval
#: Longer than the heartbeat timeout between two calls of a worker (its heartbeat thread keeps it alive).
COMPUTE_S = LIVENESS.heartbeat_timeout + LIVENESS.heartbeat_interval


class Proc:
    """A :class:`psrt.control.process.Child` whose collected output lines are read in order, pattern after pattern."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.child = Child(cmd, env=env)
        self.popen = self.child.proc
        self.seen: list[str] = []

    def expect(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.child.output.splitlines(keepends=True)
            for line in lines[len(self.seen):]:
                self.seen.append(line)
                m = re.search(pattern, line)
                if m:
                    return m
            time.sleep(0.02)
        raise AssertionError(f"no line matching {pattern!r} within {timeout}s; got {self.seen}")

    def exit_code(self, timeout: float) -> int:
        code = self.child.wait(timeout)
        time.sleep(0.05)
        self.seen = self.child.output.splitlines(keepends=True)
        return code

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            self.child.signal(sig)


class Job:
    """A scheduler, S servers and W liveness workers on loopback."""

    def __init__(self, servers: int, workers: int, steps: int = 100_000, step_s: float = 0.01,
                 elastic: bool = False) -> None:
        self.procs: list[Proc] = []
        self.env = env = {**os.environ, "PYTHONUNBUFFERED": "1", "PSRT_TIMEOUT": "30"}
        self.scheduler = self._start([*PSRT, "scheduler", "--bind", "tcp://127.0.0.1:*", "--servers", str(servers),
                                      "--workers", str(workers), "--timeout", "60",
                                      *(["--elastic"] if elastic else [])], env)
        endpoint = self.scheduler.expect(r"psrt-scheduler ready endpoint=(\S+)", 30).group(1)
        env["PSRT_SCHEDULER"] = endpoint
        self.servers = [self._start([*PSRT, "server", "--scheduler", endpoint], env) for _ in range(servers)]
        self.workers = [self.worker(r, steps, step_s) for r in range(workers)]
        for w in self.workers:
            w.expect("^training", 60)

    def worker(self, rank: int, steps: int, step_s: float) -> Proc:
        """Start one more worker process (rank -1: let the scheduler choose)."""
        env = {**self.env, "PSRT_WORKER_ID": str(rank)} if rank >= 0 else self.env
        return self._start(worker_command("liveness", steps=steps, step_s=step_s), env)

    def _start(self, cmd: list[str], env: dict[str, str]) -> Proc:
        p = Proc(cmd, env)
        self.procs.append(p)
        return p

    def close(self) -> None:
        stop_children([p.child for p in self.procs], grace=0.0)

    @staticmethod
    def result(worker: Proc, timeout: float) -> dict:
        (result,) = parse_results(worker.expect("^" + re.escape(RESULT_PREFIX), timeout).string)
        return result


@pytest.fixture
def job():
    jobs: list[Job] = []

    def start(servers: int, workers: int, **kw) -> Job:
        jobs.append(Job(servers, workers, **kw))
        return jobs[-1]

    yield start
    for j in jobs:
        j.close()


def _survivors_named(job: Job, survivors: list[Proc], who: str, killed_at: float) -> None:
    for w in survivors:
        res = Job.result(w, NAMED_WITHIN_S + 5)
        assert res["error"] == "PeerFailedError", res
        assert who in res["message"], res
        print(f"{who}: named to a survivor after {res['at'] - killed_at:.2f}s")
        assert res["at"] - killed_at < NAMED_WITHIN_S, f"named after {res['at'] - killed_at:.1f}s: {res}"
        assert w.exit_code(10) != 0


def test_a_killed_worker_is_named_to_every_process_and_the_job_fails(job):
    j = job(1, 3)
    killed_at = time.time()
    j.workers[2].kill(signal.SIGKILL)
    _survivors_named(j, j.workers[:2], "worker 2", killed_at)
    assert j.scheduler.exit_code(10) != 0
    assert any("worker 2" in line for line in j.scheduler.seen), j.scheduler.seen
    assert j.servers[0].exit_code(10) != 0
    assert any("worker 2" in line for line in j.servers[0].seen), j.servers[0].seen


def test_a_stopped_server_is_named_to_the_workers(job):
    j = job(2, 2)
    # Shard indices follow registration order: read the stopped server's from its ready line.
    rank = j.servers[1].expect(r"psrt-server ready .* rank=(\d+)", 10).group(1)
    stopped_at = time.time()
    j.servers[1].kill(signal.SIGSTOP)
    try:
        _survivors_named(j, j.workers, f"server {rank}", stopped_at)
        assert j.scheduler.exit_code(10) != 0
        assert j.servers[0].exit_code(10) != 0
    finally:
        j.servers[1].kill(signal.SIGKILL)


def test_a_killed_server_is_named_for_its_closed_connection_before_the_heartbeat_timeout(job):
    """A killed process's connection to the scheduler closes at once: it is named after two heartbeat intervals
    of silence, not the heartbeat timeout, and the notice says why."""
    j = job(2, 2)
    rank = j.servers[1].expect(r"psrt-server ready .* rank=(\d+)", 10).group(1)
    killed_at = time.time()
    j.servers[1].kill(signal.SIGKILL)
    for w in j.workers:
        res = Job.result(w, NAMED_WITHIN_S + 5)
        assert res["error"] == "PeerFailedError", res
        assert f"server {rank} (" in res["message"] and "its connection to the scheduler closed" in res["message"], res
        print(f"server {rank} killed: named to a survivor after {res['at'] - killed_at:.2f}s")
        assert res["at"] - killed_at < LIVENESS.heartbeat_timeout, res
        assert w.exit_code(10) != 0
    assert j.scheduler.exit_code(10) != 0
    assert j.servers[0].exit_code(10) != 0


def test_a_dead_scheduler_is_noticed_by_servers_and_workers(job):
    j = job(1, 2)
    killed_at = time.time()
    j.scheduler.kill(signal.SIGKILL)
    _survivors_named(j, j.workers, "scheduler", killed_at)
    assert j.servers[0].exit_code(NAMED_WITHIN_S + 5) != 0
    assert any("scheduler" in line and "heartbeat" in line for line in j.servers[0].seen), j.servers[0].seen


def test_a_healthy_job_is_not_disturbed_by_heartbeats(job):
    """Workers that compute longer than the heartbeat timeout between calls are not taken for dead."""
    j = job(1, 2, steps=2, step_s=COMPUTE_S)  # two calls, each after a silence past the timeout
    for w in j.workers:
        res = Job.result(w, 30)
        assert res["error"] is None and res["steps"] == 2, res
        assert w.exit_code(10) == 0
    assert j.scheduler.exit_code(10) == 0
    assert j.servers[0].exit_code(10) == 0


# ---------------------------------------------------------------------------------------------- elastic
def test_elastic_survivors_ride_through_a_killed_worker_and_a_new_worker_joins(job):
    j = job(2, 3, steps=400, step_s=0.02, elastic=True)
    killed_at = time.time()
    j.workers[2].kill(signal.SIGKILL)
    time.sleep(WITHOUT_IT_S)  # the survivors train on without worker 2
    joiner = j.worker(2, 20, 0.02)  # the dead worker's rank, as a restarted worker would ask
    res_joiner = Job.result(joiner, 60)
    assert res_joiner["error"] is None and res_joiner["rank"] == 2 and res_joiner["steps"] == 20, res_joiner
    # Its init returned the job's current parameters, not its own zeros: it joined a job in progress.
    assert res_joiner["init_w0"] < -1.0, res_joiner
    assert joiner.exit_code(10) == 0
    for w in j.workers[:2]:
        res = Job.result(w, 120)
        assert res["error"] is None and res["steps"] == 400, res
        print(f"elastic: a survivor's longest stall {res['max_gap']:.2f}s")
        assert res["max_gap"] < STALL_WITHIN_S, res
        assert w.exit_code(10) == 0
    assert j.scheduler.exit_code(20) == 0, j.scheduler.seen
    for s in j.servers:
        assert s.exit_code(20) == 0, s.seen
    assert time.time() - killed_at > WITHOUT_IT_S


def test_launch_elastic_rides_through_a_dying_worker():
    proc = subprocess.run([*PSRT, "launch", "--elastic", "-s", "1", "-w", "3", "--",
                           *worker_command("liveness", steps=150, step_s=0.01, die_at="2:20")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PSRT_TIMEOUT": "30"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "worker 2 was killed by signal 9" in proc.stdout and "leaves the elastic job" in proc.stdout, proc.stdout
    # The policy: an elastic job that completed exits 0, and its last line names who left it on the way.
    assert proc.stdout.strip().splitlines()[-1] == ("psrt launch: the elastic job completed; worker 2 (was killed "
                                                    "by signal 9 (SIGKILL)) left it"), proc.stdout
    finished = launched_results(proc.stdout)
    assert [r["rank"] for r in finished] == [0, 1], finished
    assert all(r["error"] is None and r["steps"] == 150 and r["max_gap"] < STALL_WITHIN_S for r in finished), finished


def test_launch_without_elastic_ends_the_job_when_a_worker_dies():
    proc = subprocess.run([*PSRT, "launch", "-s", "1", "-w", "2", "--",
                           *worker_command("liveness", steps=1000, step_s=0.01, die_at="1:10")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stdout + proc.stderr
