"""A process that dies is named before its silence reaches the heartbeat timeout; one that lives is not.

The scheduler watches the connections of its socket: a killed process's kernel closes them at once, and a member
whose connection closed while it was beating on time is dead once silent for two heartbeat intervals
(``psrt/control/scheduler.py``). A process that is stopped keeps its connections, and one whose connection drops
heartbeats again over a new one: neither is named. Real scheduler, shard and worker processes on loopback, in a
replicated job (S=2, W=2, R=1: a dead shard is failed over) where a death does not end the job; and the rule
that a close hurries only a member beating on time, with the scheduler on a thread.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import pytest
from _helpers import LIVENESS, Relay, scheduling

from psrt import transport
from psrt.control.link import SchedulerLink
from psrt.control.process import Child, psrt_command, stop_children
from psrt.errors import PeerFailedError

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import chaos  # noqa: E402  (bench/ is not a package: its scripts import each other by path)

pytestmark = pytest.mark.integration

#: What the scheduler says when a member's connection closed (psrt.control.scheduler._CLOSED).
CLOSED = "its connection to the scheduler closed"
STEPS, STEP_S, HURT_AT = 60, 0.02, 15


class Job:
    """A sync job, S=2 W=2 R=1, of ``bench/_chaos_worker.py momentum`` workers; ``via(endpoint, i)``: the
    scheduler endpoint server i is given."""

    def __init__(self, tmp: str, via: Callable[[str, int], str] = lambda endpoint, i: endpoint) -> None:
        self.children: list[Child] = []
        env = {"PSRT_TIMEOUT": "30", "PSRT_START_TIMEOUT": "30"}
        self.sched = self._spawn(psrt_command("scheduler", "--bind", "tcp://127.0.0.1:*", "--servers", "2",
                                              "--workers", "2", "--mode", "sync", "--replicas", "1", "--timeout",
                                              "60"), env, chaos.re.compile(r"psrt-scheduler ready endpoint=(\S+)"))
        endpoint = self.sched.wait_ready(30).group(1)
        started = [self._spawn(psrt_command("server", "--scheduler", via(endpoint, i)), env, chaos.SERVER_RANK)
                   for i in range(2)]
        self.workers = [self._spawn(chaos.worker_cmd("momentum", STEPS, STEP_S, os.path.join(tmp, f"w{r}.npz")),
                                    {**env, "PSRT_SCHEDULER": endpoint, "PSRT_WORKER_ID": str(r)}, None)
                        for r in range(2)]
        #: Which process started i-th (``via``'s i) serves each rank: they take ranks as they register.
        self.rank_of = [int(s.wait_ready(60).group(2)) for s in started]
        #: The servers by rank.
        self.shards = sorted(started, key=lambda s: self.rank_of[started.index(s)])

    def _spawn(self, cmd: list[str], env: dict[str, str], ready: Optional[chaos.re.Pattern]) -> Child:
        child = Child(cmd, env=env, ready=ready)
        self.children.append(child)
        return child

    def at_step(self, step: int) -> None:
        assert chaos.wait_for_line(self.workers[0], f"step {step}\n", 120) is not None, self.workers[0].tail()

    def finish(self, alive: list[Child]) -> dict[str, Optional[int]]:
        """Wait for the scheduler, the workers and ``alive`` servers to exit; their exit codes."""
        return chaos.wait_all([self.sched, *self.workers, *alive], 120)

    def close(self) -> None:
        stop_children(self.children, grace=0.0)


@pytest.fixture
def job(tmp_path):
    jobs: list[Job] = []

    def start(**kw) -> Job:
        jobs.append(Job(str(tmp_path), **kw))
        return jobs[-1]

    yield start
    for j in jobs:
        j.close()


def _completed(j: Job, codes: dict[str, Optional[int]]) -> None:
    for w in j.workers:
        res = chaos.last_json(w)
        assert res["error"] is None and res["steps"] == STEPS, res
    assert all(c == 0 for c in codes.values()), (codes, j.sched.tail())


def test_a_killed_shard_is_failed_over_well_before_the_heartbeat_timeout(job):
    j = job()
    j.at_step(HURT_AT)
    killed_at = time.monotonic()
    j.shards[0].signal(signal.SIGKILL)
    failed_over = None
    while time.monotonic() - killed_at < 3 * LIVENESS.heartbeat_timeout + 10:
        if chaos.PROMOTED in j.sched.output:
            failed_over = time.monotonic() - killed_at
            break
        time.sleep(0.01)
    assert failed_over is not None, j.sched.tail()
    print(f"shard 0 killed: failed over after {failed_over:.2f}s (heartbeat timeout {LIVENESS.heartbeat_timeout:g}s)")
    (line,) = [ln for ln in j.sched.output.splitlines() if chaos.PROMOTED in ln]
    # Named for its closed connection, not for a silence of the heartbeat timeout.
    assert "server 0" in line and CLOSED in line, line
    assert failed_over < LIVENESS.heartbeat_timeout, line
    _completed(j, j.finish(j.shards[1:]))


def test_a_shard_stopped_past_the_fast_confirmation_is_not_taken_for_dead(job):
    """A stopped process keeps its connections: it is judged by the heartbeat timeout alone, so a stop longer than
    the two heartbeat intervals that confirm a closed connection's death, but under the timeout, fails nothing."""
    j = job()
    j.at_step(HURT_AT)
    stop_s = 2 * LIVENESS.heartbeat_interval + 0.1
    assert stop_s + LIVENESS.heartbeat_interval < LIVENESS.heartbeat_timeout  # the test's premise
    j.shards[0].signal(signal.SIGSTOP)
    time.sleep(stop_s)
    j.shards[0].signal(signal.SIGCONT)
    _completed(j, j.finish(j.shards))
    assert chaos.PROMOTED not in j.sched.output and CLOSED not in j.sched.output, j.sched.tail()


