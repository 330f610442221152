"""What an overlapped step's time went to, read from ``psrt worker --overlap --trace FILE`` files.

Each file holds, per virtual worker, the pipeline's events (:attr:`psrt.worker.overlap.Pipeline.trace`): a tensor
``queued`` by the emulated backward, ``sent`` once the window let it go, ``acked`` by every shard it lies on, and
``waiting``/``ready`` where the next forward (or the last step's ``synchronize``) asked for its new values and had
them; plus each step's start (``step``), the start of the timed steps (``timed``) and their end (``end``).

:func:`summarize` turns them into what a model of the step can be held against: per timed step, how long its
forward stood waiting for parameters; per tensor, how long it waited for the window, how long its push took to be
acknowledged, and how long the forward waited for it; and the *drain*, from the last gradient queued to the last
parameters in, which a short timed window counts in full::

    python -m psrt.emulation.trace run/*.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

__all__ = ["Summary", "load", "summarize", "render", "main"]


@dataclass
class Summary:
    """Medians (and 90th percentiles) over the workers of what their timed steps spent.

    Attributes
    ----------
    workers : int
        Workers read.
    forward_wait : list of (float, float)
        Per timed step: the seconds its forward stood waiting for parameters (median, p90).
    step_s : list of (float, float)
        Per timed step: seconds from its start to the next one's (the last: to its last gradient queued).
    drain_s : (float, float)
        Seconds from the last gradient queued to the last parameters in (``synchronize``).
    tensors : dict
        Per tensor: medians of ``window_s`` (queued to sent), ``ack_s`` (sent to acknowledged) and
        ``forward_wait_s`` (what a timed forward waited for it).
    """

    workers: int = 0
    forward_wait: list[tuple[float, float]] = field(default_factory=list)
    step_s: list[tuple[float, float]] = field(default_factory=list)
    drain_s: tuple[float, float] = (float("nan"), float("nan"))
    tensors: dict[str, dict[str, float]] = field(default_factory=dict)


def load(paths: Iterable[str]) -> tuple[list[str], list[list[tuple[float, str, str]]]]:
    """``(tensors in forward order, each worker's events)`` of trace files (every worker of every file)."""
    tensors: list[str] = []
    workers: list[list[tuple[float, str, str]]] = []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        tensors = tensors or list(doc["tensors"])
        workers.extend([tuple(e) for e in w["events"]] for w in doc["workers"])  # type: ignore[misc]
    return tensors, workers


def _stats(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    return float(np.median(values)), float(np.percentile(values, 90))


def _columns() -> dict[str, list[float]]:
    return {"window_s": [], "ack_s": [], "forward_wait_s": []}


def summarize(tensors: Sequence[str], workers: Sequence[Sequence[tuple[float, str, str]]]) -> Summary:
    """Summarize the timed steps of ``workers``' events (see :class:`Summary`)."""
    waits: dict[int, list[float]] = {}
    steps: dict[int, list[float]] = {}
    drains: list[float] = []
    per: dict[str, dict[str, list[float]]] = {name: _columns() for name in tensors}
    for events in workers:
        timed = next((t for t, kind, _ in events if kind == "timed"), None)
        if timed is None:
            continue
        timed_events = [e for e in events if e[0] >= timed]
        starts = [t for t, kind, _ in timed_events if kind == "step"]
        queued: dict[str, float] = {}
        sent: dict[str, float] = {}
        waiting: dict[str, float] = {}
        step = -1
        last_queued: Optional[float] = None
        for t, kind, name in timed_events:
            if name and name not in per:  # a tensor the first file did not name (files of different models)
                per[name] = _columns()
            if kind == "step":
                step += 1
                waits.setdefault(step, []).append(0.0)
            elif kind == "queued":
                queued[name] = last_queued = t
            elif kind == "sent" and name in queued:
                sent[name] = t
                per[name]["window_s"].append(t - queued[name])
            elif kind == "acked" and name in sent:
                per[name]["ack_s"].append(t - sent.pop(name))
            elif kind == "waiting":
                waiting[name] = t
            elif kind == "ready" and name in waiting:
                waited = t - waiting.pop(name)
                if step >= 0 and (last_queued is None or last_queued < starts[step]):  # a forward's wait
                    waits[step][-1] += waited
                    per[name]["forward_wait_s"].append(waited)
            elif kind == "end" and last_queued is not None:
                drains.append(t - last_queued)
        for k, start in enumerate(starts):
            end = starts[k + 1] if k + 1 < len(starts) else last_queued
            if end is not None:
                steps.setdefault(k, []).append(end - start)
    return Summary(workers=len(workers), forward_wait=[_stats(waits[k]) for k in sorted(waits)],
                   step_s=[_stats(steps[k]) for k in sorted(steps)], drain_s=_stats(drains),
                   tensors={n: {k: _stats(v)[0] for k, v in d.items()} for n, d in per.items()})


def render(s: Summary) -> str:
    """The summary as the lines :func:`main` prints."""
    lines = [f"{s.workers} workers; per timed step, median (p90) seconds:"]
    for k, ((w, w90), (d, d90)) in enumerate(zip(s.forward_wait, s.step_s)):
        lines.append(f"  step {k + 1}: {d:6.2f} ({d90:.2f}) long, its forward waiting {w:6.2f} ({w90:.2f})")
    lines.append(f"  drain (last gradient queued -> last parameters in): {s.drain_s[0]:.2f} ({s.drain_s[1]:.2f})")
    lines.append("  tensor   window   acked   forward waited  (medians, s)")
    for name, d in s.tensors.items():
        lines.append(f"  {name:8s} {d['window_s']:6.2f}  {d['ack_s']:6.2f}  {d['forward_wait_s']:6.2f}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m psrt.emulation.trace FILE...``: print the summary of trace files."""
    p = argparse.ArgumentParser(prog="python -m psrt.emulation.trace", description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="files written by psrt worker --overlap --trace FILE")
    a = p.parse_args(argv)
    print(render(summarize(*load(a.files))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
