"""CURVE security: the job's keys let a client in; other keys, no keys or a NULL peer reach no handler.

Real sockets throughout, and real processes where the issue names a command (``psrt keygen``, ``psrt server
--keys``, ``psrt launch --secure``). Whether bytes are encrypted is checked on the wire itself, through a small
TCP relay that records what it forwards.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import zmq.auth
from _helpers import RawPeer, Relay, launched_results, scheduling, serving, worker_command
from zmq.utils import z85

import psrt
from psrt import transport
from psrt.config import ClientConfig, ServerConfig, WireLimits
from psrt.control import security
from psrt.control.scheduler import SchedulerLink
from psrt.shard.server import Server
from psrt.transport import curve

PSRT = [sys.executable, "-m", "psrt.cli"]
#: How long a refused peer's call would wait without the handshake monitor (its timeout here); the monitor reports
#: a refusal at once, so that the call ends within half of it, a margin a loaded host cannot eat, tells the two apart.
WAIT_S = 5.0
REFUSED_WITHIN_S = WAIT_S / 2
COUNTERS = ("inits", "pushes", "pulls", "rounds", "duplicates", "errors", "dropped_replies", "bytes_in", "bytes_out")


@pytest.fixture
def job_keys(tmp_path: Path) -> Path:
    return security.keygen(tmp_path / "job").directory


@pytest.fixture
def other_keys(tmp_path: Path) -> Path:
    return security.keygen(tmp_path / "other").directory


@pytest.fixture
def stolen_server_key(tmp_path: Path, job_keys: Path, other_keys: Path) -> Path:
    """The job's server public key (anyone may know it) with a client pair the job never issued."""
    mixed = tmp_path / "mixed"
    mixed.mkdir(mode=0o700)
    shutil.copy(job_keys / "server.key", mixed)
    for name in ("client.key", "client.key_secret"):
        shutil.copy(other_keys / name, mixed)
    return mixed


def counters(server: Server) -> dict[str, int]:
    c = dataclasses.asdict(server.counters)
    return {k: c[k] for k in COUNTERS}


def client_config(keys: Optional[Path], timeout: float = 5.0, **kw) -> ClientConfig:
    return ClientConfig(timeout=timeout, keys=None if keys is None else str(keys), **kw)


