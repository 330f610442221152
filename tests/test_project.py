"""The project's own shape: one source of the version, declared dependencies, honest test markers."""

from __future__ import annotations

import ast
import re
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


#: Import name -> distribution, for every third-party module psrt or its benchmarks import.
DISTRIBUTIONS = {"numpy": "numpy", "zmq": "pyzmq", "msgpack": "msgpack", "sklearn": "scikit-learn",
                 "prometheus_client": "prometheus_client", "tqdm": "tqdm", "matplotlib": "matplotlib",
                 "ray": "ray", "torch": "torch"}


def imported_modules(paths: list[Path], local: set[str]) -> dict[str, Path]:
    """Top-level names of every module imported anywhere in ``paths`` (inside functions too), but the stdlib."""
    found = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local and top != "__future__":
                    found.setdefault(top, path)
    return found


def requirement_names(specs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", s, maxsplit=1)[0].strip().lower() for s in specs}


@pytest.mark.skipif(sys.version_info < (3, 10), reason="sys.stdlib_module_names is new in Python 3.10")
def test_every_third_party_import_is_declared():
    project = pyproject()["project"]
    core = requirement_names(project["dependencies"])
    extras = {k: requirement_names(v) for k, v in project["optional-dependencies"].items()}
    where = {
        # psrt itself: its dependencies, and the extras that name what its optional parts need.
        "psrt": (sorted((ROOT / "psrt").rglob("*.py")),
                 core | extras["metrics"] | extras["examples"] | extras["torch"]),
        # The benchmarks: what README's `pip install -e ".[bench]"` installs; peers.py's baselines in `peers`.
        "bench": (sorted((ROOT / "bench").glob("*.py")), core | extras["bench"] | extras["peers"]),
    }
    local = {"psrt", "_common", "_torch_ps"}
    for paths, declared in where.values():
        for module, path in imported_modules(paths, local).items():
            assert module in DISTRIBUTIONS, f"{path.name} imports {module}: add it to pyproject.toml and this table"
            assert DISTRIBUTIONS[module].lower() in declared, f"{path.name} imports undeclared {module}"
    bench_only = imported_modules(sorted((ROOT / "bench").glob("*.py")), local)
    assert {m for m in bench_only if DISTRIBUTIONS[m] not in core} - {"ray", "torch"} <= extras["bench"]
    assert {"ray", "torch"} <= extras["peers"] and not {"ray", "torch"} & extras["bench"]


def test_the_readme_benchmark_section_starts_with_its_install_line():
    section = (ROOT / "README.md").read_text().split("## Performance", 1)[1]
    first_command = re.search(r"```bash\n(.+)\n", section).group(1)
    assert first_command.strip() == 'pip install -e ".[bench]"'
    assert '".[bench,peers]"' in section.split("|", 1)[0]


def test_ci_runs_the_readme_test_command_and_the_linter():
    script = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    command = 'pip install -e ".[test]" && python -m pytest'
    assert f"```bash\n{command}\n```" in readme
    lines = [line.strip() for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert command in lines
    assert "python -m ruff check ." in lines[lines.index(command):]
    assert "ruff" in requirement_names(pyproject()["project"]["optional-dependencies"]["test"])


def import_graph() -> dict[str, set[str]]:
    """psrt's modules and the psrt modules each imports, anywhere in its body (inside functions too)."""
    package = ROOT / "psrt"

    def name(path: Path) -> str:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    sources = sorted(package.rglob("*.py"))
    modules = {name(p) for p in sources} | {name(p) for p in package.rglob("*.pyx")}  # _core is a module too
    graph = {}
    for path in sources:
        me = name(path)
        here = me if path.name == "__init__.py" else me.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = here.rsplit(".", node.level - 1)[0] if node.level else ""
                source = ".".join(filter(None, [base, node.module]))
                for a in node.names:  # `from psrt import x` imports the module psrt.x when there is one
                    target = f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                    if target in modules:
                        edges.add(target)
        graph[me] = edges - {me}
    return graph


def test_no_import_cycle_among_psrt_modules():
    graph = import_graph()
    assert {"psrt", "psrt.cli", "psrt.cluster.launch", "psrt.cluster.daemon", "psrt.control.process"} <= set(graph)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_command_line_only_parses_arguments():
    graph = import_graph()
    assert "psrt.cli" not in {t for edges in graph.values() for t in edges}, "nothing may import the command line"
    assert not graph["psrt.cli"] & {"psrt.shard.server", "psrt.control.scheduler", "psrt.worker.client"}


def test_the_readme_says_how_to_get_the_cpu_build_of_torch():
    # PyPI's torch wheel for Linux brings the CUDA libraries (~4 GB); psrt.torch needs only the CPU build.
    section = (ROOT / "README.md").read_text().split("## With PyTorch", 1)[1].split("\n## ", 1)[0]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in section
    assert "CPU" in section.split("```python", 1)[0]


#: psrt's layers, lowest first: a module may import its own package and the layers below, never one above, and
#: the two sides of a job (shard, worker) never each other. A top-level module is its own package, but for the
#: ground's, which make one (errors, checks, dtypes, config, ... import each other). ``psrt`` itself (its
#: ``__init__``: the public names) sits on the worker side, which it re-exports.
GROUND = {"psrt._core", "psrt.errors", "psrt.checks", "psrt.dtypes", "psrt.config", "psrt.memory", "psrt.partition"}
LAYERS: list[set[str]] = [
    {"ground"},
    {"psrt.kernels", "psrt.transport"},
    {"psrt.wire", "psrt.optim"},
    {"psrt.tablespec"},
    {"psrt.control"},
    {"psrt.shm"},
    {"psrt.shard", "psrt.worker"},
    {"psrt", "psrt.torch", "psrt.cluster"},
    {"psrt.emulation"},
    {"psrt.examples"},
    {"psrt.cli"},
]


def group_of(module: str) -> str:
    """The package (or top-level module, or the ground) ``module`` belongs to, as :data:`LAYERS` names them."""
    if module in GROUND:
        return "ground"
    parts = module.split(".")
    return module if len(parts) == 1 else ".".join(parts[:2])


def test_imports_flow_down_the_layers():
    layer = {g: i for i, groups in enumerate(LAYERS) for g in groups}
    graph = import_graph()
    assert {group_of(m) for m in graph} <= set(layer), "a module outside every layer: place it in LAYERS"
    upward = []
    for source, targets in graph.items():
        for target in targets:
            a, b = group_of(source), group_of(target)
            if a != b and layer[b] >= layer[a]:
                upward.append(f"{source} -> {target}")
    assert upward == [], "imports that do not flow down the layers: " + ", ".join(sorted(upward))


def test_the_top_level_holds_few_modules():
    top = [p.name for p in (ROOT / "psrt").iterdir() if p.suffix in (".py", ".pyx")]
    assert len(top) <= 15, sorted(top)


def test_every_subpackage_is_installed():
    # The package list in pyproject.toml is explicit: a folder left out would be missing from a wheel.
    listed = set(pyproject()["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "psrt").rglob("__init__.py")}
    assert found == listed
