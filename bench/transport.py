"""psrt's push_pull to a shard on ``tcp://127.0.0.1`` against a raw pyzmq DEALER/ROUTER echo of the same bytes.

For each tensor size (4 KiB, 64 KiB, 1 MiB, 4 MiB, 16 MiB and 64 MiB of float32 by default) this script times,
in one run:

psrt
    ``client.push_pull({name: grad})`` from a :class:`psrt.Client` (rank 0, W=1) to ONE shard server, a real
    ``psrt server --workers 1 --mode sync`` child process on an ephemeral loopback port, whose tensors use
    ``psrt.SGD``. A round trip is the whole call: the client partitions the tensor (``--chunk``, 4 MiB, per
    message), the shard validates every message (including its NaN/Inf check), applies the gradient and sends
    the parameters back, and the client receives them into a fresh array ("psrt") or, as a training loop that
    overwrites its parameters would, into the same array every time (``out=``, "psrt out="). Shard and client
    share this host, so by default tensor bytes go through shared memory and the socket carries headers only
    (docs/sharedmem.md); "psrt sockets" is a second client with ``ClientConfig(shm=False)`` (``PSRT_SHM=0``),
    whose bytes all go over the TCP socket, as between two hosts.
raw
    A DEALER socket in this process and a ROUTER echo in a separate child process (this script with
    ``--echo-server``), both plain pyzmq with their default options except high-water marks and linger. The
    DEALER sends the tensor's bytes zero-copy and receives the echo zero-copy. Two forms are timed and the
    faster (lower median) is the baseline: the bytes as one message, and, when the tensor is larger than
    ``--chunk`` (4 MiB), as ``size / chunk`` zero-copy messages all in flight before the echoes are received.

A round repeats each side a block of round trips; psrt and raw blocks alternate, and which side goes first
flips every round, so load from other processes on a shared machine hits both alike. Every round trip is timed
on its own; the table reports medians (p50) and, for sizes up to ``--latency-max`` (64 KiB), p99.

Throughput is ``2 x size / round-trip time``: the tensor's bytes travel out and back once per round trip (push
and pull; message and echo). Ratios are psrt throughput over the raw baseline's (from medians).

Targets:

- 64 MiB: psrt push_pull throughput >= 0.7x the best raw echo;
- 4 KiB: psrt push_pull round-trip p50 <= 2x the raw DEALER/ROUTER echo p50.

Each check of the results is done once, after timing: the parameters psrt returned must equal the value a
constant gradient implies (exact in float32), and a raw echo must return the bytes sent. Every network wait has
a timeout (``--timeout``); the child processes are terminated (then killed) on exit, on errors and on Ctrl-C or
SIGTERM, and on Linux the kernel also sends them SIGTERM should this process die without cleaning up.

Notes
-----
On a small shared machine the ratios move with its load. On the 2-CPU virtual machine this was written on, the
raw echo's 4 KiB round trip ranged from about 90 to 200 us from run to run, while psrt's, which is dominated by
its per-message Python work, stayed nearer 250-340 us; at large sizes both sides compete for the same cores.
Run it a few times and compare the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import zmq
from _common import human_bytes as human  # this script sizes bytes: "64 KiB"
from _common import parse_size, start_child, start_server

import psrt
from psrt.config import ClientConfig
from psrt.control.process import Child, ready_line, ready_pattern

KIB, MIB = 1 << 10, 1 << 20
DEFAULT_SIZES = (4 * KIB, 64 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB)
#: Round trips per side (full run) for the default sizes; others interpolate by bytes moved.
DEFAULT_COUNTS = {4 * KIB: 3000, 64 * KIB: 1500, MIB: 300, 4 * MIB: 80, 16 * MIB: 30, 64 * MIB: 16}
QUICK_DIVISOR = 5
#: The gradient is constant and a power of two, and so is the learning rate: every parameter stays exact.
GRAD, LR = 2.0 ** -10, 0.5
HWM = 100_000

LARGE_TARGET = (64 * MIB, 0.7)  # throughput ratio >= 0.7
SMALL_TARGET = (4 * KIB, 2.0)  # p50 ratio <= 2.0


def _float32_bytes(text: str) -> int:
    """A size in bytes that holds whole float32 values."""
    return parse_size(text, multiple=4)


def fmt_time(seconds: float) -> str:
    """A duration with a readable unit."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e3:.2f} ms"


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (linear interpolation)."""
    return float(np.percentile(np.asarray(values), q))


# ---------------------------------------------------------------------------------------------------------------
# child processes
# ---------------------------------------------------------------------------------------------------------------
def echo_server() -> int:
    """The raw baseline's ROUTER: echo every message back to its sender until stdin closes or SIGTERM."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.bind("tcp://127.0.0.1:*")
    print(ready_line("echo", sock.getsockopt(zmq.LAST_ENDPOINT).decode()), flush=True)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)  # the parent holds the other end; EOF means it is gone
    try:
        while not stop:
            events = dict(poller.poll(500))
            if sys.stdin.fileno() in events and not os.read(sys.stdin.fileno(), 4096):
                break
            if sock in events:
                while True:
                    try:
                        msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    sock.send_multipart(msg, copy=False)
    finally:
        sock.close(linger=0)
        ctx.term()
    return 0


