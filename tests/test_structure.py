"""The shape of the package: one import name, one-way dependencies, small modules.

docs/ARCHITECTURE.md describes the layering; these tests keep the tree honest
about it. Imports are read from the source (ast), lazy ones inside functions
included, so a cycle hidden in a function body still fails.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

TOPS = ("engine", "server")
MAX_LINES = 600
MAX_MODULES = 14


def _modules() -> dict[str, Path]:
    found = {}
    for top in TOPS:
        for path in sorted((REPO / top).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(("flashserve", *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `name` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        out |= {c for c in candidates if c in modules and c != name}
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as a path, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = _graph()
    assert len(graph) > 50  # the walk saw the tree
    assert _cycle(graph) is None


def test_engine_never_imports_server():
    graph = _graph()
    back = {
        (name, dep)
        for name, deps in graph.items()
        if name.startswith("flashserve.engine")
        for dep in deps
        if dep.startswith("flashserve.server")
    }
    assert not back


# Inside the engine, a package may import only the packages listed before it
# (engine/__init__.py; docs/ARCHITECTURE.md).
ENGINE_ORDER = [
    "config",
    "compute",
    "kv",
    "weights",
    "experts",
    "streaming",
    "vision",
    "loader",
    "distributed",
    "prompt_cache",
    "speculative",
    "generation",
    "models",
]


def test_engine_packages_import_downwards_only():
    graph = _graph()
    rank = {name: i for i, name in enumerate([*ENGINE_ORDER, "bench"])}
    wrong = []
    for name, deps in graph.items():
        parts = name.split(".")
        if parts[1] != "engine" or len(parts) < 3:
            continue
        for dep in deps:
            dep_parts = dep.split(".")
            if dep_parts[1] != "engine" or len(dep_parts) < 3 or dep_parts[2] == parts[2]:
                continue
            if rank[dep_parts[2]] > rank[parts[2]]:
                wrong.append(f"{name} -> {dep}")
    assert not wrong


def test_chat_pipeline_knows_no_dialect():
    graph = _graph()
    leaks = {
        f"{name} -> {dep}"
        for name, deps in graph.items()
        if name.startswith(("flashserve.server.chat", "flashserve.server.http"))
        for dep in deps
        if dep.startswith(("flashserve.server.openai", "flashserve.server.routes"))
    }
    assert not leaks


def test_module_and_folder_sizes():
    too_long = {
        str(path.relative_to(REPO)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long
    crowded = {}
    for top in TOPS:
        for folder in [REPO / top, *(p for p in (REPO / top).rglob("*") if p.is_dir())]:
            count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
            if count > MAX_MODULES:
                crowded[str(folder.relative_to(REPO))] = count
    assert not crowded


def test_every_package_has_a_docstring_and_is_installed():
    with open(REPO / "pyproject.toml", "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    on_disk = set()
    for top in TOPS:
        for init in (REPO / top).rglob("__init__.py"):
            package = ".".join(("flashserve", *init.parent.relative_to(REPO).parts))
            on_disk.add(package)
            assert ast.get_docstring(ast.parse(init.read_text())), init
    assert listed == on_disk


def test_no_test_only_names_in_the_package():
    test_name = re.compile(r"\btest_\w+|\w+_test\b")
    offenders = {
        str(path.relative_to(REPO)): found
        for path in _modules().values()
        if (found := test_name.findall(path.read_text()))
    }
    assert not offenders


def test_one_import_name(tmp_path: Path):
    """The installed package answers as flashserve.*; the folder names do not import."""
    code = (
        "import importlib, shutil\n"
        "import flashserve.engine, flashserve.server, flashserve.server.cli.main\n"
        "for bare in ('engine', 'server'):\n"
        "    try:\n"
        "        importlib.import_module(bare)\n"
        "    except ImportError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit(f'{bare} imported')\n"
        "print(flashserve.engine.__file__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for cwd in (tmp_path, REPO):  # from the repo root too: the folders are right there
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert Path(result.stdout.strip()) == REPO / "engine" / "__init__.py"


def test_console_script_is_installed():
    script = shutil.which("flashserve", path=str(Path(sys.executable).parent))
    assert script is not None
    result = subprocess.run(
        [script, "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout


@pytest.mark.parametrize("bare", TOPS)
def test_bare_folder_import_is_refused_with_a_hint(bare: str):
    result = subprocess.run(
        [sys.executable, "-c", f"import {bare}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert f"import flashserve.{bare}" in result.stderr
