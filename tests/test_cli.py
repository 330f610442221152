"""The ``psrt`` command line: version, help texts, defaults and one-line errors."""

from __future__ import annotations

import argparse
import inspect
import os
import socket
import subprocess
import sys

import pytest

import psrt
from psrt import cli
from psrt.cluster import launch

PSRT = [sys.executable, "-m", "psrt.cli"]


def run_psrt(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*PSRT, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.integration
def test_version_prints_the_package_version():
    proc = run_psrt("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"psrt {psrt.__version__}"


def subcommands() -> dict:
    parser = cli.build_parser()
    (group,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return group.choices


@pytest.mark.integration
def test_every_subcommand_has_a_description():
    commands = subcommands()
    assert {"server", "scheduler", "launch", "run", "stats", "worker", "model", "demo"} <= set(commands)
    for name, parser in commands.items():
        assert parser.description and len(parser.description) > 40, name
    proc = run_psrt("server", "--help")
    assert proc.returncode == 0
    usage, description = proc.stdout.split("\n\n")[:2]
    assert description.startswith("Run one shard server")


def test_launch_start_deadline_defaults_to_the_schedulers(monkeypatch):
    argv = ["launch", "-s", "1", "-w", "1", "--", "true"]
    monkeypatch.delenv("PSRT_START_TIMEOUT", raising=False)
    assert cli.build_parser().parse_args(argv).timeout == 120.0
    assert cli.build_parser().parse_args(["scheduler"]).timeout == 120.0
    monkeypatch.setenv("PSRT_START_TIMEOUT", "33")
    assert cli.build_parser().parse_args(argv).timeout == 33.0
    assert inspect.signature(launch.launch).parameters["start_timeout"].default is None


def one_line_error(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) >= 1 and "error:" in lines[-1]
    return lines[-1]


@pytest.mark.integration
def test_a_missing_worker_program_is_a_one_line_error():
    proc = run_psrt("launch", "-s", "1", "-w", "1", "--", "/nonexistent/psrt-test-program")
    assert "cannot start the workers: /nonexistent/psrt-test-program: no such program" in one_line_error(proc)
    assert "[scheduler]" not in proc.stdout  # refused before any process started
    env = {"PSRT_ROLE": "worker", "PSRT_SCHEDULER": "tcp://127.0.0.1:5700"}
    line = one_line_error(run_psrt("run", "--", "/nonexistent/psrt-test-program", env=env))
    assert "/nonexistent/psrt-test-program: No such file or directory" in line


@pytest.mark.integration
@pytest.mark.parametrize("args", [
    ("server", "--bind", "tcp://nonsense"),
    ("server", "--bind", "foo://x"),
    ("server", "--scheduler", "tcp://127.0.0.1:*"),
    ("scheduler", "--bind", "127.0.0.1:5700"),
    ("stats", "nonsense"),
])
def test_a_malformed_endpoint_is_a_usage_error(args):
    line = one_line_error(run_psrt(*args, timeout=30))
    assert "is not an endpoint such as tcp://HOST:" in line


def test_valid_endpoints_pass_the_check():
    for text in ("tcp://127.0.0.1:5700", "tcp://*:5700", "tcp://[::1]:5700", "tcp://node-0.example:1", "ipc:///tmp/s"):
        assert cli._bind_endpoint(text) == text
    assert cli._bind_endpoint("tcp://0.0.0.0:*") == "tcp://0.0.0.0:*"


@pytest.mark.integration
def test_a_taken_metrics_port_is_a_one_line_error():
    pytest.importorskip("prometheus_client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_psrt("server", "--bind", "tcp://127.0.0.1:*", "--metrics-port", str(port))
    assert f"--metrics-port: cannot listen on 127.0.0.1:{port}" in one_line_error(proc)


@pytest.mark.integration
def test_the_demo_without_scikit_learn_says_what_to_install():
    code = "import sys; sys.modules['sklearn'] = None; from psrt.cli import main; sys.exit(main(['demo']))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install 'psrt[examples]'" in one_line_error(proc)
    assert "[scheduler]" not in proc.stdout  # refused before any process started


def test_ctrl_c_ends_a_command_without_a_traceback(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_model", interrupted)
    assert cli.main(["model"]) == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err


@pytest.mark.integration
@pytest.mark.parametrize("args, port", [
    (("server", "--bind", "tcp://127.0.0.1:99999"), "99999"),
    (("scheduler", "--bind", "tcp://127.0.0.1:70000"), "70000"),
    (("server", "--scheduler", "tcp://127.0.0.1:65536"), "65536"),
    (("server", "--bind", "tcp://127.0.0.1:*", "--metrics-port", "99999"), "99999"),
])
def test_a_port_out_of_range_is_a_usage_error_naming_it(args, port):
    # ZeroMQ wraps a port above 65535 around (99999 served on 34463); the metrics server raised OverflowError.
    line = one_line_error(run_psrt(*args, timeout=30))
    assert port in line and "65535" in line


def test_a_port_out_of_range_is_refused_in_process_too():
    from psrt.config import ServerConfig
    from psrt.control.scheduler import Scheduler

    with pytest.raises(psrt.ConfigError, match="99999"):
        ServerConfig(bind="tcp://127.0.0.1:99999")
    with pytest.raises(psrt.ConfigError, match="70000"):
        Scheduler("tcp://127.0.0.1:70000", 1, 1)
    with pytest.raises(psrt.ConfigError, match="99999"):
        psrt.Client(servers=["tcp://127.0.0.1:99999"])


@pytest.mark.integration
@pytest.mark.parametrize("args, says", [
    (("scheduler", "--timeout", "-1"), "--timeout"),
    (("launch", "-s", "1", "-w", "1", "--timeout", "-1", "--", "true"), "--timeout"),
    (("checkpoint", "tcp://127.0.0.1:1", "--timeout", "-5"), "--timeout"),
    (("stats", "tcp://127.0.0.1:1", "--count", "0"), "--count"),  # never stopped
    (("stats", "tcp://127.0.0.1:1", "--count", "-1"), "--count"),
    (("stats", "tcp://127.0.0.1:1", "--interval", "-1"), "--interval"),  # a ValueError from time.sleep
    (("server", "--checkpoint-dir", "/tmp", "--checkpoint-every", "0"), "--checkpoint-every"),
    (("server", "--checkpoint-dir", "/tmp", "--checkpoint-secs", "-1"), "--checkpoint-secs"),
    (("server", "--mode", "sync", "--staleness", "2"), "--staleness"),
    (("scheduler", "--mode", "async", "--staleness", "1"), "--staleness"),
    (("launch", "-s", "1", "-w", "1", "--staleness", "1", "--", "true"), "--staleness"),
])
def test_a_value_that_cannot_be_meant_is_a_usage_error(args, says):
    proc = run_psrt(*args, timeout=30)
    assert says in one_line_error(proc)
    assert "ready" not in proc.stdout  # refused before anything started


@pytest.mark.integration
def test_an_unwritable_checkpoint_dir_fails_at_start(tmp_path):
    (tmp_path / "file").write_text("")
    where = tmp_path / "file" / "checkpoints"  # under a regular file: no user can write there, root neither
    proc = run_psrt("server", "--bind", "tcp://127.0.0.1:*", "--checkpoint-dir", str(where), "--checkpoint-every",
                    "5", timeout=30)
    line = one_line_error(proc)
    assert line.startswith("psrt: error: --checkpoint-dir") and str(where) in line
    assert "ready" not in proc.stdout  # it used to serve, and warn at every checkpoint


def test_launch_refuses_a_staleness_without_ssp_in_process():
    with pytest.raises(psrt.ConfigError, match="--mode ssp"):
        launch.launch(1, 1, ["true"], mode="sync", staleness=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
@pytest.mark.parametrize("uri, bound", [("127.0.0.1", "127.0.0.1"), ("localhost", "127.0.0.1"),
                                        ("0.0.0.0", "0.0.0.0")])
def test_psrt_run_binds_the_schedulers_uri_not_every_interface(uri, bound):
    port = free_port()
    env = {**os.environ, "DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": uri, "DMLC_PS_ROOT_PORT": str(port),
           "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1"}
    env.pop("PSRT_SCHEDULER", None)
    proc = subprocess.Popen([*PSRT, "run"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "psrt-scheduler ready" in line, line
        assert f"endpoint=tcp://{bound}:{port} " in line  # it was tcp://0.0.0.0:PORT whatever the URI said
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()


@pytest.mark.integration
def test_psrt_run_refuses_a_scheduler_address_of_another_host():
    env = {"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "203.0.113.77", "DMLC_PS_ROOT_PORT": "5700",
           "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1"}
    line = one_line_error(run_psrt("run", env=env, timeout=30))
    assert "203.0.113.77" in line and "not an address of this host" in line and "DMLC_PS_ROOT_URI=0.0.0.0" in line


def test_scheduler_bind_resolves_names_and_keeps_the_explicit_everywhere():
    assert launch.scheduler_bind("tcp://0.0.0.0:5700") == "tcp://*:5700"
    assert launch.scheduler_bind("tcp://127.0.0.1:5700") == "tcp://127.0.0.1:5700"
    assert launch.scheduler_bind(f"tcp://{socket.gethostname()}:5700").startswith("tcp://")
    with pytest.raises(psrt.ConfigError, match="cannot resolve"):
        launch.scheduler_bind("tcp://no-such-host.invalid:5700")


@pytest.mark.integration
def test_launch_exits_143_on_sigterm():
    import signal

    proc = subprocess.Popen([*PSRT, "launch", "-s", "1", "-w", "1", "--", sys.executable, "-c",
                             "import time; print('worker up', flush=True); time.sleep(120)"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "worker up" in line:
                break
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, out  # was 130, Ctrl-C's code
        assert "terminated; stopping every process" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.integration
def test_launch_on_an_address_of_another_host_says_why_the_scheduler_did_not_start():
    line = one_line_error(run_psrt("launch", "-s", "1", "-w", "1", "--host", "203.0.113.77", "--", "true"))
    assert line.startswith("psrt: error: scheduler exited with code 2 before it was ready")
    assert "cannot bind tcp://203.0.113.77" in line and not line.endswith("''")  # it ended in '' (output streamed)


@pytest.mark.integration
def test_launch_labels_each_server_with_its_rank():
    import re

    proc = run_psrt("launch", "-s", "4", "-w", "1", "--", sys.executable, "-c", "import psrt; psrt.Client().close()",
                    timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ready = re.findall(r"^\[server (\d+)\] psrt-server ready .* rank=(\d+)$", proc.stdout, re.M)
    assert len(ready) == 4, proc.stdout
    assert all(label == rank for label, rank in ready), ready  # labels went by start order, ranks by registration


_ROWS_WORKER = """
import numpy as np, psrt
with psrt.Client() as c:
    c.init_embedding("t", dim=4, optimizer=psrt.SGD(lr=1.0), init="zeros")
    before = c.pull_rows("t", np.arange(3))
    c.push_rows("t", np.arange(3), np.ones((3, 4), np.float32))
    print("rows", before.sum(), c.pull_rows("t", np.arange(3)).sum(), flush=True)
"""


@pytest.mark.integration
def test_launch_gives_every_shard_the_checkpoint_flags_and_restores_from_them(tmp_path):
    where = tmp_path / "ckpt"
    first = run_psrt("launch", "-s", "2", "-w", "1", "--mode", "async", "--checkpoint-dir", str(where),
                     "--checkpoint-full-every", "3", "--", sys.executable, "-c", _ROWS_WORKER, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "rows 0.0 -12.0" in first.stdout
    assert len(list(where.iterdir())) >= 2, "each shard wrote its rank's checkpoint at the end"
    again = run_psrt("launch", "-s", "2", "-w", "1", "--mode", "async", "--checkpoint-dir", str(where), "--restore",
                     "--", sys.executable, "-c", _ROWS_WORKER, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "rows -12.0 -24.0" in again.stdout, "the rows came back from the checkpoints"


@pytest.mark.integration
@pytest.mark.parametrize("args, says", [
    (("--checkpoint-every", "3"), "need --checkpoint-dir"),
    (("--restore",), "need --checkpoint-dir"),
    (("--checkpoint-dir", "/tmp", "--checkpoint-full-every", "0"), "--checkpoint-full-every"),
])
def test_launch_checkpoint_flags_that_cannot_be_meant_are_one_line_errors(args, says):
    proc = run_psrt("launch", "-s", "1", "-w", "1", *args, "--", sys.executable, "-c", "pass")
    assert says in one_line_error(proc)
    assert "ready" not in proc.stdout  # refused before anything started
