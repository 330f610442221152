"""The worker's send path: one sender per shard makes and sends the requests, the routing only routes replies.

What these pin: a chunk's bytes are taken from its tensor in one place (:meth:`psrt.partition.Chunk.of`); the
routing (:mod:`psrt.worker.calls`) makes and sends no request itself, and only the senders touch a shard's
socket to send; the client's public methods keep their signatures; a tensor and an embedding table of one name
keep their versions apart.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest
from _helpers import check_named_setting

import psrt
from psrt.config import ClientConfig
from psrt.partition import PIPELINE_PIECES, Chunk
from psrt.transport import on_this_host

WORKER = Path(psrt.__file__).parent / "worker"


def test_a_chunk_is_a_view_of_its_tensor():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    part = Chunk("w", 1, 5, 4, a.dtype, 0)
    view = part.of(a)
    np.testing.assert_array_equal(view, a.reshape(-1)[5:9])
    assert np.shares_memory(view, a)
    whole = Chunk("w", 0, 0, 12, a.dtype, 0).of(a)
    assert whole.shape == (12,) and np.shares_memory(whole, a)


def _calls_in(path: Path) -> list[ast.Attribute]:
    return [node.func for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)]


def _names_a_socket(node: ast.expr) -> bool:
    """``x._channel`` or ``x.channels[...]``: a shard's DEALER socket."""
    if isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Attribute) and node.attr in ("_channel", "channels")


def test_the_routing_makes_no_request_and_only_senders_send_on_a_socket():
    routing = WORKER / "calls.py"
    source = routing.read_text()
    assert "encode_" not in source, "calls.py must not make requests: a sender does"
    assert not [f for f in _calls_in(routing) if f.attr == "send"], "calls.py must not send: a sender does"
    sending = {path.name for path in WORKER.glob("*.py")
               for f in _calls_in(path) if f.attr == "send" and _names_a_socket(f.value)}
    assert sending == {"sender.py"}


EXPECTED_API = {
    "__init__": "servers=None rank=None num_workers=None *scheduler=None *config=None *cluster=None "
                "*compression=None",
    "barrier": "timeout=None",
    "checkpoint": "timeout=None",
    "close": "failure=None",
    "init": "params optimizer=None timeout=None",
    "init_embedding": "name dim optimizer=None *initial=None *num_rows=None *dtype=float32 *init=normal "
                      "*std=0.01 *low=-0.05 *high=0.05 *seed=0 *admit_after=1 *capacity=None *ttl=None "
                      "*max_pending=None *timeout=None",
    "pull": "names=None timeout=None out=None",
    "pull_async": "names=None out=None",
    "pull_rows": "name ids timeout=None out=None",
    "pull_rows_async": "name ids out=None",
    "push": "grads timeout=None",
    "push_async": "grads",
    "push_pull": "grads timeout=None out=None",
    "push_pull_async": "grads out=None",
    "push_rows": "name ids grads timeout=None",
    "push_rows_async": "name ids grads",
    "stats": "timeout=None",
    "table_stats": "name timeout=None",
}


def _spelled(fn: object) -> str:
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:  # type: ignore[arg-type]
        star = "*" if p.kind is inspect.Parameter.KEYWORD_ONLY else ""
        default = "" if p.default is inspect.Parameter.empty else "=" + getattr(p.default, "__name__", str(p.default))
        out.append(star + p.name + default)
    return " ".join(out)


def test_the_clients_public_methods_keep_their_signatures():
    public = {n: _spelled(getattr(psrt.Client, n)) for n in dir(psrt.Client)
              if (not n.startswith("_") or n == "__init__") and inspect.isfunction(getattr(psrt.Client, n))}
    assert public == EXPECTED_API
    assert {n for n in ("rank", "num_workers", "partition") if isinstance(getattr(psrt.Client, n), property)} == \
        {"rank", "num_workers", "partition"}


