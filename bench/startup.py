"""Start-up cost: from ``psrt launch`` to the first completed step, and the time to initialize a 100 MB model.

The CNTK performance study found initialization overhead dominating short runs; this measures ours.

1. ``psrt launch -s 4 -w 16`` of a one-step job (1 MB model): time from starting the launcher to the last
   worker's first completed ``push_pull``, and to the launcher's exit; then checks that no process of the job
   is left (target: start to exit < 5 s on a 2-core machine).
2. ``client.init`` of ResNet-50's 161 trainable tensors (25.6 M float32 = 102 MB) and of one 100 MB tensor on
   4 fresh shard servers.
3. What each process pays to import its role (``python -X importtime``, median of the repeats, each a fresh
   interpreter): ``import psrt`` (target <= 120 ms), a worker's client, a shard, the scheduler, the command
   line, and NumPy and ZeroMQ alone beside them.

Usage::

    python bench/startup.py [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

import psrt
from psrt.cluster.local import LocalShards
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


def main() -> int:
    """Run the measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()

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

    inits = {}
    for spec in ("resnet50", "100MB"):
        nbytes = model_bytes(spec)
        times = [init_once(spec, args.servers) for _ in range(args.repeats)]
        inits[spec] = {"bytes": nbytes, "seconds": times}
        print(f"init of {spec} ({nbytes / 1e6:.0f} MB, {len(model_tensors(spec))} tensors) on {args.servers} "
              f"shards: median {statistics.median(times):.3f}s ({nbytes / 1e6 / statistics.median(times):.0f} MB/s)")

    imports = {role: statistics.median(import_ms(stmt) for _ in range(max(args.repeats, 5)))
               for role, stmt in ROLES.items()}
    print("import cost per process (median, ms):")
    for role, ms in imports.items():
        print(f"  {role:<36} {ms:7.1f}")
    light = "PASS" if imports["import psrt"] <= 120 else "MISS"
    print(f"  target import psrt <= 120 ms: {light} ({imports['import psrt']:.1f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"launch": runs, "init": inits, "imports_ms": imports, "servers": args.servers,
                       "workers": args.workers}, f, indent=1)
    return 0 if verdict == "PASS" and light == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
