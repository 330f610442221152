"""One shard's message rate: 4 KiB ``push_pull`` requests answered per second, against a bare pyzmq ROUTER
answering the same requests, side by side in one run; and the 4 KiB round trip of one call at a time.

At scale a round is W x chunks messages, so what one message costs the shard decides where it saturates. This
script measures, alternating blocks of each side (the order flips every round, so load from other processes on a
shared machine hits both alike):

psrt
    ONE real ``psrt server --workers W --mode async`` child process on an ephemeral loopback port (SGD on one
    1,024-element float32 tensor) and W :class:`psrt.Client` workers (ranks 0..W-1, default 8), each keeping F
    (default 8) ``push_pull_async`` calls of the tensor's 4 KiB gradient in flight: the workers take turns, each
    waits for its oldest call, counts it and starts the next one, so W x F requests are always in flight. A reply
    is the updated parameters (4 KiB). Each client is what ``psrt.Client`` makes (its own ZeroMQ context, so its
    own I/O thread; plain ``client.push_pull_async(grads)`` without ``out=``). Worker and shard share this host,
    so each client's requests and replies take a local connection of its own to the shard after its first calls
    (a Unix socket, :mod:`psrt.transport.local`), as by default; below 64 KiB no byte goes through shared memory.
psrt sockets (PSRT_SHM=0)
    The same with W more clients made with ``ClientConfig(shm=False)`` (ranks 0..W-1 again, sessions of their
    own): every request and reply over the ZeroMQ socket, as between hosts. Reported, not a target.
psrt, pipelined from the start
    W more :class:`psrt.Client` workers made anew for every block (joining the tensor with ``init``), each keeping
    F calls in flight from its first call on, as a pipelined training loop does from its start: the block includes
    setting up their local connections, and no moment has nothing in flight. Reported against the ``psrt`` side
    (whose clients start each block with nothing in flight), not a target.
psrt shard
    The same shard driven as the bare loop is (below): W plain DEALER sockets on one context, socket i being
    worker i with a session of its own, each keeping F ``push_pull`` requests in flight, packed as
    :class:`psrt.Client` packs them (:func:`psrt.wire.push_prefix` once, :func:`psrt.wire.encode_push_after` per
    request), the answers received and not read. This is the shard's own rate, the clients' cost taken out as
    far as the bare loop's is.
raw
    A bare pyzmq ROUTER loop in a child process (this script with ``--echo-server``): wait for input, then
    ``recv_multipart`` every queued message and ``send_multipart`` it back (an echo: the reply has the request's
    frames and bytes), driven the same way by W plain DEALER sockets (one context), each keeping F requests of
    the frames a psrt request has (a header frame of the same length and the 4 KiB gradient) in flight.
raw, a context per worker (``--context-per-worker``)
    The bare loop again, each DEALER with a ZeroMQ context of its own, as each ``psrt.Client`` has: what W I/O
    threads cost a client process.

Layout: the servers are one process each; every worker of every side is in THIS process, one thread taking
turns, so that a side is two processes on the two cores of the machine this was written for (a worker process
per worker would add W processes' wake-ups to every side). The clients spend CPU on these cores too: the rate
is what the pair sustains, and the table shows each process's CPU time per request (all its threads: the server
child's from ``/proc``, this process's from ``os.times``) to tell where it goes.

Latency: W = 1, one call at a time: a ``client.push_pull`` of the 4 KiB tensor by worker 0 against the raw
DEALER/ROUTER echo of a 4 KiB message (``bench/transport.py``'s 4 KiB row, on these servers), and by the first
``shm=False`` client, blocks alternating; p50 and p99 of the single round trips.

Targets:

- rate: psrt >= 0.6x the bare loop's requests/s (the ratio of the sides' median block rates), and so the psrt
  shard with bare workers;
- latency: 4 KiB ``push_pull`` round trip p50 <= 1.5x the raw echo's p50.

Checks, once, after timing: the parameters equal what the pushes of both psrt sides imply (every push applied
once: SGD with a constant gradient and learning rate, powers of two, exact in float32), the shard counted exactly
the pushes the workers made and no error, and a raw echo returns the bytes it was sent. Every network wait has a
timeout (``--timeout``); the children are terminated (then killed) on exit, on errors, on Ctrl-C or SIGTERM,
and die with this process.

Notes
-----
On a small shared machine the absolute rates move with its load by a factor of two or more from run to run;
compare the ratios of one run, and run it a few times.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Optional

import numpy as np
import zmq
from _common import human_bytes, parse_size, start_child, start_server

import psrt
from psrt.config import ClientConfig
from psrt.control.process import Child, ready_line, ready_pattern

#: The gradient is constant and a power of two, and so is the learning rate: every parameter stays exact.
GRAD, LR = 2.0 ** -10, 0.5
NAME = "w"
RATE_TARGET = 0.6  # psrt requests/s >= 0.6x the bare loop's
P50_TARGET = 1.5  # psrt 4 KiB round trip p50 <= 1.5x the raw echo's
HWM = 100_000


# ---------------------------------------------------------------------------------------------------- the bare loop
def echo_server() -> int:
    """The raw side's ROUTER: echo every message back to its sender until stdin closes or SIGTERM.

    The plain pyzmq idiom (``recv_multipart`` / ``send_multipart`` with their default copies, which are cheaper than
    zero-copy frames for small messages), receiving everything queued before it polls again.
    """
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
                        msg = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    sock.send_multipart(msg)
    finally:
        sock.close(linger=0)
        ctx.term()
    return 0


# ---------------------------------------------------------------------------------------------------- CPU time
def _cpu_of(pid: int) -> Optional[float]:
    """CPU seconds (user + system, every thread) process ``pid`` has used, or None where ``/proc`` is missing."""
    if pid == os.getpid():
        t = os.times()
        return t.user + t.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------------- the sides
class Side:
    """One side of the rate comparison: W workers each keeping F requests in flight, timed in blocks."""

    def __init__(self, name: str, server_pid: int) -> None:
        self.name = name
        self.server_pid = server_pid
        self.rates: list[float] = []
        self.server_cpu: list[float] = []  # CPU seconds per answered request, per block
        self.client_cpu: list[float] = []
        self.answered = 0  # every request answered, timed or not

    def start(self) -> None:
        """Put W x F requests in flight."""
        raise NotImplementedError

    def turn(self) -> int:
        """Each worker in turn takes its oldest reply and sends a new request; returns the replies taken (W)."""
        raise NotImplementedError

    def drain(self) -> None:
        """Take every reply still in flight (no new requests)."""
        raise NotImplementedError

    def block(self, seconds: float) -> None:
        """One timed block: requests answered per second while W x F stay in flight."""
        self.start()
        me = os.getpid()
        s0, c0 = _cpu_of(self.server_pid), _cpu_of(me)
        t0 = time.perf_counter()
        end = t0 + seconds
        n = 0
        turn = self.turn
        while True:
            n += turn()
            if time.perf_counter() >= end:
                break
        t = time.perf_counter() - t0
        s1, c1 = _cpu_of(self.server_pid), _cpu_of(me)
        self.drain()
        self.rates.append(n / t)
        if s0 is not None and s1 is not None and c0 is not None and c1 is not None:
            self.server_cpu.append((s1 - s0) / n)
            self.client_cpu.append((c1 - c0) / n)

    def summary(self) -> dict[str, Any]:
        r = self.rates
        out: dict[str, Any] = {"name": self.name, "blocks": len(r), "rate_median": statistics.median(r),
                               "rate_max": max(r), "rate_min": min(r), "rates": r}
        if self.server_cpu:
            out["server_cpu_us_per_msg"] = 1e6 * statistics.median(self.server_cpu)
            out["client_cpu_us_per_msg"] = 1e6 * statistics.median(self.client_cpu)
        return out


class PsrtSide(Side):
    """W :class:`psrt.Client` workers, each keeping F ``push_pull_async`` calls in flight."""

    def __init__(self, clients: list[psrt.Client], grads: list[dict[str, np.ndarray]], in_flight: int,
                 server_pid: int, name: str = "psrt") -> None:
        super().__init__(name, server_pid)
        self.clients, self.grads, self.in_flight = clients, grads, in_flight
        self.queues: list[collections.deque] = [collections.deque() for _ in clients]

    def start(self) -> None:
        for client, grads, q in zip(self.clients, self.grads, self.queues):
            for _ in range(self.in_flight):
                q.append(client.push_pull_async(grads))

    def turn(self) -> int:
        for client, grads, q in zip(self.clients, self.grads, self.queues):
            q.popleft().wait()
            q.append(client.push_pull_async(grads))
        self.answered += len(self.queues)
        return len(self.queues)

    def drain(self) -> None:
        for q in self.queues:
            while q:
                q.popleft().wait()
                self.answered += 1


class FreshSide(PsrtSide):
    """W :class:`psrt.Client` workers made by ``make`` for each block (before its clock starts) and closed after
    it, each keeping F ``push_pull_async`` calls in flight from its first call."""

    def __init__(self, make: Callable[[], list[psrt.Client]], grads: list[dict[str, np.ndarray]], in_flight: int,
                 server_pid: int) -> None:
        super().__init__([], grads, in_flight, server_pid, "psrt, pipelined from the start")
        self.make = make

    def start(self) -> None:
        self.clients = self.make()
        self.queues = [collections.deque() for _ in self.clients]
        super().start()

    def drain(self) -> None:
        super().drain()
        for client in self.clients:
            client.close()
        self.clients = []


class BareSide(Side):
    """W plain DEALER sockets, each keeping F requests in flight; ``requests(i)`` makes socket i's next request."""

    def __init__(self, name: str, socks: list[zmq.Socket], requests: Callable[[int], list[Any]], in_flight: int,
                 timeout: float, server_pid: int) -> None:
        super().__init__(name, server_pid)
        self.socks, self.requests, self.in_flight = socks, requests, in_flight
        self.timeout_ms = int(timeout * 1000)
        self.outstanding = [0] * len(socks)

    def _recv(self, sock: zmq.Socket) -> list[bytes]:
        if not sock.poll(self.timeout_ms, zmq.POLLIN):
            raise TimeoutError(f"{self.name}: no answer within {self.timeout_ms / 1000:g}s")
        return sock.recv_multipart()

    def start(self) -> None:
        for i, sock in enumerate(self.socks):
            for _ in range(self.in_flight):
                sock.send_multipart(self.requests(i))
            self.outstanding[i] = self.in_flight

    def turn(self) -> int:
        requests, recv = self.requests, self._recv
        for i, sock in enumerate(self.socks):
            recv(sock)
            sock.send_multipart(requests(i))
        self.answered += len(self.socks)
        return len(self.socks)

    def drain(self) -> None:
        for i, sock in enumerate(self.socks):
            for _ in range(self.outstanding[i]):
                self._recv(sock)
                self.answered += 1
            self.outstanding[i] = 0