# ---------------------------------------------------------------------------------------------------------------
# the two sides
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Series:
    """Round-trip times (seconds) of one way of moving ``size`` bytes."""

    name: str
    size: int
    op: Callable[[], None]
    samples: list[float] = field(default_factory=list)

    def run(self, count: int) -> None:
        op, out = self.op, self.samples
        clock = time.perf_counter
        for _ in range(count):
            t0 = clock()
            op()
            out.append(clock() - t0)

    def summary(self) -> dict:
        s = self.samples
        p50 = statistics.median(s)
        return {"name": self.name, "count": len(s), "p50_s": p50, "p90_s": percentile(s, 90),
                "p99_s": percentile(s, 99), "min_s": min(s), "mean_s": statistics.fmean(s),
                "gbps_p50": 2 * self.size / p50 / 1e9, "gbps_max": 2 * self.size / min(s) / 1e9}


class RawDealer:
    """The raw baseline's DEALER, connected to the echo process."""

    def __init__(self, ctx: zmq.Context, endpoint: str, timeout: float) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.setsockopt(zmq.RCVHWM, HWM)
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        self.sock.connect(endpoint)
        self.timeout_ms = int(timeout * 1000)

    def _recv(self) -> zmq.Frame:
        if not self.sock.poll(self.timeout_ms, zmq.POLLIN):
            raise TimeoutError(f"no echo within {self.timeout_ms / 1000:g}s")
        return self.sock.recv(copy=False)

    def one(self, payload: memoryview) -> Callable[[], None]:
        """Send ``payload`` as one zero-copy message and receive its echo."""
        sock = self.sock

        def op() -> None:
            sock.send(payload, copy=False)
            self._recv()
        return op

    def chunked(self, payload: memoryview, chunk: int) -> Callable[[], None]:
        """Send ``payload`` as zero-copy ``chunk``-byte messages, all in flight, then receive every echo."""
        sock = self.sock
        pieces = [payload[i:i + chunk] for i in range(0, len(payload), chunk)]

        def op() -> None:
            for piece in pieces:
                sock.send(piece, copy=False)
            for _ in pieces:
                self._recv()
        return op

    def check(self, payload: memoryview, chunk: Optional[int]) -> None:
        """One echo, compared byte for byte with what was sent."""
        pieces = [payload] if chunk is None else [payload[i:i + chunk] for i in range(0, len(payload), chunk)]
        for piece in pieces:
            self.sock.send(piece, copy=True)
        for piece in pieces:
            if self._recv().bytes != piece.tobytes():
                raise RuntimeError("the raw echo returned different bytes")

    def close(self) -> None:
        self.sock.close(linger=0)


def psrt_op(client: psrt.Client, name: str, grad: np.ndarray, counter: list[int],
            reuse: bool = False) -> Callable[[], None]:
    """One push_pull of ``grad``; counts the calls so the result can be checked.

    With ``reuse`` the parameters are received into the same array every time (``out=``), as a training loop
    that overwrites its parameters does; otherwise into a fresh array per call.
    """
    tensors = {name: grad}
    out = {name: np.empty_like(grad)} if reuse else None

    def op() -> None:
        client.push_pull(tensors, out=out)
        counter[0] += 1
    return op


