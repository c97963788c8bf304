"""The two test tiers: every test is in exactly one (tests/conftest.py gives each its tier), the
quick tier holds the unit tests but the slow ones, and `-m quick` / `-m full` split the suite
between them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import FULL, QUICK, TIERS_FILE
from tests.support import REPO

# Two collections of the whole suite (seconds each), shared by the tests: checked in the full suite.
pytestmark = pytest.mark.full


def _collect(tmp_path, *args: str) -> dict[str, str]:
    """{test id: its tiers, comma-separated} as pytest's collection gives them."""
    listing = tmp_path / f"tiers{len(args)}.tsv"
    env = {**os.environ, TIERS_FILE: str(listing), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split("\t") for line in listing.read_text().splitlines()]
    return {nodeid: tiers for nodeid, tiers in rows}


@pytest.fixture(scope="module")
def everything(tmp_path_factory) -> dict[str, str]:
    """The whole suite's tiers, collected once for both tests."""
    return _collect(tmp_path_factory.mktemp("tiers"), "tests")


def test_every_test_is_in_exactly_one_tier(everything):
    tiers = everything
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


def test_the_markers_select_the_tiers(everything):
    """``-m quick`` collects exactly the quick tier (``bash scripts/ci/test.sh --quick``)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", QUICK, "tests"],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    selected = {line for line in result.stdout.splitlines() if "::" in line}
    assert selected == {n for n, t in everything.items() if t == QUICK}
