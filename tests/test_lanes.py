"""Shared-memory lanes: segments in /dev/shm, the proof of a shared host, exactness against sockets, hostile
lane headers, fallbacks, and that no file outlives its shard."""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import subprocess
import sys

import msgpack
import numpy as np
import pytest
from _helpers import RawPeer, needs_shm, packed, push_header, run_workers, serving, worker_command
from _workers import async_pusher_expected

import psrt
from psrt import shm
from psrt.config import ClientConfig, ServerConfig
from psrt.control.process import parse_results
from psrt.errors import ConfigError
from psrt.shm import lanes

pytestmark = needs_shm(256)

BIG = 300_000  # float32 values: 1.2 MB, well over the lane threshold


def our_files(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) if shm.valid_name(n) and n.split("-")[2] == str(pid))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    return proc.pid


# ---------------------------------------------------------------------------------------------- segments
def test_a_segment_is_private_exclusive_and_its_file_goes_once_a_worker_maps_it():
    name = f"psrt-{secrets.token_hex(6)}-{os.getpid()}-g1"
    seg = shm.Segment.create(name, 1, 1 << 16)
    try:
        path = shm.SHM_DIR / name
        assert path.stat().st_mode & 0o777 == 0o600
        with pytest.raises(FileExistsError):
            shm.Segment.create(name, 1, 1 << 16)  # O_EXCL: never someone else's file
        other = shm.Segment.attach(name, 1, 1 << 16)
        assert not path.exists(), "the worker unlinks the file once both sides map it"
        seg.array(64, np.dtype(np.float32), 4)[:] = [1, 2, 3, 4]
        assert other.array(64, np.dtype(np.float32), 4).tolist() == [1, 2, 3, 4]  # one memory, two mappings
    finally:
        seg.unlink()


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "psrt-abc", "x-0123456789ab-1-g1",
                                  "psrt-0123456789ab-1-beacon", "psrt-0123456789ab-1-g1/../x"])
def test_a_worker_opens_only_segment_names_never_paths(name):
    with pytest.raises(ConfigError, match="not a psrt segment name"):
        shm.Segment.attach(name, 1, 4096)
    assert shm.Beacon.read(name) is None or name.endswith("beacon")


def test_attach_checks_the_generation_and_the_size_the_shard_announced():
    name = f"psrt-{secrets.token_hex(6)}-{os.getpid()}-g7"
    seg = shm.Segment.create(name, 7, 8192)
    try:
        with pytest.raises(ConfigError, match="generation"):
            shm.Segment.attach(name, 8, 8192)
        with pytest.raises(ConfigError, match="size"):
            shm.Segment.attach(name, 7, 4096)
        assert (shm.SHM_DIR / name).exists(), "a refused segment is left to its shard"
    finally:
        seg.unlink()


@pytest.mark.integration
def test_a_dead_shards_files_are_removed_and_a_live_ones_kept():
    tag = secrets.token_hex(6)
    dead, live = dead_pid(), os.getpid()
    names = [f"psrt-{tag}-{dead}-beacon", f"psrt-{tag}-{dead}-g3", f"psrt-{tag}-{live}-g4"]
    for n in names:
        (shm.SHM_DIR / n).write_bytes(b"x")
    try:
        removed = shm.remove_leftovers()
        assert set(names[:2]) <= set(removed) and names[2] not in removed
        assert [(shm.SHM_DIR / n).exists() for n in names] == [False, False, True]
    finally:
        for n in names:
            (shm.SHM_DIR / n).unlink(missing_ok=True)


