"""The order of the CUDA tests (the heaviest run last), which of the GPU check's two commands runs
each, and their one-rank GPU process group.

scripts/ci/gpu_check.sh gives its pytest one time budget for all the CUDA tests. A test marked
``@pytest.mark.run_last`` (a cold inductor compile takes most of a minute) runs after every other
test of the session, so that a budget that runs out loses only such tests. Among themselves they
keep their collection order.

The check runs the CUDA tests in two commands: its first selects ``-m "cuda and not gpu_second"``,
its second (``GPU_CHECK_SECOND=1``) ``-m "cuda and gpu_second"``. ``@pytest.mark.gpu_second``
puts a test (or a whole module, through ``pytestmark``) in the second.

The markers are registered here, beside the hook that reads ``run_last``; ``--strict-markers``
(pyproject.toml) holds them as the others, since this file is loaded before the modules of
tests/cuda/ are imported. The reordering hook runs after tests/conftest.py's (which gives tiers
and skips) and after ``-m`` / ``-k`` deselection: it only reorders what is left.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

RUN_LAST = "run_last"
GPU_SECOND = "gpu_second"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{RUN_LAST}: runs after every other test (tests/cuda/conftest.py)"
    )
    config.addinivalue_line(
        "markers",
        f"{GPU_SECOND}: runs in the GPU check's second command (GPU_CHECK_SECOND=1), not its "
        f"first (tests/cuda/conftest.py)",
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
