"""What several test modules share: headers packed by hand, a raw DEALER peer, a shard or a scheduler on a thread,
comparisons of float arrays, the worker processes (``tests/_workers.py``) and their results, and the timing bounds
of the liveness tests, derived from the configuration the jobs run with.

The helpers that start processes (:func:`start_worker`, :func:`run_workers`) make a test that calls them an
integration test (``tests/test_project.py::test_every_test_that_starts_a_process_is_marked_integration``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import msgpack
import numpy as np
import pytest
import zmq

from psrt import shm, wire
from psrt.config import ClusterConfig
from psrt.control.process import parse_results
from psrt.control.scheduler import Scheduler

TESTS = Path(__file__).resolve().parent
BENCH = TESTS.parent / "bench"
sys.path.insert(0, str(BENCH))
# bench/ is not a package: its shard on a thread (serving) and its recording TCP relay (Relay) serve the benches and
# the tests alike.
from _common import Relay, serving  # noqa: E402

__all__ = ["packed", "frames_of", "push_header", "RawPeer", "Relay", "serving", "scheduling", "RTOL", "assert_close",
           "WORKERS", "worker_command", "start_worker", "finish_worker", "finish_workers", "stop_workers",
           "run_workers", "launched_results", "LIVENESS", "NEWS_HELD_S", "NAMED_AFTER_S", "LOADED", "bound",
           "NAMED_WITHIN_S", "check_named_setting"]


# ---------------------------------------------------------------------------------------------- headers by hand
def whole_window(monkeypatch: Any) -> None:
    """Pace no shard below a pipeline's window, for tests of the order, the count or the window of pushes alone: a
    shard slowed by a loaded machine may otherwise keep some gradients in the pipeline's priority queue, which
    sends them first layers first as acks come (:class:`psrt.worker.overlap.Pace`)."""
    from psrt.worker import overlap

    monkeypatch.setattr(overlap, "QUEUE_S", 60.0)


def packed(header: Mapping[Any, Any], version: int = wire.PROTOCOL_VERSION) -> bytes:
    """``header`` as msgpack, as a peer might send it, without the encoders' checks: the protocol version ``v``
    first, unless ``header`` has its own."""
    fields = {"v": version, **header} if "v" not in header else header
    return msgpack.packb(fields, use_bin_type=True)


def frames_of(header: Mapping[Any, Any], arrays: Sequence[Union[bytes, np.ndarray]] = (), *,
              version: int = wire.PROTOCOL_VERSION) -> list[bytes]:
    """A message by hand: the :func:`packed` header, then each buffer's bytes."""
    return [packed(header, version), *(a.tobytes() if isinstance(a, np.ndarray) else a for a in arrays)]


def push_header(**over: Any) -> dict[str, Any]:
    """A valid push of one float32 chunk ``["w", 0]`` of 4 values from worker 0, with ``over``'s fields changed."""
    return {"op": "push", "id": 9, "worker": 0, "session": 1, "seq": 0, "clock": 1, "tensors": [["w", 0, "<f4", [4]]],
            **over}