def test_a_segment_name_is_built_and_parsed_in_one_place_and_names_every_file_a_shard_makes(tmp_path):
    tag = shm.endpoint_tag("tcp://127.0.0.1:5555")
    names = [shm.SegmentName(tag, 4321, shm.SegmentName.BEACON), shm.SegmentName(tag, 4321, shm.SegmentName.LANE, 7),
             shm.SegmentName(tag, 1, shm.SegmentName.ARENA, 2**63)]
    assert [str(n) for n in names] == [f"psrt-{tag}-4321-beacon", f"psrt-{tag}-4321-g7", f"psrt-{tag}-1-a{2**63}"]
    assert [shm.SegmentName.parse(str(n)) for n in names] == names
    assert names[0].sibling(shm.SegmentName.ARENA, 2**63) == shm.SegmentName(tag, 4321, shm.SegmentName.ARENA, 2**63)
    for bad in ["../../etc/passwd", "psrt-abc", f"psrt-{tag}-1-b3", f"psrt-{tag}-1-g", f"psrt-{tag}-1-g1/../x",
                f"psrt-{tag.upper()}-1-g1", f"psrt-{tag}-12345678901-g1", None, 5]:
        assert shm.SegmentName.parse(bad) is None and not shm.valid_name(bad)
    # What the shard side makes parses back to its own process and the kind it is.
    beacon = shm.Beacon(tag, tmp_path)
    try:
        assert shm.SegmentName.parse(beacon.name) == shm.SegmentName.own(tag, shm.SegmentName.BEACON)
        assert shm.SegmentName.own(tag, shm.SegmentName.BEACON).pid == os.getpid()
    finally:
        beacon.remove()
    endpoint = f"ipc:///tmp/{secrets.token_hex(8)}"  # a tag no other shard has
    shard = lanes.ShardLanes(endpoint, True)
    try:
        beacon = msgpack.unpackb(shard.probe(psrt.wire.LaneProbeRequest(1))[0])["name"]
        lane = msgpack.unpackb(shard.open(psrt.wire.LaneOpenRequest(2, 0, 5, shm.Beacon.read(beacon), 1 << 16))[0])
        own = shm.SegmentName.own(shm.endpoint_tag(endpoint), shm.SegmentName.LANE, lane["generation"])
        assert shm.SegmentName.parse(lane["name"]) == own
        assert shm.SegmentName.parse(beacon) == own.sibling(shm.SegmentName.BEACON, 0)
    finally:
        shard.close()


def test_a_call_below_the_transports_copy_threshold_stays_on_sockets_without_asking_the_shard():
    asked = []
    worker = lanes.WorkerLanes(1, 0, 5, True)
    ask = lambda encode: asked.append(encode) or psrt.wire.BeaconReply(1, "")  # noqa: E731
    assert worker.lane_for(0, psrt.transport.ZERO_COPY_BYTES - 1, ask) is None and asked == []
    assert worker.lane_for(0, psrt.transport.ZERO_COPY_BYTES, ask) is None  # it asked: no beacon here
    assert asked == [psrt.wire.encode_lane_probe]


def test_the_shared_parameters_log_under_their_own_name(monkeypatch, caplog):
    from psrt.shm.arena import Arena

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm.Segment, "create", full)
    with caplog.at_level("INFO", logger="psrt.arena"):
        area = Arena(shm.endpoint_tag("tcp://x:1"), iter(range(1, 9)).__next__).allocate(np.dtype(np.float32), 4)
    assert [(r.name, r.getMessage()) for r in caplog.records] == \
        [("psrt.arena", f"parameters stay private (no room in {shm.SHM_DIR}: No space left on device)")]
    assert area is None  # nothing shared: the entry keeps its private parameters


# ---------------------------------------------------------------------------------------------- end to end
def train(endpoints: list[str], shm_on: bool, steps: int = 6) -> tuple[dict, list[dict]]:
    """A fixed sequence of pushes, push_pulls and pulls (tensors above and below the lane threshold)."""
    rng = np.random.default_rng(11)
    init = {"big": rng.standard_normal(BIG).astype(np.float32), "f64": rng.standard_normal((300, 70)),
            "small": rng.standard_normal(100).astype(np.float32)}
    config = ClientConfig(timeout=30, partition_bytes=256 << 10, shm=shm_on)
    with psrt.Client(endpoints, config=config) as c:
        c.init(init, optimizer=psrt.Adam(lr=0.01))
        got = {}
        for step in range(steps):
            grads = {n: rng.standard_normal(a.shape).astype(a.dtype) for n, a in init.items()}
            if step % 3 == 0:
                c.push(grads)
            elif step % 3 == 1:
                got = c.push_pull(grads)
            else:
                got = c.pull(["big", "f64"])
        final = c.pull()
        return {"last": {n: a.copy() for n, a in got.items()}, "final": final}, c.stats()


