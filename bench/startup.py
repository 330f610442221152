"""Start-up cost, and the control plane at scale: CNTK's finding (initialization dominating short runs) for psrt.

The CNTK performance study found initialization overhead dominating short runs; this measures ours.

1. ``psrt launch -s 4 -w 16`` of a one-step job (1 MB model): time from starting the launcher to the last
   worker's first completed ``push_pull``, and to the launcher's exit; then checks that no process of the job
   is left (target: start to exit < 5 s on a 2-core machine).
2. ``client.init`` of ResNet-50's 161 trainable tensors (25.6 M float32 = 102 MB) and of one 100 MB tensor on
   4 fresh shard servers.
3. What each process pays to import its role (``python -X importtime``, median of the repeats, each a fresh
   interpreter): ``import psrt`` (target <= 120 ms), a worker's client, a shard, the scheduler, the command
   line, and NumPy and ZeroMQ alone beside them.
4. The job at scale (``--scales``, default W = 16 and 128 worker processes and 1,000 virtual workers, 250 per
   process): ``psrt launch -s 4`` of a sync job of a 64 KB model, ``--compute-ms`` of sleep per step; for each,
   the time from the launcher's start to the job formed (the last worker's client has its table), to the last
   worker's first step, and to the exit; and the scheduler's CPU in the steady state (its user + system time
   over the wall time between the last worker's first step and the first worker's last, read from /proc: the
   heartbeats and barriers of every peer; target <= 10 % of a core at 1,000 workers). At the virtual-worker
   scale one worker then goes silent while its process lives on (its heartbeat stops, its thread hangs), and
   the bench reports how long the others take to be told, naming it (target < 5 s). "hints" counts the lines
   asking whether a scheduler runs there at all, which a job that forms slowly but answers must not print.
5. ``--budget``: the 1,000-worker command of the scaling work, as a user runs it, ``psrt launch -s 4 -w 1000
   --clients 250 -- psrt worker --model 64KB --compute-ms 300 --steps 5 --warmup 1``: start to exit (target
   <= 120 s), every worker's ``param0`` equal, and the largest process's peak resident memory (target < 1.5 GB).

Usage::

    python bench/startup.py [--repeats 3] [--json FILE]
    python bench/startup.py --only scale,budget      # parts 4 and 5 alone
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

import psrt
from psrt.cluster.local import LocalShards
from psrt.control.process import parse_results
from psrt.emulation.models import model_bytes, model_tensors

WORKER = """
import sys, time
import numpy as np
import psrt
from psrt.emulation.models import model_tensors
with psrt.Client() as c:
    params = {n: np.zeros(s, np.float32) for n, s in model_tensors("1MB")}
    c.init(params, optimizer=psrt.SGD(lr=0.1))
    c.push_pull({n: np.ones_like(a) for n, a in params.items()})
    print(f"first-step {time.time():.6f}", flush=True)
"""


#: A process of N virtual workers for part 4 (argv: steps, compute seconds, the rank that goes silent or -1). Each
#: worker prints ``formed``, ``first-step`` and ``last-step`` with its rank and ``time.time()``; the silent one
#: ``vanished``, the ones told of it ``told``.
SCALE_WORKER = """
import sys, threading, time
import numpy as np
import psrt
from psrt.config import ClusterConfig
steps, compute, vanish = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
cluster = ClusterConfig.from_env()
first = cluster.worker_id or 0
lock = threading.Lock()
grads = {"w": np.full(16384, 1e-3, np.float32)}

def say(what, rank):
    with lock:
        print(f"{what} {rank} {time.time():.6f}", flush=True)

def run(rank):
    try:
        with psrt.Client(rank=rank) as c:
            say("formed", rank)
            c.init({"w": np.zeros(16384, np.float32)}, optimizer=psrt.SGD(lr=0.1))
            c.push_pull(grads)
            say("first-step", rank)
            for _ in range(steps):
                time.sleep(compute)
                c.push_pull(grads)
            say("last-step", rank)
            if vanish >= 0:
                if rank == vanish:
                    c._heartbeat.stop()
                    say("vanished", rank)
                    time.sleep(600)
                while True:
                    c.push_pull(grads)
    except psrt.PeerFailedError as exc:
        if f"worker {vanish} " in str(exc):
            say("told", rank)

