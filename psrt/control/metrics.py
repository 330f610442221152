"""Prometheus metrics for a shard server (``psrt server --metrics-port``), via prometheus_client.

The collector reads :meth:`psrt.shard.server.Server.stats` at scrape time, so the serving loop does no extra work.
Per worker (labels ``endpoint, worker, host``), who is slow: ``psrt_server_worker_lateness_p50_seconds`` and
``..._p99_seconds`` (how late its pushes come after their round's first push), ``psrt_server_worker_pushes_total``
and ``psrt_server_worker_dropped_pushes_total`` (too late for a round closed without them: backup workers).
"""

from __future__ import annotations

from typing import Any, Iterator

from psrt.checks import check_port

__all__ = ["serve_metrics", "ServerCollector", "per_worker"]

_COUNTERS = ("pushes", "pulls", "inits", "rounds", "duplicates", "errors", "dropped_replies", "bytes_in", "bytes_out",
             "dropped_pushes")
#: Per worker: (metric, the flat stats' suffix, counter or gauge, help).
_PER_WORKER = (("worker_lateness_p50_seconds", "late_p50_s", False, "median lateness of a worker's pushes after "
                "their round's first push"),
               ("worker_lateness_p99_seconds", "late_p99_s", False, "p99 lateness of a worker's pushes after "
                "their round's first push"),
               ("worker_pushes", "pushes", True, "pushes of a worker"),
               ("worker_dropped_pushes", "dropped", True, "pushes of a worker dropped as too late"))
_GAUGES = ("keys", "param_bytes", "accumulators", "accumulator_bytes", "queued_pulls", "deferred_pushes",
           "backup_workers")


class ServerCollector:
    """A prometheus_client collector over one server's counters."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:  # noqa: D102
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for _ in range(3):  # the serving thread may resize a dict mid-read; try again
            try:
                stats = self.server.stats()
                break
            except RuntimeError:
                continue
        else:
            return
        labels = ["endpoint"]
        for name in _COUNTERS:
            c = CounterMetricFamily(f"psrt_server_{name}", f"psrt shard {name.replace('_', ' ')}", labels=labels)
            c.add_metric([stats["endpoint"]], stats[name])
            yield c
        for name in _GAUGES:
            g = GaugeMetricFamily(f"psrt_server_{name}", f"psrt shard {name.replace('_', ' ')}", labels=labels)
            g.add_metric([stats["endpoint"]], stats[name])
            yield g
        workers = per_worker(stats)
        for metric, suffix, counter, help_text in _PER_WORKER:
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(
                f"psrt_server_{metric}", help_text, labels=["endpoint", "worker", "host"])
            for rank, values in sorted(workers.items()):
                family.add_metric([stats["endpoint"], str(rank), str(values.get("host", ""))], values.get(suffix, 0))
            yield family


#: The fields of a row of a shard's ``workers`` stats, after the rank (:meth:`psrt.shard.stragglers.Lateness.stats`).
WORKER_FIELDS = ("pushes", "dropped", "late_p50_s", "late_p99_s", "host")


def per_worker(stats: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """A shard's per-worker stats (its ``workers`` rows) by rank: ``pushes``, ``dropped``, ``late_p50_s``,
    ``late_p99_s``, ``host``. Rows of another shape (a newer shard's) are skipped."""
    out: dict[int, dict[str, Any]] = {}
    for row in stats.get("workers", ()):
        if type(row) in (list, tuple) and len(row) == 1 + len(WORKER_FIELDS) and type(row[0]) is int:
            out[row[0]] = dict(zip(WORKER_FIELDS, row[1:]))
    return out


def serve_metrics(server: Any, port: int, host: str = "127.0.0.1") -> Any:
    """Start the metrics HTTP endpoint in a background thread; returns the HTTP server (call ``shutdown()``)."""
    try:
        from prometheus_client import start_http_server
        from prometheus_client.core import CollectorRegistry
    except ImportError:
        from psrt.errors import ConfigError

        raise ConfigError("--metrics-port needs prometheus_client: pip install 'psrt[metrics]'") from None
    check_port(port, "the metrics port")  # the HTTP server would fail with an OverflowError
    registry = CollectorRegistry()
    registry.register(ServerCollector(server))
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    return httpd