@pytest.mark.integration
def test_lanes_give_bit_for_bit_what_sockets_give(shards):
    over_lanes, lane_stats = train(shards(2, mode="async").endpoints, True)
    over_sockets, socket_stats = train(shards(2, mode="async").endpoints, False)
    for part in ("last", "final"):
        assert over_lanes[part].keys() == over_sockets[part].keys()
        for name in over_lanes[part]:
            assert over_lanes[part][name].tobytes() == over_sockets[part][name].tobytes(), (part, name)
    assert all(s["shm_bytes_in"] > 0 and s["shm_bytes_out"] > 0 for s in lane_stats)
    assert all(s["shm_bytes_in"] == 0 == s["shm_bytes_out"] for s in socket_stats)
    # Over lanes the sockets carried the initial values (init never rides a lane) and headers only.
    assert sum(s["bytes_in"] for s in lane_stats) < 0.5 * sum(s["bytes_in"] for s in socket_stats)


@pytest.mark.integration
@pytest.mark.parametrize("psrt_shm", ["1", "0"])
def test_concurrent_workers_over_lanes_end_exact(shards, monkeypatch, psrt_shm):
    monkeypatch.setenv("PSRT_SHM", psrt_shm)
    workers, steps, size = 3, 12, 200_003
    group = shards(2, workers=workers, mode="async")
    run_workers("async_pusher", [dict(servers=group.endpoints, rank=r, workers=workers, steps=steps, size=size,
                                      partition_bytes=256 << 10) for r in range(workers)])
    expected = async_pusher_expected(workers, steps, size)
    with psrt.Client(group.endpoints, rank=0, num_workers=workers,
                     config=ClientConfig(timeout=30, partition_bytes=256 << 10)) as c:
        got = c.init({"w": np.ones(size, np.float32)}, optimizer=psrt.SGD(lr=1.0))["w"]
        stats = c.stats()
    np.testing.assert_array_equal(got, expected)
    lane_bytes = sum(s["shm_bytes_in"] for s in stats)
    assert lane_bytes == (workers * steps * size * 4 if psrt_shm == "1" else 0)


@pytest.mark.integration
def test_psrt_shm_0_on_the_shard_keeps_every_worker_on_sockets(shards, monkeypatch):
    monkeypatch.setenv("PSRT_SHM", "0")
    group = shards(1)
    assert our_files(group.procs[0].pid) == [], "no beacon: the shard offers no shared memory"
    monkeypatch.delenv("PSRT_SHM")
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=20)) as c:
        c.init({"w": np.zeros(BIG, np.float32)})
        out = c.push_pull({"w": np.ones(BIG, np.float32)})
        assert c.stats()[0]["shm_bytes_in"] == 0
    assert out["w"][0] == np.float32(-0.001)  # SGD's default lr


