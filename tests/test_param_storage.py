"""Where a shard keeps a key's parameters: the store decides once (shared memory where pushes gather into rounds,
private otherwise), and the entry owns what it got (its area, its seqlock counter, copy-on-write back to private)."""

from __future__ import annotations

import itertools
import secrets

import numpy as np
import pytest
from _helpers import needs_shm

import psrt
from psrt import kernels, shm
from psrt.shard.store import Store
from psrt.shm.arena import Arena

pytestmark = needs_shm(64)


@pytest.fixture
def arena():
    generations = itertools.count(1)
    a = Arena(secrets.token_hex(6), lambda: next(generations))
    yield a
    a.close()


class _Sending:
    """A zero-copy send ZeroMQ has not finished (what a reply's tracker says until the frame is out)."""

    done = False


def test_a_sync_round_keys_parameters_live_in_shared_memory_under_their_seqlock(arena):
    store = Store("sync", 2)
    store.use_shared_memory(arena)
    entry = store.create(("w", 0), np.arange(6, dtype=np.float32), psrt.SGD(lr=1.0))
    assert entry.shared is not None and entry.seqlock is entry.shared.seqlock
    assert np.shares_memory(entry.param, entry.shared.param) and entry.param.tolist() == list(range(6))
    generation, offset, counter = entry.shared_place()
    assert (generation, offset, counter) == (entry.shared.generation, entry.shared.offset, 0)
    assert offset % shm.ALIGN == 0
    store.apply_push(0, [entry], [np.ones(6, np.float32)])
    store.apply_push(1, [entry], [np.ones(6, np.float32)])  # the round completes: one step, the counter moves twice
    assert entry.version == 1 and entry.shared_place()[2] == 2
    assert entry.shared.param.tolist() == [v - 1.0 for v in range(6)]
    other = store.create(("w", 1), np.zeros(3), psrt.SGD())
    assert other.shared_place()[:2] != [generation, offset], "each key has its own area"


@pytest.mark.parametrize("mode, workers", [("async", 2), ("ssp", 2), ("sync", 1)])
def test_keys_stepped_at_every_push_stay_private(arena, mode, workers):
    store = Store(mode, workers)
    store.use_shared_memory(arena)
    entry = store.create(("w", 0), np.zeros(4, np.float32), psrt.SGD())
    assert entry.shared is None and entry.seqlock is None and entry.shared_place() == []


def test_a_store_without_shared_memory_keeps_every_key_private():
    store = Store("sync", 2)
    store.use_shared_memory(None)
    entry = store.create(("w", 0), np.zeros(4, np.float32), psrt.SGD())
    assert entry.shared is None and entry.shared_place() == []


def test_keys_held_before_shared_memory_is_given_move_there_once(arena):
    # A restored checkpoint's store: its keys exist before the shard hands it the arena.
    store = Store("sync", 2)
    entry = store.create(("w", 0), np.full(4, 7.0, np.float32), psrt.SGD())
    assert entry.shared is None
    store.use_shared_memory(arena)
    area = entry.shared
    assert area is not None and entry.param.tolist() == [7.0] * 4 and np.shares_memory(entry.param, area.param)
    store.use_shared_memory(arena)
    assert entry.shared is area, "a key already shared keeps its area"


def test_copy_on_write_makes_a_shared_key_private_and_leaves_its_readers_the_old_version(arena):
    store = Store("sync", 2)
    store.use_shared_memory(arena)
    entry = store.create(("w", 0), np.zeros(4, np.float32), psrt.SGD(lr=1.0))
    area = entry.shared
    assert area is not None
    entry.trackers.append(_Sending())  # a socket reply is still sending the shared parameters
    entry.apply(np.ones(4, np.float32), 1.0)
    assert entry.shared is None and entry.seqlock is None and entry.shared_place() == []
    assert not np.shares_memory(entry.param, area.param) and entry.param.tolist() == [-1.0] * 4
    assert area.param.tolist() == [0.0] * 4 and kernels.seq_read(area.seqlock) == 0, "readers see the old version"