class RawPeer:
    """A bare DEALER that speaks the wire protocol by hand, to send what no client would.

    ``keys`` (a :class:`psrt.control.security.Keys` with the client pair) makes it a CURVE client of the job.
    """

    def __init__(self, endpoint: str, keys: Any = None) -> None:
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            self.sock.curve_serverkey = keys.server_public
            self.sock.curve_publickey, self.sock.curve_secretkey = keys.client_public, keys.client_secret
        self.sock.connect(endpoint)

    def send(self, frames: Sequence[Any]) -> None:
        self.sock.send_multipart(frames)

    def answered(self, timeout: float = 5.0) -> bool:
        """Whether a reply arrives within ``timeout`` seconds (it is left to :meth:`recv`)."""
        return bool(self.sock.poll(int(timeout * 1000)))

    def recv(self) -> tuple[dict, list[bytes]]:
        """The next reply: its decoded header and its other frames."""
        reply = self.sock.recv_multipart()
        return msgpack.unpackb(reply[0]), reply[1:]

    def ask(self, message: Union[Mapping[str, Any], Sequence[bytes]], frames: Sequence[bytes] = (),
            timeout: float = 5.0) -> tuple[dict, list[bytes]]:
        """Send ``message`` (a header, :func:`packed` here, followed by ``frames``; or a list of frames) and return
        the reply; no reply within ``timeout`` seconds fails the test."""
        self.send([packed(message), *frames] if isinstance(message, Mapping) else [*message, *frames])
        assert self.answered(timeout), f"{self.endpoint} did not answer"
        return self.recv()

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- on a thread
@contextmanager
def scheduling(servers: int = 1, workers: int = 1, start_timeout: float = 30.0, **kw: Any) -> Iterator[Scheduler]:
    """A :class:`psrt.control.scheduler.Scheduler` for S servers and W workers (``kw``: its other arguments)
    serving on a thread of this process on a loopback port; stopped on exit."""
    sched = Scheduler("tcp://127.0.0.1:*", servers, workers, start_timeout=start_timeout, **kw)
    thread = threading.Thread(target=sched.serve, daemon=True)
    thread.start()
    try:
        yield sched
    finally:
        sched.stop()
        thread.join(10)


# ---------------------------------------------------------------------------------------------- comparisons
#: Relative tolerance per dtype of a result computed two ways (a kernel and its NumPy reference).
RTOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-11}


def assert_close(actual: np.ndarray, expected: np.ndarray, rtol: Mapping[np.dtype, float] = RTOL) -> None:
    """``actual`` has ``expected``'s dtype and shape and its values within ``rtol`` of its dtype.

    The absolute tolerance scales with the magnitude of the expected values, so that cancellation (a parameter
    stepping through zero) is judged against the size of the numbers involved.
    """
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    tol = rtol[np.dtype(expected.dtype)]
    mag = float(np.max(np.abs(expected))) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * max(1.0, mag))


# ---------------------------------------------------------------------------------------------- worker processes
WORKERS = TESTS / "_workers.py"


def worker_command(role: str, **args: Any) -> list[str]:
    """``python tests/_workers.py ROLE JSON_ARGS``: one worker process of the tests (the roles are in
    ``tests/_workers.py``)."""
    return [sys.executable, str(WORKERS), role, json.dumps(args)]


