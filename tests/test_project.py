"""The project's own shape: one source of the version, declared dependencies."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import psrt

ROOT = Path(__file__).resolve().parent.parent


def test_the_package_version_has_one_source():
    expand = pytest.importorskip("setuptools.config.pyprojecttoml")
    project = expand.read_configuration(ROOT / "pyproject.toml")["project"]
    assert "version" in project["dynamic"]
    assert project["version"] == psrt.__version__


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_declared_marker_selects_a_test():
    options = pyproject()["tool"]["pytest"]["ini_options"]
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    for line in options.get("markers", []):
        name = line.split(":")[0].split("(")[0].strip()
        assert f"mark.{name}" in sources, f"marker {name!r} is declared but no test uses it"
    assert "-m" not in options.get("addopts", ""), "the default run must not deselect tests"