@pytest.mark.integration
def test_a_worker_with_its_own_dev_shm_is_not_on_the_shards_host(shards, tmp_path):
    """Same address, another /dev/shm (a private mount, as in another container or host): sockets, and right."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private /dev/shm")
    group = shards(1)
    worker = shlex.join(worker_command("lane_probe", servers=group.endpoints, size=BIG, steps=3, value=2.0))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(["unshare", "--mount", "sh", "-c", f"mount -t tmpfs tmpfs /dev/shm && exec {worker}"],
                          capture_output=True, text=True, timeout=120, env=env)
    if proc.returncode != 0 and ("unshare:" in proc.stderr or "mount:" in proc.stderr):
        pytest.skip(f"cannot mount a private /dev/shm here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    assert parse_results(proc.stdout) == [{"first": -6.0, "last": -6.0, "shm_bytes_in": 0, "pushes": 3}]


# ---------------------------------------------------------------------------------------------- hostile lanes
class LanePeer(RawPeer):
    """A bare DEALER that sets up a lane by hand, then sends whatever lane headers a test wants."""

    def __init__(self, endpoint: str, size: int = 1 << 20, worker: int = 0, session: int = 5) -> None:
        super().__init__(endpoint)
        beacon, _ = self.ask({"op": "lane_probe", "id": 1})
        self.beacon = beacon["name"]
        self.token = shm.Beacon.read(self.beacon)
        lane, _ = self.ask({"op": "lane_open", "id": 2, "worker": worker, "session": session, "token": self.token,
                            "size": size})
        assert lane["op"] == "lane", lane
        self.generation = lane["generation"]
        self.segment = shm.Segment.attach(lane["name"], lane["generation"], lane["size"])


def push(lane: list, op: str = "push", seq: int = 0, n: int = 4) -> dict:
    return push_header(op=op, session=5, seq=seq, tensors=[["w", 0, "<f4", [n]]], lane=lane)


@pytest.mark.integration
def test_hostile_lane_headers_get_errors_and_change_nothing(shards):
    group = shards(1)
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=20)) as c:
        c.init({"w": np.arange(4, dtype=np.float32)}, optimizer=psrt.SGD(lr=1.0))
    peer = LanePeer(group.endpoints[0])
    try:
        g = peer.generation
        peer.segment.array(64, np.dtype(np.float32), 4)[:] = 1.0
        size = peer.segment.size
        cases = [
            (push([g + 1, [64], []]), "lane_stale"),  # a generation the shard never made
            (push([g, [size - 8], []]), "lane_bounds"),  # runs past the end
            (push([g, [size + 4096], []]), "lane_bounds"),  # starts past the end
            (push([g, [0], []]), "lane_bounds"),  # over the segment's header
            (push([g, [100], []]), "lane_bounds"),  # not aligned
            (push([g, [64], [size]], op="push_pull"), "lane_bounds"),  # parameters to go outside
            (dict(op="pull", id=9, worker=0, clock=0, keys=[["w", 0, 0]], lane=[g, [], [size - 4]]), "lane_bounds"),
            (push([g, [64], []], n=5), "mismatch"),  # a wrong size: the shard's own check, read from the lane
            (push([g, [64, 128], []]), "protocol"),  # two offsets for one tensor
            (push([g, [64]]), "protocol"),
            (push([g, [-64], []]), "protocol"),
            (push([g, [64], []], op="push_pull"), "protocol"),  # a push_pull names where its parameters go
            (dict(op="init", id=9, worker=0, session=5, optimizer={"name": "sgd", "lr": 1.0},
                  tensors=[["w", 0, "<f4", [4]]], lane=[g, [64], []]), "protocol"),
            (dict(op="stats", id=9, lane=[g, [], []]), "protocol"),
            ({**push([g, [64], []]), "tensors": [["w", 0, "fp16", [4]]]}, "protocol"),  # no compression on lanes
            (dict(op="lane_open", id=9, worker=0, session=5, token="0" * 32, size=1 << 20), "lane_token"),
            (dict(op="lane_open", id=9, worker=0, session=5, token=peer.token, size=1 << 40), "lane_size"),
            (dict(op="lane_open", id=9, worker=0, session=5, token=peer.token, size=0), "protocol"),
        ]
        for header, code in cases:
            reply, frames = peer.ask(header)
            assert (reply["op"], reply.get("code")) == ("error", code), (header, reply)
        reply, _ = peer.ask(push([g, [64], []]), (b"\0" * 16,))  # frames besides a lane
        assert reply.get("code") == "protocol"
        with psrt.Client(group.endpoints, config=ClientConfig(timeout=20)) as c:
            now = c.init({"w": np.zeros(4, np.float32)}, optimizer=psrt.SGD(lr=1.0))  # the stored value comes back
            assert now["w"].tolist() == [0, 1, 2, 3], "nothing was applied"
            stats = c.stats()[0]
            assert stats["pushes"] == 0 and stats["shm_bytes_in"] == 0
        # The lane still works for a well-formed request: the gradient is read from the segment.
        reply, frames = peer.ask(push([g, [64], [128]], op="push_pull"))
        assert reply["op"] == "params" and reply["lane"] == g and frames == []
        # W = 1: every push is a step of its own, so the shard writes the result into the lane's output area.
        assert reply["places"] == [[]]
        assert peer.segment.array(128, np.dtype(np.float32), 4).tolist() == [-1, 0, 1, 2]
    finally:
        peer.close()


# ---------------------------------------------------------------------------------------------- fallbacks
@pytest.fixture()
def inproc_server(monkeypatch):
    """A shard in this process (its serving loop on a thread) keeping at most one lane."""
    monkeypatch.setattr(lanes, "MAX_LANES", 1)
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async", shm=True)) as server:
        yield server


def _two_workers_take_turns(server) -> None:
    """Two clients of one async shard push_pull in turn, five times each; every result exact."""
    config = ClientConfig(timeout=20)
    ep = [server.endpoint]
    with psrt.Client(ep, config=config) as a, psrt.Client(ep, config=config) as b:
        a.init({"w": np.zeros(BIG, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        b.init({"w": np.zeros(BIG, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        for step in range(5):
            pa = a.push_pull({"w": np.ones(BIG, np.float32)})
            pb = b.push_pull({"w": np.ones(BIG, np.float32)})
            assert pa["w"][0] == -(2 * step + 1) and pb["w"][-1] == -(2 * step + 2)


def test_a_lane_the_shard_dropped_is_replaced_and_no_call_is_lost(inproc_server, monkeypatch):
    """Two workers evict each other's (idle) lane at every call: each refused call goes again over the socket."""
    monkeypatch.setattr(lanes, "LANE_IDLE_S", 0.0)
    _two_workers_take_turns(inproc_server)
    assert inproc_server.counters.pushes == 10
    assert inproc_server.lanes.count <= 1


