"""Packaging: ``pip install .`` must carry everything the package reads at run time, and the
layout must keep its promises (no import cycles, the config module torch-free, modules small)."""

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
MAX_MODULE_LINES = 400


def test_package_data_covers_every_data_file() -> None:
    """Every file of the package that is not Python (under data/, the kernels' C source)
    matches a package-data glob, or an installed copy would miss it (presets, prompts, model
    configs are read through importlib.resources; the Q4_K kernel is compiled from its source)."""
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]["localspec"]
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


def test_modules_stay_small() -> None:
    """A newcomer reads a module in one sitting."""
    sizes = {p.relative_to(REPO).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
             for p in PACKAGE.rglob("*.py")}
    assert {k: v for k, v in sizes.items() if v > MAX_MODULE_LINES} == {}
