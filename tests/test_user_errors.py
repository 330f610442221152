"""What a new user runs into: a busy port, a refused init, an empty pull, a silent peer, the pull counters.

Each test here reproduces a defect seen by following the README on a fresh machine.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

import psrt
from psrt import transport
from psrt.config import ClientConfig
from psrt.control.scheduler import Scheduler, SchedulerLink
from psrt.shard.server import Server, ServerConfig

PSRT = [sys.executable, "-m", "psrt.cli"]


@pytest.fixture
def busy_port():
    """A loopback TCP port held by a listening socket for the whole test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.integration
@pytest.mark.parametrize("command", [["server", "--workers", "2"], ["scheduler"]])
def test_a_busy_port_is_a_one_line_error_naming_the_address(busy_port, command):
    address = f"tcp://127.0.0.1:{busy_port}"
    started = time.monotonic()
    proc = subprocess.run([*PSRT, *command, "--bind", address], capture_output=True, text=True, timeout=30)
    assert time.monotonic() - started < 10
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert address in lines[0] and "in use" in lines[0] and "tcp://127.0.0.1:*" in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_a_busy_port_raises_bind_error_in_process_and_leaves_no_socket(busy_port):
    address = f"tcp://127.0.0.1:{busy_port}"
    for make in (lambda: Server(ServerConfig(bind=address)), lambda: Scheduler(address, 1, 1)):
        with pytest.raises(psrt.BindError, match="in use") as info:
            make()
        assert isinstance(info.value, OSError) and isinstance(info.value, psrt.PsrtError)
    # The channel closed its socket, so the context it was made in can terminate (it used to hang here).
    ctx = transport.new_context()
    with pytest.raises(psrt.BindError):
        transport.RouterChannel(ctx, address, hwm=10, send_timeout=1.0)
    ctx.term()


