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
                 core | extras["metrics"] | extras["examples"] | extras["torch"] | extras["plot"]),
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


# ---------------------------------------------------------------------------------------------- integration tests
#: What starts a process, a network namespace or a job, by the name a test module reaches it by (a module, a class,
#: a function; ``shards`` is the fixture of tests/conftest.py): a test that reaches one, itself or through a
#: fixture or a helper (of its module, tests/_helpers.py, tests/conftest.py), is an integration test. A shard
#: server or a scheduler on a thread of the test process (``_helpers.serving``, ``_helpers.scheduling``) is not:
#: it starts in milliseconds, and it is how the unit tests reach one component over real sockets.
STARTERS = {"subprocess", "multiprocessing", "pty", "Popen", "Child", "LocalShards", "VirtualCluster", "psrt_command",
            "start_child", "start_server", "shards"}
#: ``os`` functions that start a process (``os.fork``, ``os.system``, ``os.exec*``, ``os.spawn*``, ...).
OS_STARTERS = re.compile(r"(fork|forkpty|system|popen|posix_spawnp?|exec\w*|spawn\w*)$")


def _mentions_starter(node: ast.AST, starting: set[str], modules: dict[str, set[str]]) -> bool:
    """Whether ``node`` reaches something that starts a process: one of ``starting`` (or :data:`STARTERS`) by name
    or as a parameter (a fixture it asks for), an attribute of that name, a starting attribute of a local module
    (``modules``: its name or alias in this module -> what it defines that starts one), an ``os`` function that
    starts a process. Names ``node`` assigns itself (a local ``shards = ...``) are its own, not a starter."""
    names = STARTERS | starting
    own = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in names - own:
            return True
        if isinstance(sub, ast.arg) and sub.arg in names:
            return True
        if isinstance(sub, ast.Attribute):
            owner = sub.value.id if isinstance(sub.value, ast.Name) else None
            if sub.attr in STARTERS or (owner == "os" and OS_STARTERS.match(sub.attr)) \
                    or sub.attr in modules.get(owner, ()):
                return True
    return False


def starting_names(tree: ast.Module, local: dict[str, set[str]]) -> tuple[set[str], dict[str, set[str]]]:
    """The module-level names of ``tree`` (functions, fixtures, classes, constants) that start a process when used,
    and the local modules it imports whole (by the name it uses -> what they start); ``local`` gives what each of
    the test directory's modules it may import (``_helpers``, ``conftest``, another test module) starts. A fixed
    point: a helper that calls a helper that starts a process starts one too."""
    starting: set[str] = set()
    modules: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module in local:
            starting |= {a.asname or a.name for a in node.names if a.name in local[node.module]}
        elif isinstance(node, ast.Import):
            modules.update({a.asname or a.name: local[a.name] for a in node.names if a.name in local})
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Assign))]
    changed = True
    while changed:
        changed = False
        for node in defs:
            names = {node.name} if not isinstance(node, ast.Assign) else \
                {t.id for t in node.targets if isinstance(t, ast.Name)}
            if names - starting and _mentions_starter(node, starting, modules):
                starting |= names
                changed = True
    return starting, modules


def _marked_integration(node: ast.AST) -> bool:
    return any("mark.integration" in ast.unparse(d) for d in getattr(node, "decorator_list", []))


def unmarked_starters(sources: dict[str, str]) -> list[str]:
    """``module.py::test`` for every test in ``sources`` (module name -> source, the test directory's modules) that
    starts a process, a namespace or a job without the ``integration`` mark (on itself, its class, or its
    module's ``pytestmark``)."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    local: dict[str, set[str]] = {}
    found = []
    # The helpers first (conftest, _helpers, _workers, ...), then the test modules, which may import each other.
    for name in sorted(trees, key=lambda n: (n.startswith("test_"), n)):
        tree = trees[name]
        starting, modules = starting_names(tree, local)
        local[name] = starting
        if not name.startswith("test_"):
            continue
        reach = starting | local.get("conftest", set())  # conftest's fixtures need no import
        if any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
               and "mark.integration" in ast.unparse(n.value) for n in tree.body):
            continue
        tests = [(n, None) for n in tree.body if isinstance(n, ast.FunctionDef)]
        tests += [(m, c) for c in tree.body if isinstance(c, ast.ClassDef) and c.name.startswith("Test")
                  for m in c.body if isinstance(m, ast.FunctionDef)]
        for fn, cls in tests:
            if fn.name.startswith("test_") and not _marked_integration(fn) and not _marked_integration(cls) \
                    and _mentions_starter(fn, reach, modules):
                found.append(f"{name}.py::{fn.name}")
    return found


def test_every_test_that_starts_a_process_is_marked_integration():
    sources = {p.stem: p.read_text() for p in (ROOT / "tests").glob("*.py")}
    found = unmarked_starters(sources)
    assert found == [], ("these tests start a process, a namespace or a job: mark them @pytest.mark.integration "
                         "(docs/architecture.md, Tests) so that `-m \"not integration\"` leaves them out: "
                         + ", ".join(found))


def test_the_integration_check_sees_through_fixtures_and_helpers():
    helpers = "import subprocess\ndef run(cmd):\n    return subprocess.run(cmd)\ndef pure():\n    return 1\n"
    conftest = "import pytest\n@pytest.fixture\ndef shards():\n    yield None\n"
    module = '''
import os
import pytest
from _helpers import pure, run

@pytest.fixture
def job(shards):
    return shards(1)

def launch(*args):
    return run(["psrt", *args])

def test_pure():
    assert pure() == 1

def test_by_fixture(job):
    pass

def test_by_helper_of_a_helper():
    launch("--help")

def test_by_os():
    os.system("true")

@pytest.mark.integration
def test_marked(shards):
    pass
'''
    found = unmarked_starters({"_helpers": helpers, "conftest": conftest, "test_x": module})
    assert found == ["test_x.py::test_by_fixture", "test_x.py::test_by_helper_of_a_helper", "test_x.py::test_by_os"]
    marked = "import pytest\npytestmark = [pytest.mark.integration]\n" + module.split("\n", 3)[3]
    assert unmarked_starters({"_helpers": helpers, "conftest": conftest, "test_y": marked}) == []
