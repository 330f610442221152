"""Throughput of psrt's compiled optimizer kernels against their straightforward NumPy forms.

For every kernel of :mod:`psrt.kernels` (``accumulate``, ``sgd_step``, ``momentum_step``, ``adam_step``,
``adagrad_step``) and every size (1M and 16M elements by default, float32), this script times the kernel, called
through the validated :mod:`psrt.kernels` API, against its NumPy twin in :mod:`psrt.kernels.reference` (for
``adam_step`` that is the NumPy AdamW update, ``reference.adam_step``), and both against NumPy's copy bandwidth
(``np.copyto(dst, src)``), all in one run.

The optimizer kernels get ``scale = 1/W`` (``--workers``, default 4), as a sync-mode shard applies them to the
sum of W gradients; ``adam_step`` runs as AdamW (decoupled ``weight_decay=0.01``, the step counting up).
``sgd_step`` has no weight decay (the pure averaged update).

Method
------
The machine is assumed shared and noisy, so only ratios measured side by side are reported as results. Kernels are
measured one after the other; for each, a repeat round times ``np.copyto``, the psrt kernel and its NumPy twin once
each, psrt and NumPy in an order that alternates between rounds, so drifts in load hit both sides alike (the copy
bandwidth is the median over all rounds of the size). One sample is ``inner`` back-to-back calls, with ``inner``
chosen once per kernel so that a sample of either side lasts at least ``--min-sample-ms`` (short samples are rarely
preempted), the same for both sides (a sample's first call finds the arrays colder); a variant's time per call is
the median (and the minimum) over its samples: ``--repeats`` rounds, or more (up to ten times as many) until
``--min-time`` seconds have passed, so that fast kernels get more samples. The targets use the ratio of the
medians; the table also shows the ratio of the minima, and the JSON file adds the median of the per-round ratios
(psrt and NumPy samples taken back to back). Each implementation updates its own arrays (all 64-byte aligned),
which stay hot in cache when they fit. NumPy's time includes allocating its temporaries: that is the cost of the
straightforward form.

Throughput is counted as *bytes touched*: every array the kernel reads counts once, every array it writes counts
once more (``accumulate`` and ``sgd_step`` 3 accesses per element, ``momentum_step`` and ``adagrad_step`` 5,
``adam_step`` 7, ``copyto`` 2), times the item size, divided by the time per call. The same count is used for
both sides, so a NumPy form that streams its temporaries through memory several times shows up as a lower GB/s.

Targets (the ratio is psrt GB/s over NumPy GB/s, from the median times, at every size measured)

- ``accumulate`` >= 0.9x ``np.add(dst, src, out=dst)``;
- ``adam_step`` >= 4x the NumPy AdamW update;
- ``sgd_step`` with averaging (``scale=1/W``) >= 2x NumPy.

Examples
--------
``python bench/kernels.py``, ``python bench/kernels.py --sizes 1M,4M,16M --repeats 21 --json kernels.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
from _common import human, parse_size

import psrt
from psrt import _core, kernels
from psrt.kernels import reference

KERNELS = ("accumulate", "sgd_step", "momentum_step", "adam_step", "adagrad_step")

#: Accesses per element: arrays read + arrays written.
ACCESSES = {"copyto": 2, "accumulate": 3, "sgd_step": 3, "momentum_step": 5, "adam_step": 7, "adagrad_step": 5}

#: (kernel, minimum ratio of psrt GB/s over NumPy GB/s).
TARGETS = (("accumulate", 0.9), ("adam_step", 4.0), ("sgd_step", 2.0))

LR, MOMENTUM, BETA1, BETA2, EPS, WEIGHT_DECAY, ADAGRAD_EPS = 1e-3, 0.9, 0.9, 0.999, 1e-8, 1e-2, 1e-10


@dataclass
class Variant:
    """One timed callable and its samples (seconds per call)."""

    name: str
    call: Optional[Callable[[], None]]
    inner: int = 1
    samples: list[float] = field(default_factory=list)

    def sample(self) -> None:
        call, inner = self.call, self.inner
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            call()
        self.samples.append((time.perf_counter_ns() - t0) / 1e9 / inner)

    def calibrate(self, min_sample_s: float) -> None:
        self.call()  # warm-up: first touch, NumPy's allocator, the CPU dispatch of the kernels
        t0 = time.perf_counter()
        self.call()
        once = max(time.perf_counter() - t0, 1e-7)
        self.inner = max(1, min(10_000, math.ceil(min_sample_s / once)))

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        return min(self.samples)


def aligned_empty(n: int, dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an ``align``-byte boundary.

    Both sides get equally aligned arrays: vector loops run up to ~15% slower on data that straddles cache lines,
    and NumPy's allocator leaves large arrays at an arbitrary 16-byte offset.
    """
    raw = np.empty(n * dtype.itemsize + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + n * dtype.itemsize].view(dtype)