def test_a_live_shard_whose_connection_to_the_scheduler_drops_is_not_taken_for_dead(job):
    """Shard 0 reaches the scheduler through a relay, which closes the connection mid-job: the scheduler sees it
    close, the shard's socket connects anew and heartbeats, and the job goes on to the end with both shards
    (whose notices, the shutdown among them, follow the new connection)."""
    relays: list[Relay] = []

    def via(endpoint: str, i: int) -> str:
        if i:
            return endpoint
        relays.append(Relay(endpoint))
        return relays[0].endpoint

    try:
        j = job(via=via)
        rank = j.rank_of[0]
        j.at_step(HURT_AT)
        relays[0].cut()
        deadline = time.monotonic() + 10
        while relays[0].accepted < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relays[0].accepted == 2, "the shard did not connect again"
        _completed(j, j.finish(j.shards))
        out = j.sched.output
        # The close was seen, and forgiven.
        assert any(f"server {rank} (" in ln and CLOSED in ln for ln in out.splitlines()), j.sched.tail()
        assert chaos.PROMOTED not in out, j.sched.tail()
        # The shutdown reached it over its new connection: it did not end by finding the scheduler silent.
        assert "departed peer" not in out, j.sched.tail()
        assert "psrt: error" not in j.shards[rank].output, j.shards[rank].tail()
    finally:
        for r in relays:
            r.close()


def test_a_member_silent_before_its_connection_closes_gets_the_whole_timeout():
    """A close hurries only a member that was beating on time: one already silent for longer than the two intervals
    (a stopped process whose connection ZeroMQ's own heartbeat dropped, say) is judged by the timeout alone. The
    scheduler on a thread; a server and a worker are SchedulerLinks of this process, on real sockets."""
    interval, timeout = 0.1, 2.0
    ctx = transport.new_context()
    try:
        with scheduling(1, 1, heartbeat_timeout=timeout, heartbeat_interval=interval) as sched:
            server = SchedulerLink(ctx, sched.endpoint, heartbeat_interval=interval, heartbeat_timeout=10.0)
            worker = SchedulerLink(ctx, sched.endpoint, heartbeat_interval=interval, heartbeat_timeout=10.0)
            registered = threading.Thread(target=server.register, args=("server", "tcp://127.0.0.1:1"), daemon=True)
            registered.start()
            worker.register("worker")
            registered.join(10)
            server.tick()
            last_beat = time.monotonic()
            time.sleep(4 * interval)  # silent for twice what a close would allow
            server.close()
            closed_at = time.monotonic()
            failure = None
            while failure is None and time.monotonic() - closed_at < 3 * timeout:
                try:
                    worker.tick()
                except PeerFailedError as exc:
                    failure = (time.monotonic(), str(exc))
                time.sleep(interval / 2)
            worker.close()
    finally:
        ctx.term()
    assert failure is not None, "the server was never named"
    at, message = failure
    assert "server 0" in message and "stopped heartbeating" in message and CLOSED not in message, message
    assert at - last_beat > timeout, (at - last_beat, message)  # not hurried by the close: the whole timeout
