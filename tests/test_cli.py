"""The ``psrt`` command line: version, help texts, defaults and one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import psrt

PSRT = [sys.executable, "-m", "psrt.cli"]


def run_psrt(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*PSRT, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_version_prints_the_package_version():
    proc = run_psrt("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"psrt {psrt.__version__}"