def test_a_shard_whose_lanes_are_all_in_use_refuses_a_new_one_and_that_worker_uses_sockets(inproc_server):
    """Past MAX_LANES busy lanes, a new worker is refused a lane, not given one taken from a busy worker: the
    first keeps its lane, the second goes over the socket, and no call is refused or counted as an error."""
    _two_workers_take_turns(inproc_server)
    counters = inproc_server.counters
    # One message a push: a's through its lane, b's over a loopback socket (no network: not cut for pipelining).
    assert counters.pushes == 10 and counters.errors == 0
    # Every push of a's came through its lane (5 gradients), none of b's.
    assert counters.shm_bytes_in == 5 * BIG * 4
    assert inproc_server.lanes.count <= 1


@pytest.mark.integration
def test_no_file_outlives_its_shard_and_a_killed_ones_are_removed_by_the_next(shards):
    group = shards(1, workers=2)  # sync with W = 2: the shard shares its parameters
    pid = group.procs[0].pid
    with psrt.Client(group.endpoints, rank=0, num_workers=2, config=ClientConfig(timeout=20)) as c:
        c.init({"w": np.zeros(BIG, np.float32)})
        c.pull()  # over a lane: its segment's file is gone once mapped
        assert c.stats()[0]["shm_bytes_out"] > 0
        kinds = sorted(f.rsplit("-", 1)[1][0] for f in our_files(pid))
        assert kinds.count("b") == 1 and set(kinds) == {"a", "b"}, \
            "the beacon and the shared parameters' arenas; a mapped lane has no file left"
    assert group.close() == [0]
    assert our_files(pid) == []
    killed = shards(1, workers=2)
    pid = killed.procs[0].pid
    with psrt.Client(killed.endpoints, rank=0, num_workers=2, config=ClientConfig(timeout=20)) as c:
        c.init({"w": np.zeros(BIG, np.float32)})
    files = our_files(pid)
    assert len(files) >= 2
    killed.procs[0].kill()
    killed.procs[0].wait(10)
    assert our_files(pid) == files, "SIGKILL leaves the beacon and the shared parameters behind"
    shards(1)
    assert our_files(pid) == [], "the next shard on the host removed it"


def test_a_lane_hands_out_aligned_areas_and_starts_over_when_nothing_is_in_flight():
    name = f"psrt-{secrets.token_hex(6)}-{os.getpid()}-g1"
    seg = shm.Segment.create(name, 1, 1024)
    try:
        lane = lanes.Lane(seg)
        assert lane.fits(960) and not lane.fits(961)
        first, second = lane.take(10), lane.take(100)
        assert (first, second) == (64, 128) and lane.top == 256
        lane.live = 2
        lane.give_back()
        assert lane.top == 256, "one request still holds its areas"
        lane.give_back()
        assert lane.top == shm.HEADER_BYTES
        lane.retired = True
        assert not lane.fits(64), "a retired lane hands out nothing"
    finally:
        seg.unlink()
    assert lanes.call_bytes([[]], True, True) == 0


