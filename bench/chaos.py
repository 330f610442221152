"""Chaos: hurt a running job on purpose and measure what it notices, how fast, and what it loses.

Each scenario runs real processes (``psrt scheduler``, ``psrt server``, workers from ``bench/_chaos_worker.py``),
does one harmful thing, and measures; every scenario is bounded by hard timeouts and stops every process it
started, whatever happens.

- ``flood``: 100,000 malformed messages (28 kinds, and a header over the 1 MiB limit every 2,000th) from a raw
  DEALER at a standalone shard while a worker trains on it (integer gradients, SGD lr=1, so the final parameters
  are known exactly); every message must be answered with an error reply and counted by the shard; the worker's
  push_pull p50/p99 before and during the flood, side by side.
- ``sigstop``: SIGSTOP of one of two servers of a running job: the time until every worker's wait raises
  ``PeerFailedError`` naming it, and that every other process exits (no hang).
- ``restore``: ``kill -9`` of a standalone shard (``--checkpoint-every 5``) during sync training with 2 workers,
  restarted on its address with ``--restore``; the workers ride through. Rounds lost, time from the kill to the
  next completed step, and pushes applied twice (each push is recognisable in the final parameters).
- ``worker``: ``kill -9`` of one of three workers, without ``--elastic`` (time until the survivors get the error
  naming it) and with it (the survivors' longest stall; they must finish).
- ``linkcut``: a job in network namespaces (scheduler, server, 2 workers; root and iproute2); worker 1's link is
  cut with ``ip link set ... down``. Without ``--elastic``: time until worker 0 gets the error naming worker 1.
  With ``--elastic``: worker 0's longest stall; after ``up``, whether and when the cut-off worker joins again.
- ``auth``: a CURVE shard with the job's keys; clients with the job's key, another job's key, the job's server
  key with a client pair it never issued, no key, and a raw NULL-mechanism peer: only the first reaches a handler
  (the shard's counters stay unchanged for all others), and with keys the gradient's bytes never appear in the
  TCP stream (a relay records it; without keys they do, which shows the check can see them).

Targets (each printed PASS or MISS with its figure; any MISS makes the exit status 1): a dead or stopped peer is
named within 5 s, and nothing hangs; with ``--elastic`` the survivors' longest stall < 8 s; kill -9 + ``--restore``:
zero pushes applied twice, lost rounds <= the checkpoint interval, recovery < 5 s; other keys, no keys, NULL: zero
messages reach a handler, and gradients are never readable on the wire with keys; the flood: the shard alive,
parameters exact, every message answered or counted.

Usage::

    sudo python bench/chaos.py --json chaos.json        # everything, ~1 minute
    python bench/chaos.py --quick                       # 20,000 malformed messages, shorter runs
    python bench/chaos.py --only flood,auth             # some scenarios (linkcut needs root)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import zmq
from _common import Relay, serving, start_server

import psrt
from psrt.config import ClientConfig, ServerConfig
from psrt.control.process import SERVER_READY, Child, psrt_command, stop_children

WORKER = str(Path(__file__).with_name("_chaos_worker.py"))
SCENARIOS = ("flood", "sigstop", "restore", "worker", "linkcut", "auth")
#: The issue's bounds.
NAMED_WITHIN_S, ELASTIC_STALL_S, RECOVERY_S = 5.0, 8.0, 5.0
TRAINING = re.compile(r"^training")
SERVER_RANK = re.compile(r"psrt-server ready endpoint=(\S+).* rank=(\d+)")


@dataclass
class Row:
    """One line of the results table: a measured figure, its target, and the verdict (None: only reported)."""

    scenario: str
    measure: str
    value: str
    target: str = ""
    ok: Optional[bool] = None

    @property
    def verdict(self) -> str:
        """``PASS``, ``MISS``, or empty for a figure without a target."""
        return "" if self.ok is None else ("PASS" if self.ok else "MISS")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, nearest rank; NaN when there are none.

    Parameters
    ----------
    values : sequence of float
        The samples.
    q : float
        The percentile, 0 to 100.
    """
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, int(np.ceil(q / 100.0 * len(ordered))))
    return ordered[min(rank, len(ordered)) - 1]


