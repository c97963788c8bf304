"""The package's layout as docs/architecture.md describes it: the folders the page names are the
package's folders, the import rules between them hold, and every import path that README.md and
docs/ show works."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from tests.support import REPO

PACKAGE = REPO / "sdnet_trainer"
ARCHITECTURE = REPO / "docs" / "architecture.md"
# The folders below training/: none of them imports it (they build on runtime/ and config/).
LOWER = ("data", "distributed", "models", "observability", "checkpoint", "runtime")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.split(".")[0] == "sdnet_trainer"}


def _modules(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def test_the_folders_table_names_every_folder_of_the_package():
    text = ARCHITECTURE.read_text()
    table = text.split("## Folders", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([a-z_]+)/` \|", table, flags=re.MULTILINE))
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert named == folders


def test_config_imports_nothing_else_of_ours():
    for path in _modules("config"):
        for name in _imports(path):
            assert name.startswith(("sdnet_trainer.config", "sdnet_trainer.errors")), (path, name)


@pytest.mark.parametrize("folder", LOWER)
def test_lower_folders_import_nothing_of_training(folder):
    """No exception and no allow-list: what several folders share lives in runtime/."""
    for path in _modules(folder):
        for name in _imports(path):
            assert not name.startswith("sdnet_trainer.training"), (path, name)


def _folder_imports() -> dict[str, set[str]]:
    """Each folder of the package -> the other folders its modules import (any import: at the
    top, inside a function, under TYPE_CHECKING)."""
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    graph: dict[str, set[str]] = {folder: set() for folder in folders}
    for folder in folders:
        for path in _modules(folder):
            for name in _imports(path):
                other = name.split(".")[1] if "." in name else ""
                if other in folders and other != folder:
                    graph[folder].add(other)
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (each node -> the nodes it imports), as the path around it; None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for other in sorted(graph[node]):
            cycle = visit(other, [*path, node])
            if cycle is not None:
                return cycle
        done.add(node)
        return None

    return next((c for c in (visit(node, []) for node in sorted(graph)) if c is not None), None)


def test_no_two_folders_import_each_other_in_a_circle():
    """The folders' imports form no cycle: each room is built on the ones below it (the ft room
    takes what it needs as arguments; its place in the loop is training/fault_tolerance.py)."""
    cycle = _circle(_folder_imports())
    assert cycle is None, f"an import circle: {' -> '.join(cycle)}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports (any import: at the top,
    inside a function, under TYPE_CHECKING): ``from package import module`` imports that module,
    ``from module import name`` the module that defines the name."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        found: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    whole = f"{node.module}.{alias.name}"
                    found.add(whole if whole in modules else owner(node.module))
            elif isinstance(node, ast.Import):
                found.update(owner(alias.name) for alias in node.names)
        graph[module] = {other for other in found if other is not None and other != module}
    return graph


def _folder(module: str) -> str:
    """A module's top-level folder of the package (``models`` for models/moe/model.py and for
    models/__init__.py; ``.`` for the package's own files)."""
    path = REPO.joinpath(*module.split("."))
    relative = (path if path.is_dir() else path.parent).relative_to(PACKAGE)
    return relative.parts[0] if relative.parts else "."


def test_no_two_files_of_a_folder_import_each_other_in_a_circle():
    """Inside each folder too, the files' imports form no cycle: a registry that imports the
    families which import it back works by import order alone (issue 55)."""
    graph = _module_imports()
    folder = {module: _folder(module) for module in graph}
    within = {m: {o for o in imported if folder[o] == folder[m]} for m, imported in graph.items()}
    cycle = _circle(within)
    assert cycle is None, f"an import circle in {folder[cycle[0]]}/: {' -> '.join(cycle)}"


def test_the_circle_check_finds_a_circle(monkeypatch):
    """The check above fails on a circle (a test that cannot fail is none)."""
    graph = _module_imports()
    graph["sdnet_trainer.models.registry"].add("sdnet_trainer.models.build")
    monkeypatch.setattr(sys.modules[__name__], "_module_imports", lambda: graph)
    with pytest.raises(AssertionError, match="an import circle in models/"):
        test_no_two_files_of_a_folder_import_each_other_in_a_circle()


