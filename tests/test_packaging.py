"""Packaging: ``pip install .`` must carry everything the package reads at run time, and the
layout must keep its promises (imports point down the layers, no cycles, modules small)."""

from __future__ import annotations

import ast
import fnmatch
import importlib
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "localspec"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
MAX_MODULE_LINES = 400
# The architecture, bottom first: a module may import its own subsystem and those on lower
# floors, never one beside it or above (docs/design.md, "Layers").
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"errors"}),  # the torch-free base: errors, names and limits, user files
    frozenset({"registry"}),
    frozenset({"drafter_set", "output_format"}),  # a method resolved into its drafters' names;
    # what an answer must look like (a grammar's torch-free description)
    frozenset({"config"}),
    frozenset({"files"}),
    frozenset({"presets", "chats"}),  # preset files; the saved conversations (SQLite)
    frozenset({"runtime", "sampling"}),  # forwards, kernels; pure sampling functions
    frozenset({"engine"}),  # the draft/verify loop, its policy and the drafter contract
    frozenset({"models", "drafters"}),  # loading and caches; each drafter
    frozenset({"pipeline"}),  # a preset's models and engines
    frozenset({"slots"}),  # parallel requests over a pipeline, sharing its target passes
    frozenset({"training", "host"}),  # heads trained over a pipeline; the one served
    frozenset({"api"}),  # the OpenAI-compatible routes over the host
    frozenset({"ui", "cli"}),  # the edges a user touches (the app and `serve` mount the API)
    frozenset({"__main__"}),
)


def test_every_package_is_listed() -> None:
    """pyproject.toml lists the packages by name (the presets folder is mapped into one): a
    subpackage missing from the list would be missing from the wheel."""
    found = {".".join(p.parent.relative_to(REPO).parts) for p in PACKAGE.rglob("__init__.py")}
    assert set(SETUPTOOLS["packages"]) == found | set(SETUPTOOLS["package-dir"])


def test_presets_are_mapped_into_the_wheel() -> None:
    """The top-level presets/ folder ships inside the wheel as localspec/data/presets/, where
    ``presets_dir`` finds it in an installed copy."""
    assert SETUPTOOLS["package-dir"] == {"localspec.data.presets": "presets"}
    globs = SETUPTOOLS["package-data"]["localspec.data.presets"]
    shipped = sorted(p.name for p in (REPO / "presets").iterdir())
    assert shipped and all(any(fnmatch.fnmatch(name, g) for g in globs) for name in shipped)


def test_package_data_covers_every_data_file() -> None:
    """Every file of the package that is not Python (under data/, the kernels' C source)
    matches a package-data glob, or an installed copy would miss it (presets, prompts, model
    configs are read through importlib.resources; the Q4_K kernel is compiled from its source)."""
    globs = SETUPTOOLS["package-data"]["localspec"]
    files = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*")
             if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert files
    missing = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert missing == []


@pytest.mark.parametrize("name", sorted(PYPROJECT["project"]["scripts"]))
def test_console_scripts_resolve(name: str) -> None:
    """Each console command points at a function that exists."""
    module, _, attr = PYPROJECT["project"]["scripts"][name].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))


def _imports(path: Path) -> set[str]:
    """localspec modules imported by a file (absolute imports only; the package uses no others)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("localspec"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("localspec"))
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles() -> None:
    """The subsystems form a DAG (lazy imports inside functions count too)."""
    graph = {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == 2:
            return
        assert state.get(node) != 1, "import cycle: " + " -> ".join([*trail, node])
        state[node] = 1
        for dep in graph.get(node, ()):
            if dep in graph and dep != node:
                visit(dep, [*trail, node])
        state[node] = 2

    for module in graph:
        visit(module, [])


def _subsystem(module: str) -> str:
    """``localspec.engine.verify`` -> ``engine``; ``localspec.config`` -> ``config``."""
    return module.split(".")[1] if "." in module else module


def _floor(module: str) -> int:
    subsystem = _subsystem(module)
    floors = [i for i, layer in enumerate(LAYERS) if subsystem in layer]
    assert floors, f"{module}: subsystem '{subsystem}' is on no floor of LAYERS"
    return floors[0]


def test_every_subsystem_has_a_floor() -> None:
    for path in PACKAGE.rglob("*.py"):
        if path.parent != PACKAGE or path.stem != "__init__":
            _floor(_module_name(path))


def test_imports_point_down() -> None:
    """No import (lazy ones inside functions included) reaches a subsystem on the same floor or
    a higher one: only its own subsystem and lower floors."""
    upward = []
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        if module == "localspec":
            continue
        for dep in _imports(path):
            if dep == "localspec" or _subsystem(dep) == _subsystem(module):
                continue
            if _floor(dep) >= _floor(module):
                upward.append(f"{module} -> {dep}")
    assert upward == []


def test_layer_check_would_catch_an_upward_import() -> None:
    """The check above is not vacuous: a drafter importing the contract from the engine is on
    the floor above it, an engine module importing a drafter is caught."""
    assert _floor("localspec.engine.drafter") < _floor("localspec.drafters.base")
    assert _floor("localspec.drafter_set") < _floor("localspec.config")
    assert _floor("localspec.sampling") < _floor("localspec.drafters.ngram")
    assert _floor("localspec.pipeline") < _floor("localspec.training.answers")
    assert _floor("localspec.training.corpus") < _floor("localspec.cli.tune")


def _too_long(sources: list[Path]) -> dict[str, int]:
    """The files among ``sources`` over MAX_MODULE_LINES lines, with their line counts."""
    sizes = {p.relative_to(REPO).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
             for p in sources}
    return {k: v for k, v in sizes.items() if v > MAX_MODULE_LINES}


def test_modules_stay_small() -> None:
    """A newcomer reads a module in one sitting: Python and C alike."""
    sources = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.c"), *PACKAGE.rglob("*.h")]
    assert _too_long(sources) == {}


def test_test_modules_stay_small() -> None:
    """The tests are read as often as the code they check: each test module, conftest and
    helper module keeps to the same limit, split by subject when it grows past it."""
    sources = list((REPO / "tests").rglob("*.py"))
    assert sources
    assert _too_long(sources) == {}