def last_json(child: Child) -> dict[str, Any]:
    """The last JSON object line a child printed; raises RuntimeError with its output when there is none."""
    for line in reversed(child.output.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{child.label} printed no result: {child.tail().strip()!r}")


def worker_cmd(role: str, *args: object) -> list[str]:
    """The command line of a ``bench/_chaos_worker.py`` role."""
    return [sys.executable, WORKER, role, *map(str, args)]


def wait_all(children: Sequence[Child], timeout: float) -> dict[str, Optional[int]]:
    """Wait up to ``timeout`` seconds in all for ``children`` to exit; each one's exit code, None if it still runs."""
    deadline = time.monotonic() + timeout
    codes: dict[str, Optional[int]] = {}
    for c in children:
        try:
            codes[c.label] = c.wait(max(0.01, deadline - time.monotonic()))
        except psrt.PsrtTimeoutError:
            codes[c.label] = None
    return codes


def wait_for_line(child: Child, text: str, timeout: float) -> Optional[float]:
    """Poll ``child``'s collected output until a line contains ``text``; when it was seen, or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in child.output:
            return time.time()
        if child.poll() is not None:
            break
        time.sleep(0.02)
    return time.time() if text in child.output else None


def fmt_s(seconds: Optional[float]) -> str:
    """Seconds for the table, or ``never`` for None."""
    return "never" if seconds is None else f"{seconds:.2f} s"


# ------------------------------------------------------------------------------------------------ flood
def scenario_flood(opts: argparse.Namespace, raw: dict[str, Any]) -> list[Row]:
    """Malformed messages from a raw DEALER while a worker trains on the same shard."""
    size, count = 16_384, opts.flood
    tmp = tempfile.mkdtemp(prefix="psrt-chaos-")
    stopfile = os.path.join(tmp, "stop")
    children: list[Child] = []
    try:
        shard = start_server(1, timeout=30)
        children.append(shard)
        trainer = Child(worker_cmd("train", shard.endpoint, size, stopfile), label="trainer", ready=TRAINING)
        children.append(trainer)
        trainer.wait_ready(60)
        time.sleep(opts.baseline)  # steps with no flood, to compare with
        flooder = Child(worker_cmd("flood", shard.endpoint, size, count, 1), label="flooder")
        children.append(flooder)
        flooder.wait(opts.flood_timeout)
        time.sleep(0.5)
        Path(stopfile).touch()
        trainer.wait(60)
        fl, tr = last_json(flooder), last_json(trainer)
        alive = shard.poll() is None
        with psrt.Client([shard.endpoint], config=ClientConfig(timeout=10)) as c:
            stats = c.stats()[0]
    finally:
        stop_children(children)
        shutil.rmtree(tmp, ignore_errors=True)
    times, lat = tr.pop("times"), tr.pop("latencies")
    before = [x for t, x in zip(times, lat) if t < fl["start"]]
    during = [x for t, x in zip(times, lat) if fl["start"] <= t <= fl["end"]]
    raw["flood"] = {"flooder": fl, "trainer": tr, "shard": stats,
                    "p50_ms": [percentile(before, 50) * 1e3, percentile(during, 50) * 1e3],
                    "p99_ms": [percentile(before, 99) * 1e3, percentile(during, 99) * 1e3]}
    unanswered = fl["sent"] - fl["replies"]
    counted = stats["errors"] == fl["sent"]
    rate = fl["sent"] / max(1e-9, fl["end"] - fl["start"])
    return [
        Row("flood", "malformed messages sent (kinds)", f"{fl['sent']:,} ({len(fl['kinds'])}) in "
            f"{fl['end'] - fl['start']:.1f} s, {rate:,.0f}/s", f"{count:,}", fl["sent"] == count),
        Row("flood", "answered with an error reply / other replies / unanswered",
            f"{fl['error_replies']:,} / {sum(fl['other_replies'].values())} / {unanswered}",
            "all errors, none other", fl["error_replies"] == fl["sent"] and not fl["other_replies"]),
        Row("flood", "shard's errors counter / dropped replies", f"{stats['errors']:,} / {stats['dropped_replies']}",
            "= messages sent", counted),
        Row("flood", "shard alive after the flood", "yes" if alive else "NO", "alive", alive),
        Row("flood", "parameters exact after training", f"{'exact' if tr['exact'] else 'WRONG'} after "
            f"{tr['steps']} steps (max error {tr['max_error']:g}); shard pushes {stats['pushes']}",
            "exact", tr["exact"] and stats["pushes"] == tr["steps"]),
        Row("flood", "push_pull p50 / p99 without flood (steps)",
            f"{percentile(before, 50) * 1e3:.2f} / {percentile(before, 99) * 1e3:.2f} ms ({len(before)})"),
        Row("flood", "push_pull p50 / p99 during the flood (steps)",
            f"{percentile(during, 50) * 1e3:.2f} / {percentile(during, 99) * 1e3:.2f} ms ({len(during)})"),
    ]


# ------------------------------------------------------------------------------------------------ jobs
class Job:
    """A scheduler, S servers and W chaos job workers, on loopback or in a :class:`psrt.emulation.netns.VirtualCluster`.

    Hosts in a virtual cluster are named ``sched``, ``s0``.., ``w0``.., and the scheduler binds ``port`` there
    (on loopback, any free port); every child is stopped by :meth:`close`.
    """

    def __init__(self, servers: int, workers: int, steps: int, step_s: float, elastic: bool = False,
                 vc: Any = None, rejoin_s: float = 0.0, stopfile: str = "", port: int = 5700) -> None:
        self.children: list[Child] = []
        self.vc = vc
        env = {"PSRT_TIMEOUT": "30", "PSRT_START_TIMEOUT": "30"}
        bind = f"tcp://{vc.address('sched')}:{port}" if vc else "tcp://127.0.0.1:*"
        try:
            self.scheduler = self._spawn("sched", psrt_command(
                "scheduler", "--bind", bind, "--servers", str(servers), "--workers", str(workers), "--timeout", "30",
                *(["--elastic"] if elastic else [])), env, re.compile(r"psrt-scheduler ready endpoint=(\S+)"))
            endpoint = self.scheduler.wait_ready(30).group(1)
            env["PSRT_SCHEDULER"] = endpoint
            self.servers = [self._spawn(f"s{i}", psrt_command("server", "--scheduler", endpoint), env, SERVER_RANK)
                            for i in range(servers)]
            self.workers = [self._spawn(f"w{r}", worker_cmd("job", steps, step_s, rejoin_s, stopfile),
                                        {**env, "PSRT_WORKER_ID": str(r)}, TRAINING) for r in range(workers)]
            for c in (*self.servers, *self.workers):
                c.wait_ready(60)
        except BaseException:
            self.close()
            raise

    def _spawn(self, host: str, cmd: list[str], env: dict[str, str], ready: re.Pattern) -> Child:
        child = self.vc.spawn(host, cmd, env=env, ready=ready) if self.vc else \
            Child(cmd, label=host, env=env, ready=ready)
        self.children.append(child)
        return child

    def close(self) -> None:
        """Stop every process of the job (SIGKILL also ends a stopped one)."""
        for c in self.children:
            if c.poll() is None:
                c.signal(signal.SIGCONT)
        stop_children(self.children, grace=2.0)


def scenario_sigstop(opts: argparse.Namespace, raw: dict[str, Any]) -> list[Row]:
    """SIGSTOP one server of two: every worker must hear its name, and every other process exit."""
    job = Job(2, 2, 1_000_000, 0.01)
    try:
        victim = job.servers[1]
        rank = victim.match.group(2)
        time.sleep(1.0)
        stopped_at = time.time()
        victim.signal(signal.SIGSTOP)
        others = [c for c in job.children if c is not victim]
        codes = wait_all(others, NAMED_WITHIN_S + 10)
        results = [last_json(w) for w in job.workers]
    finally:
        job.close()
    named = [r["at"] - stopped_at for r in results if r["error"] == "PeerFailedError"
             and f"server {rank}" in r["message"]]
    raw["sigstop"] = {"workers": results, "exit_codes": codes}
    worst = max(named) if len(named) == len(results) else None
    hung = [k for k, v in codes.items() if v is None]
    return [
        Row("sigstop", f"SIGSTOP of server {rank}: named to both workers after (slowest)", fmt_s(worst),
            f"< {NAMED_WITHIN_S:g} s", worst is not None and worst < NAMED_WITHIN_S),
        Row("sigstop", "other processes exited (codes) / hung", f"{sorted(codes.items())} / {hung or 'none'}",
            "no hang", not hung and all(v != 0 for v in codes.values())),
        Row("sigstop", "a worker's message", results[0]["message"][:110] if results else ""),
    ]


def scenario_worker(opts: argparse.Namespace, raw: dict[str, Any]) -> list[Row]:
    """kill -9 of one worker of three, without and with --elastic."""
    rows = []
    job = Job(1, 3, 1_000_000, 0.01)
    try:
        time.sleep(1.0)
        killed_at = time.time()
        job.workers[2].signal(signal.SIGKILL)
        codes = wait_all([c for c in job.children if c is not job.workers[2]], NAMED_WITHIN_S + 10)
        results = [last_json(w) for w in job.workers[:2]]
    finally:
        job.close()
    named = [r["at"] - killed_at for r in results if r["error"] == "PeerFailedError" and "worker 2" in r["message"]]
    worst = max(named) if len(named) == 2 else None
    hung = [k for k, v in codes.items() if v is None]
    raw["worker"] = {"plain": {"workers": results, "exit_codes": codes}}
    rows += [Row("worker", "kill -9 of worker 2, no --elastic: survivors get the error after (slowest)",
                 fmt_s(worst), f"< {NAMED_WITHIN_S:g} s", worst is not None and worst < NAMED_WITHIN_S),
             Row("worker", "no --elastic: processes hung", ", ".join(hung) or "none", "none", not hung)]

    steps = opts.elastic_steps
    job = Job(1, 3, steps, 0.01, elastic=True)
    try:
        time.sleep(1.0)
        killed_at = time.time()
        job.workers[2].signal(signal.SIGKILL)
        codes = wait_all([c for c in job.children if c is not job.workers[2]], 120)
        results = [last_json(w) for w in job.workers[:2]]
    finally:
        job.close()
    raw["worker"]["elastic"] = {"workers": results, "exit_codes": codes, "killed_at": killed_at}
    stall = max(r["max_gap"] for r in results)
    finished = all(r["error"] is None and r["steps"] == steps for r in results)
    clean = all(v == 0 for v in codes.values())
    rows += [Row("worker", "kill -9 of worker 2, --elastic: survivors' longest stall", fmt_s(stall),
                 f"< {ELASTIC_STALL_S:g} s", stall < ELASTIC_STALL_S),
             Row("worker", "--elastic: survivors finished all steps, job exit codes",
                 f"{'yes' if finished else 'NO'} ({steps} steps), {sorted(codes.items())}", "finished, all 0",
                 finished and clean)]
    return rows


# ------------------------------------------------------------------------------------------------ restore
def scenario_restore(opts: argparse.Namespace, raw: dict[str, Any]) -> list[Row]:
    """kill -9 of a standalone shard with checkpoints, restarted with --restore; the workers ride through."""
    workers, steps, every = 2, opts.ride_steps, 5
    tmp = tempfile.mkdtemp(prefix="psrt-chaos-ckpt-")
    serve = ("server", "--workers", str(workers), "--checkpoint-dir", tmp, "--checkpoint-every", str(every))
    children: list[Child] = []
    try:
        shard = Child(psrt_command(*serve, "--bind", "tcp://127.0.0.1:*"), label="shard", ready=SERVER_READY)
        children.append(shard)
        endpoint = shard.wait_ready(30).group(1)
        ws = [Child(worker_cmd("ride", endpoint, r, workers, steps, 0.02), label=f"ride{r}", ready=TRAINING)
              for r in range(workers)]
        children += ws
        for w in ws:
            w.wait_ready(60)
        time.sleep(1.5)  # rounds and checkpoints go by
        killed_at = time.time()
        shard.signal(signal.SIGKILL)
        shard.wait(10)
        restarted = Child(psrt_command(*serve, "--bind", endpoint, "--restore"), label="shard2",
                          ready=SERVER_READY)
        children.append(restarted)
        restarted.wait_ready(30)
        ready_at = time.time()
        codes = wait_all(ws, 120)
        results = [last_json(w) for w in ws]
        with psrt.Client([endpoint], config=ClientConfig(timeout=10)) as c:
            stats = c.stats()[0]
    finally:
        stop_children(children)
        shutil.rmtree(tmp, ignore_errors=True)
    counts = results[0]["counts"]
    twice = sum(n for r in results for v, n in r["counts"].items() if float(v) < -1.0)
    lost = max(r["counts"].get("0.0", 0) for r in results) // workers
    recovered = [min((t for t in r["times"] if t > killed_at), default=float("inf")) - killed_at for r in results]
    recovery = max(recovered)
    for r in results:
        r.pop("times")
    raw["restore"] = {"workers": results, "exit_codes": codes, "restart_s": ready_at - killed_at, "shard": stats}
    return [
        Row("restore", "pushes applied twice", str(twice), "0", twice == 0),
        Row("restore", f"rounds lost (checkpoint every {every})", f"{lost} of {steps}", f"<= {every}",
            lost <= every and all(r["counts"] == counts for r in results)),
        Row("restore", "recovery: kill -9 to the next completed step (slowest worker)", fmt_s(recovery),
            f"< {RECOVERY_S:g} s", recovery < RECOVERY_S),
        Row("restore", "shard restart: kill -9 to ready; resent pushes seen as duplicates",
            f"{ready_at - killed_at:.2f} s; {stats['duplicates']}"),
        Row("restore", "workers finished", f"exit codes {sorted(codes.items())}", "all 0",
            all(v == 0 for v in codes.values())),
    ]


# ------------------------------------------------------------------------------------------------ link cut
def scenario_linkcut(opts: argparse.Namespace, raw: dict[str, Any]) -> list[Row]:
    """Cut worker 1's link inside an emulated cluster, without and with --elastic; then restore it."""
    from psrt.emulation.netns import VirtualCluster, check_available

    try:
        check_available()
    except psrt.ConfigError as exc:
        print(f"linkcut: skipped: {exc}", flush=True)
        return [Row("linkcut", "skipped", str(exc)[:100])]
    hosts = ["sched", "s0", "w0", "w1"]
    rows: list[Row] = []
    raw.setdefault("linkcut", {})
    # One cluster for both jobs: a second one made at once by this process would reuse the veth names while the
    # kernel may still be removing the first one's (its namespaces go away asynchronously).
    with VirtualCluster(hosts) as vc:
        veth = vc.veth("w1")  # the outer end of w1's veth pair
        for elastic in (False, True):
            rows += _cut_once(opts, raw, vc, veth, elastic)
    return rows


def _cut_once(opts: argparse.Namespace, raw: dict[str, Any], vc: Any, veth: str, elastic: bool) -> list[Row]:
    """One job in ``vc``: cut worker 1's link (``veth``), wait, restore it, and measure."""
    tmp = tempfile.mkdtemp(prefix="psrt-chaos-")
    stopfile = os.path.join(tmp, "stop")
    job = Job(1, 2, 1_000_000, 0.01, elastic=elastic, vc=vc, rejoin_s=30.0 if elastic else 0.0, stopfile=stopfile,
              port=5701 if elastic else 5700)
    rejoined_at = up_at = None
    try:
        time.sleep(1.0)
        cut_at = time.time()
        vc_ip("link", "set", veth, "down")
        if not elastic:
            codes = wait_all([job.scheduler, *job.servers, job.workers[0]], NAMED_WITHIN_S + 10)
            time.sleep(max(0.0, cut_at + opts.cut - time.time()))
            up_at = time.time()
            vc_ip("link", "set", veth, "up")
            codes.update(wait_all([job.workers[1]], 15))
        else:
            time.sleep(opts.cut)
            up_at = time.time()
            vc_ip("link", "set", veth, "up")
            rejoined_at = wait_for_line(job.workers[1], "rejoined", 30)
            time.sleep(1.0)  # both train together again
            Path(stopfile).touch()
            codes = wait_all(job.children, 30)
        results = [last_json(w) for w in job.workers]
    finally:
        vc_ip("link", "set", veth, "up")
        job.close()
        shutil.rmtree(tmp, ignore_errors=True)
    rows: list[Row] = []
    w0, w1 = results
    raw["linkcut"]["elastic" if elastic else "plain"] = {"workers": results, "exit_codes": codes,
                                                         "cut_at": cut_at, "up_at": up_at}
    hung = [k for k, v in codes.items() if v is None]
    w1_err = fmt_s(w1["at"] - cut_at) if w1["error"] else "none"
    if not elastic:
        named = w0["at"] - cut_at if w0["error"] == "PeerFailedError" and "worker 1" in w0["message"] else None
        rows += [Row("linkcut", "link of worker 1 down, no --elastic: worker 0 gets the error naming it after",
                     fmt_s(named), f"< {NAMED_WITHIN_S:g} s", named is not None and named < NAMED_WITHIN_S),
                 Row("linkcut", "no --elastic: the cut-off worker's own error after",
                     f"{w1_err}: {w1['message'][:80]}"),
                 Row("linkcut", "no --elastic: processes hung (link up again after "
                     f"{up_at - cut_at:.1f} s)", ", ".join(hung) or "none", "none", not hung)]
    else:
        stall = w0["max_gap"]
        rows += [Row("linkcut", "link of worker 1 down, --elastic: worker 0's longest stall", fmt_s(stall),
                     f"< {ELASTIC_STALL_S:g} s", stall < ELASTIC_STALL_S and w0["error"] is None),
                 Row("linkcut", "--elastic: the cut-off worker's own error after",
                     f"{w1_err}: {w1['message'][:80]}"),
                 Row("linkcut", f"--elastic: link up after {up_at - cut_at:.1f} s; worker 1 rejoined after",
                     fmt_s(None if rejoined_at is None else w1["rejoined_at"] - up_at), "rejoins",
                     w1["rejoined_at"] is not None),
                 Row("linkcut", "--elastic: processes hung at the end (exit codes)",
                     f"{', '.join(hung) or 'none'} ({sorted(codes.items())})", "none", not hung)]
    return rows


def vc_ip(*args: str) -> None:
    """Run ``ip ARGS`` (outside the namespaces), raising with its message when it fails."""
    import subprocess

    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


# ------------------------------------------------------------------------------------------------ auth
def keyed_shard(keys: Optional[Path]) -> Any:
    """An in-process shard on a thread (its counters can be read exactly), with the job's keys or none."""
    return serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, keys=None if keys is None else str(keys)))


