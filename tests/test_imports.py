"""What a process loads: ``import psrt`` is light, and each role imports its own side of the house only.

A job on one host starts a process per worker and shard; what every one of them imports at start-up is paid that
many times (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys

import pytest
import zmq

import psrt
from psrt import transport
from psrt.errors import ProtocolError


def loaded_after(statement: str) -> dict:
    """Run ``statement`` in a fresh interpreter: the modules it loaded and the threads it runs afterwards."""
    probe = (f"{statement}\nimport json, sys, threading\n"
             "print(json.dumps({'modules': sorted(sys.modules), 'threads': threading.active_count()}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def heavy(modules: list[str], *roots: str) -> list[str]:
    return [m for m in modules if m.split(".")[0] in roots or any(m == r or m.startswith(r + ".") for r in roots)]


@pytest.mark.integration
def test_importing_psrt_loads_no_client_stack_and_starts_nothing():
    got = loaded_after("import psrt")
    assert heavy(got["modules"], "numpy", "zmq", "msgpack", "asyncio", "psrt.worker", "psrt.shard",
                 "psrt.wire", "psrt.transport") == []
    assert got["threads"] == 1


@pytest.mark.integration
@pytest.mark.parametrize(("role", "statement", "absent"), [
    ("scheduler", "import psrt.control.scheduler", ("psrt.worker", "psrt.shard", "psrt.shm", "psrt.cluster",
                                                    "asyncio", "torch")),
    ("shard", "import psrt.shard.server", ("psrt.worker", "psrt.cluster", "asyncio", "torch")),
    ("worker", "import psrt; psrt.Client", ("psrt.shard", "psrt.cluster", "asyncio", "torch")),
    ("command line", "import psrt.cli", ("psrt.worker", "psrt.shard", "psrt.control", "zmq", "asyncio")),
])
def test_each_role_imports_its_own_side_only(role, statement, absent):
    got = loaded_after(statement)
    assert heavy(got["modules"], *absent) == [], f"the {role} process loads these"
    assert got["threads"] == 1, f"the {role} process started a thread at import"


def test_every_public_name_resolves_where_it_is_defined():
    for name in psrt.__all__:
        value = getattr(psrt, name)
        if name != "__version__":
            assert value.__module__.startswith("psrt."), name
    assert set(psrt.__all__) <= set(dir(psrt))
    from psrt.worker.client import Client
    assert psrt.Client is Client
    with pytest.raises(AttributeError, match="no attribute 'Clients'"):
        psrt.Clients  # noqa: B018


def test_every_module_is_reached_from_the_package_as_before():
    """``import psrt`` then ``psrt.wire...`` works as when the package imported the client stack eagerly; only
    ``psrt.torch`` (torch) and ``psrt.cli`` want an import of their own."""
    modules = {m.name for m in pkgutil.iter_modules(psrt.__path__)}
    assert psrt._SUBMODULES == modules - {"_core", "errors", "torch", "cli"}
    for name in sorted(psrt._SUBMODULES):
        assert getattr(psrt, name) is importlib.import_module(f"psrt.{name}")


def test_a_monitor_event_is_read_from_its_frames():
    ctx = zmq.Context()
    try:
        server = ctx.socket(zmq.ROUTER)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client = ctx.socket(zmq.DEALER)
        monitor = client.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        client.connect(f"tcp://127.0.0.1:{port}")
        assert monitor.poll(10_000), "no handshake within 10 s on loopback"
        event, value = transport.monitor_event(monitor.recv_multipart())
        assert (event, value) == (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
        client.disable_monitor()
        for sock in (monitor, client, server):
            sock.close(0)
    finally:
        ctx.term()
    for frames in ([b"\x00" * 6], [b"\x00" * 5, b"tcp://x"], []):
        with pytest.raises(ProtocolError, match="not a socket monitor event"):
            transport.monitor_event(frames)

