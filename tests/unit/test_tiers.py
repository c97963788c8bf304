"""The two test tiers: every test is in exactly one (tests/conftest.py gives each its tier), the
quick tier holds the unit tests but the slow ones, and `-m quick` / `-m full` split the suite
between them."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.conftest import FULL, QUICK, TIERS_FILE
from tests.support import REPO

# A collection of the whole suite (seconds), shared by the tests: checked in the full suite.
pytestmark = pytest.mark.full


@dataclass(frozen=True)
class Collection:
    tiers: dict[str, str]  # every collected test: its tiers, comma-separated
    selected: set[str]  # what `-m quick` kept of them


@pytest.fixture(scope="module")
def collection(tmp_path_factory) -> Collection:
    """One collection of the whole suite with ``-m quick``, for both tests: tests/conftest.py
    writes every test's tiers to TIERS_FILE before the marker deselects any (its hook runs
    first), and pytest lists what the marker kept."""
    listing = tmp_path_factory.mktemp("tiers") / "tiers.tsv"
    env = {**os.environ, TIERS_FILE: str(listing), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["-m", QUICK, "tests"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split("\t") for line in listing.read_text().splitlines()]
    selected = {line for line in result.stdout.splitlines() if "::" in line}
    return Collection({nodeid: tiers for nodeid, tiers in rows}, selected)


def test_every_test_is_in_exactly_one_tier(collection):
    tiers = collection.tiers
    assert len(tiers) > 1000  # the whole suite was collected
    assert {t for t in tiers.values()} == {QUICK, FULL}, sorted(set(tiers.values()))
    quick = {n for n, t in tiers.items() if t == QUICK}
    full = {n for n, t in tiers.items() if t == FULL}
    # The multi-process, end-to-end, security and CUDA tests are outside the quick tier ...
    assert all(n.startswith("tests/unit/") for n in quick), sorted(quick)[:5]
    # ... with the slowest unit tests, which carry the `full` marker.
    assert "tests/unit/test_plan.py::test_1024_ranks_of_gpt_1b_plan_in_one_process" in full
    assert any(n.startswith("tests/unit/test_gpu_check.py::") for n in full)
    assert len(quick) > 500 and len(full) > 300


def test_the_markers_select_the_tiers(collection):
    """``-m quick`` collects exactly the quick tier (``bash scripts/ci/test.sh --quick``)."""
    quick = {n for n, t in collection.tiers.items() if t == QUICK}
    assert collection.selected == quick
    assert len(collection.selected) < len(collection.tiers)  # the full tier was deselected