def counters(server: Any) -> dict[str, int]:
    """A shard's counters, but its start time."""
    c = dataclasses.asdict(server.counters)
    c.pop("started")
    return c


def _intrude(endpoint: str, keys: Optional[Path]) -> tuple[str, float]:
    """A psrt client with ``keys`` tries init and push_pull; what it got and after how long."""
    started = time.monotonic()
    try:
        with psrt.Client([endpoint], config=ClientConfig(timeout=5.0, keys=None if keys is None else str(keys))) as c:
            c.init({"w": np.ones(8, np.float32)}, optimizer=psrt.SGD(lr=1.0))
            c.push_pull({"w": np.ones(8, np.float32)})
        return "served", time.monotonic() - started
    except psrt.PsrtError as exc:
        return type(exc).__name__, time.monotonic() - started


def _null_peer(endpoint: str) -> str:
    """A plain ZeroMQ DEALER (NULL mechanism) sends a stats request and a pull: did anything answer?"""
    with zmq.Context() as ctx:
        peer = ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(endpoint)
        peer.send_multipart(psrt.wire.encode_stats_request(1))
        peer.send_multipart(psrt.wire.encode_pull(2, 0, [["w", 0, 0]]))
        answered = peer.poll(1000)
        peer.close()
    return "answered" if answered else "no answer"