@pytest.mark.integration
def test_a_tensor_and_a_table_of_one_name_keep_their_versions_apart(shards):
    """Sync, W = 1: the tensor ``x`` steps twice for each step of the table ``x``; each pull asks for its own
    version (one taken for the other would ask the table for a version no push makes, and be refused)."""
    group = shards(2)
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=20)) as c:
        c.init({"x": np.zeros(8, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        c.init_embedding("x", 4, psrt.SGD(lr=1.0), init="zeros")
        ids = np.arange(6)
        for step in range(1, 4):
            c.push({"x": np.ones(8, np.float32)})
            c.push({"x": np.ones(8, np.float32)})
            c.push_rows("x", ids, np.ones((6, 4), np.float32))
            np.testing.assert_array_equal(c.pull(["x"])["x"], np.full(8, -2.0 * step, np.float32))
            np.testing.assert_array_equal(c.pull_rows("x", ids), np.full((6, 4), -1.0 * step, np.float32))


@pytest.mark.parametrize("endpoint, local", [
    ("ipc:///tmp/psrt-x/s0", True), ("inproc://shard", True), ("tcp://127.0.0.1:5701", True),
    ("tcp://127.3.2.1:5701", True), ("tcp://[::1]:5701", True), ("tcp://localhost:5701", True),
    ("tcp://10.213.4.2:5701", False), ("tcp://[fe80::1]:5701", False), ("tcp://shard-3.cluster:5701", False)])
def test_a_shard_on_this_host_is_told_from_its_endpoint(endpoint, local):
    """Messages to a shard reached without a network are not cut for pipelining; a host name is not resolved."""
    assert on_this_host(endpoint) is local


@pytest.mark.integration
@pytest.mark.parametrize("pipeline, pieces, messages_per_step", [("auto", 1, 1), ("off", 1, 1),
                                                                 ("on", PIPELINE_PIECES, PIPELINE_PIECES // 2)])
def test_the_pipeline_setting_decides_the_cut_whatever_the_endpoints(shards, pipeline, pieces, messages_per_step):
    """On loopback ``auto`` and ``off`` keep a tensor whole (one message a step) and ``on`` cuts it for a network
    anyway, its pieces joined two to a message over the socket for a call that is not paced; sync rounds stay
    exact either way (two workers, the mean of 1 and 3, SGD lr=1), and the shard counts each message of each
    worker."""
    size, steps = 1_000_000, 3  # 4 MB on one shard: whole, or PIPELINE_PIECES pieces of 250 KB
    group = shards(1, workers=2)
    config = ClientConfig(timeout=30, shm=False, pipeline=pipeline)
    clients = [psrt.Client(group.endpoints, rank=r, num_workers=2, config=config) for r in range(2)]
    try:
        for c in clients:
            c.init({"w": np.zeros(size, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        assert len(clients[0]._map.chunks["w"]) == pieces
        for step in range(1, steps + 1):
            handles = [c.push_pull_async({"w": np.full(size, 2 * r + 1, np.float32)}) for r, c in enumerate(clients)]
            for h in handles:
                np.testing.assert_array_equal(h.wait()["w"], np.full(size, -2.0 * step, np.float32))
        assert clients[0].stats()[0]["pushes"] == 2 * steps * messages_per_step
    finally:
        for c in clients:
            c.close()


@pytest.mark.integration
@pytest.mark.parametrize("pipeline, messages_per_step", [("on", 8), ("off", 1)])
def test_a_model_of_small_tensors_crosses_a_network_in_messages_the_shard_answers_one_by_one(
        shards, pipeline, messages_per_step):
    """16 tensors of 125 KB (none cut) on one shard: cut for a network (``on``), a call sends them in messages of
    at most MIN_PIECE_BYTES, two tensors each, so the shard answers one while the next is on the wire (in one
    message, the model crossed a link one way and then the other: a push_pull took twice as long); ``off`` keeps
    one message. Sync rounds stay exact (two workers, the mean of 1 and 3, SGD lr=1)."""
    names, steps = [f"t{i:02d}" for i in range(16)], 2
    group = shards(1, workers=2)
    config = ClientConfig(timeout=30, shm=False, pipeline=pipeline)
    clients = [psrt.Client(group.endpoints, rank=r, num_workers=2, config=config) for r in range(2)]
    try:
        for c in clients:
            c.init({n: np.zeros(32_000, np.float32) for n in names}, optimizer=psrt.SGD(lr=1.0))
        for step in range(1, steps + 1):
            handles = [c.push_pull_async({n: np.full(32_000, 2 * r + 1, np.float32) for n in names})
                       for r, c in enumerate(clients)]
            for h in handles:
                got = h.wait()
                assert sorted(got) == names
                for values in got.values():
                    np.testing.assert_array_equal(values, np.full(32_000, -2.0 * step, np.float32))
        assert clients[0].stats()[0]["pushes"] == 2 * steps * messages_per_step
    finally:
        for c in clients:
            c.close()


def test_a_pipeline_setting_other_than_auto_on_or_off_is_refused(monkeypatch):
    check_named_setting(monkeypatch, "pipeline", "PSRT_PIPELINE", "'auto', 'on' or 'off'", ("yes", "always"), "off")