def start_worker(role: str, env: Optional[Mapping[str, str]] = None, **args: Any) -> subprocess.Popen:
    """Start one worker (its output collected as text; ``env`` added to this process's environment)."""
    return subprocess.Popen(worker_command(role, **args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def finish_worker(proc: subprocess.Popen, timeout: float = 120) -> tuple[dict, str]:
    """Wait for a worker; it must exit 0. Its result and its standard error."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    results = parse_results(out)
    assert results, f"no result line: {out}{err}"
    return results[-1], err


def finish_workers(procs: Sequence[subprocess.Popen], timeout: float = 120) -> list[dict]:
    """Wait for every worker (``timeout`` seconds for them all); each must exit 0. Their results, in order.

    Every worker is waited for before anything is judged, so a failure shows what each of them printed: in a sync
    job one worker's error is often another's doing (a round that never completed for want of its push).
    """
    deadline = time.monotonic() + timeout
    done: list[tuple[Optional[int], str, str]] = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            err += f"\n(still running after {timeout:g} s: killed)"
        done.append((p.returncode, out, err))
    bad = [i for i, (code, out, _) in enumerate(done) if code != 0 or not parse_results(out)]
    assert not bad, "\n".join(f"worker {i} exited {code}:\n{out[-2000:]}{err[-4000:]}"
                               for i, (code, out, err) in enumerate(done) if i in bad)
    return [parse_results(out)[-1] for _, out, _ in done]


def stop_workers(procs: Sequence[subprocess.Popen]) -> None:
    """Kill the workers still running (a test that failed halfway leaves no process behind)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def run_workers(role: str, argsets: Sequence[Mapping[str, Any]], timeout: float = 120,
                env: Optional[Mapping[str, str]] = None) -> list[dict]:
    """Run one worker per argument set, all at once; their results, in order."""
    procs = [start_worker(role, env, **args) for args in argsets]
    try:
        return finish_workers(procs, timeout)
    finally:
        stop_workers(procs)


def launched_results(stdout: str) -> list[dict]:
    """The workers' results in a ``psrt launch``'s output, by rank."""
    return sorted(parse_results(stdout), key=lambda r: r["rank"])


# ---------------------------------------------------------------------------------------------- timing bounds
#: The liveness settings of the tests' jobs: the defaults, or what the environment sets (every process of a test's
#: job inherits it). Only these variables are read, so that a launcher's environment around the test run (Slurm,
#: MPI ranks) cannot fail the import.
LIVENESS = ClusterConfig.from_env({k: v for k, v in os.environ.items()
                                   if k in ("PSRT_HEARTBEAT_INTERVAL", "PSRT_HEARTBEAT_TIMEOUT")})
#: How long the scheduler holds the news of a worker's end before it tells the others
#: (``psrt.control.scheduler.Scheduler._hold``; not configurable).
NEWS_HELD_S = 1.0
#: The longest, by the design, from a process's death to its name reaching a waiting process: the scheduler
#: names a member silent for the heartbeat timeout (its last beat came before it died, so at most the timeout
#: after the death), and one interval covers the polls in between (the scheduler's watch, the survivor's
#: heartbeat thread, its wait). A dead scheduler is judged the same way by each process.
NAMED_AFTER_S = LIVENESS.heartbeat_timeout + LIVENESS.heartbeat_interval
#: A loaded host (the suite on 2 cores beside other work) runs every step of a mechanism late: a test allows
#: this factor over the design's time.
LOADED = 2.0


def bound(design_s: float, promised_s: Optional[float] = None) -> float:
    """The bound a test asserts for what the design does within ``design_s`` seconds: :data:`LOADED` times that,
    but never more than the bound an issue promised (``promised_s``), which stays the ceiling."""
    allowed = LOADED * design_s
    return allowed if promised_s is None else min(allowed, promised_s)


#: The issue's promise, "a dead peer is named within 5 s", as the ceiling of what the design allows a loaded host.
NAMED_WITHIN_S = bound(NAMED_AFTER_S, promised_s=5.0)


# ---------------------------------------------------------------------------------------------- shared memory
def needs_shm(megabytes: int) -> Any:
    """A skip mark for tests that need a writable /dev/shm with ``megabytes`` MB free."""
    try:
        st = os.statvfs(shm.SHM_DIR)
        room = st.f_bavail * st.f_frsize
    except OSError:
        room = 0
    return pytest.mark.skipif(not shm.available() or room < megabytes << 20,
                              reason=f"needs a writable /dev/shm with {megabytes} MB free")


def check_named_setting(monkeypatch: pytest.MonkeyPatch, field: str, variable: str, choices: str,
                        bad: tuple[str, str], good: str) -> None:
    """A ``ClientConfig`` setting that takes one of some names: ``bad[0]`` given and ``bad[1]`` from ``variable``
    are refused, saying ``choices`` and naming the variable only for the second; ``good`` from it is taken."""
    from psrt.config import ClientConfig
    from psrt.errors import ConfigError

    with pytest.raises(ConfigError, match=f"{field} must be {choices}, got '{bad[0]}'$"):
        ClientConfig(**{field: bad[0]})
    monkeypatch.setenv(variable, bad[1])
    with pytest.raises(ConfigError, match=rf"got '{bad[1]}' \({variable}\)"):
        ClientConfig()
    monkeypatch.setenv(variable, good)
    assert getattr(ClientConfig(), field) == good