def scenario_auth(opts: argparse.Namespace, raw: dict[str, Any]) -> list[Row]:
    """The authentication matrix against a CURVE shard, and what the wire shows with and without keys."""
    from psrt.control import security

    tmp = Path(tempfile.mkdtemp(prefix="psrt-chaos-keys-"))
    rows: list[Row] = []
    try:
        job, other = security.keygen(tmp / "job").directory, security.keygen(tmp / "other").directory
        stolen = tmp / "stolen"  # the job's server key, which anyone may know, with a client pair never issued
        stolen.mkdir(mode=0o700)
        shutil.copy(job / "server.key", stolen)
        for name in ("client.key", "client.key_secret"):
            shutil.copy(other / name, stolen)
        with keyed_shard(job) as server:
            got, _ = _intrude(server.endpoint, job)
            rows.append(Row("auth", "the job's key: init + push_pull", got, "served", got == "served"))
            for who, keys in (("another job's key", other), ("the job's server key, another client pair", stolen),
                              ("no key", None)):
                time.sleep(0.2)  # the shard's thread counts a reply after sending it: let it finish counting
                before = counters(server)
                got, took = _intrude(server.endpoint, keys)
                time.sleep(0.2)  # anything that slipped through would be counted by now
                moved = {k: (v, counters(server)[k]) for k, v in before.items() if counters(server)[k] != v}
                rows.append(Row("auth", f"{who}: result (after); counters moved",
                                f"{got} ({took:.2f} s); {moved or 'none'}", "refused, none",
                                got == "AuthenticationError" and not moved))
            before = counters(server)
            got = _null_peer(server.endpoint)
            time.sleep(0.2)
            moved = {k: (v, counters(server)[k]) for k, v in before.items() if counters(server)[k] != v}
            rows.append(Row("auth", "raw NULL-mechanism peer: result; counters moved", f"{got}; {moved or 'none'}",
                            "no answer, none", got == "no answer" and not moved))
        seen = {}
        grad = np.arange(4096, dtype=np.float32) * 0.25 + 1000.0
        for keys in (job, None):
            with keyed_shard(keys) as server:
                relay = Relay(server.endpoint)
                try:
                    with psrt.Client([relay.endpoint],
                                     config=ClientConfig(timeout=10, keys=None if keys is None else str(keys))) as c:
                        c.init({"w": np.zeros(grad.size, np.float32)}, optimizer=psrt.SGD(lr=1.0))
                        c.push_pull({"w": grad})
                finally:
                    relay.close()
            seen[keys is not None] = (grad.tobytes()[1024:1280] in relay.to_server,
                                      (-grad).tobytes()[1024:1280] in relay.to_client, len(relay.to_server))
        raw["auth"] = {"wire": {"curve": seen[True], "plain": seen[False]}}
        rows.append(Row("auth", "gradient / parameters readable on the wire: with keys; without",
                        f"{seen[True][0]} / {seen[True][1]}; {seen[False][0]} / {seen[False][1]}",
                        "False / False; True / True", seen[True][:2] == (False, False) and seen[False][:2] == (True,
                                                                                                             True)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


RUNNERS: dict[str, Callable[[argparse.Namespace, dict[str, Any]], list[Row]]] = {
    "flood": scenario_flood, "sigstop": scenario_sigstop, "restore": scenario_restore, "worker": scenario_worker,
    "linkcut": scenario_linkcut, "auth": scenario_auth}


def table(rows: Sequence[Row]) -> str:
    """The results as a Markdown table."""
    lines = ["| scenario | measure | result | target | verdict |", "|---|---|---|---|---|"]
    lines += [f"| {r.scenario} | {r.measure} | {r.value} | {r.target} | {r.verdict} |" for r in rows]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the chosen scenarios, print the table and the verdicts; 1 if any target was missed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(SCENARIOS),
                        help=f"comma-separated scenarios to run (default: all of {', '.join(SCENARIOS)})")
    parser.add_argument("--quick", action="store_true", help="20,000 malformed messages and shorter runs")
    parser.add_argument("--flood", type=int, default=None, help="malformed messages (default 100000, quick 20000)")
    parser.add_argument("--cut", type=float, default=5.0, help="seconds the link stays down (default 5)")
    parser.add_argument("--json", default=None, help="write every row and the raw measurements to this file")
    opts = parser.parse_args(argv)
    chosen = [s.strip() for s in opts.only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in RUNNERS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    if opts.flood is None:
        opts.flood = 20_000 if opts.quick else 100_000
    opts.baseline = 2.0 if opts.quick else 4.0
    opts.flood_timeout = 120.0 if opts.quick else 300.0
    opts.ride_steps = 100 if opts.quick else 150
    opts.elastic_steps = 250 if opts.quick else 400
    logging.getLogger("psrt").setLevel(logging.ERROR)  # refused keys and reconnects are what we cause on purpose

    rows: list[Row] = []
    raw: dict[str, Any] = {}
    started = time.monotonic()
    for name in chosen:
        t0 = time.monotonic()
        print(f"chaos: {name} ...", flush=True)
        try:
            got = RUNNERS[name](opts, raw)
        except Exception as exc:  # a scenario that breaks is a miss, said in one row; the others still run
            got = [Row(name, "scenario ran to the end", f"{type(exc).__name__}: {str(exc)[:200]}", "ran", False)]
        rows += got
        print(f"chaos: {name} done in {time.monotonic() - t0:.1f} s", flush=True)
    elapsed = time.monotonic() - started
    print()
    print(table(rows))
    print()
    for r in rows:
        if r.ok is not None:
            print(f"{r.verdict}  {r.scenario}: {r.measure}: {r.value} (target {r.target})")
    print(f"\n{len(chosen)} scenario(s) in {elapsed:.0f} s; {sum(r.ok is False for r in rows)} target(s) missed")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"quick": opts.quick, "elapsed_s": elapsed,
                                               "rows": [dataclasses.asdict(r) | {"verdict": r.verdict} for r in rows],
                                               "raw": raw}, indent=1, default=str))
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