@pytest.mark.integration
def test_a_result_overwritten_before_it_was_copied_is_asked_for_again(shards):
    """Sync: worker 0 reads its push_pull only after both workers finished the next round, so the shared copy
    it was pointed to has changed (its counter moved): it asks again and gets the newer parameters, exactly."""
    group = shards(1, workers=2)
    config = ClientConfig(timeout=20)
    with psrt.Client(group.endpoints, rank=0, num_workers=2, config=config) as a, \
            psrt.Client(group.endpoints, rank=1, num_workers=2, config=config) as b:
        for c in (a, b):
            c.init({"w": np.zeros(BIG, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        ones = np.ones(BIG, np.float32)
        late = a.push_pull_async({"w": ones})  # round 1: its reply waits, unread, on a's socket
        b.push_pull({"w": ones})
        a.push_async({"w": 3 * ones})  # round 2, while round 1's answer is still unread
        b.push_pull({"w": ones})
        pulls_before = b.stats()[0]["pulls"]
        got = late.wait()["w"]
        stats = a.stats()[0]
    # Round 1 moved w to -1, round 2 to -3: what a finally reads is the newer result, never a torn mix.
    assert np.all(got == -3.0)
    assert stats["pulls"] == pulls_before + 1, "one pull went again over the socket"


@pytest.mark.integration
def test_random_lane_headers_never_harm_the_shard(shards):
    """Any generation and offsets, any lengths: an error reply, or (all in bounds) a zero gradient applied."""
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    group = shards(1)
    w0 = np.arange(4, dtype=np.float32)
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=20)) as c:
        c.init({"w": w0}, optimizer=psrt.SGD(lr=1.0))
    peer = LanePeer(group.endpoints[0], size=4096)
    offsets = st.one_of(st.integers(0, 8192), st.sampled_from([64, 128, 4032, 4096]), st.integers(0, 2**63 - 1))
    lane = st.tuples(st.one_of(st.just(peer.generation), st.integers(0, 2**63 - 1)),
                     st.lists(offsets, max_size=3), st.lists(offsets, max_size=3))
    seen = set()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(lane=lane, op=st.sampled_from(["push", "push_pull", "pull"]), n=st.sampled_from([4, 5, 1 << 20]))
    @example(lane=(peer.generation + 7, [64], []), op="push", n=4)  # each refusal at least once, whatever is drawn
    @example(lane=(peer.generation, [4090], []), op="push", n=4)
    @example(lane=(peer.generation, [64, 128], []), op="push", n=4)
    def fuzz(lane, op, n):
        g, ins, outs = lane
        header = (dict(op="pull", id=9, worker=0, clock=0, keys=[["w", 0, 0]], lane=[g, ins, outs]) if op == "pull"
                  else push([g, ins, outs], op=op, n=n))
        reply, frames = peer.ask(header)
        assert reply["op"] in ("error", "params", "ack") and frames == []
        seen.add(reply.get("code", reply["op"]))

    try:
        fuzz()
        assert group.alive() == [True]
        with psrt.Client(group.endpoints, config=ClientConfig(timeout=20)) as c:
            got = c.init({"w": np.zeros(4, np.float32)}, optimizer=psrt.SGD(lr=1.0))["w"]
        assert got.tolist() == w0.tolist(), "only zero gradients from the (zeroed) segment were ever applied"
        assert {"protocol", "lane_stale", "lane_bounds"} <= seen
    finally:
        peer.close()


@pytest.mark.integration
def test_a_sync_round_is_read_from_the_shards_own_memory_under_its_counter(shards):
    """W = 2: both answers point at the shard's shared parameters (no copy per worker on the shard)."""
    group = shards(1, workers=2)
    peers = [LanePeer(group.endpoints[0], worker=w, session=10 + w) for w in range(2)]
    with psrt.Client(group.endpoints, rank=0, num_workers=2, config=ClientConfig(timeout=20)) as c:
        c.init({"w": np.arange(4, dtype=np.float32)}, optimizer=psrt.SGD(lr=1.0))
    try:
        for worker, peer in enumerate(peers):
            peer.segment.array(64, np.dtype(np.float32), 4)[:] = 2.0 * (worker + 1)
            header = {**push([peer.generation, [64], [128]], op="push_pull"), "worker": worker, "session": 10 + worker}
            peer.send([packed(header)])
        replies = []
        for peer in peers:
            assert peer.answered(5.0), "the round was not answered"
            replies.append(peer.recv()[0])
        places = [r["places"] for r in replies]
        assert places[0] == places[1] and len(places[0]) == 1 and len(places[0][0]) == 3
        generation, offset, counter = places[0][0]
        arena = shm.Segment.read_only(peers[0].beacon.replace("-beacon", f"-a{generation}"), generation)
        assert arena.array(offset, np.dtype(np.float32), 4).tolist() == [-3, -2, -1, 0]  # w - mean(2, 4)
        assert counter % 2 == 0 and arena.array(offset - 64, np.dtype(np.uint64), 1)[0] == counter
        assert peers[0].segment.array(128, np.dtype(np.float32), 4).tolist() == [0, 0, 0, 0], "no lane write"
    finally:
        for peer in peers:
            peer.close()


def test_psrt_stats_counts_the_bytes_that_came_through_shared_memory():
    from psrt.cluster.stats import format_table

    row = {"endpoint": "tcp://127.0.0.1:1", "keys": 1, "param_bytes": 4e6, "pushes": 10, "pulls": 10, "rounds": 10,
           "queued_pulls": 0, "deferred_pushes": 0, "errors": 0, "bytes_in": 1_000_000, "bytes_out": 0,
           "shm_bytes_in": 3_000_000, "shm_bytes_out": 4_000_000}
    earlier = {**row, "bytes_in": 0, "shm_bytes_in": 0, "shm_bytes_out": 0}
    header, line = format_table([row], [earlier], 2.0).splitlines()
    assert header.split()[-2:] == ["shm", "in"]
    # MB/s in and out over the 2 s, MB in, kB in per push, and the share that came through shared memory.
    assert line.split()[-5:] == ["2.0", "2.0", "4.0", "400.0", "75"]


@pytest.mark.integration
def test_a_closing_client_gives_its_lanes_back(shards):
    group = shards(2, mode="async")
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=20)) as c:
        c.init({"w": np.zeros(BIG, np.float32)})
        c.push_pull({"w": np.ones(BIG, np.float32)})
        assert [s["lanes"] for s in c.stats()] == [1, 1]
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=20)) as c:
        assert [s["lanes"] for s in c.stats()] == [0, 0], "the first client's segments are gone"


