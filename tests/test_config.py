"""Configuration facts written once: one reader of the environment, named defaults, flags built from the fields."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import numpy as np
import pytest

import psrt
from psrt import cli, config
from psrt.cluster.daemon import run_server
from psrt.config import ClusterConfig, RowLimits, ServerConfig
from psrt.control.link import HeartbeatThread, SchedulerLink
from psrt.control.process import SCHEDULER_READY, SERVER_READY, Child, psrt_command, stop_children
from psrt.control.scheduler import Scheduler
from psrt.shard.server import Server

PSRT_DIR = Path(psrt.__file__).parent
CONFIGS = (ServerConfig, psrt.config.ClientConfig, ClusterConfig, RowLimits)


def _reads_the_environment(node: ast.AST) -> bool:
    """``os.environ.get(...)``, ``os.environ[...]`` read, ``NAME in os.environ`` or ``os.getenv(...)``."""
    def is_environ(n: ast.AST) -> bool:
        return isinstance(n, ast.Attribute) and n.attr == "environ" and isinstance(n.value, ast.Name) \
            and n.value.id == "os"

    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in ("get", "getenv") and (is_environ(node.func.value) or node.func.attr == "getenv"):
            return True
    if isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
        return True
    return isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators)


def test_only_config_reads_environment_variables():
    # A child's environment may be passed on ({**os.environ, ...}), but a variable is read in one place.
    readers = []
    for path in PSRT_DIR.rglob("*.py"):
        if path.name == "config.py" and path.parent == PSRT_DIR:
            continue
        if any(_reads_the_environment(n) for n in ast.walk(ast.parse(path.read_text()))):
            readers.append(str(path.relative_to(PSRT_DIR)))
    assert readers == []


def test_every_variable_is_in_the_configs_table():
    table = config.__doc__
    for kind in CONFIGS:
        for f in dataclasses.fields(kind):
            for name in f.metadata.get("env", ()):
                assert f"``{name}``" in table, f"{kind.__name__}.{f.name}: {name} is missing from psrt.config's table"


def test_the_defaults_are_named_once():
    cluster = ClusterConfig()
    assert (cluster.start_timeout, cluster.heartbeat_interval, cluster.heartbeat_timeout, cluster.restart_grace) == (
        config.START_TIMEOUT, config.HEARTBEAT_INTERVAL, config.HEARTBEAT_TIMEOUT, config.RESTART_GRACE)
    assert ClusterConfig.from_env({}) == cluster
    assert (config.START_TIMEOUT, config.HEARTBEAT_INTERVAL, config.HEARTBEAT_TIMEOUT, config.RESTART_GRACE) == (
        120.0, 0.5, 2.5, 30.0)
    defaults = {name: p.default for cls in (Scheduler, SchedulerLink, HeartbeatThread)
                for name, p in inspect.signature(cls).parameters.items()}
    assert defaults["start_timeout"] is config.START_TIMEOUT
    assert defaults["heartbeat_timeout"] is defaults["timeout"] is config.HEARTBEAT_TIMEOUT
    assert defaults["heartbeat_interval"] is defaults["interval"] is config.HEARTBEAT_INTERVAL
    assert defaults["restart_grace"] is config.RESTART_GRACE


def test_a_variable_is_read_alike_by_every_config(monkeypatch):
    monkeypatch.setenv("PSRT_STALENESS", "3")
    monkeypatch.setenv("PSRT_KEYS", "")
    assert ServerConfig().staleness == ClusterConfig.from_env().staleness == 3
    assert ServerConfig().keys is ClusterConfig.from_env().keys is psrt.config.ClientConfig().keys is None
    monkeypatch.setenv("PSRT_STALENESS", "three")
    for make in (ServerConfig, ClusterConfig.from_env):
        with pytest.raises(psrt.ConfigError, match=r"environment variable PSRT_STALENESS = 'three' must be an "):
            make()


def test_row_limits_come_from_the_servers_config(monkeypatch):
    monkeypatch.setenv("PSRT_MAX_ROWS_PER_MESSAGE", "100")
    assert ServerConfig().row_limits == RowLimits(100, 1 << 28)
    limits = RowLimits(max_rows_per_message=7, max_table_rows=9)
    server = Server(ServerConfig(bind="tcp://127.0.0.1:*", row_limits=limits))
    try:
        assert server.tables.limits is limits
    finally:
        server.close()


def _subparser(name: str):
    import argparse

    (group,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return group.choices[name]


@pytest.mark.parametrize("command, kind, own", [
    ("server", ServerConfig, {"--scheduler", "--host", "--metrics-port", "--metrics-host"}),
    ("scheduler", ClusterConfig, {"--bind"}),
])
def test_a_daemons_flags_are_its_configs_fields(command, kind, own):
    flags = {a.option_strings[-1] for a in _subparser(command)._actions if a.option_strings} - {"--help"}
    assert flags - own == {flag.name for _, flag in config.flags(kind)}


def test_server_flags_reach_the_config_they_name(tmp_path):
    argv = ["server", "--bind", "tcp://127.0.0.1:*", "--workers", "3", "--mode", "ssp", "--staleness", "2",
            "--nonfinite", "allow", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "4",
            "--checkpoint-secs", "1.5", "--restore", "--rank", "2", "--keys", str(tmp_path)]
    made = ServerConfig(**cli._settings(ServerConfig, cli.build_parser().parse_args(argv)))
    assert made == dataclasses.replace(
        ServerConfig(), bind="tcp://127.0.0.1:*", num_workers=3, mode="ssp", staleness=2, nonfinite="allow",
        checkpoint_dir=str(tmp_path), checkpoint_every=4, checkpoint_secs=1.5, restore=True, rank=2,
        keys=str(tmp_path))
    # run_server takes the config's fields by their names only: none is spelled again in its signature.
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    assert not fields & set(inspect.signature(run_server).parameters)


def test_scheduler_flags_reach_its_config(monkeypatch):
    monkeypatch.setenv("PSRT_RESTART_GRACE", "7")
    args = cli.build_parser().parse_args(["scheduler", "--servers", "3", "--workers", "4", "--mode", "ssp",
                                          "--staleness", "1", "--timeout", "inf", "--elastic"])
    given = {k: v for k, v in cli._settings(ClusterConfig, args).items() if v is not None}
    made = dataclasses.replace(ClusterConfig.from_env(), **given)
    assert (made.num_servers, made.num_workers, made.mode, made.staleness, made.start_timeout, made.elastic,
            made.restart_grace) == (3, 4, "ssp", 1, float("inf"), True, 7.0)


def test_the_roles_that_register_are_the_process_roles_but_the_schedulers():
    assert psrt.wire.control.REGISTERING_ROLES == ("server", "worker")
    assert set(psrt.wire.control.REGISTERING_ROLES) == set(config.PROCESS_ROLES) - {"scheduler"}


@pytest.mark.integration
def test_psrt_run_as_a_server_follows_psrt_nonfinite():
    # `psrt run` started its server with nonfinite="reject" whatever PSRT_NONFINITE said (psrt server read it).
    psrt_ = psrt_command()
    procs = [Child([*psrt_, "scheduler", "--bind", "tcp://127.0.0.1:*", "--servers", "1", "--workers", "1"],
                   label="scheduler", ready=SCHEDULER_READY)]
    try:
        endpoint = procs[0].wait_ready(60).group(1)
        procs.append(Child([*psrt_, "run"], label="server", ready=SERVER_READY,
                           env={"PSRT_ROLE": "server", "PSRT_SCHEDULER": endpoint, "PSRT_NODE_HOST": "127.0.0.1",
                                "PSRT_NONFINITE": "allow"}))
        with psrt.Client(scheduler=endpoint) as client:
            client.init({"w": np.zeros(2, np.float32)}, optimizer=psrt.SGD(lr=1.0))
            out = client.push_pull({"w": np.array([np.nan, 1.0], np.float32)})["w"]
            assert np.isnan(out[0]) and out[1] == -1.0
        assert [p.wait(60) for p in procs] == [0, 0]
    finally:
        stop_children(procs)
