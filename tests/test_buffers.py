"""Receive arrays: reused once the caller has let go of them, never while anything of the caller's holds them."""

from __future__ import annotations

import numpy as np
import pytest

import psrt

pytestmark = pytest.mark.integration


def test_returned_arrays_are_reused_only_once_free(shards):
    group = shards(1, workers=1)
    with psrt.Client(group.endpoints) as c:
        c.init({"w": np.zeros(1000, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        g = {"w": np.ones(1000, np.float32)}
        kept = c.push_pull(g)["w"]  # held for the whole test
        view = c.push_pull(g)["w"][:10]  # a view holds its base
        handle = c.pull_async()  # a pending handle holds its outputs
        seen = set()
        for _ in range(6):
            params = c.push_pull(g)  # the usual loop: the previous step's dict is dropped when rebound
            seen.add(params["w"].__array_interface__["data"][0])
        held = handle.wait()["w"]
        np.testing.assert_array_equal(kept, np.full(1000, -1.0))  # never written again
        np.testing.assert_array_equal(view, np.full(10, -2.0))
        np.testing.assert_array_equal(held, np.full(1000, -2.0))
        np.testing.assert_array_equal(params["w"], np.full(1000, -8.0))
        assert len(seen) <= 3  # the loop alternates between arrays instead of allocating one per step
        for a in (kept, view.base, held):
            assert a.__array_interface__["data"][0] not in seen


def test_out_arrays_are_still_the_callers(shards):
    group = shards(1, workers=1)
    with psrt.Client(group.endpoints) as c:
        c.init({"w": np.zeros(8, np.float32)}, optimizer=psrt.SGD(lr=1.0))
        mine = np.empty(8, np.float32)
        assert c.push_pull({"w": np.ones(8, np.float32)}, out={"w": mine})["w"] is mine
