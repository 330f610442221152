"""Child processes, and the lines psrt's processes print for whoever started them.

One helper, :class:`Child`, starts every child process psrt, its tests and its benchmarks run: ``psrt launch``'s
scheduler, servers and workers, :class:`psrt.cluster.local.LocalShards`, the emulated hosts of
:mod:`psrt.emulation.netns`. A child runs in its own session (so its whole process group can be signalled) and gets
SIGTERM when the thread that started it dies (Linux ``PR_SET_PDEATHSIG``), so no child outlives its parent. A reader
thread takes its output line by line: it watches for a ready line, and either streams each line to a stream behind a
``[label]`` prefix or collects it for the caller.

The machine-readable lines are defined here and nowhere else:

- ``psrt-server ready endpoint=EP ...`` and ``psrt-scheduler ready endpoint=EP ...``, printed once a daemon is
  bound (:func:`ready_line`; matched by :data:`SERVER_READY`, :data:`SCHEDULER_READY`, or :func:`ready_pattern`);
- ``psrt-server stopped ...`` and ``psrt-scheduler stopped ...`` when it exits (:func:`stopped_line`);
- ``psrt-worker-result {json}``, a load-test worker's result (:func:`result_line`, :func:`parse_results`).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import IO, Any, Callable, Optional, Sequence, Union

from psrt.errors import ConfigError, PsrtError, PsrtTimeoutError

__all__ = ["pid_alive", "Child", "ChildError", "popen", "stop_processes", "stop_children", "exit_status",
           "describe_exit", "psrt_command", "ready_line", "ready_pattern", "stopped_line", "result_line",
           "parse_results", "first_results", "SERVER_READY", "SCHEDULER_READY", "RESULT_PREFIX"]

#: Prefix of a load-test worker's result line; the JSON object follows on the same line.
RESULT_PREFIX = "psrt-worker-result "


def ready_line(role: str, endpoint: str, **fields: object) -> str:
    """The line a daemon prints once it is bound: ``psrt-ROLE ready endpoint=EP key=value ...``."""
    return " ".join([f"psrt-{role} ready endpoint={endpoint}", *(f"{k}={v}" for k, v in fields.items())])


def ready_pattern(role: str) -> re.Pattern:
    """The regular expression of ``role``'s ready line; group 1 is the endpoint."""
    return re.compile(rf"psrt-{re.escape(role)} ready endpoint=(\S+)")


def stopped_line(role: str, **fields: object) -> str:
    """The line a daemon prints when it exits: ``psrt-ROLE stopped key=value ...``."""
    return " ".join([f"psrt-{role} stopped", *(f"{k}={v}" for k, v in fields.items())])


def result_line(result: dict[str, Any]) -> str:
    """A load-test worker's result as one line."""
    return RESULT_PREFIX + json.dumps(result)


def parse_results(text: str) -> list[dict[str, Any]]:
    """Every result line's JSON object in ``text``, also behind a launcher's ``[worker N]`` prefix."""
    return [json.loads(line.split(RESULT_PREFIX, 1)[1]) for line in text.splitlines() if RESULT_PREFIX in line]


#: A shard server's ready line; group 1 is the endpoint it bound.
SERVER_READY = ready_pattern("server")
#: The scheduler's ready line; group 1 is its endpoint.
SCHEDULER_READY = ready_pattern("scheduler")


