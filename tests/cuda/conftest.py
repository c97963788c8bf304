"""The order of the CUDA tests (the heaviest run last), and their one-rank GPU process group.

scripts/ci/gpu_check.sh gives its pytest one time budget for all the CUDA tests. A test marked
``@pytest.mark.run_last`` (a cold inductor compile takes most of a minute) runs after every other
test of the session, so that a budget that runs out loses only such tests. Among themselves they
keep their collection order.

The marker is registered here, beside the one hook that reads it; ``--strict-markers``
(pyproject.toml) holds it as for the others, since this file is loaded before the modules of
tests/cuda/ are imported. This hook runs after tests/conftest.py's (which gives tiers and skips)
and after ``-m`` / ``-k`` deselection: it only reorders what is left.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

RUN_LAST = "run_last"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{RUN_LAST}: runs after every other test (tests/cuda/conftest.py)"
    )


def runs_last(item: pytest.Item) -> bool:
    return item.get_closest_marker(RUN_LAST) is not None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Called with the whole session's items, wherever they come from: a stable partition.
    items[:] = [item for item in items if not runs_last(item)] + [
        item for item in items if runs_last(item)
    ]


@pytest.fixture
def one_rank() -> Iterator[Any]:
    """A one-rank group in this process on the GPU: NCCL for CUDA tensors, gloo for CPU ones
    (offloaded gradients' norm), on an in-memory store; its DistEnv. (The CPU tests' fixture of
    this name, tests/conftest.py, is a gloo group on the CPU.)"""
    import torch
    import torch.distributed as dist

    from sdnet_trainer.distributed.env import CUDA_WITH_CPU_BACKEND, DistEnv

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        CUDA_WITH_CPU_BACKEND, store=dist.HashStore(), rank=0, world_size=1, device_id=device
    )
    try:
        yield DistEnv(rank=0, world_size=1, device=device, backend=CUDA_WITH_CPU_BACKEND)
    finally:
        dist.destroy_process_group()
