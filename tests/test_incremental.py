"""Incremental checkpoints of embedding tables: a full file, then deltas of the rows changed (or evicted) since
the file before, a full one every ``--checkpoint-full-every``; a restore reads the newest full file and its
deltas, and gives back every row exactly."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import numpy as np
import pytest
from _helpers import serving

import psrt
from psrt.config import ClientConfig, ServerConfig
from psrt.shard import checkpoint

DIM, ROWS = 16, 100_000


def kinds(directory: Path) -> list[str]:
    files = sorted(directory.glob("rank-0-*"), key=lambda p: p.name.rsplit("-", 2)[-2])
    return ["delta" if p.name.endswith(".delta.psrtckpt") else "full" for p in files]


def everything(c: psrt.Client, ids: np.ndarray) -> np.ndarray:
    return np.concatenate([c.pull_rows("items", ids[i:i + 50_000]) for i in range(0, len(ids), 50_000)])


def grow(c: psrt.Client, ids: np.ndarray, value: float) -> None:
    for i in range(0, len(ids), 50_000):
        part = ids[i:i + 50_000]
        c.push_rows("items", part, np.full((len(part), DIM), value, np.float32))


def test_a_delta_after_one_percent_changed_writes_at_most_five_percent_and_restores_exactly(tmp_path):
    config = ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async", checkpoint_dir=str(tmp_path),
                          checkpoint_full_every=3)
    with serving(config) as server, psrt.Client([server.endpoint], config=ClientConfig(timeout=60)) as c:
        c.init_embedding("items", dim=DIM, optimizer=psrt.AdaGrad(lr=0.1), capacity=ROWS)
        grow(c, np.arange(ROWS, dtype=np.int64), 1.0)
        (full,) = c.checkpoint()
        changed = np.arange(ROWS // 200, dtype=np.int64) * 7  # 0.5% pushed again, 0.5% new (evicting as many)
        grow(c, np.concatenate([changed, np.arange(ROWS, ROWS + ROWS // 200, dtype=np.int64)]), 0.5)
        (delta,) = c.checkpoint()
        assert Path(delta).name.endswith(".delta.psrtckpt")
        full_bytes, delta_bytes = Path(full).stat().st_size, Path(delta).stat().st_size
        assert delta_bytes <= 0.05 * full_bytes, (delta_bytes, full_bytes)
        (second,) = c.checkpoint()  # nothing changed: a delta of (almost) nothing
        assert Path(second).stat().st_size < 0.001 * full_bytes
        grow(c, np.arange(5, dtype=np.int64), 2.0)
        c.checkpoint()  # the third after the full one: full again
        grow(c, np.arange(3, 9, dtype=np.int64), 3.0)
        c.checkpoint()
        assert kinds(tmp_path) == ["full", "delta", "delta", "full", "delta"]
        probe = np.arange(ROWS + ROWS // 100, dtype=np.int64)
        expected = everything(c, probe)
        stats = c.table_stats("items")[0]
        assert stats["evicted"] > ROWS // 200 and stats["rows"] == ROWS  # (ids 1-8 had been evicted)
    restored = checkpoint.load_latest(tmp_path, "rank-0")
    assert restored is not None and restored.path.name.endswith(".delta.psrtckpt")
    (table,) = restored.tables
    np.testing.assert_array_equal(table.gather(probe), expected)
    assert (table.used, table.evicted, table.admitted) == (stats["rows"], stats["evicted"], stats["admitted"])


def test_a_torn_or_foreign_delta_ends_the_chain_before_it(tmp_path, caplog):
    config = ServerConfig(bind="tcp://127.0.0.1:*", num_workers=1, mode="async", checkpoint_dir=str(tmp_path))
    ids = np.arange(10, dtype=np.int64)
    with serving(config) as server, psrt.Client([server.endpoint], config=ClientConfig(timeout=20)) as c:
        c.init_embedding("items", dim=DIM, optimizer=psrt.SGD(lr=1.0), admit_after=2, ttl=3600)
        seen = []
        for _ in range(3):
            c.push_rows("items", ids, np.ones((10, DIM), np.float32))
            c.checkpoint()
            seen.append(c.pull_rows("items", ids))
    deltas = checkpoint.deltas_of(tmp_path, "rank-0")
    assert len(deltas) == 2 and len(checkpoint.files_of(tmp_path, "rank-0")) == 1
    restored = checkpoint.load_latest(tmp_path, "rank-0")
    np.testing.assert_array_equal(restored.tables[0].gather(ids), seen[2])
    deltas[-1].write_bytes(deltas[-1].read_bytes()[:-5])  # torn: its trailer is gone
    restored = checkpoint.load_latest(tmp_path, "rank-0")
    np.testing.assert_array_equal(restored.tables[0].gather(ids), seen[1])
    assert restored.path == deltas[0]
    deltas[0].unlink()  # a missing link: the chain ends at the full file
    restored = checkpoint.load_latest(tmp_path, "rank-0")
    np.testing.assert_array_equal(restored.tables[0].gather(ids), seen[0])
    assert restored.tables[0].pending.used == 10 and restored.tables[0].used == 0  # one push: pending, no row
    assert "ignoring delta checkpoint" in caplog.text


@pytest.mark.integration
def test_sigkill_and_restore_give_back_every_row_of_a_table_checkpointed_incrementally(tmp_path):
    """A real shard process, SIGKILLed after a full checkpoint and two deltas (with evictions and pending ids),
    comes back with --restore holding exactly the rows, counters and pending counts it had."""
    from psrt.control.process import SERVER_READY, Child, psrt_command

    serve = ("server", "--workers", "1", "--mode", "async", "--checkpoint-dir", str(tmp_path),
             "--checkpoint-full-every", "4")
    shard = Child(psrt_command(*serve, "--bind", "tcp://127.0.0.1:*"), label="shard", ready=SERVER_READY)
    endpoint = shard.wait_ready(30).group(1)
    restarted = None
    probe = np.arange(-100, 30_000, dtype=np.int64)
    rng = np.random.default_rng(0)

    def define(c: psrt.Client) -> None:
        c.init_embedding("items", dim=8, optimizer=psrt.Adam(lr=0.01), admit_after=2, capacity=20_000, seed=5)

    try:
        with psrt.Client([endpoint], config=ClientConfig(timeout=60)) as c:
            define(c)
            for step in range(6):
                ids = rng.integers(-100, 30_000, 20_000).astype(np.int64)
                c.push_rows("items", ids, rng.standard_normal((len(ids), 8)).astype(np.float32))
                if step % 2:
                    c.checkpoint()
            assert kinds(tmp_path) == ["full", "delta", "delta"]
            expected, stats = c.pull_rows("items", probe), c.table_stats("items")[0]
            assert stats["evicted"] > 0 and stats["pending"] > 0
        shard.signal(signal.SIGKILL)
        shard.wait(10)
        restarted = Child(psrt_command(*serve, "--bind", endpoint, "--restore"), label="shard", ready=SERVER_READY)
        restarted.wait_ready(30)
        with psrt.Client([endpoint], config=ClientConfig(timeout=60)) as c:
            define(c)  # the same definition: the restored table's
            np.testing.assert_array_equal(c.pull_rows("items", probe), expected)
            back = c.table_stats("items")[0]
            assert {k: v for k, v in back.items() if k != "bytes"} == {k: v for k, v in stats.items() if k != "bytes"}
    finally:
        for child in (shard, restarted):
            if child is not None:
                child.stop()


@pytest.mark.integration
def test_the_criteo_like_example_learns_evicts_and_checkpoints_deltas(shards, tmp_path):
    """``python -m psrt.examples.ctr --criteo-like``: 2 workers, 2 checkpointing shards; AUC rises, rows are
    admitted and evicted, and every checkpoint after the first is a delta."""
    import subprocess
    import sys

    group = shards(2, workers=2, mode="sync", extra=("--checkpoint-dir", str(tmp_path)))
    cmd = [sys.executable, "-m", "psrt.examples.ctr", "--criteo-like", "--steps", "100", "--batch", "512",
           "--capacity", "256",
           "--servers", ",".join(group.endpoints), "--workers", "2", "--rank"]
    procs = [subprocess.Popen([*cmd, str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    lines = outs[0][0].splitlines()
    aucs = [float(line.rsplit("AUC", 1)[1]) for line in lines if "AUC" in line]
    assert len(aucs) == 6 and aucs[-1] > aucs[0] + 0.2, lines
    (tables,) = [line for line in lines if line.startswith("tables:")]
    counts = dict(re.findall(r"(held|admitted|evicted|pending) (\d+)", tables))
    assert int(counts["evicted"]) > 0 and int(counts["admitted"]) == int(counts["held"]) + int(counts["evicted"])
    sizes = [(kind, float(mb)) for kind, mb in re.findall(r"checkpoint at step \d+: (\w+), ([\d.]+) MB", outs[0][0])]
    assert [k for k, _ in sizes] == ["full", "delta", "delta", "delta", "delta"], sizes
    assert all(mb > 0 for _, mb in sizes), sizes  # (here most of a delta is the counts of new tail ids)