def psrt_command(*args: str) -> list[str]:
    """``psrt ARGS`` as a command line that runs this interpreter's psrt, installed as a script or not."""
    return [sys.executable, "-m", "psrt.cli", *args]


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs (one of another user counts as running): names that carry the pid of the
    process that made them (namespaces, shared-memory files) are leftovers once it is gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_status(returncode: int) -> int:
    """The exit status a shell reports for a child's ``returncode``: 128 + N for a child killed by signal N.

    :class:`subprocess.Popen` gives -N for a child killed by signal N; returned from ``main`` as is, -N would
    become 256 - N (247 for SIGKILL), which shells and supervisors do not read as a signal.
    """
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """``"exited with code 7"`` or ``"was killed by signal 9 (SIGKILL)"``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


class ChildError(PsrtError, RuntimeError):
    """A child process exited before it reported ready; the message carries the end of its output."""


def _resolve_prctl() -> Optional[Callable[..., int]]:
    # Looked up once in the parent: between fork and exec the child must do as little as possible.
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _resolve_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def popen(cmd: Sequence[str], label: Optional[str] = None, **kwargs: Any) -> subprocess.Popen:
    """:class:`subprocess.Popen` in a session of its own that gets SIGTERM when the starting thread dies.

    The child leads a new process group, which :func:`stop_processes` signals as a whole (what the child started
    goes too). ``kwargs`` go to Popen. A program that cannot be started raises :class:`ConfigError`, naming the
    process by ``label`` if given.
    """
    try:
        return subprocess.Popen(list(cmd), start_new_session=True, preexec_fn=_die_with_parent, **kwargs)
    except OSError as exc:  # a mistyped or missing program: the user's error, said in one line
        who = f"{label}: " if label else ""
        raise ConfigError(f"cannot start {who}{exc.filename or cmd[0]}: {exc.strerror or exc}") from None


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # gone since poll()
            pass


def stop_processes(procs: Sequence[subprocess.Popen], grace: float = 5.0) -> list[int]:
    """SIGTERM every process group, wait up to ``grace`` seconds for all, SIGKILL what is left; exit codes."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        _signal_group(p, signal.SIGKILL)  # the whole group: what a child started goes too
        if p.poll() is None:
            p.wait()
    return [p.returncode for p in procs]


