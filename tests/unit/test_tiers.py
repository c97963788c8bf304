"""The two test tiers: every test is in exactly one (tests/conftest.py gives each its tier), the
quick tier holds the unit tests but the slow ones, and `-m quick` / `-m full` split the suite
between them."""

from __future__ import annotations

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


class _Selected:
    """A plugin that keeps the node ids a session selected (what ``--collect-only`` lists)."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.ids = {item.nodeid for item in session.items}


@pytest.fixture(scope="module")
def collection(tmp_path_factory) -> Collection:
    """One collection of the whole suite with ``-m quick``, for both tests: tests/conftest.py
    writes every test's tiers to TIERS_FILE before the marker deselects any (its hook runs
    first), and the session keeps what the marker selected. In this process (``pytest.main``,
    as pytest's own pytester runs one inline): the modules this session already imported are
    not imported again, where a new interpreter would import torch and every test module (about
    17 CPU-seconds on the 2-core machine)."""
    listing = tmp_path_factory.mktemp("tiers") / "tiers.tsv"
    selected = _Selected()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(TIERS_FILE, str(listing))
        code = pytest.main(
            ["--collect-only", "-q", "-p", "no:cacheprovider", "-m", QUICK, str(REPO / "tests")],
            plugins=[selected],
        )
    assert code == pytest.ExitCode.OK, code
    rows = [line.split("\t") for line in listing.read_text().splitlines()]
    return Collection({nodeid: tiers for nodeid, tiers in rows}, selected.ids)


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