# ---------------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------------
def count_for(size: int, quick: bool, scale: float) -> int:
    """Round trips per side for ``size`` bytes."""
    if size in DEFAULT_COUNTS:
        n = DEFAULT_COUNTS[size]
    else:  # about as many bytes as the nearest default size moves, within [10, 3000]
        n = int(min(3000, max(10, 2e8 / size)))
    n = max(5, int(n * scale))
    return max(5, n // QUICK_DIVISOR) if quick else n


def measure_size(size: int, client: psrt.Client, sockets: psrt.Client, raw: RawDealer,
                 args: argparse.Namespace) -> dict:
    """Time psrt and every raw form at ``size`` bytes, interleaved; then check both sides' results."""
    n = size // 4
    name = f"t{size}"
    client.init({name: np.zeros(n, np.float32)}, optimizer=psrt.SGD(lr=LR))
    grad = np.full(n, GRAD, np.float32)
    payload = memoryview(np.full(n, GRAD, np.float32)).cast("B")
    calls = [0]
    sockets.init({name: np.zeros(n, np.float32)}, optimizer=psrt.SGD(lr=LR))
    sides = [Series("psrt", size, psrt_op(client, name, grad, calls)),
             Series("psrt out=", size, psrt_op(client, name, grad, calls, reuse=True)),
             Series("psrt sockets", size, psrt_op(sockets, name, grad, calls))]
    raws = [Series("raw one message", size, raw.one(payload))]
    if size > args.chunk:
        raws.append(Series(f"raw {size // args.chunk} x {human(args.chunk)} in flight", size,
                           raw.chunked(payload, args.chunk)))
    sides += raws
    total = count_for(size, args.quick, args.scale)
    block = max(1, math.ceil(total / args.rounds))
    for s in sides:  # warm-up: connections, first-touch allocations, page cache of the kernel buffers
        s.run(max(2, min(block, 20)))
        s.samples.clear()
    done = 0
    r = 0
    while done < total:
        k = min(block, total - done)
        order = sides if r % 2 == 0 else sides[::-1]
        for s in order:
            s.run(k)
        done += k
        r += 1
    # Checks, after timing: psrt's parameters after `calls` SGD steps of a constant gradient; the raw echo's bytes.
    params = client.pull([name])[name]
    want = np.float32(-calls[0] * LR * GRAD)
    if not np.all(params == want):
        raise RuntimeError(f"psrt returned wrong parameters for {human(size)}: {params[:4]} != {want}")
    raw.check(payload, None)
    if size > args.chunk:
        raw.check(payload, args.chunk)
    best = min(raws, key=lambda s: statistics.median(s.samples))
    ps = sides[0].summary()
    po = sides[1].summary()
    pk = sides[2].summary()
    bs = best.summary()
    return {
        "size": size,
        "round_trips_per_side": total,
        "psrt": ps,
        "psrt_out": po,
        "psrt_sockets": pk,
        "throughput_ratio_sockets": pk["gbps_p50"] / bs["gbps_p50"],
        "p50_ratio_sockets": pk["p50_s"] / bs["p50_s"],
        "throughput_ratio_out": po["gbps_p50"] / bs["gbps_p50"],
        "p50_ratio_out": po["p50_s"] / bs["p50_s"],
        "raw": [s.summary() for s in raws],
        "raw_best": bs["name"],
        "throughput_ratio": ps["gbps_p50"] / bs["gbps_p50"],
        "throughput_ratio_best": ps["gbps_max"] / bs["gbps_max"],
        "p50_ratio": ps["p50_s"] / bs["p50_s"],
        "p99_ratio": ps["p99_s"] / bs["p99_s"],
    }


def print_table(rows: list[dict], latency_max: int) -> None:
    """One line per size; p50/p99 for the small ones."""
    print("\nthroughput = 2 x size / round-trip time (out and back), from the median (p50) round trip; "
          "ratio = psrt throughput / best raw throughput.\n")
    head = (f"{'size':>8} | {'psrt p50':>10} {'psrt GB/s':>9} | {'raw p50':>10} {'raw GB/s':>9} {'raw form':<24} | "
            f"{'ratio':>6} | {'psrt p99':>10} {'raw p99':>10} {'p50 x':>6} {'p99 x':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        p, b = r["psrt"], next(x for x in r["raw"] if x["name"] == r["raw_best"])
        tail = ""
        if r["size"] <= latency_max:
            tail = (f"{fmt_time(p['p99_s']):>10} {fmt_time(b['p99_s']):>10} {r['p50_ratio']:>5.2f}x "
                    f"{r['p99_ratio']:>5.2f}x")
        print(f"{human(r['size']):>8} | {fmt_time(p['p50_s']):>10} {p['gbps_p50']:>9.3f} | {fmt_time(b['p50_s']):>10} "
              f"{b['gbps_p50']:>9.3f} {r['raw_best']:<24} | {r['throughput_ratio']:>5.2f}x | {tail}")
        o = r["psrt_out"]
        print(f"{'':>8} | {fmt_time(o['p50_s']):>10} {o['gbps_p50']:>9.3f} {'(psrt, out= reused)':<24}"
              f"{'':>12} | {r['throughput_ratio_out']:>5.2f}x | p50 {r['p50_ratio_out']:.2f}x")
        k = r["psrt_sockets"]
        print(f"{'':>8} | {fmt_time(k['p50_s']):>10} {k['gbps_p50']:>9.3f} {'(psrt, PSRT_SHM=0)':<24}"
              f"{'':>12} | {r['throughput_ratio_sockets']:>5.2f}x | p50 {r['p50_ratio_sockets']:.2f}x")
        for other in r["raw"]:
            if other["name"] != r["raw_best"]:
                print(f"{'':>8} | {'':>10} {'':>9} | {fmt_time(other['p50_s']):>10} {other['gbps_p50']:>9.3f} "
                      f"{other['name']:<24} |")


def check_targets(rows: list[dict]) -> list[dict]:
    """PASS/MISS for the two targets; prints one line each."""
    out = []
    by_size = {r["size"]: r for r in rows}
    size, target = LARGE_TARGET
    print()
    if size in by_size:
        r = by_size[size]
        ok = r["throughput_ratio"] >= target
        best = next(x for x in r["raw"] if x["name"] == r["raw_best"])
        print(f"{'PASS' if ok else 'MISS'}  {human(size)} push_pull throughput {r['psrt']['gbps_p50']:.3f} GB/s = "
              f"{r['throughput_ratio']:.2f}x the best raw echo ({r['raw_best']}: {best['gbps_p50']:.3f} GB/s), "
              f"target >= {target:g}x [from minimum times: {r['throughput_ratio_best']:.2f}x]")
        out.append({"target": f"{human(size)} throughput ratio >= {target:g}", "ratio": r["throughput_ratio"],
                    "ratio_best": r["throughput_ratio_best"], "pass": ok})
        ok_out = r["throughput_ratio_out"] >= target
        print(f"{'PASS' if ok_out else 'MISS'}  {human(size)} push_pull into reused arrays (out=) "
              f"{r['psrt_out']['gbps_p50']:.3f} GB/s = {r['throughput_ratio_out']:.2f}x the best raw echo, "
              f"target >= {target:g}x")
        out.append({"target": f"{human(size)} throughput ratio (out=) >= {target:g}",
                    "ratio": r["throughput_ratio_out"], "pass": ok_out})
        ok_sock = r["throughput_ratio_sockets"] >= target
        print(f"{'PASS' if ok_sock else 'MISS'}  {human(size)} push_pull over the socket only (PSRT_SHM=0, as "
              f"between hosts) {r['psrt_sockets']['gbps_p50']:.3f} GB/s = {r['throughput_ratio_sockets']:.2f}x the "
              f"best raw echo, target >= {target:g}x")
        out.append({"target": f"{human(size)} throughput ratio (sockets) >= {target:g}",
                    "ratio": r["throughput_ratio_sockets"], "pass": ok_sock})
    else:
        print(f"(no {human(size)} size measured: throughput target not checked)")
    size, target = SMALL_TARGET
    if size in by_size:
        r = by_size[size]
        ok = r["p50_ratio"] <= target
        best = next(x for x in r["raw"] if x["name"] == r["raw_best"])
        print(f"{'PASS' if ok else 'MISS'}  {human(size)} push_pull round trip p50 {fmt_time(r['psrt']['p50_s'])} = "
              f"{r['p50_ratio']:.2f}x the raw echo p50 {fmt_time(best['p50_s'])}, target <= {target:g}x "
              f"[p99: {fmt_time(r['psrt']['p99_s'])} vs {fmt_time(best['p99_s'])}, {r['p99_ratio']:.2f}x]")
        out.append({"target": f"{human(size)} p50 ratio <= {target:g}", "ratio": r["p50_ratio"], "pass": ok})
        ok_out = r["p50_ratio_out"] <= target
        print(f"{'PASS' if ok_out else 'MISS'}  {human(size)} push_pull (out=) p50 {fmt_time(r['psrt_out']['p50_s'])}"
              f" = {r['p50_ratio_out']:.2f}x the raw echo p50, target <= {target:g}x")
        out.append({"target": f"{human(size)} p50 ratio (out=) <= {target:g}", "ratio": r["p50_ratio_out"],
                    "pass": ok_out})
    else:
        print(f"(no {human(size)} size measured: latency target not checked)")
    return out


def run(args: argparse.Namespace) -> int:
    me = os.path.abspath(__file__)
    children: list[Child] = []
    ctx: Optional[zmq.Context] = None
    client: Optional[psrt.Client] = None
    sockets: Optional[psrt.Client] = None
    raw: Optional[RawDealer] = None
    try:
        # Children first: no ZeroMQ threads exist yet in this process when they are forked.
        server = start_server(1, args.timeout)
        children.append(server)
        # The echo server also ends when its stdin closes: it watches the pipe we hold.
        echo = start_child([sys.executable, me, "--echo-server"], ready_pattern("echo"), args.timeout, label="echo",
                           stdin=subprocess.PIPE)
        children.append(echo)
        ctx = zmq.Context()
        client = psrt.Client([server.endpoint], rank=0, num_workers=1,
                             config=ClientConfig(timeout=args.timeout, partition_bytes=args.chunk))
        sockets = psrt.Client([server.endpoint], rank=0, num_workers=1,
                              config=ClientConfig(timeout=args.timeout, partition_bytes=args.chunk, shm=False))
        raw = RawDealer(ctx, echo.endpoint, args.timeout)
        rows = []
        for size in args.sizes:
            print(f"measuring {human(size)} ...", file=sys.stderr, flush=True)
            rows.append(measure_size(size, client, sockets, raw, args))
        print_table(rows, args.latency_max)
        targets = check_targets(rows)
        if args.json:
            meta = {"psrt": psrt.__version__, "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
                    "numpy": np.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                    "quick": args.quick, "rounds": args.rounds, "chunk": args.chunk, "timeout": args.timeout,
                    "throughput": "2 x size / round-trip time, 1 GB = 1e9 bytes"}
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "results": rows, "targets": targets}, f, indent=1)
            print(f"\nwrote {args.json}")
        return 1 if args.strict and not all(t["pass"] for t in targets) else 0
    finally:
        if raw is not None:
            raw.close()
        for c in (client, sockets):
            if c is not None:
                c.close()
        if ctx is not None:
            ctx.term()
        for child in reversed(children):
            child.stop()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sizes", type=lambda s: [_float32_bytes(x) for x in s.split(",") if x.strip()],
                        default=list(DEFAULT_SIZES), help="comma-separated tensor sizes in bytes (K/M suffixes)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_DIVISOR}x fewer round trips")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the round trips per size by this")
    parser.add_argument("--rounds", type=int, default=10, help="alternating psrt/raw blocks per size")
    parser.add_argument("--chunk", type=_float32_bytes, default=4 * MIB,
                        help="psrt's partition size and the raw baseline's message size for large tensors")
    parser.add_argument("--latency-max", type=_float32_bytes, default=64 * KIB, help="show p99 up to this size")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any single network wait may take")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 when a target is missed")
    parser.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo_server:
        return echo_server()
    if args.rounds < 1 or args.timeout <= 0 or args.scale <= 0:
        parser.error("--rounds must be >= 1, --timeout and --scale > 0")

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    print(f"psrt {psrt.__version__}, pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), numpy {np.__version__}, "
          f"python {platform.python_version()}, {os.cpu_count()} CPUs; TCP loopback, one shard, W=1, sync, SGD"
          + (", quick" if args.quick else ""))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