threads = [threading.Thread(target=run, args=(first + i,), daemon=True) for i in range(cluster.clients)]
for t in threads:
    t.start()
for i, t in enumerate(threads):
    if first + i != vanish:
        t.join()
"""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def find_process(marker: str, word: str, timeout: float) -> int:
    """The pid of the process whose environment holds ``marker`` and whose command line holds ``word``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in leftover(marker):
            try:
                if word.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                    return pid
            except OSError:
                pass
        time.sleep(0.05)
    raise RuntimeError(f"no {word} process appeared within {timeout:g}s")


def scale_once(servers: int, workers: int, clients: int, steps: int, compute_ms: float, vanish: bool) -> dict:
    """One launch of part 4's job; returns its timings (seconds from the launcher's start)."""
    mark = uuid.uuid4().hex
    silent = workers // 2 + 1 if vanish else -1
    cmd = [sys.executable, "-m", "psrt.cli", "launch", "-s", str(servers), "-w", str(workers),
           "--clients", str(clients), "--", sys.executable, "-c", SCALE_WORKER, str(steps), str(compute_ms / 1000),
           str(silent)]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PSRT_BENCH_MARK": mark})
    events: dict[str, list[float]] = {}
    steady: list[tuple[float, float]] = []
    lines: list[str] = []
    pattern = re.compile(r"\b(formed|first-step|last-step|vanished|told) (\d+) ([\d.]+)$")
    done = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            m = pattern.search(line.strip())
            if m:
                events.setdefault(m.group(1), []).append(float(m.group(3)))
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        scheduler = find_process(mark, "scheduler", 60)
        deadline = time.monotonic() + 600
        while len(events.get("first-step", ())) < workers and time.monotonic() < deadline and not done.is_set():
            time.sleep(0.02)
        steady.append((time.time(), cpu_seconds(scheduler)))
        while not events.get("last-step") and time.monotonic() < deadline and not done.is_set():
            time.sleep(0.02)
        steady.append((time.time(), cpu_seconds(scheduler)))
        proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(10)
    t_exit = time.time() - t0
    if len(events.get("last-step", ())) != workers:
        finished = len(events.get("last-step", ()))
        raise RuntimeError(f"{finished} of {workers} workers finished:\n" + "".join(lines[-40:]))
    if not vanish and proc.returncode != 0:
        raise RuntimeError(f"launch failed ({proc.returncode}):\n" + "".join(lines[-40:]))
    (ta, ca), (tb, cb) = steady
    result = {"servers": servers, "workers": workers, "clients": clients, "processes": -(-workers // clients),
              "formed_s": max(events["formed"]) - t0, "first_step_s": max(events["first-step"]) - t0,
              "exit_s": t_exit, "scheduler_cpu_percent": 100.0 * (cb - ca) / max(tb - ta, 1e-9),
              "steady_s": tb - ta, "leftover_processes": len(leftover(mark)),
              # A worker that waits for a scheduler that answered (the job forming) must not ask if one runs there.
              "unreachable_warnings": sum("is a psrt scheduler running there" in line for line in lines)}
    if vanish:
        told = [t - events["vanished"][0] for t in events.get("told", [])]
        result.update(told=len(told), told_median_s=statistics.median(told) if told else None,
                      told_max_s=max(told) if told else None)
    return result


BUDGET = ["launch", "-s", "4", "-w", "1000", "--clients", "250", "--", "psrt", "worker", "--model", "64KB",
          "--compute-ms", "300", "--steps", "5", "--warmup", "1"]
#: Runs a command and prints the peak resident memory of its largest descendant (Linux: kilobytes).
PEAK = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
        "print('peak-rss-kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True); sys.exit(rc)")


def budget_once() -> dict:
    """Part 5: the 1,000-worker command, start to exit, exactness and peak memory."""
    mark = uuid.uuid4().hex
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", PEAK, sys.executable, "-m", "psrt.cli", *BUDGET],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PSRT_BENCH_MARK": mark})
    took = time.time() - t0
    results = parse_results(proc.stdout)
    peak = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("peak-rss-kb")]
    return {"command": "psrt " + " ".join(BUDGET), "exit_code": proc.returncode, "exit_s": took,
            "results": len(results), "ranks": len({r["rank"] for r in results}),
            "param0": sorted({r["param0"] for r in results}), "peak_rss_mb": peak[0] / 1024 if peak else None,
            "leftover_processes": len(leftover(mark))}


