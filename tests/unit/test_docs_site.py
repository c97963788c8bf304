"""The docs site (mkdocs.yml over docs/): every page is in the navigation and every navigation entry
is a page; the site builds with ``--strict``; and ``--strict`` does fail on a broken link and on a
page left out of the navigation, so a clean build means something."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import REPO

MKDOCS_YML = REPO / "mkdocs.yml"
HOOKS = REPO / "scripts" / "docs" / "mkdocs_hooks.py"
# What a build reads: the config, the pages, the hook and the two root files the hook shows.
SITE_SOURCES = [
    "mkdocs.yml",
    "docs",
    "scripts/docs/mkdocs_hooks.py",
    "README.md",
    "CONTRIBUTING.md",
]
BUILD_TIMEOUT_S = 300

needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed (pip install -e '.[docs]')",
)


def _nav_pages(entries) -> list[str]:
    pages: list[str] = []
    for entry in entries:
        if isinstance(entry, str):
            pages.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def _config(root: Path = REPO) -> dict:
    return yaml.safe_load((root / "mkdocs.yml").read_text())


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    config = _config()
    assert config["docs_dir"] == "docs"
    nav = _nav_pages(config["nav"])
    assert len(nav) == len(set(nav)), (
        f"pages listed twice: {sorted(p for p in nav if nav.count(p) > 1)}"
    )
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert not pages - set(nav), (
        f"docs pages missing from mkdocs.yml's nav: {sorted(pages - set(nav))}"
    )
    assert not set(nav) - pages, f"nav entries with no docs page: {sorted(set(nav) - pages)}"


def test_the_nav_follows_a_users_path():
    nav = _nav_pages(_config()["nav"])
    path = [
        "index.md",
        "getting-started.md",
        "recipes.md",
        "overrides.md",
        "configuration.md",
        "parallel.md",
        "data.md",
        "language-models.md",
        "checkpoints.md",
        "fault_tolerance.md",
        "monitoring.md",
        "serving.md",
        "export.md",
        "multinode.md",
        "subclassing.md",
        "sweeps.md",
        "benchmarks.md",
        "gpu.md",
        "troubleshooting.md",
        "architecture.md",
        "testing.md",
        "contributing.md",
    ]
    assert nav == path


@pytest.fixture(scope="module")
def hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", HOOKS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_root_files_links_are_rewritten_for_the_site(hooks):
    text = (
        "[a](docs/parallel.md#speed) [b](CONTRIBUTING.md) [c](README.md) "
        "[d](https://pytorch.org/x) [e](docs/gpu.md) `docs/x.md`"
    )
    assert hooks.site_text(text) == (
        "[a](parallel.md#speed) [b](contributing.md) [c](index.md) "
        "[d](https://pytorch.org/x) [e](gpu.md) `docs/x.md`"
    )
    # Each mirrored page exists in docs/ and its source at the repository root.
    for page, source in hooks.MIRRORED.items():
        assert (REPO / "docs" / page).exists() and (REPO / source).exists(), (page, source)


def _copy_site(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for name in SITE_SOURCES:
        source, target = REPO / name, root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
    return root


def _build(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(root / "_site")],
        cwd=root,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )


def _add_page(root: Path, name: str, text: str, *, in_nav: bool) -> None:
    (root / "docs" / name).write_text(text)
    if in_nav:
        config = _config(root)
        config["nav"].append({"Added": name})
        (root / "mkdocs.yml").write_text(yaml.safe_dump(config, sort_keys=False))


@needs_mkdocs
def test_the_site_builds_strictly(tmp_path):
    root = _copy_site(tmp_path)
    result = _build(root)
    assert result.returncode == 0, result.stdout + result.stderr
    home = (root / "_site" / "index.html").read_text()
    assert "Where to go next" in home  # the README is the home page
    assert 'href="parallel/#speed-communication-compilation-profiling"' in home  # links rewritten
    assert "Adding a config key" in (root / "_site" / "contributing" / "index.html").read_text()


@needs_mkdocs
def test_strict_build_fails_on_a_link_to_a_missing_page(tmp_path):
    root = _copy_site(tmp_path)
    _add_page(root, "broken.md", "# Broken\n\nSee [the page](no_such_page.md).\n", in_nav=True)
    result = _build(root)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "broken.md" in output and "no_such_page.md" in output, output


@needs_mkdocs
def test_strict_build_fails_on_a_page_left_out_of_the_nav(tmp_path):
    root = _copy_site(tmp_path)
    _add_page(root, "orphan.md", "# Orphan\n\nNo page links here.\n", in_nav=False)
    result = _build(root)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "orphan.md" in output, output
