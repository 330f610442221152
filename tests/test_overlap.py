"""The overlapped load generator (``psrt worker --overlap``): each tensor pushed from an emulated backward, last layer
first, each one's parameters awaited in the next forward, first layer first, through the pipeline psrt.torch uses
(:class:`psrt.worker.overlap.Pipeline`); the job ends exactly where the serial one does, in every mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from _helpers import BENCH, launched_results, serving, whole_window

import psrt
from psrt import cli
from psrt.config import ServerConfig
from psrt.control.process import psrt_command
from psrt.emulation import loadgen
from psrt.emulation.models import model_tensors

PSRT = psrt_command()
LR = 0.5
LAYERS = 4


def sgd(updates: int) -> float:
    """param0 after ``updates`` float32 SGD steps on the load generator's gradient (1e-3 everywhere), ``lr = LR``,
    from 0: a sync job's after that many rounds (the mean of W equal gradients), an async one's after that many
    pushes (each applied on its own)."""
    p = np.float32(0)
    for _ in range(updates):
        p = p - np.float32(LR) * np.float32(1e-3)
    return float(p)


class Recording(psrt.Client):
    """A real client that notes, per call, which tensors it pushes and which pulls the caller waits on."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pushed: list[str] = []
        self.awaited: list[str] = []

    def push_async(self, grads):
        self.pushed.extend(grads)
        return super().push_async(grads)

    def pull_async(self, names=None, out=None):
        handle = super().pull_async(names, out=out)
        wait, names = handle.wait, list(self.partition.tensors if names is None else names)

        def noted(timeout=None):
            self.awaited.extend(names)
            return wait(timeout)

        handle.wait = noted
        return handle


def clients_made_as(cls: type, monkeypatch) -> list:
    """Make every psrt.Client the load generator opens a ``cls`` (a real client that notes its calls); returns
    the list they are added to."""
    clients: list = []

    def make(*args, **kwargs):
        clients.append(cls(*args, **kwargs))
        return clients[-1]

    monkeypatch.setattr(psrt, "Client", make)
    return clients


def test_an_overlapped_worker_pushes_the_last_layer_first_and_awaits_the_first_layer_first(monkeypatch):
    whole_window(monkeypatch)
    clients = clients_made_as(Recording, monkeypatch)
    steps, warmup = 3, 1
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=2, mode="sync")) as server:
        results = loadgen.run_worker("64KB", 4, steps, warmup=warmup, servers=[server.endpoint], num_workers=2,
                                     lr=LR, clients=2, overlap=True, layers=LAYERS)
        assert server.counters.pushes == 2 * (steps + warmup) * LAYERS  # one push per tensor per step
    names = [f"t{i}" for i in range(LAYERS)]
    for client in clients:
        # Every step's backward pushes the last layer first; the forwards after it (and the waits that end the
        # warm-up and the timed steps) take each tensor's parameters first layer first.
        assert client.pushed == names[::-1] * (steps + warmup)
        assert client.awaited == names * (steps + warmup)
    assert [r["param0"] for r in results] == [sgd(steps + warmup)] * 2
    assert all(r["overlap"] is True and r["tensors"] == LAYERS for r in results)


