"""Child processes (psrt.control.process): ready lines, output, teardown of the whole group, no orphans."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time

import pytest

from psrt import ConfigError, PsrtTimeoutError
from psrt.control.process import (
    SCHEDULER_READY,
    SERVER_READY,
    Child,
    ChildError,
    describe_exit,
    exit_status,
    parse_results,
    ready_line,
    result_line,
    stop_children,
    stopped_line,
)

PY = sys.executable
PID_READY = re.compile(r"pid=(\d+)")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its parent to reap it is gone too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_ready_and_result_lines_round_trip():
    line = ready_line("server", "tcp://127.0.0.1:5701", mode="sync", workers=2)
    assert line == "psrt-server ready endpoint=tcp://127.0.0.1:5701 mode=sync workers=2"
    assert SERVER_READY.search(line).group(1) == "tcp://127.0.0.1:5701"
    assert SCHEDULER_READY.search(ready_line("scheduler", "ipc:///tmp/s")).group(1) == "ipc:///tmp/s"
    assert SERVER_READY.search(ready_line("scheduler", "tcp://h:1")) is None
    assert stopped_line("scheduler", code=0) == "psrt-scheduler stopped code=0"
    text = f"noise\n[worker 1] {result_line({'rank': 1})}\n{result_line({'rank': 0, 'x': [1.5]})}\n"
    assert parse_results(text) == [{"rank": 1}, {"rank": 0, "x": [1.5]}]


def test_exit_status_is_what_a_shell_reports():
    assert [exit_status(c) for c in (0, 3, -9, -15)] == [0, 3, 137, 143]
    assert describe_exit(7) == "exited with code 7"
    assert describe_exit(-9) == "was killed by signal 9 (SIGKILL)"


@pytest.mark.integration
def test_a_child_collects_its_output_and_reports_its_endpoint():
    code = "import sys; print('hello'); print('psrt-server ready endpoint=tcp://x:1', flush=True); " \
           "sys.stderr.write('on stderr\\n')"
    child = Child([PY, "-c", code], ready=SERVER_READY)
    assert child.wait_ready(30).group(1) == "tcp://x:1" and child.endpoint == "tcp://x:1"
    assert child.wait(30) == 0
    assert child.output.splitlines() == ["hello", "psrt-server ready endpoint=tcp://x:1", "on stderr"]


@pytest.mark.integration
def test_a_child_streams_its_output_behind_its_label():
    out = io.StringIO()
    child = Child([PY, "-c", "print('a'); print('b')"], label="worker 3", out=out)
    assert child.wait(30) == 0
    assert out.getvalue() == "[worker 3] a\n[worker 3] b\n" and child.output == ""


@pytest.mark.integration
def test_a_child_that_exits_before_ready_says_so_with_its_output():
    child = Child([PY, "-c", "print('bad flag'); raise SystemExit(3)"], label="psrt server 0", ready=SERVER_READY)
    with pytest.raises(ChildError, match=r"psrt server 0 exited with code 3 before it was ready: 'bad flag'"):
        child.wait_ready(30)


@pytest.mark.integration
def test_waiting_for_a_ready_line_has_a_deadline():
    with Child([PY, "-c", "import time; time.sleep(60)"], ready=SERVER_READY) as child:
        t = time.monotonic()
        with pytest.raises(PsrtTimeoutError, match="did not report ready within 0.3s"):
            child.wait_ready(0.3)
        assert time.monotonic() - t < 5
        with pytest.raises(PsrtTimeoutError):
            child.wait(0.1)
    assert child.returncode is not None


@pytest.mark.integration
def test_stop_takes_the_whole_process_group():
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']); print(f'pid={p.pid}', flush=True); time.sleep(60)")
    child = Child([PY, "-c", code], ready=PID_READY)
    grandchild = int(child.wait_ready(30).group(1))
    assert alive(grandchild)
    assert child.stop(grace=5) == -15
    assert gone_within(grandchild, 10)


@pytest.mark.integration
def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period():
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('pid=0', flush=True); " \
           "time.sleep(60)"
    children = [Child([PY, "-c", code], ready=PID_READY) for _ in range(2)]
    for c in children:
        c.wait_ready(30)
    t = time.monotonic()
    assert stop_children(children, grace=0.5) == [-9, -9]
    assert time.monotonic() - t < 10


@pytest.mark.integration
def test_children_die_with_their_parent():
    # A parent that starts a child and is then killed outright (no cleanup runs): the kernel ends the child.
    code = ("import os, signal, sys; from psrt.control.process import Child; "
            "c = Child([sys.executable, '-c', 'import time; time.sleep(60)']); print(c.pid, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    assert gone_within(int(proc.stdout.split()[0]), 10)


@pytest.mark.integration
def test_a_missing_program_is_a_config_error():
    with pytest.raises(ConfigError, match=r"cannot start worker 0: /nonexistent/prog: No such file or directory"):
        Child(["/nonexistent/prog"], label="worker 0")