def test_runtime_imports_only_config_and_errors():
    for path in _modules("runtime"):
        for name in _imports(path):
            assert name.split(".")[1] in {"runtime", "config", "errors"}, (path, name)


def _doc_texts() -> list[tuple[str, str]]:
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    if (REPO / "CONTRIBUTING.md").exists():
        paths.append(REPO / "CONTRIBUTING.md")
    return [(str(p.relative_to(REPO)), p.read_text()) for p in paths]


def _shown_paths() -> set[tuple[str, str]]:
    """(module, attribute or "") pairs of every import the docs show, every ``python -m`` module
    and every dotted ``sdnet_trainer.…`` name in backticks."""
    shown: set[tuple[str, str]] = set()
    for _, text in _doc_texts():
        for module, names in re.findall(r"from (sdnet_trainer[\w.]*) import ([\w, ]+)", text):
            shown.update((module, name.strip()) for name in names.split(",") if name.strip())
        for module in re.findall(r"^\s*import (sdnet_trainer[\w.]*)", text, flags=re.MULTILINE):
            shown.add((module, ""))
        for module in re.findall(r"python -m (sdnet_trainer[\w.]*)", text):
            shown.add((module, "__main__"))
        for dotted in re.findall(r"`(sdnet_trainer(?:\.\w+)+)[`(]", text):
            shown.add((dotted, "?"))
    return shown


def _resolve(module: str, attribute: str) -> None:
    if attribute == "__main__":  # `python -m X`: X is a module, or a package with __main__
        spec = importlib.util.find_spec(module)
        assert spec is not None, module
        if spec.submodule_search_locations is not None:
            assert importlib.util.find_spec(f"{module}.__main__") is not None, module
        return
    if attribute == "?":  # a dotted name: the longest importable prefix, then attributes
        parts = module.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for part in parts[cut:]:
                obj = getattr(obj, part)
            return
        raise AssertionError(module)
    obj = importlib.import_module(module)
    if attribute:
        assert hasattr(obj, attribute), f"{module}.{attribute}"


def test_every_import_path_the_docs_show_works():
    shown = _shown_paths()
    # The paths users have imported from since before the package was grouped, whatever the
    # docs show today.
    shown |= {
        ("sdnet_trainer", "Trainer"),
        ("sdnet_trainer", "HookBase"),
        ("sdnet_trainer", "launch"),
        ("sdnet_trainer", "compose"),
        ("sdnet_trainer.hooks", "HookBase"),
        ("sdnet_trainer.trainer", "Trainer"),
        ("sdnet_trainer.export", "__main__"),
        ("sdnet_trainer.serve", "__main__"),
    }
    assert len(shown) > 20  # the docs' examples were found
    for module, attribute in sorted(shown):
        _resolve(module, attribute)


def test_the_checker_fails_on_a_path_that_does_not_exist():
    with pytest.raises((AssertionError, ModuleNotFoundError, AttributeError)):
        _resolve("sdnet_trainer.no_such_module", "X")
    with pytest.raises(AssertionError):
        _resolve("sdnet_trainer.hooks", "NoSuchHook")
    with pytest.raises(AttributeError):
        _resolve("sdnet_trainer.training.hooks.NoSuchHook", "?")


def test_every_file_path_the_docs_name_exists():
    for doc, text in _doc_texts():
        for path in re.findall(r"`(sdnet_trainer/[\w/]+\.py)`", text):
            assert (REPO / path).exists(), f"{doc} names {path}"


# One concern per file: a module past this many lines holds several (the Trainer's phases read top
# to bottom in one file, so it may be longer).
MAX_LINES = 520
LONGER = {"training/trainer.py": 650}


def test_no_module_holds_several_concerns_by_size():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        lines = len(path.read_text().splitlines())
        assert lines <= LONGER.get(name, MAX_LINES), f"{name}: {lines} lines"


def test_the_wheel_lists_every_package_folder():
    """pyproject.toml names the wheel's packages one by one (configs/ and recipes/ are mapped in):
    a folder left out installs without its modules, and only a non-editable install shows it."""
    import tomllib

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {
        ".".join(path.parent.relative_to(REPO).parts)
        for path in PACKAGE.rglob("__init__.py")
        if "__pycache__" not in path.parts
    }
    assert folders - listed == set(), "add them to [tool.setuptools] packages"