class InFlight(psrt.Client):
    """A real client that notes, at each push, how many of its earlier pushes were still unanswered."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handles: list = []
        self.unanswered: list[int] = []

    def push_async(self, grads):
        self.unanswered.append(sum(1 for h in self.handles if h._outstanding))
        self.handles.append(super().push_async(grads))
        return self.handles[-1]


@pytest.mark.parametrize("window", [16_000, None])
def test_the_window_bounds_the_pushes_in_flight(monkeypatch, window):
    whole_window(monkeypatch)
    clients = clients_made_as(InFlight, monkeypatch)
    steps, warmup = 3, 1
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=2, mode="sync")) as server:
        # A 64 kB model in 4 tensors of 16 kB, and no compute: the backward queues them all at once.
        results = loadgen.run_worker("64KB", 0, steps, warmup=warmup, servers=[server.endpoint], num_workers=2,
                                     lr=LR, clients=2, overlap=True, layers=LAYERS, window=window)
        assert server.counters.pushes == 2 * (steps + warmup) * LAYERS
    assert [r["param0"] for r in results] == [sgd(steps + warmup)] * 2  # the same rounds, whatever the window
    assert {r["window"] for r in results} == {window or loadgen.DEFAULT_WINDOW}
    if window is not None:  # one tensor's bytes: a push leaves only once the one before it is answered
        assert all(max(client.unanswered) == 0 for client in clients)
    else:  # 4 MiB: the whole model at once. A client whose partner pushed first finds each round closing as it
        # pushes (its answers may be in before its next push); the one that pushed first had them all in flight.
        assert max(max(client.unanswered) for client in clients) == LAYERS - 1


def test_the_window_needs_overlap_and_a_positive_size(capsys):
    assert cli.main(["worker", "--model", "64KB", "--window", "16KB", "--servers", "tcp://127.0.0.1:1"]) == 2
    assert "--window sets the bytes --overlap keeps in flight" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # argparse's usage error, as for every flag's bad value
        cli.main(["worker", "--model", "64KB", "--overlap", "--window", "0", "--servers", "tcp://127.0.0.1:1"])
    assert exited.value.code == 2 and "argument --window: size '0' must be at least one byte" in capsys.readouterr().err
    with pytest.raises(psrt.ConfigError, match="--window must be a positive number of bytes"):
        loadgen.run_worker("64KB", 0, 1, servers=["tcp://127.0.0.1:1"], num_workers=1, overlap=True, window=-1)


@pytest.mark.parametrize("compute", ["sleep", "numpy"])
def test_overlapped_virtual_workers_end_on_the_serial_jobs_parameters(compute):
    """Same rounds, same gradients: every worker's param0 is the serial job's, to the bit."""
    ends = {}
    for overlap in (False, True):
        with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=3, mode="sync")) as server:
            results = loadgen.run_worker("64KB", 6, 3, warmup=1, compute=compute, servers=[server.endpoint],
                                         num_workers=3, lr=LR, clients=3, overlap=overlap, layers=LAYERS)
            rounds = server.counters.rounds
        ends[overlap] = {r["param0"] for r in results}
        assert rounds == 4 * LAYERS, "a sync round per tensor per step"
        assert [r["overlap"] for r in results] == [overlap] * 3
    assert ends[True] == ends[False] == {sgd(4)}


@pytest.mark.integration
@pytest.mark.parametrize("mode", [[], ["--mode", "async"], ["--mode", "ssp", "--staleness", "0"]],
                         ids=["sync", "async", "ssp"])
def test_a_launched_overlapped_job_applies_every_push_once(mode):
    steps, warmup, workers = 3, 1, 4
    args = [*PSRT, "launch", "-s", "2", "-w", str(workers), "--clients", "2", *mode, "--", *PSRT, "worker",
            "--model", "64KB", "--layers", str(LAYERS), "--compute-ms", "20", "--steps", str(steps),
            "--warmup", str(warmup), "--lr", str(LR), "--overlap"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = launched_results(proc.stdout)
    assert [r["rank"] for r in results] == list(range(workers))
    stopped = [line for line in proc.stdout.splitlines() if "psrt-server stopped" in line]
    pushes = sum(int(line.rsplit("pushes=", 1)[1].split()[0]) for line in stopped)
    assert pushes == workers * (steps + warmup) * LAYERS  # every tensor of every step, once
    if not mode:  # sync: a round per step, the serial job's parameters on every worker
        assert {r["param0"] for r in results} == {sgd(steps + warmup)}
    else:
        # async and ssp apply each push on arrival (scale 1). With s = 0 each worker's last pull of t0 waits
        # until every worker has pushed it as often: all read every push. Async reads at least its own pushes.
        everything = sgd(workers * (steps + warmup))
        if mode[1] == "ssp":
            assert {r["param0"] for r in results} == {everything}
        else:
            own = sgd(steps + warmup)
            assert all(everything <= r["param0"] <= own for r in results), results


def test_layers_split_a_sized_model_and_are_refused_for_a_shipped_one(capsys):
    assert model_tensors("64KB", layers=3) == [("t0", (5334,)), ("t1", (5333,)), ("t2", (5333,))]
    assert cli.main(["worker", "--model", "resnet50", "--layers", "4", "--servers", "tcp://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("psrt: error: --layers splits a sized model") and "leave --layers out" in err
    assert cli.main(["worker", "--model", "8", "--layers", "3", "--servers", "tcp://127.0.0.1:1"]) == 2
    assert "--layers must be a whole number from 1 to the model's 2 float32 values" in capsys.readouterr().err


@pytest.mark.integration
def test_the_overlap_bench_measures_the_load_generator_on_loopback(tmp_path):
    out = tmp_path / "loadgen.json"
    proc = subprocess.run([sys.executable, str(BENCH / "overlap.py"), "--loadgen", "--loopback", "--model", "64KB",
                           "--layers", "4", "--compute-ms", "20", "--steps", "3", "--rounds", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 1: a MISS, which a loaded machine may give
    record = json.loads(out.read_text())
    assert {"comm_ms", "serial_ms", "overlap_ms", "overlap_vs_max", "overlap_vs_sum", "pass"} <= set(record)
    assert record["layers"] == 4 and record["link"] == "loopback"
    assert "overlapped step (--overlap)" in proc.stdout and "max(compute, comm)" in proc.stdout


def test_only_the_pushed_slots_share_the_window_out():
    """A frozen tensor (never pushed) holds no credit: the window is shared out over the pushed tensors' shards by
    their bytes alone, and a slot not declared pushed cannot be queued."""
    from psrt.errors import ConfigError
    from psrt.worker.overlap import Pipeline, Slot

    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async")) as a, \
            serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async")) as b, \
            psrt.Client([a.endpoint, b.endpoint]) as client:
        arrays = {"frozen": np.zeros(1 << 16, np.float32), "head": np.zeros(1024, np.float32),
                  "bias": np.zeros(16, np.float32)}
        stored = client.init(arrays, optimizer=psrt.SGD(lr=0.1))
        slots = [Slot(name, i, stored[name]) for i, name in enumerate(arrays)]
        window = 8192
        pipe = Pipeline(client, slots, window, pushed=slots[1:])
        pushed_bytes: dict[int, int] = {}
        for name in ("head", "bias"):
            for chunk in client.partition.chunks_of([name]):
                pushed_bytes[chunk.shard] = pushed_bytes.get(chunk.shard, 0) + chunk.nbytes
        total = sum(pushed_bytes.values())
        assert pipe._credit == pytest.approx({shard: window * n / total for shard, n in pushed_bytes.items()})
        everything = Pipeline(client, slots, window)  # (all pushed: the frozen tensor's shard takes most of it)
        assert sum(everything._credit.values()) == pytest.approx(window)
        assert everything._credit != pipe._credit
        with pytest.raises(ConfigError, match="'frozen' was not given as a pushed slot"):
            pipe.enqueue(slots[0], np.zeros(1 << 16, np.float32))
        with pytest.raises(ConfigError, match="every pushed slot must be one of the pipeline's slots"):
            Pipeline(client, slots, window, pushed=[Slot("head", 1, stored["head"])])
        # The pushed slots still go through it: one step, every pull landing in its array.
        pipe.enqueue(slots[1], np.full(1024, 1.0, np.float32))
        pipe.enqueue(slots[2], np.full(16, 1.0, np.float32))
        pipe.end_step()
        pipe.synchronize()
        np.testing.assert_array_equal(stored["head"], np.full(1024, -0.1, np.float32))
        np.testing.assert_array_equal(stored["frozen"], np.zeros(1 << 16, np.float32))


def test_a_traced_overlapped_run_notes_each_tensors_events_in_order(tmp_path):
    from psrt.emulation import trace

    path = tmp_path / "trace.json"
    steps, warmup = 3, 1
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=2, mode="sync")) as server:
        loadgen.run_worker("64KB", 20, steps, warmup=warmup, servers=[server.endpoint], num_workers=2, lr=LR,
                           clients=2, overlap=True, layers=LAYERS, window=16_000, trace=str(path))
    doc = json.loads(path.read_text())
    names = [f"t{i}" for i in range(LAYERS)]
    assert doc["tensors"] == names and [w["rank"] for w in doc["workers"]] == [0, 1]
    for w in doc["workers"]:
        events = [(kind, name) for _, kind, name in w["events"]]
        times = [t for t, _, _ in w["events"]]
        assert times == sorted(times)
        assert [k for k, _ in events if k in ("step", "timed", "end")] == \
            ["step"] * warmup + ["timed"] + ["step"] * steps + ["end"]
        for name in names:  # every step, each tensor: queued, then sent, then acknowledged
            mine = [k for k, n in events if n == name and k in ("queued", "sent", "acked")]
            assert mine == ["queued", "sent", "acked"] * (steps + warmup)
            waits = [k for k, n in events if n == name and k in ("waiting", "ready")]
            assert waits == ["waiting", "ready"] * (len(waits) // 2) and len(waits) >= 2 * (steps + warmup)
    summary = trace.summarize(*trace.load([str(path)]))
    assert summary.workers == 2 and len(summary.forward_wait) == steps and len(summary.step_s) == steps
    assert summary.drain_s[0] >= 0 and set(summary.tensors) == set(names)


def test_the_trace_summary_adds_up_a_known_timeline():
    from psrt.emulation import trace

    events = [(0.0, "step", ""), (1.0, "queued", "a"), (1.0, "sent", "a"), (1.5, "timed", ""),
              (2.0, "step", ""), (2.0, "waiting", "a"), (2.4, "ready", "a"), (3.0, "queued", "a"),
              (3.25, "sent", "a"), (3.75, "acked", "a"),
              (4.0, "step", ""), (4.0, "waiting", "a"), (5.0, "ready", "a"), (6.0, "queued", "a"),
              (6.0, "sent", "a"), (6.5, "acked", "a"), (6.0, "waiting", "a"), (7.5, "ready", "a"), (7.5, "end", "")]
    events.sort(key=lambda e: e[0])
    s = trace.summarize(["a"], [events])
    assert s.workers == 1
    assert [w for w, _ in s.forward_wait] == pytest.approx([0.4, 1.0])  # the forwards' waits, step by step
    assert [d for d, _ in s.step_s] == pytest.approx([2.0, 2.0])  # step start to the next, the last to its queue
    assert s.drain_s[0] == pytest.approx(1.5)  # the last gradient queued (6.0) to the end (7.5)
    assert s.tensors["a"]["window_s"] == pytest.approx(0.125) and s.tensors["a"]["ack_s"] == pytest.approx(0.5)


def test_the_trace_needs_overlap(capsys):
    assert cli.main(["worker", "--model", "64KB", "--trace", "t.json", "--servers", "tcp://127.0.0.1:1"]) == 2
    assert "--trace notes the events of --overlap's pipeline" in capsys.readouterr().err


def test_a_trace_folder_gets_a_file_per_process(tmp_path):
    from psrt.emulation import trace

    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async")) as server:
        loadgen.run_worker("64KB", 0, 2, warmup=0, servers=[server.endpoint], num_workers=1, lr=LR,
                           overlap=True, layers=LAYERS, trace=str(tmp_path))
    (path,) = tmp_path.glob("trace-*.json")
    assert path.name == f"trace-{os.getpid()}.json"
    assert trace.summarize(*trace.load([str(path)])).workers == 1


# ---------------------------------------------------------------------------------------------- the pace
def _paced(pace, pushes: int, nbytes: int, rate: float, t0: float = 10.0, held_ns: int = 0, gap: float = 0.0,
           ack_after: float = 0.001) -> None:
    """Acks of ``pushes`` pushes handed to the sockets together at ``t0`` and taken in one after another at
    ``rate`` bytes/s by the shard (whose clock starts at 5 s), each seen ``ack_after`` after it was taken."""
    for i in range(pushes):
        taken = 5_000_000_000 + round((i + 1) * nbytes / rate * 1e9)
        seen = t0 + (i + 1) * nbytes / rate + ack_after
        pace.acked(nbytes, t0, seen, taken, held_ns, gap)


def test_the_pace_sizes_the_credit_by_the_rate_pushes_are_taken_in():
    """Pushes taken one after another, the next sent before the last one's ack was seen: their spacing at the
    shard gives the rate, and the credit is what keeps the shard busy for the round trip plus QUEUE_S."""
    from psrt.worker.overlap import QUEUE_S, Pace

    pace = Pace(4 << 20)
    assert pace.credit == 4 << 20  # nothing measured: the window's share
    rate, nbytes = 20e6, 125_000  # 160 Mbit/s, a 125 KB tensor: 6.25 ms each
    _paced(pace, 6, nbytes, rate, ack_after=0.0005)
    # The first push's ack says nothing of the rate (nothing was taken before it); the rest say 20 MB/s exactly;
    # the least delay beyond their own bytes' time is the 0.5 ms the acks took back.
    assert pace.credit == pytest.approx(rate * (0.0005 + QUEUE_S))
    # A shard that holds its acks (a replicated job's sync round) needs more in flight to stay busy, and so do
    # a caller's gaps between pumps.
    held = Pace(4 << 20)
    _paced(held, 6, nbytes, rate, held_ns=3_000_000, ack_after=0.0035)
    assert held.credit == pytest.approx(rate * (0.0005 + 0.003 + QUEUE_S))
    gappy = Pace(4 << 20)
    _paced(gappy, 6, nbytes, rate, gap=0.010, ack_after=0.0005)
    assert gappy.credit == pytest.approx(rate * (0.0005 + 0.010 + QUEUE_S))
    # Never more than the window's share, however fast the shard.
    fast = Pace(1 << 20)
    _paced(fast, 6, nbytes, 10e9)
    assert fast.credit == 1 << 20


def test_the_pace_takes_no_rate_from_a_push_sent_after_the_last_ack_was_seen():
    """A push sent once the one before it was answered found the shard idle: its spacing there counts the idle
    time too, and says nothing of the rate."""
    from psrt.worker.overlap import Pace

    pace = Pace(4 << 20)
    seen = 10.0
    for i in range(6):
        sent = seen + 0.050  # 50 ms after the last ack: the shard was idle
        seen = sent + 0.007
        pace.acked(125_000, sent, seen, 5_000_000_000 + i * 57_000_000, 0, 0.0)
    assert pace.credit == 4 << 20
    # A burst at the start of a busy spell (a token bucket's, a socket buffer's) is averaged over the spell,
    # not taken for the rate.
    burst = Pace(4 << 20)
    burst.acked(125_000, 20.0, 20.001, 9_000_000_000, 0, 0.0)
    burst.acked(125_000, 20.0, 20.002, 9_000_100_000, 0, 0.0)  # 0.1 ms: 1.25 GB/s, a burst
    for i in range(2, 10):
        burst.acked(125_000, 20.0, 20.002 + (i - 1) * 0.00625, 9_000_100_000 + (i - 1) * 6_250_000, 0, 0.0)
    assert burst.rate() == pytest.approx(20e6)  # (the burst's 1.25 GB/s would make it 2.5 MB for QUEUE_S alone)
    # So is a shard that stalled once (a checkpoint written, a restart), and the spacing behind a small push
    # (mostly the shard's work on the push before it): the rate is the median of the spacings' by their bytes.
    stalled = Pace(4 << 20)
    taken = 9_000_000_000
    for i, (nbytes, ns) in enumerate([(0, 0), (125_000, 6_250_000), (125_000, 2_000_000_000), (1024, 400_000)]
                                     + [(125_000, 6_250_000), (1024, 400_000)] * 4):
        taken += ns
        stalled.acked(nbytes, 20.0, 20.0 + i * 0.001, taken, 0, 0.0)
    assert stalled.rate() == pytest.approx(20e6)


def test_a_wait_for_one_tensor_takes_in_the_other_acks_and_asks_for_their_pulls():
    """While the forward waits for a tensor whose round another worker has not pushed, the pipeline goes on:
    the push queued behind it (the window holds one) leaves when its ack comes, and the pull of that one is asked
    for when its own ack comes, before the awaited tensor is in."""
    import threading
    import time

    from psrt.worker.overlap import PULLING, Pipeline, Slot

    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=2, mode="sync")) as shard, \
            psrt.Client([shard.endpoint], rank=0, num_workers=2) as client, \
            psrt.Client([shard.endpoint], rank=1, num_workers=2) as other:
        arrays = {"b": np.zeros(256, np.float32), "c": np.zeros(256, np.float32)}
        stored = client.init(arrays, optimizer=psrt.SGD(lr=1.0))
        other.init(arrays, optimizer=psrt.SGD(lr=1.0))
        slots = [Slot(name, i, stored[name]) for i, name in enumerate(arrays)]
        pipe = Pipeline(client, slots, window=1)  # one push in flight at a time
        pipe.enqueue(slots[0], np.ones(256, np.float32))
        pipe.enqueue(slots[1], np.ones(256, np.float32))
        pipe.end_step()  # b goes; c waits for b's ack

        def late_peer() -> None:
            time.sleep(1.0)  # b's round (and c's) close only now
            other.push({"b": np.ones(256, np.float32), "c": np.ones(256, np.float32)})

        peer = threading.Thread(target=late_peer)
        peer.start()
        try:
            pipe.wait_for(slots[0])
        finally:
            peer.join()
        np.testing.assert_array_equal(stored["b"], np.full(256, -1.0, np.float32))
        # c was pushed and its pull asked for while the wait went on (an older wait_for blocked on b's pull and
        # left c's ack untaken, c still pushing).
        assert slots[1].state == PULLING
        pipe.synchronize()
        np.testing.assert_array_equal(stored["c"], np.full(256, -1.0, np.float32))


def test_the_pipeline_learns_a_shards_rate_from_its_acks():
    """A real shard's push acks carry when it took each push in: a pipeline that keeps several in flight has a
    rate, and its credit is then what the rate needs, below the window."""
    from psrt.worker.overlap import Pipeline, Slot

    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async")) as shard, \
            psrt.Client([shard.endpoint]) as client:
        arrays = {f"t{i}": np.zeros(1 << 14, np.float32) for i in range(8)}
        stored = client.init(arrays, optimizer=psrt.SGD(lr=1.0))
        slots = [Slot(name, i, stored[name]) for i, name in enumerate(arrays)]
        window = 1 << 30
        pipe = Pipeline(client, slots, window)
        for _ in range(4):
            for s in reversed(slots):
                pipe.enqueue(s, np.ones(1 << 14, np.float32))
            pipe.end_step()
            pipe.synchronize()
        (pace,) = pipe._paces.values()
        assert pace._spans and 0 < pace.credit < window
        assert pipe._credit == {0: pace.credit}
        np.testing.assert_array_equal(stored["t0"], np.full(1 << 14, -4.0, np.float32))