class Child:
    """A child process whose output is read line by line: watched for a ready line, streamed or collected.

    Parameters
    ----------
    cmd : sequence of str
        The program and its arguments.
    label : str, optional
        A name for messages and the prefix of streamed lines (default: the program's name).
    env : dict, optional
        More environment on top of this process's (``PYTHONUNBUFFERED=1`` is always set: lines arrive as printed).
    ready : re.Pattern, optional
        The child's ready line; :meth:`wait_ready` waits for it and :attr:`endpoint` is its group 1.
    out : text stream, optional
        Stream every line there as ``[label] line``; by default lines are collected (:attr:`output`).
    lock : threading.Lock, optional
        Shared by children that stream to one stream, so lines do not interleave mid-line.
    stderr : int or file, optional
        Where the child's stderr goes: into the same pipe as stdout (the default), or as Popen takes it.
    stdin : int or file, optional
        As Popen takes it (default: inherited).
    wrap : sequence of str
        A prefix of the command line, e.g. ``ip netns exec NS``.
    relabel : callable, optional
        Given the ready line's match, the label from that line on (a server's rank is known only once ready).

    Notes
    -----
    The kernel sends the child SIGTERM when the *thread* that started it exits: start children from a thread that
    outlives them (normally the main thread).
    """

    def __init__(self, cmd: Sequence[str], *, label: Optional[str] = None, env: Optional[dict[str, str]] = None,
                 ready: Optional[re.Pattern] = None, out: Optional[IO[str]] = None,
                 lock: Optional[threading.Lock] = None, stderr: Union[int, IO[Any], None] = subprocess.STDOUT,
                 stdin: Union[int, IO[Any], None] = None, wrap: Sequence[str] = (),
                 relabel: Optional[Callable[[re.Match], str]] = None) -> None:
        self.cmd = list(cmd)
        self.label = label or os.path.basename(self.cmd[0])
        self.match: Optional[re.Match] = None
        self._ready, self._relabel = ready, relabel
        self._seen = threading.Event()
        self._lines: list[str] = []
        self._recent: deque[str] = deque(maxlen=20)  # the last lines, streamed or not: for error messages
        self._out = out
        self._lock = lock or threading.Lock()
        self.proc = popen([*wrap, *self.cmd], label=self.label, stdout=subprocess.PIPE, stderr=stderr, stdin=stdin,
                          text=True, bufsize=1, errors="replace",
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self._reader = threading.Thread(target=self._pump, name=f"psrt-child-{self.label}", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                if self._ready is not None and self.match is None:
                    self.match = self._ready.search(line)
                    if self.match:
                        if self._relabel is not None:
                            self.label = self._relabel(self.match)
                        self._seen.set()
                self._recent.append(line)
                if self._out is None:
                    self._lines.append(line)
                    continue
                with self._lock:
                    try:
                        self._out.write(f"[{self.label}] {line}")
                        self._out.flush()
                    except (ValueError, OSError):  # the stream was closed: keep draining the pipe
                        self._out = None
        finally:
            self._seen.set()  # at EOF: whoever waits for the ready line learns it will not come

    @property
    def pid(self) -> int:
        """The child's process id (also its process group's)."""
        return self.proc.pid

    @property
    def returncode(self) -> Optional[int]:
        """The exit code once the child has exited (-N if killed by signal N), else None."""
        return self.proc.poll()

    def poll(self) -> Optional[int]:
        """The exit code, or None while the child runs."""
        return self.proc.poll()

    @property
    def output(self) -> str:
        """The lines collected so far (empty when streaming)."""
        return "".join(self._lines)

    def tail(self, limit: int = 2000) -> str:
        """The end of the output (the last lines, when streaming), for error messages."""
        return "".join(self._recent)[-limit:]

    def wait_ready(self, timeout: float) -> re.Match:
        """Wait for the ready line; raises :class:`ChildError` if the child exits first, else on the deadline
        :class:`~psrt.errors.PsrtTimeoutError`."""
        if self._ready is None:
            raise ConfigError(f"{self.label}: no ready line to wait for")
        self._seen.wait(timeout)
        if self.match is not None:
            return self.match
        if not self._seen.is_set():
            raise PsrtTimeoutError(f"{self.label} did not report ready within {timeout:g}s")
        try:
            how = describe_exit(self.proc.wait(5.0))
        except subprocess.TimeoutExpired:
            how = "closed its output"
        said = self.tail().strip()
        raise ChildError(f"{self.label} {how} before it was ready" + (f": {said!r}" if said else ", printing nothing"))

    @property
    def endpoint(self) -> str:
        """Group 1 of the ready line: the endpoint the child bound."""
        if self.match is None:
            raise ConfigError(f"{self.label} has not reported ready")
        return self.match.group(1)

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the child to exit; its exit code. Raises :class:`~psrt.errors.PsrtTimeoutError`."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise PsrtTimeoutError(f"{self.label} did not exit within {timeout:g}s") from None
        self._reader.join(5.0)  # its last lines
        return code

    def communicate(self, timeout: float) -> str:
        """Wait for the child to exit and return everything it printed."""
        self.wait(timeout)
        return self.output

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group."""
        _signal_group(self.proc, sig)

    def stop(self, grace: float = 5.0) -> int:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds; the exit code."""
        return stop_children([self], grace)[0]

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def first_results(children: Sequence[Child], timeout: float, what: str) -> list[dict[str, Any]]:
    """Each child's first result line, in order, once it exited 0 within ``timeout`` seconds.

    Raises
    ------
    RuntimeError
        When a child exits with another code, naming ``what`` and the end of its output.
    """
    results = []
    for child in children:
        out = child.communicate(timeout=timeout)
        if child.returncode != 0:
            raise RuntimeError(f"{what}: a worker failed ({child.returncode}):\n{out[-3000:]}")
        results.append(parse_results(out)[0])
    return results


def stop_children(children: Sequence[Child], grace: float = 5.0) -> list[int]:
    """:func:`stop_processes` for children, then the end of their output; their exit codes."""
    codes = stop_processes([c.proc for c in children], grace)
    for c in children:
        c._reader.join(5.0)
        # A reader still blocked (a grandchild that left the group holds the pipe) keeps its pipe: closing a
        # file another thread reads from would wait for that read.
        pipes = (c.proc.stdin,) if c._reader.is_alive() else (c.proc.stdout, c.proc.stdin)
        for pipe in pipes:
            if pipe is not None:
                pipe.close()
    return codes