class EchoRequests:
    """The raw side's requests: a psrt request's frames (its header's length, then the gradient), the same every
    time; :meth:`check` asks each socket for one echo and compares it with what was sent."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames

    def __call__(self, i: int) -> list[bytes]:
        return self.frames

    def check(self, side: BareSide) -> None:
        for sock in side.socks:
            sock.send_multipart(self.frames)
            if side._recv(sock) != self.frames:
                raise RuntimeError("the raw echo returned different bytes")


class PushPullRequests:
    """The psrt shard's bare workers' requests: socket i is worker i, with a session of its own, and sends
    ``push_pull`` requests of the gradient as :class:`psrt.Client` packs them (the header's fixed part once,
    then the id, sequence number and clock of each), without reading the answers."""

    def __init__(self, workers: int, n: int, grad: np.ndarray) -> None:
        entry = [psrt.wire.tensor_entry(NAME, 0, grad.dtype, (n,))]
        self.prefixes = [psrt.wire.push_prefix(r, secrets.randbits(63), entry, True) for r in range(workers)]
        self.seqs = [0] * workers
        self.payload = [grad]

    def __call__(self, i: int) -> list[Any]:
        seq = self.seqs[i] = self.seqs[i] + 1
        return psrt.wire.encode_push_after(self.prefixes[i], seq, seq, seq, self.payload)


class RoundTrips:
    """Round trips of one operation, one at a time, each timed on its own (as ``bench/transport.py`` times them)."""

    def __init__(self, name: str, op: Callable[[], None]) -> None:
        self.name, self.op = name, op
        self.samples: list[float] = []

    def run(self, count: int) -> None:
        op, out, clock = self.op, self.samples, time.perf_counter
        for _ in range(count):
            t0 = clock()
            op()
            out.append(clock() - t0)

    def summary(self) -> dict[str, Any]:
        s = np.asarray(self.samples)
        return {"name": self.name, "count": len(s), "p50_s": float(np.median(s)), "p99_s": float(np.percentile(s, 99))}


def echo_once(sock: zmq.Socket, payload: memoryview, timeout: float) -> Callable[[], None]:
    """``bench/transport.py``'s raw 4 KiB round trip: the bytes as one zero-copy message, its echo received."""
    timeout_ms = int(timeout * 1000)

    def op() -> None:
        sock.send(payload, copy=False)
        if not sock.poll(timeout_ms, zmq.POLLIN):
            raise TimeoutError(f"no echo within {timeout:g}s")
        sock.recv(copy=False)
    return op


