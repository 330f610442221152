"""What a shard counts, and the flat report of it that ``stats`` replies, ``psrt stats`` and Prometheus show."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from psrt.shard.store import Store

__all__ = ["Counters", "report"]


@dataclass
class Counters:
    """A shard's event counts since it started."""

    pushes: int = 0
    pulls: int = 0
    inits: int = 0
    rounds: int = 0
    duplicates: int = 0
    #: Pushes (or parts of them) dropped as too late for a round closed without them (backup workers).
    dropped_pushes: int = 0
    errors: int = 0
    dropped_replies: int = 0
    checkpoints: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    #: Tensor bytes that came and went through shared-memory lanes instead of the socket.
    shm_bytes_in: int = 0
    shm_bytes_out: int = 0
    started: float = field(default_factory=time.time)


def report(counters: Counters, store: Store, **state: Any) -> dict[str, Any]:
    """The counters and the store's sizes as one flat mapping of numbers and strings (``state`` adds more)."""
    n_acc, acc_bytes = store.accumulators()
    counts = {f.name: getattr(counters, f.name) for f in dataclasses.fields(counters) if f.name != "started"}
    return {**state, "keys": len(store.entries), "param_bytes": store.nbytes(), "accumulators": n_acc,
            "accumulator_bytes": acc_bytes, **counts, "uptime_s": time.time() - counters.started}
