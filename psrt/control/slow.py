"""Who is slow in the whole job: the scheduler's merge of what each server's heartbeats say of its workers.

Each shard of a sync job measures, per worker, how late its pushes come after their round's first push, and names
the workers far later than the others (:mod:`psrt.shard.stragglers`). Every second or so a server's heartbeat
carries that verdict (:class:`psrt.wire.SlowReport`: its round, how many workers it measured, their typical
median and the slow ones). A worker slow on one shard alone has a slow path to that shard (that shard's own log
names it); one slow on every shard (of those that measured two workers or more) is a straggler of the job.
:class:`SlowWorkers` keeps each shard's latest verdict and names the stragglers: the scheduler logs them every N
rounds of the job (its round: the highest any shard reported; N is ``PSRT_SLOW_EVERY``) and once when the job
ends.
"""

from __future__ import annotations

from typing import Optional

from psrt import wire

__all__ = ["SlowWorkers"]


class SlowWorkers:
    """The servers' latest word on who is slow, merged.

    Parameters
    ----------
    every : int
        Rounds of the job between two lines (:meth:`add` says when one is due).
    """

    def __init__(self, every: int) -> None:
        self.every = every
        #: Per shard rank, its latest report.
        self.reports: dict[int, wire.SlowReport] = {}
        #: Names of workers the scheduler knew (a worker that said done is no longer a member).
        self.names: dict[int, str] = {}
        self._next = every

    @property
    def round(self) -> int:
        """The job's round as the shards last reported it (the highest)."""
        return max((r.round for r in self.reports.values()), default=0)

    def add(self, shard: int, report: wire.SlowReport) -> bool:
        """Take ``shard``'s report; True when the job's round reached the next multiple of N (a line is due)."""
        self.reports[shard] = report
        if self.round < self._next:
            return False
        self._next = (self.round // self.every + 1) * self.every
        return True

    def slow(self) -> dict[int, list[tuple[float, int, int]]]:
        """The workers every shard that measured two or more names slow: per rank, ``(median lateness s, pushes,
        dropped)`` on each of those shards (empty when none is, or no shard measured enough)."""
        judging = [r for r in self.reports.values() if r.measured >= 2]
        if not judging:
            return {}
        named = [{row[0]: row[1:] for row in r.slow} for r in judging]
        common = set(named[0]).intersection(*named[1:])
        return {w: [n[w] for n in named] for w in common}

    def line(self, final: bool = False) -> Optional[str]:
        """The line naming the job's slow workers, slowest first, or None when there are none."""
        slow = self.slow()
        if not slow:
            return None
        shards = sum(1 for r in self.reports.values() if r.measured >= 2)
        typical = [r.typical for r in self.reports.values() if r.measured >= 2]
        parts = []
        for w in sorted(slow, key=lambda w: -min(m for m, _, _ in slow[w])):
            medians = [m for m, _, _ in slow[w]]
            pushes, dropped = sum(p for _, p, _ in slow[w]), sum(d for _, _, d in slow[w])
            parts.append(f"{self.names.get(w, f'worker {w}')} {_span(medians)} ms, {dropped} of its {pushes} "
                         "pushes to them dropped")
        when = "at the job's end" if final else f"at round {self.round}"
        return (f"slow workers {when} (slow on every one of the {shards} shards measuring lateness; median lateness "
                f"of their pushes after their round's first push): {', '.join(parts)}; the workers' typical median "
                f"is {_span(typical)} ms")


def _span(seconds: list[float]) -> str:
    """Milliseconds, as ``lo-hi`` where they differ."""
    lo, hi = f"{1e3 * min(seconds):.0f}", f"{1e3 * max(seconds):.0f}"
    return lo if lo == hi else f"{lo}-{hi}"
