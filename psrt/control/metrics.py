"""Prometheus metrics for a shard server (``psrt server --metrics-port``), via prometheus_client.

The collector reads :meth:`psrt.shard.server.Server.stats` at scrape time, so the serving loop does no extra work.
"""

from __future__ import annotations

from typing import Any, Iterator

from psrt.checks import check_port

__all__ = ["serve_metrics", "ServerCollector"]

_COUNTERS = ("pushes", "pulls", "inits", "rounds", "duplicates", "errors", "dropped_replies", "bytes_in", "bytes_out")
_GAUGES = ("keys", "param_bytes", "accumulators", "accumulator_bytes", "queued_pulls", "deferred_pushes")


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
