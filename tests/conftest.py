"""Shared fixtures: real shard server processes on loopback."""

from __future__ import annotations

from typing import Callable, Iterator

import pytest

from psrt.cluster.local import LocalShards


@pytest.fixture
def shards() -> Iterator[Callable[..., LocalShards]]:
    """Start shard server processes: ``shards(S, workers=W, mode="sync")``; all are stopped after the test."""
    started: list[LocalShards] = []

    def _start(num_servers: int = 1, workers: int = 1, mode: str = "sync", extra: tuple[str, ...] = ()) -> LocalShards:
        group = LocalShards(num_servers, workers, mode, extra_args=extra)
        started.append(group)
        return group

    yield _start
    for group in started:
        group.close()