def dealers(contexts: list[zmq.Context], endpoint: str) -> list[zmq.Socket]:
    """One DEALER per context in ``contexts``, connected to ``endpoint``."""
    socks = []
    for ctx in contexts:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, HWM)
        s.setsockopt(zmq.RCVHWM, HWM)
        s.connect(endpoint)
        socks.append(s)
    return socks


# ---------------------------------------------------------------------------------------------------- the run
def alternate(sides: list[Any], rounds: int, run: Callable[[Any], None]) -> None:
    """``run(side)`` for every side, ``rounds`` times, the order flipping every round."""
    for r in range(rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            run(side)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    me = os.path.abspath(__file__)
    children: list[Child] = []
    clients: list[psrt.Client] = []
    contexts: list[zmq.Context] = []
    socks: list[zmq.Socket] = []
    try:
        # Children first: no ZeroMQ threads exist yet in this process when they are forked.
        server = start_server(args.workers, args.timeout, mode="async")
        children.append(server)
        echo = start_child([sys.executable, me, "--echo-server"], ready_pattern("echo"), args.timeout, label="echo",
                           stdin=subprocess.PIPE)
        children.append(echo)
        n = args.size // 4
        # W workers as psrt.Client makes them (on this host: over local connections), and W more over ZeroMQ alone
        # (shm=False), as between hosts, each with a session of its own.
        for shm in (True, False):
            config = ClientConfig(timeout=args.timeout, shm=shm)
            clients += [psrt.Client([server.endpoint], rank=r, num_workers=args.workers, config=config)
                        for r in range(args.workers)]
        for c in clients:  # the first init creates the tensor; the others join it
            c.init({NAME: np.zeros(n, np.float32)}, optimizer=psrt.SGD(lr=LR))
        plain, over_sockets = clients[:args.workers], clients[args.workers:]

        def make_fresh() -> list[psrt.Client]:
            made = [psrt.Client([server.endpoint], rank=r, num_workers=args.workers,
                                config=ClientConfig(timeout=args.timeout)) for r in range(args.workers)]
            for c in made:
                c.init({NAME: np.zeros(n, np.float32)}, optimizer=psrt.SGD(lr=LR))  # (joins: nothing changes)
            return made

        grads = [{NAME: np.full(n, GRAD, np.float32)} for _ in plain]
        shard_requests = PushPullRequests(args.workers, n, grads[0][NAME])
        # The raw requests have a psrt request's frames: its header's length, then the gradient's bytes.
        frames = [b"h" * len(shard_requests(0)[0]), grads[0][NAME].tobytes()]
        shard_requests.seqs[0] = 0
        echo_requests = EchoRequests(frames)
        contexts.append(zmq.Context())
        shared = [contexts[0]] * args.workers
        shard_socks = dealers(shared, server.endpoint)
        raw_socks = dealers(shared, echo.endpoint)
        socks += shard_socks + raw_socks
        sides: list[Side] = [
            PsrtSide(plain, grads, args.in_flight, server.pid),
            BareSide("psrt shard", shard_socks, shard_requests, args.in_flight, args.timeout, server.pid),
            BareSide("raw", raw_socks, echo_requests, args.in_flight, args.timeout, echo.pid),
            PsrtSide(over_sockets, grads, args.in_flight, server.pid, "psrt sockets (PSRT_SHM=0)"),
            FreshSide(make_fresh, grads, args.in_flight, server.pid),
        ]
        if args.context_per_worker:  # what a ZeroMQ context (and its I/O thread) per worker costs the bare loop
            own = [zmq.Context() for _ in range(args.workers)]
            contexts += own
            own_socks = dealers(own, echo.endpoint)
            socks += own_socks
            sides.append(BareSide("raw, a context per worker", own_socks, echo_requests, args.in_flight,
                                  args.timeout, echo.pid))

        print(f"rate: {args.rounds} rounds of {args.seconds:g} s blocks per side ...", file=sys.stderr, flush=True)
        for side in sides:  # warm-up: connections, allocations, caches
            side.block(min(0.3, args.seconds))
            side.rates.clear()
            side.server_cpu.clear()
            side.client_cpu.clear()
        alternate(sides, args.rounds, lambda side: side.block(args.seconds))

        print(f"latency: {args.latency_count} round trips per side ...", file=sys.stderr, flush=True)
        (dealer,) = dealers(contexts[:1], echo.endpoint)
        socks.append(dealer)
        payload = memoryview(grads[0][NAME]).cast("B")
        calls = [0]

        def one_push_pull(client: psrt.Client) -> Callable[[], None]:
            def op() -> None:
                client.push_pull(grads[0])
                calls[0] += 1
            return op

        lat = [RoundTrips("psrt", one_push_pull(plain[0])),
               RoundTrips("raw one message", echo_once(dealer, payload, args.timeout)),
               RoundTrips("psrt sockets", one_push_pull(over_sockets[0]))]
        for s in lat:
            s.run(50)
            s.samples.clear()
        block = max(1, args.latency_count // args.rounds)
        alternate(lat, args.rounds, lambda s: s.run(block))

        # Checks, after timing: every push applied once (the warm-up's included), the echo's bytes.
        pushes = sides[0].answered + sides[1].answered + sides[3].answered + sides[4].answered + calls[0]
        params = clients[0].pull([NAME])[NAME]
        want = np.float32(-pushes * LR * GRAD)
        if not np.all(params == want):
            raise RuntimeError(f"psrt returned wrong parameters after {pushes} pushes: {params[:4]} != {want}")
        counted = clients[0].stats()[0]
        if counted["pushes"] != pushes or counted["errors"]:
            raise RuntimeError(f"the shard counted {counted['pushes']} pushes and {counted['errors']} errors; the "
                               f"workers made {pushes} pushes")
        # Which way the requests went: the shard's peers over local connections (the W default clients; the shm=False
        # ones stay on ZeroMQ) and the requests it took over them.
        shard_stats = plain[0].stats()[0]
        echo_requests.check(sides[2])
        dealer.send(payload)
        if dealer.poll(int(args.timeout * 1000)) == 0 or dealer.recv() != payload.tobytes():
            raise RuntimeError("the raw echo returned different bytes")

        summaries = [side.summary() for side in sides]
        raw = summaries[2]
        for x, side in zip(summaries, sides):
            x["ratio"] = x["rate_median"] / raw["rate_median"]
            x["ratio_per_round"] = [a / b for a, b in zip(side.rates, sides[2].rates)]
        lp, lr, ls = lat[0].summary(), lat[1].summary(), lat[2].summary()
        return {
            "sides": summaries, "rate_ratio": summaries[0]["ratio"], "shard_rate_ratio": summaries[1]["ratio"],
            "sockets_rate_ratio": summaries[3]["ratio"], "fresh_rate_ratio": summaries[4]["ratio"],
            "fresh_vs_psrt": summaries[4]["rate_median"] / summaries[0]["rate_median"],
            "latency_psrt": lp, "latency_raw": lr,
            "latency_psrt_sockets": ls, "p50_ratio": lp["p50_s"] / lr["p50_s"],
            "sockets_p50_ratio": ls["p50_s"] / lr["p50_s"],
            "p99_ratio": lp["p99_s"] / lr["p99_s"], "pushes_checked": pushes,
            "local_peers": shard_stats["local_peers"], "local_messages": shard_stats["local_messages"],
            "request_frames": [len(f) for f in frames],
        }
    finally:
        for sock in socks:
            sock.close(linger=0)
        for c in clients:
            c.close()
        for ctx in contexts:
            ctx.term()
        for child in reversed(children):
            child.stop()


def report(res: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The table and the PASS/MISS lines; returns the targets."""
    sides = res["sides"]
    print(f"\nrequests answered per second, {args.workers} workers x {args.in_flight} in flight, "
          f"{human_bytes(args.size)} each way (median of {sides[0]['blocks']} blocks; min-max); ratio to raw; CPU "
          "time per request of the server process and of the clients' (all threads):")
    for x in sides:
        cpu = ""
        if "server_cpu_us_per_msg" in x:
            cpu = f"  server {x['server_cpu_us_per_msg']:6.1f} us, clients {x['client_cpu_us_per_msg']:6.1f} us"
        print(f"  {x['name']:<31} {x['rate_median']:>8,.0f}/s ({x['rate_min']:>6,.0f}-{x['rate_max']:<6,.0f}) "
              f"{x['ratio']:5.2f}x{cpu}")
    for x in (sides[0], sides[1], sides[3], sides[4]):
        print(f"  {x['name']} / raw per round: {', '.join(f'{r:.2f}' for r in x['ratio_per_round'])}")
    lp, lr, ls = res["latency_psrt"], res["latency_raw"], res["latency_psrt_sockets"]
    print(f"\n{human_bytes(args.size)} round trip, one call at a time ({lp['count']} per side):")
    print(f"  psrt push_pull  p50 {1e6 * lp['p50_s']:7.1f} us  p99 {1e6 * lp['p99_s']:7.1f} us")
    print(f"  raw echo        p50 {1e6 * lr['p50_s']:7.1f} us  p99 {1e6 * lr['p99_s']:7.1f} us")
    print(f"  psrt sockets    p50 {1e6 * ls['p50_s']:7.1f} us  p99 {1e6 * ls['p99_s']:7.1f} us "
          f"(PSRT_SHM=0: ZeroMQ alone, as between hosts)")
    print(f"  p50 {res['p50_ratio']:.2f}x  p99 {res['p99_ratio']:.2f}x; over sockets p50 "
          f"{res['sockets_p50_ratio']:.2f}x")
    p, shard, raw, sockets, fresh = sides[0], sides[1], sides[2], sides[3], sides[4]
    ok_rate = res["rate_ratio"] >= RATE_TARGET
    ok_shard = res["shard_rate_ratio"] >= RATE_TARGET
    ok_p50 = res["p50_ratio"] <= P50_TARGET
    print()
    print(f"{'PASS' if ok_rate else 'MISS'}  psrt (psrt.Client workers) answers {p['rate_median']:,.0f} requests/s = "
          f"{res['rate_ratio']:.2f}x the bare pyzmq ROUTER's {raw['rate_median']:,.0f}/s, target >= {RATE_TARGET:g}x")
    print(f"{'PASS' if ok_shard else 'MISS'}  the psrt shard with bare workers answers {shard['rate_median']:,.0f} "
          f"requests/s = {res['shard_rate_ratio']:.2f}x the bare loop's, target >= {RATE_TARGET:g}x")
    print(f"{'PASS' if ok_p50 else 'MISS'}  {human_bytes(args.size)} push_pull round trip p50 "
          f"{1e6 * lp['p50_s']:.1f} us = {res['p50_ratio']:.2f}x the raw echo's {1e6 * lr['p50_s']:.1f} us, "
          f"target <= {P50_TARGET:g}x")
    print(f"info  over ZeroMQ alone (PSRT_SHM=0, as between hosts): {sockets['rate_median']:,.0f} requests/s = "
          f"{res['sockets_rate_ratio']:.2f}x the bare loop's, p50 {res['sockets_p50_ratio']:.2f}x the raw echo's")
    print(f"info  pipelined from the start (fresh clients each block, never a moment with nothing in flight): "
          f"{fresh['rate_median']:,.0f} requests/s = {res['fresh_vs_psrt']:.2f}x the psrt side's")
    print(f"exact: parameters after {res['pushes_checked']} pushes as every push applied once, no error; the raw "
          "echo returned its bytes")
    return [{"target": f"rate ratio >= {RATE_TARGET:g}", "ratio": res["rate_ratio"], "pass": ok_rate},
            {"target": f"shard rate ratio >= {RATE_TARGET:g}", "ratio": res["shard_rate_ratio"], "pass": ok_shard},
            {"target": f"p50 ratio <= {P50_TARGET:g}", "ratio": res["p50_ratio"], "pass": ok_p50}]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workers", type=int, default=8, help="W: workers (clients) on each side")
    parser.add_argument("--in-flight", type=int, default=8, help="F: requests each worker keeps in flight")
    parser.add_argument("--size", type=lambda s: parse_size(s, multiple=4), default=4096,
                        help="the tensor's bytes (float32); below 64 KiB calls stay on the socket")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of one timed block")
    parser.add_argument("--rounds", type=int, default=6, help="alternating psrt/raw blocks per side")
    parser.add_argument("--latency-count", type=int, default=3000, help="single round trips per side")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 0.5 s blocks, 1,000 round trips")
    parser.add_argument("--context-per-worker", action="store_true",
                        help="also time the bare loop driven by DEALERs with a ZeroMQ context each, as psrt.Client has")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any single network wait may take")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 when a target is missed")
    parser.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo_server:
        return echo_server()
    if args.quick:
        args.rounds, args.seconds, args.latency_count = 3, 0.5, 1000
    if args.workers < 1 or args.in_flight < 1 or args.rounds < 1 or args.latency_count < 1:
        parser.error("--workers, --in-flight, --rounds and --latency-count must be >= 1")
    if not args.seconds > 0 or not args.timeout > 0:
        parser.error("--seconds and --timeout must be > 0")

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    print(f"psrt {psrt.__version__}, pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), numpy {np.__version__}, "
          f"python {platform.python_version()}, {os.cpu_count()} CPUs; TCP loopback, one shard, async, "
          f"W={args.workers}, SGD")
    res = measure(args)
    targets = report(res, args)
    if args.json:
        meta = {"psrt": psrt.__version__, "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
                "numpy": np.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                "workers": args.workers, "in_flight": args.in_flight, "size": args.size, "seconds": args.seconds,
                "rounds": args.rounds, "latency_count": args.latency_count, "timeout": args.timeout}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": res, "targets": targets}, f, indent=1)
        print(f"\nwrote {args.json}")
    return 1 if args.strict and not all(t["pass"] for t in targets) else 0


if __name__ == "__main__":
    sys.exit(main())
