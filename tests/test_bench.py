"""The benchmark scripts: their shared helpers, and that each one starts."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402  (bench/ is not a package: its scripts import this module by path)


@pytest.mark.parametrize("text, multiple, value", [
    ("4096", 1, 4096), ("64K", 1, 64 << 10), ("1M", 1, 1 << 20), ("1g", 1, 1 << 30), ("1.5K", 1, 1536),
    ("4KiB", 4, 4096), ("16MiB", 4, 16 << 20), ("100MB", 4, 100_000_000), ("4 K", 4, 4096),
])
def test_parse_size(text, multiple, value):
    assert _common.parse_size(text, multiple) == value


@pytest.mark.parametrize("text, multiple", [("", 1), ("fast", 1), ("0", 1), ("-4K", 1), ("6", 4), ("1KX", 1)])
def test_parse_size_refuses_what_is_not_a_size(text, multiple):
    with pytest.raises(argparse.ArgumentTypeError):
        _common.parse_size(text, multiple)


def test_human_units():
    assert [_common.human(n) for n in (1 << 20, 64 << 10, 1 << 30, 1000)] == ["1M", "64K", "1G", "1000"]
    assert [_common.human_bytes(n) for n in (64 << 10, 4 << 20, 100)] == ["64 KiB", "4 MiB", "100 B"]


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")))
def test_every_bench_script_starts(script):
    proc = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:")


def test_start_server_gives_a_ready_server_and_stops_it_cleanly():
    server = _common.start_server(1, timeout=30)
    try:
        assert server.endpoint.startswith("tcp://127.0.0.1:")
        assert server.poll() is None
    finally:
        assert server.stop() == 0  # SIGTERM: the server stops its loop and says what it served
    assert "psrt-server stopped" in server.output


def test_chaos_percentiles_and_table():
    import chaos

    assert chaos.percentile([], 50) != chaos.percentile([], 50)  # NaN: no samples
    values = [float(v) for v in range(1, 101)]
    assert (chaos.percentile(values, 50), chaos.percentile(values, 99), chaos.percentile(values, 100)) == (50, 99, 100)
    rows = [chaos.Row("s", "m", "1 s", "< 5 s", True), chaos.Row("s", "n", "2", "0", False), chaos.Row("s", "o", "x")]
    assert [r.verdict for r in rows] == ["PASS", "MISS", ""]
    assert chaos.table(rows).splitlines()[2] == "| s | m | 1 s | < 5 s | PASS |"