@pytest.mark.integration
def test_a_lane_grows_to_hold_every_call_in_flight(shards):
    """Eight non-blocking pushes at once: the first lane holds two, the rest go over the socket; once idle, the next
    lane is made big enough and every later round goes through shared memory whole."""
    group = shards(1, mode="async")
    names = [f"k{i}" for i in range(8)]
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=20)) as c:
        c.init({n: np.zeros(BIG, np.float32) for n in names}, optimizer=psrt.SGD(lr=1.0))
        ones = np.ones(BIG, np.float32)
        lane_bytes = []
        for _ in range(3):
            before = c.stats()[0]["shm_bytes_in"]
            for handle in [c.push_async({n: ones}) for n in names]:
                handle.wait()
            lane_bytes.append(c.stats()[0]["shm_bytes_in"] - before)
        final = c.pull()
    assert lane_bytes[0] < len(names) * BIG * 4, "the first round spills over to the socket"
    assert lane_bytes[1:] == [len(names) * BIG * 4] * 2, "later rounds fit in the grown lane"
    assert all(np.all(final[n] == -3.0) for n in names)


@pytest.mark.integration
def test_a_secured_job_sets_up_lanes_over_its_authenticated_sockets(shards, tmp_path, monkeypatch):
    from psrt.control import security

    keys = security.keygen(tmp_path / "job").directory
    monkeypatch.setenv("PSRT_KEYS", str(keys))  # the shard processes take the job's keys from the environment
    group = shards(1, mode="async")
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=20, keys=str(keys))) as c:
        c.init({"w": np.zeros(BIG, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        out = c.push_pull({"w": np.ones(BIG, np.float32)})
        assert c.stats()[0]["shm_bytes_in"] == BIG * 4
    assert np.all(out["w"] == -1.0)
    with psrt.Client(group.endpoints, config=ClientConfig(timeout=5, keys=None)) as stranger:
        with pytest.raises(psrt.AuthenticationError):  # the shard is secured: no lane for a stranger either
            stranger.stats()