def leftover(marker: str) -> list[int]:
    """Pids whose environment holds ``marker``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/environ").read_bytes():
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def launch_once(servers: int, workers: int) -> dict:
    """One launch of the one-step job; returns its timings."""
    mark = uuid.uuid4().hex
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "psrt.cli", "launch", "-s", str(servers), "-w", str(workers),
                           "--", sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PSRT_BENCH_MARK": mark})
    t_exit = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"launch failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    firsts = [float(line.rsplit(" ", 1)[1]) for line in proc.stdout.splitlines() if "first-step" in line]
    if len(firsts) != workers:
        raise RuntimeError(f"expected {workers} first steps, saw {len(firsts)}")
    return {"first_step_s": max(firsts) - t0, "exit_s": t_exit, "leftover_processes": len(leftover(mark))}


def init_once(spec: str, servers: int) -> float:
    """Seconds for ``client.init`` of the model ``spec`` on fresh shards."""
    params = {n: np.zeros(s, np.float32) for n, s in model_tensors(spec)}
    with LocalShards(servers, 1) as shards, psrt.Client(shards.endpoints) as client:
        t = time.perf_counter()
        client.init(params, optimizer=psrt.SGD(lr=0.1))
        return time.perf_counter() - t


#: What each role's process imports first (the statement run in a fresh interpreter).
ROLES = {
    "import psrt": "import psrt",
    "worker (psrt.Client)": "import psrt; psrt.Client",
    "shard (psrt.shard.server)": "import psrt.shard.server",
    "scheduler (psrt.control.scheduler)": "import psrt.control.scheduler",
    "command line (psrt.cli)": "import psrt.cli",
    "numpy alone": "import numpy",
    "zmq alone": "import zmq",
}


def import_ms(statement: str) -> float:
    """Milliseconds a fresh interpreter spends importing what ``statement`` imports (the sum of its top-level
    imports in ``-X importtime``; the interpreter's own start-up and ``site`` are not counted)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", statement], capture_output=True, text=True,
                         timeout=120, check=True, cwd="/")
    total, after_site = 0, False
    for line in out.stderr.splitlines():
        if not line.startswith("import time:") or line.count("|") != 2:
            continue
        _, cumulative, name = line.split("|")
        if after_site and name.startswith(" ") and not name.startswith("  "):
            total += int(cumulative)
        after_site = after_site or name.strip() == "site"
    return total / 1000


def parse_scales(text: str) -> list[tuple[int, int]]:
    """``16,128,1000/250``: (W, workers per process) pairs; a bare W is one worker per process."""
    scales = []
    for part in text.split(","):
        w, _, n = part.strip().partition("/")
        try:
            scales.append((int(w), int(n) if n else 1))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a scale: {part!r} (use e.g. 16,128,1000/250)") from None
    return scales


