"""Two gloo ranks: ZeRO-1's bucket views, GradientComm.release, and shortening the group timeout.

One launch of tests/distributed/_readiness_worker.py runs every scenario; each test checks one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import _readiness_worker as worker
from tests.support import run_cli

WORKER = Path(worker.__file__)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict]:
    out_dir = tmp_path_factory.mktemp("readiness")
    launch = run_cli([str(out_dir)], cwd=out_dir, nproc=2, script=WORKER, timeout=240)
    assert launch.returncode == 0, launch.output
    return {r: torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in (0, 1)}


def test_release_lets_the_ddp_model_go(results):
    for rank in (0, 1):
        release = results[rank]["release"]
        assert release == {"kept_before_release": True, "kept_after_release": False}


@pytest.mark.parametrize("group", ["pair", "world"])
def test_a_collective_missing_a_rank_fails_after_the_shortened_timeout(results, group):
    outcome, seconds = results[1]["timeouts"][group]
    # The group started with dist.timeout_s=1800: only the shortened 2 s ends it this soon.
    assert outcome != "completed", outcome
    assert worker.SHORT_TIMEOUT_S * 0.9 <= seconds < 30, (outcome, seconds)