@pytest.mark.integration
def test_a_refused_init_leaves_the_client_as_it_was(shards):
    group = shards(1, workers=1)
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=20)) as first:
        first.init({"w": np.zeros(4, np.float32)}, optimizer=psrt.SGD(lr=1.0))
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=20)) as c:
        with pytest.raises(psrt.ServerError, match="holds 4"):
            c.init({"w": np.zeros(5, np.float32), "v": np.zeros(2, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        assert c.partition.tensors == {} and c.partition.shard_bytes == [0]
        got = c.init({"w": np.full(4, 9.0, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        np.testing.assert_array_equal(got["w"], np.zeros(4, np.float32))  # the stored value wins
        params = c.push_pull({"w": np.ones(4, np.float32)})
        np.testing.assert_array_equal(params["w"], np.full(4, -1.0, np.float32))


@pytest.mark.integration
def test_pull_of_nothing_says_to_call_init(shards):
    group = shards(1)
    with psrt.Client(group.endpoints) as c:
        with pytest.raises(psrt.PsrtError, match=r"call client\.init"):
            c.pull()
        c.init({"w": np.zeros(3, np.float32)})
        with pytest.raises(psrt.ConfigError, match="never initialized"):
            c.pull(["nope"])
        with pytest.raises(psrt.ConfigError, match="empty"):
            c.pull([])


def test_nobody_listening_times_out():
    with zmq.Context() as ctx:
        s = ctx.socket(zmq.ROUTER)
        port = s.bind_to_random_port("tcp://127.0.0.1")
        s.close(linger=0)
    endpoint = f"tcp://127.0.0.1:{port}"
    with psrt.Client([endpoint], config=ClientConfig(timeout=0.3, partition_bytes=4 << 20)) as c:
        with pytest.raises(psrt.ShardTimeoutError, match=endpoint):
            c.init({"w": np.zeros(3, np.float32)})


def test_a_shard_that_answered_before_and_is_busy_is_not_said_to_be_unreachable(caplog):
    from _helpers import serving

    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=2, mode="sync")) as server:
        config = ClientConfig(timeout=1.0, warn_after=0.2)
        with psrt.Client([server.endpoint], rank=0, num_workers=2, config=config) as c:
            c.init_embedding("items", dim=4)
            c.push_rows("items", [1, 2], np.ones((2, 4), np.float32))
            with caplog.at_level(logging.WARNING, logger="psrt.client"):
                with pytest.raises(psrt.ShardTimeoutError):
                    c.pull_rows("items", [1, 2])  # the round waits for worker 1, which never pushes
    warnings = [r.getMessage() for r in caplog.records if r.name == "psrt.client"]
    assert len(warnings) == 1 and "answered this client before" in warnings[0], warnings
    assert "is a psrt server running" not in warnings[0]


def test_a_silent_shard_is_named_in_one_warning_before_the_timeout(caplog):
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts connections and never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        with psrt.Client([endpoint], config=ClientConfig(timeout=2.0, warn_after=0.3)) as c:
            with caplog.at_level(logging.WARNING, logger="psrt.client"):
                with pytest.raises(psrt.ShardTimeoutError):
                    c.init({"w": np.zeros(3, np.float32)})
        warnings = [r.getMessage() for r in caplog.records if r.name == "psrt.client"]
        assert len(warnings) == 1, warnings
        assert endpoint in warnings[0] and "init" in warnings[0]
    finally:
        silent.close(0)
        ctx.term()


def test_a_silent_scheduler_is_named_in_one_warning_before_the_timeout(caplog):
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    link = SchedulerLink(ctx, endpoint, warn_after=0.3)
    try:
        with caplog.at_level(logging.WARNING, logger="psrt.scheduler"):
            with pytest.raises(psrt.PsrtTimeoutError, match=endpoint):
                link.register("worker", timeout=1.5)
        warnings = [r.getMessage() for r in caplog.records if r.name == "psrt.scheduler"]
        assert len(warnings) == 1, warnings
        assert endpoint in warnings[0] and "register" in warnings[0]
    finally:
        link.close()
        silent.close(0)
        ctx.term()


@pytest.mark.integration
def test_the_pull_half_of_push_pull_is_counted(shards):
    group = shards(1)
    with psrt.Client(group.endpoints) as c:
        c.init({"w": np.zeros(3, np.float32)})
        for _ in range(5):
            c.push_pull({"w": np.ones(3, np.float32)})
        c.push({"w": np.ones(3, np.float32)})
        c.pull()
        (stats,) = c.stats()
    assert stats["pushes"] == 6 and stats["pulls"] == 6


@pytest.mark.parametrize("servers", [["http://127.0.0.1:5701"], ["tcp://127.0.0.1"], ["tcp://127.0.0.1:*"]])
def test_a_server_endpoint_of_another_kind_is_a_config_error(servers):
    with pytest.raises(psrt.ConfigError, match="is not an endpoint such as tcp://HOST:PORT"):
        psrt.Client(servers=servers)  # was a raw zmq.ZMQError ("Protocol not supported")


@pytest.mark.integration
def test_a_root_port_that_is_not_a_port_is_named():
    from psrt.config import ClusterConfig

    for port in ("notaport", "99999", "0"):
        with pytest.raises(psrt.ConfigError, match="DMLC_PS_ROOT_PORT"):
            ClusterConfig.from_env({"DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": port})
    env = {**os.environ, "DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "notaport"}
    code = "import psrt; psrt.Client()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode != 0 and "ConfigError" in proc.stderr and "DMLC_PS_ROOT_PORT" in proc.stderr
    assert "ZMQError" not in proc.stderr
    proc = subprocess.run([*PSRT, "run", "--", "true"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("psrt: error:") and "DMLC_PS_ROOT_PORT" in proc.stderr


@pytest.mark.integration
@pytest.mark.parametrize("value", ["inf", "1e10"])
def test_an_unlimited_or_huge_timeout_works(shards, monkeypatch, value):
    # Both were an OverflowError from turning the timeout into ZeroMQ's milliseconds.
    group = shards(2)
    monkeypatch.setenv("PSRT_TIMEOUT", value)
    with psrt.Client(group.endpoints) as c:
        assert c.config.timeout == float(value)
        c.init({"w": np.zeros(3, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        np.testing.assert_array_equal(c.push_pull({"w": np.ones(3, np.float32)})["w"], -np.ones(3, np.float32))
        np.testing.assert_array_equal(c.push_pull_async({"w": np.ones(3, np.float32)}).wait(float("inf"))["w"],
                                      np.full(3, -2.0, np.float32))
        c.init_embedding("e", dim=2)
        assert c.pull_rows("e", np.array([1, 2])).shape == (2, 2)
        assert len(c.stats()) == 2


@pytest.mark.parametrize("value", ["nan", "-1", "0", "soon"])
def test_an_unusable_timeout_is_a_config_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("PSRT_TIMEOUT", value)
    with pytest.raises(psrt.ConfigError, match="PSRT_TIMEOUT"):
        ClientConfig()


@pytest.mark.integration
def test_a_negative_wait_timeout_is_refused(shards):
    group = shards(1)
    with psrt.Client(group.endpoints) as c:
        c.init({"w": np.zeros(3, np.float32)})
        handle = c.push_pull_async({"w": np.ones(3, np.float32)})
        for bad in (-1, float("nan"), "5"):
            with pytest.raises(psrt.ConfigError, match="timeout must be a number of seconds >= 0"):
                handle.wait(timeout=bad)
        assert handle.wait(timeout=30)["w"].shape == (3,)  # nothing was lost by the refusals
        with pytest.raises(psrt.ConfigError, match="timeout"):
            c.pull(timeout=-1)


def test_an_unwritable_checkpoint_dir_is_refused_before_binding(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(psrt.ConfigError, match="--checkpoint-dir"):
        Server(ServerConfig(bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "file" / "ck")))


@pytest.mark.integration
def test_a_refused_checkpoint_request_is_not_a_shard_error(shards):
    group = shards(1)  # no --checkpoint-dir
    with psrt.Client(group.endpoints) as c:
        c.init({"w": np.zeros(3, np.float32)})
        with pytest.raises(psrt.ServerError, match="without --checkpoint-dir"):
            c.checkpoint(timeout=20)
        c.stats()
        (stats,) = c.stats()
    assert stats["errors"] == 0  # an operator's probe used to count as one of the shard's errors


@pytest.fixture
def lone_scheduler():
    """A real scheduler process whose job never forms (it waits for a server and a worker)."""
    proc = subprocess.Popen([*PSRT, "scheduler", "--bind", "tcp://127.0.0.1:*", "--servers", "1", "--workers", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert "psrt-scheduler ready" in line, line
        yield line.split("endpoint=")[1].split()[0]
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()


@pytest.mark.integration
@pytest.mark.parametrize("command", ["stats", "checkpoint"])
def test_stats_and_checkpoint_before_the_job_forms_are_a_psrt_error(lone_scheduler, command):
    proc = subprocess.run([*PSRT, command, lone_scheduler], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stdout + proc.stderr  # was 1, on stdout
    assert proc.stderr.startswith("psrt: error:") and "no servers have joined yet" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.integration
def test_checkpoint_waits_for_the_scheduler_as_long_as_its_timeout_says():
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # a "scheduler" that never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    timeout = 3
    try:
        started = time.monotonic()
        proc = subprocess.run([*PSRT, "checkpoint", f"tcp://127.0.0.1:{port}", "--timeout", str(timeout)],
                              capture_output=True, text=True, timeout=30)
        assert time.monotonic() - started > timeout - 0.5  # it waited its timeout (less a timer's slack), not 5s
        assert proc.returncode == 2 and f"within {timeout}s" in proc.stderr, proc.stderr  # it said (and waited) 5s
    finally:
        silent.close(0)
        ctx.term()


@pytest.mark.integration
def test_the_ctr_example_without_a_scheduler_prints_one_error_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSRT_", "DMLC_"))}
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "psrt.examples.ctr"], capture_output=True, text=True, timeout=60,
                          env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("ctr: error:") and "PSRT_SCHEDULER" in line


@pytest.mark.integration
def test_many_tensors_with_long_names_fit_the_shards_header_limit(shards):
    # 4,096 tensors of 1,024-character names made one 4.2 MB header: over the shard's 1 MiB limit, the socket cut
    # the client off and init ran into its timeout.
    group = shards(1)
    params = {f"{i:04d}" + "x" * 1020: np.full(2, i, np.float32) for i in range(4096)}
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=20)) as c:
        c.init(params, optimizer=psrt.SGD(lr=1.0))
        got = c.push_pull({name: np.ones(2, np.float32) for name in params})
        assert all(np.array_equal(got[name], value - 1) for name, value in params.items())
        assert len(c.pull()) == len(params)
        (stats,) = c.stats()
    assert stats["errors"] == 0 and stats["keys"] == len(params)


def test_a_bad_compression_argument_is_not_blamed_on_the_environment(monkeypatch):
    monkeypatch.delenv("PSRT_COMPRESSION", raising=False)
    with pytest.raises(psrt.ConfigError) as info:
        psrt.Client(servers=["tcp://127.0.0.1:5701"], compression="fp8")
    assert "fp8" in str(info.value) and "PSRT_COMPRESSION" not in str(info.value)
    monkeypatch.setenv("PSRT_COMPRESSION", "fp8")
    with pytest.raises(psrt.ConfigError, match=r"\(PSRT_COMPRESSION\)"):
        ClientConfig()


@pytest.mark.integration
def test_init_without_an_optimizer_uses_the_documented_default(shards):
    import re

    documented = float(re.search(r"``SGD\(lr=([0-9.e-]+)\)``", psrt.Client.init.__doc__).group(1))
    assert documented == psrt.SGD().lr  # the docstring said 0.01
    group = shards(1)
    with psrt.Client(group.endpoints) as c:
        c.init({"w": np.zeros(2, np.float32)})
        np.testing.assert_allclose(c.push_pull({"w": np.ones(2, np.float32)})["w"], -documented)


def test_adam_takes_torchs_betas():
    assert psrt.Adam(betas=(0.8, 0.99)) == psrt.Adam(beta1=0.8, beta2=0.99)  # was a TypeError
    assert psrt.AdamW(lr=0.1, betas=(0.5, 0.6)).to_wire()["beta2"] == 0.6
    with pytest.raises(psrt.ConfigError, match="not both"):
        psrt.Adam(betas=(0.8, 0.99), beta1=0.7)
    with pytest.raises(psrt.ConfigError, match="pair"):
        psrt.Adam(betas=(0.8,))


@pytest.mark.integration
def test_a_server_that_never_became_ready_prints_no_stopped_line(busy_port):
    proc = subprocess.run([*PSRT, "server", "--bind", "tcp://127.0.0.1:*", "--metrics-port", str(busy_port)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--metrics-port" in proc.stderr
    assert "ready" not in proc.stdout and "stopped" not in proc.stdout, proc.stdout


@pytest.mark.integration
def test_a_table_defined_differently_is_named_field_by_field(shards):
    group = shards(1)
    with psrt.Client(group.endpoints) as a, psrt.Client(group.endpoints) as b:
        a.init_embedding("t", dim=4)
        with pytest.raises(psrt.ServerError) as info:
            b.init_embedding("t", dim=8, dtype=np.float64)
    message = str(info.value)
    assert "dim 4 vs 8" in message and "dtype float32 vs float64" in message
    assert "TableSpec(" not in message and "dtype('" not in message and "seed" not in message


def test_a_bad_mode_lists_ssp_too():
    with pytest.raises(psrt.ConfigError, match="'ssp'"):
        Scheduler("tcp://127.0.0.1:*", 1, 1, mode="bsp")


@pytest.mark.integration
def test_psrt_model_does_not_call_its_defaults_a_calibration():
    proc = subprocess.run([*PSRT, "model", "--workers", "1", "--servers", "1"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "calibration" not in proc.stdout and "assumed costs (--calibrate measures them)" in proc.stdout


@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_an_unusable_restart_grace_names_its_variable(monkeypatch, value):
    monkeypatch.setenv("PSRT_RESTART_GRACE", value)
    with pytest.raises(psrt.ConfigError, match="PSRT_RESTART_GRACE"):
        psrt.config.ClusterConfig.from_env()
