"""psrt on the benchmark pattern of ps-lite (bytedance/ps-lite, ``tests/test_benchmark.cc``): push/pull goodput.

The pattern, as ps-lite's benchmark runs it in its default PUSH_PULL mode with a message size of 4,096,000 bytes
(its first argument; the 1,024,000-byte default is smaller) and its default of 40 keys per server
(``NUM_KEY_PER_SERVER``): every worker holds ``40 * S`` keys of ``--key-bytes`` bytes each, spread evenly over
the S servers. One round: for every key in turn the worker starts a push of its value and then a pull of the
key (ps-lite: ``ZPush`` then ``ZPull``, both non-blocking, the pull issued right behind the push without
waiting for it), and only after all ``2 * 40 * S`` requests are out does it wait for every one of them; then the
next round. Before timing, ps-lite pushes every key once (not counted); here one whole round is the warm-up.

The metric is ps-lite's "application goodput": bytes *pushed* per second. ps-lite prints, per worker,
``8 * len * total_key_num * rounds / elapsed`` in Gbit/s, so the pulls (which move as many bytes back) are not
counted. Here it is in GB/s (1e9 bytes/s) and counted two ways: per worker (``rounds * 40 * S * key_bytes`` over
the worker's own time from the end of its warm-up to the end of its last round), and aggregate over all
workers (``W`` times that many bytes over the time from the earliest start to the latest end). The targets are
judged on the aggregate of the headline row: >= 0.76 GB/s at 1 server / 1 worker and >= 1.2 GB/s at 2 servers /
2 workers, twice what ps-lite built on this project's development machine reached (0.38 and 0.59 GB/s).

Server semantics, and why psrt runs in ``--mode async``: ps-lite's benchmark handle answers a push at once
with an empty response (outside its debug mode it adds 0 bytes of the value into the stored key: it only
allocates the key's buffer the first time), and answers a pull at once with the key's stored buffer; nothing
waits for other workers. psrt's async mode is the one that does the same: each push is applied on arrival and
acknowledged, a pull is answered with the current parameters without waiting for the other workers (sync mode
would make every pull wait for all W workers' pushes of the round, a barrier ps-lite's pattern does not have).
psrt does more work per push than ps-lite's handle: it applies a real optimizer step, SGD with ``lr = 1``
(``w -= g``), to the key's parameters. Keys are float32 tensors of ``key_bytes / 4`` values; one key is one
psrt chunk (4,096,000 bytes < its 4 MiB partition size), so every key is one message each way, as in ps-lite.

Rows
----
psrt (the headline: plain usage, no knobs)
    S ``psrt server --bind tcp://127.0.0.1:* --workers W --mode async`` children started by hand, W spawned
    workers each with ``psrt.Client(servers=[...], rank=r, num_workers=W)``,
    ``client.init({name: zeros}, optimizer=psrt.SGD(lr=1.0))`` and, per key of a round,
    ``client.push_async({name: value})`` then ``client.pull_async([name])``, then ``handle.wait()`` on all of
    them. No ``out=``, no ``psrt.tune_allocator()``, no environment variables.
psrt-tuned
    The same with ``ipc://`` endpoints, ``psrt.tune_allocator()`` in the workers and pulls received into arrays
    the worker holds (``client.pull_async([name], out={name: array})``).
psrt-sockets
    Plain usage with ``PSRT_SHM=0`` for servers and workers (no shared-memory path between a worker and a
    shard of one host where psrt has one; ignored by a psrt without one).

Every run is checked exactly: values are multiples of 1/64 (worker ``r`` pushes ``(r + 1) * roll(g, k)`` for
key ``k``, one fixed random ``g`` with values in [-4/64, 4/64]) and parameters start at 0, so after the
warm-up round and ``rounds`` more the parameters of key ``k`` must be exactly
``-(rounds + 1) * W (W + 1) / 2 * roll(g, k)``: once every worker has finished its rounds (all pushes
acknowledged, so applied), the bench lets each worker pull every key and compare. A push lost or applied twice
shows as a difference.

All waits have a deadline (``--timeout`` seconds per row); servers and workers are stopped on errors and on
Ctrl-C. ``--json FILE`` writes every row.

Examples
--------
Run from the repository root::

    python bench/pslite.py                                   # 1 server/1 worker, then 2/2; every row
    python bench/pslite.py --servers 2 --workers 2 --rounds 10 --variants psrt --json pslite.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import _common
import numpy as np
from _common import VARIANTS, BenchError, Variant

#: The default configurations, (servers, workers), and the headline's target goodput (GB/s) at each.
TARGETS = {(1, 1): 0.76, (2, 2): 1.2}
PSLITE = {(1, 1): 0.38, (2, 2): 0.59}


@dataclass(frozen=True)
class Pattern:
    """One run of the pattern; picklable, so every worker rebuilds the same values from the seed.

    Parameters
    ----------
    servers : int
        S, the number of servers (shards).
    workers : int
        W, the number of worker processes.
    rounds : int
        Timed rounds per worker, after one warm-up round.
    key_bytes : int
        Bytes of one key's value (a multiple of 4: float32).
    keys_per_server : int
        Keys per server; a worker pushes and pulls ``keys_per_server * servers`` keys a round.
    timeout : float
        Seconds one row may take in all; also the limit of every single wait.
    seed : int
        Seed of the pushed values.
    """

    servers: int
    workers: int
    rounds: int
    key_bytes: int = 4_096_000
    keys_per_server: int = 40
    timeout: float = 600.0
    seed: int = 1234

    @property
    def names(self) -> list[str]:
        """The keys' tensor names."""
        return [f"k{i:05d}" for i in range(self.keys_per_server * self.servers)]

    def base(self) -> np.ndarray:
        """The fixed values ``g``: multiples of 1/64 in [-4/64, 4/64], float32."""
        rng = np.random.default_rng(self.seed)
        return rng.integers(-4, 5, self.key_bytes // 4).astype(np.float32) / np.float32(64)

    def value(self, base: np.ndarray, rank: int, key: int) -> np.ndarray:
        """What worker ``rank`` pushes for key ``key``: ``(rank + 1) * roll(g, key)``."""
        return np.roll(base, key) * np.float32(rank + 1)

    def expected(self, base: np.ndarray, key: int) -> np.ndarray:
        """Key ``key``'s parameters after every worker's warm-up and timed rounds (exact in float32)."""
        pushes = (self.rounds + 1) * self.workers * (self.workers + 1) // 2
        return np.roll(base, key) * np.float32(-pushes)


@dataclass
class Row:
    """What one row produced at one configuration."""

    variant: str
    servers: int
    workers: int
    status: str = "ok"  # ok | failed
    message: str = ""
    goodput_gbps: float = 0.0  # aggregate push bytes per second over all workers, 1e9 bytes
    per_worker_gbps: list[float] = field(default_factory=list)
    timed_s: float = 0.0
    wall_s: float = 0.0
    push_bytes: int = 0  # pushed during the timed rounds, all workers
    check_ok: Optional[bool] = None
    max_err: float = 0.0


def _worker(pattern: Pattern, variant: Variant, endpoints: list[str], rank: int, results: Any, go: Any) -> None:
    """One worker process: the warm-up round, ``rounds`` timed rounds, then (once told) the exact check."""
    try:
        import psrt
        from psrt.config import ClientConfig

        if variant.tune:
            psrt.tune_allocator()
        base = pattern.base()
        names = pattern.names
        values = [pattern.value(base, rank, k) for k in range(len(names))]
        outs = {n: np.empty(pattern.key_bytes // 4, np.float32) for n in names} if variant.out else None
        wait = pattern.timeout
        config = ClientConfig(timeout=wait)
        with psrt.Client(servers=endpoints, rank=rank, num_workers=pattern.workers, config=config) as client:
            client.init({n: np.zeros(pattern.key_bytes // 4, np.float32) for n in names},
                        optimizer=psrt.SGD(lr=1.0))

            def one_round() -> None:
                handles = []
                for name, value in zip(names, values):
                    handles.append(client.push_async({name: value}))
                    handles.append(client.pull_async([name], out={name: outs[name]} if outs else None))
                for handle in handles:
                    handle.wait(wait)

            one_round()  # warm-up
            t0 = time.monotonic()
            for _ in range(pattern.rounds):
                one_round()
            t1 = time.monotonic()
            results.put({"rank": rank, "t0": t0, "t1": t1})
            if not go.wait(wait):
                raise TimeoutError("the bench never said every worker was done")
            final = client.pull(timeout=wait)
        errors = [float(np.max(np.abs(final[n] - pattern.expected(base, k)), initial=0.0))
                  for k, n in enumerate(names)]
        results.put({"rank": rank, "max_err": max(errors), "ok": max(errors) == 0.0})
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})


def run_row(pattern: Pattern, variant: Variant) -> Row:
    """Run ``variant`` on ``pattern``: S async ``psrt server`` children and W spawned workers."""
    deadline = time.monotonic() + pattern.timeout
    row = Row(variant.name, pattern.servers, pattern.workers)
    ctx = multiprocessing.get_context("spawn")
    results, go = ctx.Queue(), ctx.Event()
    procs: list[Any] = []
    try:
        with _common.shards(pattern.servers, pattern.workers, "async", variant, deadline) as servers:
            endpoints = [s.endpoint for s in servers]
            print(f"[{variant.name}] servers at {', '.join(endpoints)}; starting {pattern.workers} workers",
                  flush=True)
            try:
                with _common.environ(variant.env):
                    procs += _common.spawn(ctx, _worker, [(pattern, variant, endpoints, r, results, go)
                                                          for r in range(pattern.workers)], "pslite-worker")
                timed = _common.collect(results, procs, pattern.workers, deadline, variant.name)
                go.set()
                checks = _common.collect(results, procs, pattern.workers, deadline, variant.name)
            finally:
                _common.join_or_kill(procs, 10.0)
    finally:
        results.close()
    per_worker = pattern.rounds * len(pattern.names) * pattern.key_bytes
    row.timed_s = max(r["t1"] for r in timed) - min(r["t0"] for r in timed)
    row.push_bytes = pattern.workers * per_worker
    row.goodput_gbps = row.push_bytes / row.timed_s / 1e9
    row.per_worker_gbps = [per_worker / (r["t1"] - r["t0"]) / 1e9 for r in sorted(timed, key=lambda r: r["rank"])]
    row.check_ok = all(c["ok"] for c in checks)
    row.max_err = max(c["max_err"] for c in checks)
    return row


def _verdict(rows: list[Row], pattern: Pattern) -> dict[str, Any]:
    config = (pattern.servers, pattern.workers)
    target = TARGETS.get(config) if (pattern.key_bytes, pattern.keys_per_server) == (4_096_000, 40) else None
    plain = next((r for r in rows if r.variant == "psrt" and r.status == "ok"), None)
    if target is None or plain is None:
        why = ("targets are set for S/W = 1/1 and 2/2 with 40 keys of 4,096,000 bytes per server" if target is None
               else "the plain psrt row did not run")
        return {"verdict": "n/a", "required_gbps": target, "reason": why}
    ok = plain.goodput_gbps >= target and bool(plain.check_ok)
    return {"verdict": "PASS" if ok else "MISS", "required_gbps": target, "measured_gbps": plain.goodput_gbps,
            "pslite_gbps": PSLITE[config], "reason": "" if plain.check_ok else "the check failed"}


def _verdict_line(config: tuple[int, int], verdict: dict[str, Any]) -> str:
    head = f"S={config[0]}/W={config[1]}: target plain psrt goodput"
    if verdict["verdict"] == "n/a":
        return f"{head}: n/a ({verdict['reason']})"
    note = f" ({verdict['reason']})" if verdict["reason"] else ""
    return (f"{head} >= {verdict['required_gbps']} GB/s (2x ps-lite's {verdict['pslite_gbps']}): "
            f"{verdict['verdict']} (measured {verdict['measured_gbps']:.2f} GB/s){note}")


def _print_table(rows: list[Row]) -> None:
    print(f"\n{'row':<13} {'goodput GB/s':>12} {'per worker GB/s':>22} {'timed s':>8}  check")
    print("-" * 90)
    for r in rows:
        if r.status != "ok":
            print(f"{r.variant:<13} {'-':>12} {'-':>22} {'-':>8}  {r.status}: {r.message.splitlines()[0]}")
            continue
        each = ", ".join(f"{g:.2f}" for g in r.per_worker_gbps)
        check = "OK (exact)" if r.check_ok else f"WRONG (max |w - expected| = {r.max_err:.3g})"
        print(f"{r.variant:<13} {r.goodput_gbps:>12.2f} {each:>22} {r.timed_s:>8.2f}  {check}")
    print("-" * 90)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(description="psrt on ps-lite's benchmark pattern (tests/test_benchmark.cc): every "
                                            "worker pushes and pulls 40 keys of 4,096,000 bytes per server at "
                                            "once, then waits; goodput = bytes pushed per second. By default "
                                            "1 server/1 worker, then 2 servers/2 workers.")
    p.add_argument("--servers", type=int, help="servers S of one configuration of your own (with --workers)")
    p.add_argument("--workers", type=int, help="workers W of one configuration of your own (with --servers)")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds per worker after a warm-up round "
                                                          "(%(default)s)")
    p.add_argument("--key-bytes", type=lambda t: _common.parse_size(t, 4), default=4_096_000,
                   help="bytes per key, a multiple of 4 (%(default)s)")
    p.add_argument("--keys-per-server", type=int, default=40, help="keys per server (%(default)s)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated psrt rows, run in this order (%(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one row may take (%(default)s)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """Run every configuration with every selected row; print the tables and the targets."""
    parser = build_parser()
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or set(variants) - set(VARIANTS) or len(set(variants)) != len(variants):
        parser.error(f"--variants takes a comma-separated subset of {','.join(VARIANTS)}, got {args.variants!r}")
    if (args.servers is None) != (args.workers is None):
        parser.error("--servers and --workers go together")
    configs = [(args.servers, args.workers)] if args.servers is not None else list(TARGETS)
    if any(s < 1 or w < 1 for s, w in configs) or args.rounds < 1 or args.keys_per_server < 1:
        parser.error("--servers, --workers, --rounds and --keys-per-server must be >= 1")
    if not args.timeout > 0:
        parser.error("--timeout must be > 0")
    started = time.monotonic()
    report = []
    try:
        for servers, workers in configs:
            pattern = Pattern(servers=servers, workers=workers, rounds=args.rounds, key_bytes=args.key_bytes,
                              keys_per_server=args.keys_per_server, timeout=args.timeout)
            keys = len(pattern.names)
            print(f"\n=== S={servers} servers, W={workers} workers: {keys} keys of {pattern.key_bytes:,} bytes, "
                  f"each worker pushes and pulls all of them per round; 1 warm-up + {pattern.rounds} timed rounds",
                  flush=True)
            rows = []
            for name in variants:
                t = time.monotonic()
                try:
                    row = run_row(pattern, VARIANTS[name])
                except Exception as exc:  # one broken row must not hide the others
                    message = str(exc) if isinstance(exc, BenchError) else traceback.format_exc()
                    row = Row(name, servers, workers, status="failed", message=message)
                    print(f"[{name}] FAILED: {message}", file=sys.stderr, flush=True)
                row.wall_s = time.monotonic() - t
                if row.status == "ok":
                    print(f"[{name}] goodput {row.goodput_gbps:.2f} GB/s pushed ({2 * row.goodput_gbps:.2f} GB/s "
                          f"pushed + pulled) over {row.timed_s:.2f}s; check {'OK' if row.check_ok else 'WRONG'}; "
                          f"{row.wall_s:.1f}s with start-up", flush=True)
                rows.append(row)
            verdict = _verdict(rows, pattern)
            _print_table(rows)
            print(_verdict_line((servers, workers), verdict))
            report.append({"pattern": asdict(pattern), "rows": [asdict(r) for r in rows], "target": verdict})
    except KeyboardInterrupt:
        print("\ninterrupted; servers and workers stopped", file=sys.stderr)
        return 130
    elapsed = time.monotonic() - started
    print()
    for entry in report:
        p = entry["pattern"]
        print(_verdict_line((p["servers"], p["workers"]), entry["target"]))
    print(f"total {elapsed:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"configs": report, "elapsed_s": elapsed, "argv": sys.argv[1:] if argv is None else argv},
                      f, indent=2)
            f.write("\n")
    failed = any(r["status"] == "failed" or r["check_ok"] is False for e in report for r in e["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