def main() -> int:
    """Run the measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="launch,init,imports,scale,budget",
                        help="the parts to run, comma-separated: launch, init, imports, scale, budget")
    parser.add_argument("--scales", type=parse_scales, default=parse_scales("16,128,1000/250"),
                        help="part 4's jobs: W or W/N (N virtual workers per process), comma-separated")
    parser.add_argument("--steps", type=int, default=10, help="part 4: steady-state steps after the first")
    parser.add_argument("--compute-ms", type=float, default=300.0, help="part 4: emulated compute per step")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    out: dict = {"servers": args.servers, "workers": args.workers}
    verdicts = []

    if "launch" in parts:
        runs = [launch_once(args.servers, args.workers) for _ in range(args.repeats)]
        first = [r["first_step_s"] for r in runs]
        exits = [r["exit_s"] for r in runs]
        print(f"psrt launch -s {args.servers} -w {args.workers}, one-step job, 1 MB model ({args.repeats} runs)")
        print(f"  launch -> last worker's first step: median {statistics.median(first):.2f}s  "
              f"min {min(first):.2f}s  max {max(first):.2f}s")
        print(f"  launch -> exit:                     median {statistics.median(exits):.2f}s  "
              f"min {min(exits):.2f}s  max {max(exits):.2f}s")
        left = sum(r["leftover_processes"] for r in runs)
        print(f"  processes left behind: {left}")
        verdict = "PASS" if max(exits) < 5.0 and left == 0 else "MISS"
        print(f"  target start-to-exit < 5 s with nothing left: {verdict} (worst {max(exits):.2f}s)")
        out["launch"] = runs
        verdicts.append(verdict)

    if "init" in parts:
        inits = {}
        for spec in ("resnet50", "100MB"):
            nbytes = model_bytes(spec)
            times = [init_once(spec, args.servers) for _ in range(args.repeats)]
            inits[spec] = {"bytes": nbytes, "seconds": times}
            print(f"init of {spec} ({nbytes / 1e6:.0f} MB, {len(model_tensors(spec))} tensors) on {args.servers} "
                  f"shards: median {statistics.median(times):.3f}s "
                  f"({nbytes / 1e6 / statistics.median(times):.0f} MB/s)")
        out["init"] = inits

    if "imports" in parts:
        imports = {role: statistics.median(import_ms(stmt) for _ in range(max(args.repeats, 5)))
                   for role, stmt in ROLES.items()}
        print("import cost per process (median, ms):")
        for role, ms in imports.items():
            print(f"  {role:<36} {ms:7.1f}")
        light = "PASS" if imports["import psrt"] <= 120 else "MISS"
        print(f"  target import psrt <= 120 ms: {light} ({imports['import psrt']:.1f} ms)")
        out["imports_ms"] = imports
        verdicts.append(light)

    if "scale" in parts:
        print(f"the job at scale: psrt launch -s {args.servers}, sync, 64 KB model, {args.steps} steps of "
              f"{args.compute_ms:g} ms compute after the first (seconds from the launcher's start)")
        print(f"  {'W':>5} {'procs':>5} {'formed':>7} {'1st step':>8} {'exit':>6} {'sched CPU':>9} {'hints':>5}  "
              "silent peer told")
        out["scale"] = []
        for workers, clients in args.scales:
            virtual = clients > 1
            r = scale_once(args.servers, workers, clients, args.steps, args.compute_ms, vanish=virtual)
            out["scale"].append(r)
            told = (f"{r['told']} of {workers - 1} told in {r['told_median_s']:.2f}s median, {r['told_max_s']:.2f}s "
                    "max" if virtual and r["told"] else ("nobody told" if virtual else "-"))
            print(f"  {workers:>5} {r['processes']:>5} {r['formed_s']:>6.1f}s {r['first_step_s']:>7.1f}s "
                  f"{r['exit_s']:>5.1f}s {r['scheduler_cpu_percent']:>8.1f}% {r['unreachable_warnings']:>5}  {told}")
            if workers >= 1000:
                ok = (r["scheduler_cpu_percent"] <= 10.0 and virtual and r["told"] == workers - 1
                      and r["told_max_s"] < 5.0)
                verdict = "PASS" if ok else "MISS"
                print(f"  target at {workers} workers: scheduler <= 10 % of a core, the silent one named to every "
                      f"other within 5 s: {verdict}")
                verdicts.append(verdict)

    if "budget" in parts:
        b = budget_once()
        out["budget"] = b
        exact = b["results"] == 1000 and b["ranks"] == 1000 and len(b["param0"]) == 1
        peak = b["peak_rss_mb"]
        verdict = "PASS" if b["exit_code"] == 0 and exact and b["exit_s"] <= 120 and peak is not None \
            and peak < 1536 else "MISS"
        print(f"{b['command']}")
        values = b["param0"] if len(b["param0"]) <= 3 else f"{len(b['param0'])} different values"
        print(f"  exit code {b['exit_code']}, start to exit {b['exit_s']:.1f}s, {b['results']} results from "
              f"{b['ranks']} ranks, param0 {values}, largest process {peak or 0:.0f} MB, processes left "
              f"{b['leftover_processes']}")
        print(f"  target <= 120 s, every worker exact, largest process < 1.5 GB: {verdict}")
        verdicts.append(verdict)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(v == "PASS" for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