def random_array(n: int, dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    """Standard normal values in an aligned array."""
    out = aligned_empty(n, dtype)
    out[...] = rng.standard_normal(n, dtype=np.float64)
    return out


def make_pair(kernel: str, n: int, dtype: np.dtype, scale: float, rng: np.random.Generator) -> tuple[Variant, Variant]:
    """The psrt and NumPy variants of ``kernel`` on fresh arrays of ``n`` elements (each side its own state)."""

    def arrays(k: int) -> list[np.ndarray]:
        return [random_array(n, dtype, rng) for _ in range(k)]

    def zeros() -> np.ndarray:
        out = aligned_empty(n, dtype)
        out.fill(0)
        return out

    grad = random_array(n, dtype, rng)
    sides = []
    for mod in (kernels, reference):
        if kernel == "accumulate":
            (dst,) = arrays(1)

            def call(mod=mod, dst=dst) -> None:
                mod.accumulate(dst, grad)
        elif kernel == "sgd_step":
            (param,) = arrays(1)

            def call(mod=mod, param=param) -> None:
                mod.sgd_step(param, grad, LR, scale, 0.0)
        elif kernel == "momentum_step":
            (param,) = arrays(1)
            buf = zeros()

            def call(mod=mod, param=param, buf=buf) -> None:
                mod.momentum_step(param, buf, grad, LR, MOMENTUM, scale, 0.0, False)
        elif kernel == "adam_step":
            (param,) = arrays(1)
            m, v = zeros(), zeros()
            step = [0]

            def call(mod=mod, param=param, m=m, v=v, step=step) -> None:
                step[0] += 1
                mod.adam_step(param, m, v, grad, LR, BETA1, BETA2, EPS, step[0], scale, WEIGHT_DECAY)
        elif kernel == "adagrad_step":
            (param,) = arrays(1)
            acc = zeros()

            def call(mod=mod, param=param, acc=acc) -> None:
                mod.adagrad_step(param, acc, grad, LR, ADAGRAD_EPS, scale, 0.0)
        else:
            raise ValueError(kernel)
        sides.append(Variant("psrt" if mod is kernels else "numpy", call))
    return sides[0], sides[1]


def stats(v: Variant, nbytes: int) -> dict:
    """JSON-ready summary of one variant."""
    return {
        "median_s": v.median,
        "min_s": v.best,
        "gbps_median": nbytes / v.median / 1e9,
        "gbps_max": nbytes / v.best / 1e9,
        "inner": v.inner,
        "samples_s": v.samples,
    }


def run_size(n: int, args: argparse.Namespace, rng: np.random.Generator) -> tuple[dict, list[dict]]:
    """Measure every selected kernel at ``n`` elements; returns the copy baseline and the kernel rows."""
    dtype = np.dtype(args.dtype)
    scale = 1.0 / args.workers
    src, dst = random_array(n, dtype, rng), aligned_empty(n, dtype)
    copy = Variant("copyto", lambda: np.copyto(dst, src))
    copy.calibrate(args.min_sample_ms / 1e3)
    pairs = {}
    gc_was_enabled = gc.isenabled()
    try:
        for kernel in args.kernels:  # one kernel at a time, so its arrays are as hot (or cold) for both sides
            psrt_side, numpy_side = make_pair(kernel, n, dtype, scale, rng)
            psrt_side.calibrate(args.min_sample_ms / 1e3)
            numpy_side.calibrate(args.min_sample_ms / 1e3)
            # The same number of calls per sample on both sides: a sample's first call finds the arrays colder.
            psrt_side.inner = numpy_side.inner = max(psrt_side.inner, numpy_side.inner)
            gc.disable()
            deadline = time.perf_counter() + args.min_time
            r = 0
            while r < args.repeats or (time.perf_counter() < deadline and r < 10 * args.repeats):
                r += 1
                copy.sample()
                first, second = (psrt_side, numpy_side) if r % 2 == 0 else (numpy_side, psrt_side)
                first.sample()
                second.sample()
            if gc_was_enabled:
                gc.enable()
            psrt_side.call = numpy_side.call = None  # free the arrays before the next kernel
            pairs[kernel] = (psrt_side, numpy_side)
            gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    itemsize = dtype.itemsize
    copy_row = {"n": n, "bytes_per_element": ACCESSES["copyto"] * itemsize,
                **stats(copy, ACCESSES["copyto"] * itemsize * n)}
    rows = []
    for kernel, (p, q) in pairs.items():
        nbytes = ACCESSES[kernel] * itemsize * n
        rows.append({
            "kernel": kernel,
            "n": n,
            "dtype": dtype.name,
            "bytes_per_element": ACCESSES[kernel] * itemsize,
            "psrt": stats(p, nbytes),
            "numpy": stats(q, nbytes),
            "ratio": q.median / p.median,
            "ratio_best": q.best / p.best,
            "ratio_paired": statistics.median(b / a for a, b in zip(p.samples, q.samples)),
            "psrt_vs_copy": nbytes / p.median / 1e9 / copy_row["gbps_median"],
        })
    return copy_row, rows


def print_table(copies: list[dict], rows: list[dict], dtype: str) -> None:
    """The results table: one line per (kernel, size), plus NumPy's copy bandwidth per size."""
    accesses = ", ".join(f"{k} {v}" for k, v in ACCESSES.items())
    print(f"\nGB/s = bytes touched per call / median time per call; bytes touched = (arrays read + arrays written) "
          f"x n x itemsize ({dtype}); accesses per element: {accesses}.")
    print("ratio = psrt GB/s / numpy GB/s (= numpy time / psrt time), from medians; best = from minimum times; "
          "of copy = psrt GB/s / np.copyto GB/s.\n")
    head = f"{'kernel':<14} {'size':>6} {'B/elem':>6} {'psrt GB/s':>10} {'numpy GB/s':>11} {'ratio':>7} " \
           f"{'best':>7} {'of copy':>8} {'psrt ms':>9} {'numpy ms':>9}"
    print(head)
    print("-" * len(head))
    for c in copies:
        print(f"{'np.copyto':<14} {human(c['n']):>6} {c['bytes_per_element']:>6} {'':>10} {c['gbps_median']:>11.2f} "
              f"{'':>7} {'':>7} {'':>8} {'':>9} {c['median_s'] * 1e3:>9.3f}")
    for r in rows:
        print(f"{r['kernel']:<14} {human(r['n']):>6} {r['bytes_per_element']:>6} {r['psrt']['gbps_median']:>10.2f} "
              f"{r['numpy']['gbps_median']:>11.2f} {r['ratio']:>6.2f}x {r['ratio_best']:>6.2f}x "
              f"{r['psrt_vs_copy']:>8.2f} {r['psrt']['median_s'] * 1e3:>9.3f} {r['numpy']['median_s'] * 1e3:>9.3f}")


def check_targets(rows: list[dict], workers: int) -> list[dict]:
    """PASS/MISS per target and size; prints one line each."""
    results = []
    print()
    for kernel, target in TARGETS:
        for r in (r for r in rows if r["kernel"] == kernel):
            ok = r["ratio"] >= target
            what = {"accumulate": "vs np.add(dst, src, out=dst)", "adam_step": "vs NumPy AdamW (reference.adam_step)",
                    "sgd_step": f"scale=1/{workers} vs NumPy (reference.sgd_step)"}[kernel]
            print(f"{'PASS' if ok else 'MISS'}  {kernel:<11} n={human(r['n']):<4} {what}: ratio {r['ratio']:.2f}x "
                  f"(best-of {r['ratio_best']:.2f}x), target >= {target:g}x")
            results.append({"kernel": kernel, "n": r["n"], "target": target, "ratio": r["ratio"],
                            "ratio_best": r["ratio_best"], "pass": ok})
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",") if x.strip()],
                        default=[1 << 20, 1 << 24], help="comma-separated element counts (K/M/G suffixes)")
    parser.add_argument("--kernels", type=lambda s: [k.strip() for k in s.split(",") if k.strip()],
                        default=list(KERNELS), help=f"comma-separated subset of {','.join(KERNELS)}")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--workers", type=int, default=4, help="W: optimizer kernels get scale=1/W")
    parser.add_argument("--repeats", type=int, default=31, help="least samples per variant and size")
    parser.add_argument("--min-time", type=float, default=1.0,
                        help="per kernel and size, keep sampling (up to 10x --repeats) for at least these seconds")
    parser.add_argument("--min-sample-ms", type=float, default=0.5,
                        help="a sample repeats a call to last at least this long (short samples dodge preemption)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 when a target is missed")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.kernels) - set(KERNELS))
    if unknown:
        parser.error(f"unknown kernels {unknown}; choose from {','.join(KERNELS)}")
    if args.workers < 1 or args.repeats < 1 or args.min_sample_ms <= 0 or args.min_time < 0:
        parser.error("--workers and --repeats must be >= 1, --min-sample-ms > 0 and --min-time >= 0")

    simd = getattr(_core, "simd_target", lambda: "unknown")()
    print(f"psrt {psrt.__version__} (kernels: {simd}), numpy {np.__version__}, python {platform.python_version()}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs; {args.dtype}, W={args.workers}, >= {args.repeats} samples "
          f"and >= {args.min_time:g} s per kernel and size")
    rng = np.random.default_rng(args.seed)
    copies, rows = [], []
    for n in args.sizes:
        print(f"measuring n={human(n)} ...", file=sys.stderr, flush=True)
        copy_row, size_rows = run_size(n, args, rng)
        copies.append(copy_row)
        rows.extend(size_rows)
        gc.collect()
    print_table(copies, rows, args.dtype)
    targets = check_targets(rows, args.workers)
    if args.json:
        meta = {"psrt": psrt.__version__, "simd_target": simd, "numpy": np.__version__,
                "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
                "dtype": args.dtype, "workers": args.workers, "repeats": args.repeats, "min_time_s": args.min_time,
                "min_sample_ms": args.min_sample_ms, "accesses_per_element": ACCESSES,
                "gbps": "bytes touched (reads + writes) / time, 1 GB = 1e9 bytes"}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "copy": copies, "results": rows, "targets": targets}, f, indent=1)
        print(f"\nwrote {args.json}")
    return 1 if args.strict and not all(t["pass"] for t in targets) else 0


if __name__ == "__main__":
    sys.exit(main())
