"""The main job: a real model trained on a real dataset by a launched local cluster."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("sklearn")

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_launched_digits_training_reaches_high_accuracy(mode):
    proc = subprocess.run([sys.executable, "-m", "psrt.cli", "launch", "-s", "2", "-w", "2", "--mode", mode, "--",
                           sys.executable, "-m", "psrt.examples.digits", "--epochs", "8"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"\[worker 0\] final test accuracy (\d\.\d+)", proc.stdout)
    assert m, proc.stdout
    assert float(m.group(1)) > 0.93
    assert "psrt-scheduler stopped code=0" in proc.stdout


def test_missing_compiled_core_fails_loudly():
    code = "import sys; sys.modules['psrt._core'] = None; import psrt"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "pip install -e ." in proc.stderr