# ---------------------------------------------------------------------------------------------- keys on disk
@pytest.mark.integration
def test_keygen_writes_loadable_keys_with_private_secrets(tmp_path):
    target = tmp_path / "made" / "keys"
    proc = subprocess.run([*PSRT, "keygen", str(target)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert str(target) in proc.stdout
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
    for pair in ("server", "client"):
        public, secret = zmq.auth.load_certificate(str(target / f"{pair}.key_secret"))
        assert zmq.auth.load_certificate(str(target / f"{pair}.key")) == (public, None)
        assert len(public) == 40 and secret is not None and len(secret) == 40
        assert stat.S_IMODE((target / f"{pair}.key_secret").stat().st_mode) == 0o600
    assert sorted(p.name for p in target.iterdir()) == ["client.key", "client.key_secret", "server.key",
                                                         "server.key_secret"]
    before = (target / "client.key_secret").read_bytes()
    again = subprocess.run([*PSRT, "keygen", str(target)], capture_output=True, text=True, timeout=30)
    assert again.returncode != 0 and "already holds keys" in again.stderr
    assert (target / "client.key_secret").read_bytes() == before  # never overwritten


def test_a_secret_readable_by_others_is_refused(job_keys):
    os.chmod(job_keys / "server.key_secret", 0o644)
    with pytest.raises(psrt.ConfigError, match="chmod 600"):
        security.load_keys(job_keys, serve=True)
    with pytest.raises(psrt.ConfigError, match="chmod 600"):
        Server(ServerConfig(bind="tcp://127.0.0.1:*", keys=str(job_keys)))


def test_a_missing_key_file_is_named(job_keys):
    (job_keys / "client.key_secret").unlink()
    security.load_keys(job_keys, serve=True, connect=False)  # a shard does not need the client's secret
    with pytest.raises(psrt.ConfigError, match="client.key_secret"):
        psrt.Client(["tcp://127.0.0.1:1"], config=client_config(job_keys))


@pytest.mark.integration
@pytest.mark.parametrize("command", [["server"], ["scheduler"]])
def test_keys_in_a_missing_directory_are_a_one_line_error(command, tmp_path):
    missing = tmp_path / "nonexistent"
    proc = subprocess.run([*PSRT, *command, "--bind", "tcp://127.0.0.1:*", "--keys", str(missing)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(missing) in lines[0] and "psrt keygen" in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


# ---------------------------------------------------------------------------------------------- who gets in
def test_a_secured_shard_serves_the_jobs_clients(job_keys):
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", keys=str(job_keys))) as server:
        with psrt.Client([server.endpoint], config=client_config(job_keys)) as c:
            c.init({"w": np.zeros(5, np.float32)}, optimizer=psrt.SGD(lr=1.0))
            got = c.push_pull({"w": np.arange(5, dtype=np.float32)})
            np.testing.assert_array_equal(got["w"], -np.arange(5, dtype=np.float32))
        assert counters(server)["pushes"] == 1 and counters(server)["inits"] == 1


@pytest.mark.parametrize("who", ["other-job", "stolen-server-key", "no-keys"])
def test_a_client_without_the_jobs_keys_is_refused_and_reaches_nothing(who, job_keys, other_keys,
                                                                       stolen_server_key):
    keys = {"other-job": other_keys, "stolen-server-key": stolen_server_key, "no-keys": None}[who]
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", keys=str(job_keys))) as server:
        before = counters(server)
        with psrt.Client([server.endpoint], config=client_config(keys, timeout=WAIT_S)) as c:
            started = time.monotonic()
            with pytest.raises(psrt.AuthenticationError) as info:
                c.init({"w": np.ones(5, np.float32)})
            elapsed = time.monotonic() - started
            with pytest.raises(psrt.AuthenticationError):
                c.stats()
        time.sleep(0.2)  # anything that did slip through would be counted by now
        assert counters(server) == before
    assert elapsed < REFUSED_WITHIN_S, f"refusal took {elapsed:.2f}s: the handshake monitor should report it at once"
    message = str(info.value)
    assert server.endpoint in message and "PSRT_KEYS" in message and "--keys" in message
    assert info.value.endpoint == server.endpoint
    assert isinstance(info.value, PermissionError) and isinstance(info.value, psrt.PsrtError)


def test_a_shard_back_with_other_keys_fails_the_next_call_at_once(job_keys, other_keys):
    """A refused reconnection leaves the DEALER no queue (ZeroMQ does not retry it), so the next request finds no
    room: its wait for room watches the handshake monitor and ends with the refusal, not the send timeout."""
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", keys=str(job_keys))) as first:
        endpoint = first.endpoint
        c = psrt.Client([endpoint], config=client_config(job_keys, timeout=WAIT_S))
        c.init({"w": np.zeros(5, np.float32)}, optimizer=psrt.SGD(lr=1.0))
    try:
        with serving(ServerConfig(bind=endpoint, keys=str(other_keys))) as second:
            # The reconnection's refusal is in the monitor, unread: nothing has waited on the socket since.
            assert c._calls.channels[0].monitor.poll(int(WAIT_S * 1000)), "the client never tried the new shard"
            started = time.monotonic()
            with pytest.raises(psrt.AuthenticationError) as info:
                c.push_pull({"w": np.ones(5, np.float32)})
            elapsed = time.monotonic() - started
            assert counters(second)["pushes"] == 0 and counters(second)["bytes_in"] == 0
    finally:
        c.close()
    assert elapsed < REFUSED_WITHIN_S, f"refusal took {elapsed:.2f}s: the wait for room should report it at once"
    assert info.value.endpoint == endpoint and "PSRT_KEYS" in str(info.value)


def test_the_zap_handler_admits_only_the_jobs_curve_key_in_psrt_s_domain(job_keys, other_keys):
    job, other = security.load_keys(job_keys), security.load_keys(other_keys)
    ctx = transport.new_context()
    try:
        handler = curve.ZapHandler(ctx, curve._OnlyKey(job.client_public))
        try:
            def status(*, key: bytes = job.client_public, domain: bytes = b"psrt", mechanism: bytes = b"CURVE",
                       version: bytes = b"1.0") -> bytes:
                request = [b"peer", b"", version, b"7", domain, b"127.0.0.1", b"", mechanism, z85.decode(key)]
                reply = handler.answer(request)
                assert reply[:4] == [b"peer", b"", b"1.0", b"7"]  # routed back, the request's id answered
                return reply[4]

            assert status() == b"200"
            assert status(key=other.client_public) == b"400"
            assert status(key=job.server_public) == b"400"  # the server's public key is no client key
            assert status(domain=b"other") == b"400"
            assert status(mechanism=b"PLAIN") == b"400"
            assert status(version=b"2.0") == b"400"
            assert handler.answer([b"peer", b"", b"1.0"]) is None  # nothing ZeroMQ would send: no reply
        finally:
            handler.stop()
        assert not handler._thread.is_alive()
    finally:
        ctx.term()


def test_a_raw_null_mechanism_peer_reaches_no_handler(job_keys):
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", keys=str(job_keys))) as server:
        before = counters(server)
        with RawPeer(server.endpoint) as peer:
            peer.send(psrt.wire.encode_stats_request(1))
            peer.send(psrt.wire.encode_pull(2, 0, [["w", 0, 0]]))
            answered = peer.answered(1.0)
        assert not answered
        assert counters(server) == before


def test_a_keyed_client_refuses_an_unsecured_shard(job_keys):
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", keys=None)) as server:
        with psrt.Client([server.endpoint], config=client_config(job_keys)) as c:
            with pytest.raises(psrt.AuthenticationError, match="PSRT_KEYS"):
                c.stats()
        assert counters(server)["errors"] == 0 and counters(server)["bytes_in"] == 0


@pytest.mark.parametrize("who", ["other-job", "stolen-server-key", "no-keys"])
def test_the_scheduler_refuses_an_unkeyed_registration(who, job_keys, other_keys, stolen_server_key):
    keys = {"other-job": other_keys, "stolen-server-key": stolen_server_key, "no-keys": None}[who]
    with scheduling(1, 1, keys=str(job_keys)) as sched:
        ctx = psrt.transport.new_context()
        link = SchedulerLink(ctx, sched.endpoint, keys=keys)
        try:
            started = time.monotonic()
            with pytest.raises(psrt.AuthenticationError, match="PSRT_KEYS") as info:
                link.register("worker", timeout=WAIT_S)
            assert time.monotonic() - started < REFUSED_WITHIN_S
            assert sched.endpoint in str(info.value)
        finally:
            link.close()
            ctx.term()
        time.sleep(0.2)
        assert sched._forming.pending == [] and not sched._formed  # the registration never arrived
        # The job's keys still get in.
        ctx = psrt.transport.new_context()
        good = SchedulerLink(ctx, sched.endpoint, keys=job_keys)
        try:
            table = good.table(timeout=5.0)
            assert (table.num_servers, table.num_workers) == (1, 1)
        finally:
            good.close()
            ctx.term()


# ---------------------------------------------------------------------------------------------- on the wire
@pytest.mark.parametrize("secure", [True, False], ids=["curve", "plain"])
def test_gradients_are_never_readable_on_the_wire_with_keys(secure, job_keys):
    keys = job_keys if secure else None
    grad = np.arange(4096, dtype=np.float32) * 0.25 + 1000.0
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", keys=None if keys is None else str(keys))) as server:
        relay = Relay(server.endpoint)
        try:
            # (shm=False: the relay is on loopback, and a client of a shard on its own host would leave the wire
            # for a local connection, which no other host can reach)
            with psrt.Client([relay.endpoint], config=client_config(keys, shm=False)) as c:
                c.init({"w": np.zeros(grad.size, np.float32)}, optimizer=psrt.SGD(lr=1.0))
                params = c.push_pull({"w": grad})
        finally:
            relay.close()
    np.testing.assert_array_equal(params["w"], -grad)
    grad_bytes, param_bytes = grad.tobytes()[1024:1280], (-grad).tobytes()[1024:1280]
    assert len(relay.to_server) > grad.nbytes and len(relay.to_client) > grad.nbytes  # it all went through
    assert (grad_bytes in relay.to_server) is not secure
    assert (param_bytes in relay.to_client) is not secure


# ---------------------------------------------------------------------------------------------- frame limits
def test_maxmsgsize_follows_the_decode_limits(job_keys):
    limit = 1 << 20
    config = ServerConfig(bind="tcp://127.0.0.1:*", keys=str(job_keys), limits=WireLimits(max_tensor_bytes=limit))
    with serving(config) as server:
        # A push whose frame is exactly the limit passes, encrypted (CURVE adds its envelope on the wire).
        with psrt.Client([server.endpoint], config=client_config(job_keys, partition_bytes=limit)) as c:
            c.init({"w": np.zeros(limit // 4, np.float32)}, optimizer=psrt.SGD(lr=1.0))
            got = c.push_pull({"w": np.ones(limit // 4, np.float32)})
        np.testing.assert_array_equal(got["w"], -np.ones(limit // 4, np.float32))
        before = counters(server)
        # A frame no valid message can hold gets its sender disconnected before any decoding: no error reply.
        with RawPeer(server.endpoint, keys=security.load_keys(job_keys)) as peer:
            peer.send(psrt.wire.encode_stats_request(1))
            assert peer.answered(5.0), "a keyed peer is answered"
            peer.recv()
            peer.send([b"x" * (limit + 4096)])
            answered = peer.answered(1.0)
        assert not answered
        after = counters(server)
        assert after == {**before, "bytes_in": after["bytes_in"], "bytes_out": after["bytes_out"]}
        assert after["errors"] == before["errors"]


# ---------------------------------------------------------------------------------------------- processes
@pytest.mark.integration
def test_a_shard_process_takes_its_keys_from_psrt_keys(job_keys, monkeypatch, shards):
    monkeypatch.setenv("PSRT_KEYS", str(job_keys))
    group = shards(1)
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=5.0)) as c:  # keys from PSRT_KEYS too
        c.init({"w": np.zeros(3, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        np.testing.assert_array_equal(c.push_pull({"w": np.ones(3, np.float32)})["w"], -np.ones(3, np.float32))
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=5.0, keys="")) as c:  # empty: off
        with pytest.raises(psrt.AuthenticationError, match="runs without keys"):
            c.stats()


@pytest.mark.integration
def test_launch_secure_trains_and_leaves_no_key_directory(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PSRT_KEYS"}
    proc = subprocess.run([*PSRT, "launch", "--secure", "-s", "1", "-w", "2", "--", *worker_command("secure")],
                          capture_output=True, text=True, timeout=120, env={**env, "TMPDIR": str(scratch)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = launched_results(proc.stdout)
    assert [r["rank"] for r in rows] == [0, 1]
    assert all(r["w0"] == -4.5 for r in rows)  # 3 sync rounds of the mean gradient (1 + 2) / 2
    assert all(r["refused"] for r in rows)
    assert rows[0]["keys"] == rows[1]["keys"] and rows[0]["mode"] == 0o700
    assert Path(rows[0]["keys"]).parent == scratch
    assert not Path(rows[0]["keys"]).exists()
    assert list(scratch.iterdir()) == []


@pytest.mark.integration
def test_psrt_stats_needs_the_keys_of_a_secured_scheduler(job_keys):
    env = {k: v for k, v in os.environ.items() if k != "PSRT_KEYS"}
    sched = subprocess.Popen([*PSRT, "scheduler", "--bind", "tcp://127.0.0.1:*", "--keys", str(job_keys)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = sched.stdout.readline()
        assert "psrt-scheduler ready" in line, line
        endpoint = line.split("endpoint=")[1].split()[0]
        started = time.monotonic()
        refused = subprocess.run([*PSRT, "stats", endpoint, "--count", "1"], capture_output=True, text=True,
                                 timeout=30, env=env)
        assert time.monotonic() - started < 10
        assert refused.returncode == 2 and "PSRT_KEYS" in refused.stderr and endpoint in refused.stderr
        keyed = subprocess.run([*PSRT, "stats", endpoint, "--count", "1"], capture_output=True, text=True,
                               timeout=30, env={**env, "PSRT_KEYS": str(job_keys)})
        assert keyed.returncode == 2 and "no servers have joined yet" in keyed.stderr, keyed.stdout + keyed.stderr
    finally:
        sched.terminate()
        sched.wait(10)
        sched.stdout.close()


def test_a_keyless_handshake_cut_short_once_is_no_refusal_but_again_and_again_is():
    """A keyless socket whose handshake ends with no detail (a peer that hangs up at once here; at scale: a
    scheduler too busy to greet within the handshake interval) keeps waiting, as ZeroMQ connects again; only a peer
    that drops it at every attempt, as a secured one drops a keyless one, is a refusal (keys on one side only)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(10)
    ctx = zmq.Context()
    ch = transport.DealerChannel(ctx, f"tcp://127.0.0.1:{listener.getsockname()[1]}", 1000)

    def cut_short() -> None:  # one handshake cut short, and the monitor's report of it taken in
        listener.accept()[0].close()
        assert ch.monitor.poll(10_000), "no monitor event within 10 s"
        ch.check_handshake()

    try:
        for _ in range(transport.UNFINISHED_HANDSHAKES - 1):
            cut_short()  # does not raise
        assert not ch.refused
        with pytest.raises(psrt.AuthenticationError, match="PSRT_KEYS"):
            cut_short()
        assert ch.refused
    finally:
        ch.close()
        ctx.term()
        listener.close()
