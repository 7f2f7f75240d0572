"""The import graph points one way, down the launch path, and has no cycle: the import-linter
contract in pyproject.toml (`lint-imports`), and, module by module with the imports inside
functions counted, a cycle check and a check that every module has its place on that path. Both
are shown to fail on a small package that breaks them."""

from __future__ import annotations

import logging
import textwrap

import pytest
from conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
grimp = pytest.importorskip("grimp")  # import-linter's graph, in the test extra
cli = pytest.importorskip("importlinter.cli")

pytestmark = pytest.mark.quick

MAX_LINES = 500


def layers() -> list[list[str]]:
    """The launch path's layers, top first, each a list of module names (`a | b`, `a : b`)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return [[name.strip() for name in layer.replace(":", "|").split("|")] for layer in contract["layers"]]


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every set of modules that import one another round a cycle (Tarjan's strongly connected
    components over direct imports, wherever in a module they are)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def unplaced(graph: grimp.ImportGraph, placed: list[str], root: str) -> list[str]:
    """Modules in no layer: neither a layer nor inside one, nor a package that only holds layers."""
    def inside(module: str) -> bool:
        return any(module == p or module.startswith(p + ".") for p in placed)

    def holds_layers(module: str) -> bool:
        return any(p.startswith(module + ".") for p in placed)

    return sorted(m for m in graph.modules if m.startswith(root) and not inside(m) and not holds_layers(m))


def lint_imports(config: str) -> int:
    """import-linter's command, in this process. It configures logging with dictConfig's default,
    which disables every logger that exists: titan_exp's, whose records later tests read
    (caplog). Those keep the state they had."""
    loggers = [logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)]
    disabled = [logger.disabled for logger in loggers]
    try:
        return cli.lint_imports(config_filename=config, no_cache=True)
    finally:
        for logger, was in zip(loggers, disabled):
            logger.disabled = was


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("titan_exp", cache_dir=None)


def test_imports_point_down_the_launch_path():
    assert lint_imports(str(REPO / "pyproject.toml")) == 0


def test_the_import_check_leaves_the_loggers_of_later_tests_enabled():
    launch = logging.getLogger("titan_exp.launch")
    assert not launch.disabled
    lint_imports(str(REPO / "pyproject.toml"))
    assert not launch.disabled


def test_every_module_has_its_place_on_the_launch_path(graph):
    assert unplaced(graph, [m for layer in layers() for m in layer], "titan_exp") == []


def test_no_import_cycle_module_by_module(graph):
    assert cycles(graph) == []


def test_no_module_past_500_lines_but_the_schema():
    """A module does one thing; the schema, one dataclass a config group, with a doc per field, is
    the one allowed to be longer."""
    long = {str(p.relative_to(REPO)): n for p in (REPO / "titan_exp").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES and p.name != "schema.py"}
    assert long == {}


def test_the_checks_fail_on_a_cycle_an_upward_import_and_an_unplaced_module(tmp_path, monkeypatch):
    """A package whose bottom layer imports its top one inside a function: the cycle check, the
    layers contract and the placement check each say so."""
    package = tmp_path / "house"
    package.mkdir()
    files = {
        "__init__.py": "",
        "top.py": "from house import bottom\n",
        "bottom.py": "def late():\n    from house import top\n",
        "stray.py": "",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    (tmp_path / "contracts.toml").write_text(textwrap.dedent("""
        [tool.importlinter]
        root_package = "house"
        [[tool.importlinter.contracts]]
        name = "top over bottom"
        type = "layers"
        layers = ["house.top", "house.bottom"]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    house = grimp.build_graph("house", cache_dir=None)
    assert cycles(house) == [["house.bottom", "house.top"]]
    assert unplaced(house, ["house.top", "house.bottom"], "house") == ["house.stray"]
    assert lint_imports(str(tmp_path / "contracts.toml")) == 1
