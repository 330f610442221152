"""The project's own shape: one source of the version, declared dependencies."""

from __future__ import annotations

from pathlib import Path

import pytest

import psrt

ROOT = Path(__file__).resolve().parent.parent


def test_the_package_version_has_one_source():
    expand = pytest.importorskip("setuptools.config.pyprojecttoml")
    project = expand.read_configuration(ROOT / "pyproject.toml")["project"]
    assert "version" in project["dynamic"]
    assert project["version"] == psrt.__version__
