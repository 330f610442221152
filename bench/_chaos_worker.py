"""The processes ``bench/chaos.py`` starts: a training worker, a flooder, a ride-through worker and a job worker.

Run as ``python bench/_chaos_worker.py ROLE ARGS...``; each role prints ``ready`` (or ``training``) once it is
under way and, last, one JSON line with what it measured. Times are wall-clock (``time.time()``), so the bench
can compare them with the moment it hurt a process.

- ``train ENDPOINT SIZE STOPFILE``: push_pull integer-valued gradients to a standalone W=1 sync shard (SGD,
  lr=1) until STOPFILE exists; the final parameters must equal minus the sum of every gradient, exactly.
- ``flood ENDPOINT SIZE COUNT SEED``: send COUNT malformed messages of many kinds over a raw DEALER, with a
  window in flight, and count the replies (every one must be an error).
- ``ride ENDPOINT RANK W STEPS STEP_S``: each push is recognisable (rank, step) so that the final parameters say
  which pushes were lost, applied once, or applied twice (as tests/_ride_worker.py).
- ``job STEPS STEP_S [REJOIN_S [STOPFILE]]``: a worker under a scheduler (``psrt.Client()`` from the
  environment) that trains until STEPS are done, STOPFILE exists, or psrt raises; with REJOIN_S > 0 it then
  tries for that many seconds to join the job again (printing ``rejoined``) and goes on training.
- ``momentum STEPS STEP_S OUT``: sync training under a scheduler with SGD and momentum and deterministic gradients
  (a function of the rank and the step alone) over tensors both of two shards hold parts of; prints ``step N``
  after each step and saves the final parameters in OUT (an .npz), so that two runs can be compared bit for bit.
- ``ride-job RANK W STEPS STEP_S``: ``ride`` under a scheduler (async mode: a barrier before the final pull).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Iterator

import msgpack
import numpy as np
import zmq

import psrt
from psrt.config import ClientConfig

# ------------------------------------------------------------------------------------------------ train


def train(endpoint: str, size: int, stopfile: str) -> dict[str, Any]:
    """Train until ``stopfile`` exists; every step's end time and push_pull latency, and the exactness check."""
    expected = np.zeros(size, np.float64)
    idx = np.arange(size)
    times, lat = [], []
    with psrt.Client([endpoint], rank=0, num_workers=1, config=ClientConfig(timeout=60)) as client:
        params = client.init({"w": np.zeros(size, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        step = 0
        while not os.path.exists(stopfile):
            # Integers in [-3, 3]: every partial sum is exact in float32, so the result is predictable exactly.
            grad = (((idx + step) % 7) - 3).astype(np.float32)
            start = time.perf_counter()
            params = client.push_pull({"w": grad}, out=params)
            lat.append(time.perf_counter() - start)
            times.append(time.time())
            expected -= grad
            step += 1
            if step == 1:
                print("training", flush=True)
            time.sleep(0.002)  # a sliver of compute between steps
        final = client.pull()["w"]
    return {"steps": step, "times": times, "latencies": lat, "exact": bool(np.array_equal(final, expected)),
            "max_error": float(np.max(np.abs(final - expected))) if size else 0.0}


# ------------------------------------------------------------------------------------------------ flood


def _h(**fields: Any) -> bytes:
    return msgpack.packb({"v": 1, **fields})


def malformed_kinds(size: int, rng: np.random.Generator) -> dict[str, Callable[[int], list[bytes]]]:
    """Makers of malformed messages by kind: ``maker(request_id)`` gives the frames of one message.

    None of them is a valid request, so none may change the shard: each is refused before any state changes.
    ``size`` is the length of the trained tensor ``w`` (so mismatches are near misses, not random noise).
    """
    good = np.ones(size, np.float32).tobytes()

    def push(rid: int, **over: Any) -> dict[str, Any]:
        base = dict(op="push", id=rid, worker=0, session=7, seq=int(rng.integers(1 << 40)), clock=1,
                    tensors=[["w", 0, "<f4", [size]]])
        base.update(over)
        return base

    def garbage(rid: int) -> list[bytes]:
        # 0xc1 is never used by msgpack: the frame cannot decode, however the random tail reads.
        return [b"\xc1" + rng.bytes(int(rng.integers(0, 256)))]

    def nonfinite(rid: int) -> list[bytes]:
        g = np.ones(size, np.float32)
        g[int(rng.integers(size))] = [np.nan, np.inf, -np.inf][rid % 3]
        return [_h(**push(rid)), g.tobytes()]

    return {
        "garbage-bytes": garbage,
        "empty-frame": lambda rid: [b""],
        "truncated-msgpack": lambda rid: [_h(**push(rid))[:-int(rng.integers(1, 8))], good],
        "not-a-map": lambda rid: [msgpack.packb([[1, 2, 3], "push", 7.5, None][rid % 4])],
        "non-string-keys": lambda rid: [msgpack.packb({1: 2, "v": 1})],
        "bin-in-header": lambda rid: [msgpack.packb({"v": 1, **push(rid), "x": rng.bytes(8)}, use_bin_type=True)],
        "wrong-version": lambda rid: [msgpack.packb({**push(rid), "v": int(rng.integers(2, 1000))}), good],
        "unknown-op": lambda rid: [_h(op=f"x-{rng.integers(1 << 30)}", id=rid)],
        "missing-field": lambda rid: [_h(op="push", id=rid, worker=0, tensors=[]), b""],
        "extra-field": lambda rid: [_h(**push(rid), admin=True), good],
        "bool-as-int": lambda rid: [_h(**push(rid, seq=True)), good],
        "float-id": lambda rid: [_h(**push(rid, id=rid + 0.5)), good],
        "negative-worker": lambda rid: [_h(**push(rid, worker=-1)), good],
        "missing-payload": lambda rid: [_h(**push(rid))],
        "extra-frame": lambda rid: [_h(**push(rid)), good, b"x"],
        "bad-dtype": lambda rid: [_h(**push(rid, tensors=[["w", 0, ["<i4", "O", ">f4", "<f2", "|b1", "<c8", "S4"]
                                                           [rid % 7], [size]]])), good],
        "wrong-byte-count": lambda rid: [_h(**push(rid)), good[:-4 * int(rng.integers(1, 4))]],
        "huge-shape": lambda rid: [_h(**push(rid, tensors=[["w", 0, "<f4", [2**40, 2**40, 2**40]]])), good],
        "negative-dim": lambda rid: [_h(**push(rid, tensors=[["w", 0, "<f4", [-size]]])), good],
        "too-many-dims": lambda rid: [_h(**push(rid, tensors=[["w", 0, "<f4", [1] * 40]])), good[:4]],
        "long-name": lambda rid: [_h(**push(rid, tensors=[["w" * 5000, 0, "<f4", [size]]])), good],
        "unknown-key": lambda rid: [_h(**push(rid, tensors=[["nope", 0, "<f4", [size]]])), good],
        "size-mismatch": lambda rid: [_h(**push(rid, tensors=[["w", 0, "<f4", [size - 1]]])), good[:-4]],
        "dtype-mismatch": lambda rid: [_h(**push(rid, tensors=[["w", 0, "<f8", [size // 2]]])), good],
        "nonfinite-gradient": nonfinite,
        "bad-optimizer": lambda rid: [_h(op="init", id=rid, worker=0, session=7, optimizer={"name": "pickle"},
                                         tensors=[["z", 0, "<f4", [1]]]), good[:4]],
        "pull-unreachable": lambda rid: [_h(op="pull", id=rid, worker=0, clock=0, keys=[["w", 0, 1 << 50]])],
        "pull-bad-keys": lambda rid: [_h(op="pull", id=rid, worker=0, clock=0, keys=[["w", "0", 0]])],
    }


#: Every this many messages, one oversized header (over the 1 MiB limit): rare, as each moves a megabyte.
OVERSIZED_EVERY = 2000


def messages(count: int, size: int, seed: int) -> Iterator[tuple[str, list[bytes]]]:
    """``count`` malformed messages, the kinds in turn, with an oversized header every :data:`OVERSIZED_EVERY`."""
    rng = np.random.default_rng(seed)
    kinds = list(malformed_kinds(size, rng).items())
    oversized = _h(op="stats", id=1, pad="x" * 4096)  # a valid stats request but for the padding...
    oversized = oversized + b"\0" * ((1 << 20) + 1 - len(oversized))  # ...and past the header limit
    for i in range(count):
        rid = i + 1
        if i % OVERSIZED_EVERY == OVERSIZED_EVERY - 1:
            yield "oversized-header", [oversized]
            continue
        name, make = kinds[i % len(kinds)]
        yield name, make(rid)


def flood(endpoint: str, size: int, count: int, seed: int, window: int = 512) -> dict[str, Any]:
    """Send ``count`` malformed messages, at most ``window`` unanswered at a time, and count the replies."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    sent = replies = errors = 0
    other: dict[str, int] = {}
    by_kind: dict[str, int] = {}

    def take(timeout_ms: int) -> None:
        nonlocal replies, errors
        if not sock.poll(timeout_ms):
            return
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            replies += 1
            op = msgpack.unpackb(frames[0]).get("op") if frames and frames[0] else None
            if op == "error":
                errors += 1
            else:  # a malformed message that was answered as if valid: the bench reports it
                other[str(op)] = other.get(str(op), 0) + 1

    print("ready", flush=True)
    start = time.time()
    for name, frames in messages(count, size, seed):
        while sent - replies >= window:
            take(1000)
        sock.send_multipart(frames)
        sent += 1
        by_kind[name] = by_kind.get(name, 0) + 1
    deadline = time.monotonic() + 30.0
    while replies < sent and time.monotonic() < deadline:
        take(200)
    end = time.time()
    sock.close()
    ctx.term()
    return {"sent": sent, "replies": replies, "error_replies": errors, "other_replies": other, "kinds": by_kind,
            "start": start, "end": end}


# ------------------------------------------------------------------------------------------------ ride


def ride(endpoint: str, rank: int, workers: int, steps: int, step_s: float) -> dict[str, Any]:
    """Push (rank, step) as -1 at index rank*steps+step; the final values count lost, once and twice applied."""
    size = workers * steps
    times: list[float] = []  # when each step ended
    with psrt.Client([endpoint], rank=rank, num_workers=workers, config=ClientConfig(timeout=30)) as client:
        client.init({"w": np.zeros(size, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        grad = np.zeros(size, np.float32)
        for step in range(steps):
            grad[:] = 0
            grad[rank * steps + step] = workers
            client.push_pull({"w": grad})
            times.append(time.time())
            if step == 0:
                print("training", flush=True)
            time.sleep(step_s)
        final = client.pull()["w"]
    values, counts = np.unique(final, return_counts=True)
    return {"rank": rank, "counts": {str(float(v)): int(c) for v, c in zip(values, counts)},
            "max_gap": max(b - a for a, b in zip(times, times[1:])), "times": times}


# ------------------------------------------------------------------------------------------------ job


def job(steps: int, step_s: float, rejoin_s: float = 0.0, stopfile: str = "") -> dict[str, Any]:
    """Train under the scheduler of the environment; how the job ended, the longest stall, and any rejoin."""
    res: dict[str, Any] = {"error": None, "message": "", "at": 0.0, "steps": 0, "max_gap": 0.0, "max_gap_end": 0.0,
                           "rank": -1, "rejoined_at": None, "rejoin_error": None}
    last = None
    step = 0
    rejoin_until = None
    while step < steps and not (stopfile and os.path.exists(stopfile)):
        try:
            with psrt.Client() as client:
                res["rank"] = client.rank
                client.init({"w": np.zeros(1000, np.float32)}, optimizer=psrt.SGD(lr=0.1))
                if rejoin_until is not None:
                    res["rejoined_at"] = time.time()
                    print("rejoined", flush=True)
                while step < steps and not (stopfile and os.path.exists(stopfile)):
                    client.push_pull({"w": np.ones(1000, np.float32)})
                    now = time.time()
                    if last is not None and now - last > res["max_gap"]:
                        res["max_gap"], res["max_gap_end"] = now - last, now
                    last = now
                    step += 1
                    res["steps"] = step
                    if step == 1:
                        print("training", flush=True)
                    time.sleep(step_s)
        except psrt.PsrtError as exc:
            if res["error"] is None:
                res.update(error=type(exc).__name__, message=str(exc), at=time.time())
            elif rejoin_until is not None:
                res["rejoin_error"] = f"{type(exc).__name__}: {exc}"
            if rejoin_until is None and rejoin_s > 0:
                rejoin_until = time.time() + rejoin_s
            if rejoin_until is None or time.time() > rejoin_until:
                break
            last = None  # the stall of a worker that was cut off is not a survivor's stall
            time.sleep(0.2)
    return res


# ------------------------------------------------------------------------------------------------ replication


def momentum(steps: int, step_s: float, out: str) -> dict[str, Any]:
    """Deterministic sync training (SGD with momentum) under the scheduler; every step's end time, the final
    parameters in ``out``, and the first error (None when every step completed)."""
    res: dict[str, Any] = {"rank": -1, "steps": 0, "times": [], "error": None, "message": ""}
    try:
        with psrt.Client(config=ClientConfig(timeout=60)) as client:
            res["rank"] = rank = client.rank
            shapes = {"big": 600_000, "small": 1000, "mid": 70_000}
            client.init({n: np.linspace(-1, 1, s, dtype=np.float32) for n, s in shapes.items()},
                        optimizer=psrt.SGD(lr=0.05, momentum=0.9))
            grads = {n: np.empty(s, np.float32) for n, s in shapes.items()}
            base = {n: np.sin(np.arange(s, dtype=np.float32) * 0.001) for n, s in shapes.items()}
            for step in range(steps):
                for n, g in grads.items():
                    np.multiply(base[n], np.float32((rank + 1) * np.cos(step * 0.1)), out=g)
                client.push_pull(grads)
                res["times"].append(time.time())
                res["steps"] = step + 1
                print(f"step {step}", flush=True)
                if step == 0:
                    print("training", flush=True)
                time.sleep(step_s)
            final = client.pull()
            client.barrier()  # nobody ends the job before everyone has pulled
        np.savez(out, **final)
    except psrt.PsrtError as exc:
        res.update(error=type(exc).__name__, message=str(exc))
    return res


def ride_job(rank: int, workers: int, steps: int, step_s: float) -> dict[str, Any]:
    """Recognisable pushes (as :func:`ride`) under the scheduler of the environment, in any mode; ``acked``: the
    push_pulls that returned (each one an acknowledged push)."""
    size = workers * steps
    res: dict[str, Any] = {"rank": rank, "acked": 0, "times": [], "error": None, "message": "", "counts": {}}
    try:
        with psrt.Client(None, rank=rank, num_workers=workers, config=ClientConfig(timeout=60)) as client:
            client.init({"w": np.zeros(size, np.float32)}, optimizer=psrt.SGD(lr=1.0))
            grad = np.zeros(size, np.float32)
            for step in range(steps):
                grad[:] = 0
                grad[rank * steps + step] = workers
                client.push_pull({"w": grad})
                res["acked"] += 1
                res["times"].append(time.time())
                if step == 0:
                    print("training", flush=True)
                time.sleep(step_s)
            client.barrier()  # every worker's pushes are in before the final pull
            final = client.pull()["w"]
            client.barrier()
        values, counts = np.unique(final, return_counts=True)
        res["counts"] = {str(float(v)): int(c) for v, c in zip(values, counts)}
    except psrt.PsrtError as exc:
        res.update(error=type(exc).__name__, message=str(exc))
    return res


def main(argv: list[str]) -> int:
    """Run the role named by ``argv[0]`` and print its result as the last line."""
    role, args = argv[0], argv[1:]
    if role == "train":
        result = train(args[0], int(args[1]), args[2])
    elif role == "flood":
        result = flood(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif role == "ride":
        result = ride(args[0], int(args[1]), int(args[2]), int(args[3]), float(args[4]))
    elif role == "job":
        result = job(int(args[0]), float(args[1]), float(args[2]) if len(args) > 2 else 0.0,
                     args[3] if len(args) > 3 else "")
    elif role == "momentum":
        result = momentum(int(args[0]), float(args[1]), args[2])
    elif role == "ride-job":
        result = ride_job(int(args[0]), int(args[1]), int(args[2]), float(args[3]))
    else:
        print(f"unknown role {role!r}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    # A job worker that was cut off but joined again and finished has recovered: that is a success.
    return 1 if result.get("error") and not result.get("rejoined_at") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
