"""The two lanes of the suite: CPU tests, and CUDA tests (``@pytest.mark.cuda``, in tests/cuda/).

- A ``cuda`` test is skipped, with the reason ``no CUDA device`` (shown by ``-rs``), where
  ``torch.cuda.is_available()`` is False. ``pytest -m cuda`` selects only them
  (scripts/ci/gpu_check.sh); a plain run collects both lanes.
- Every other test runs as on a machine without GPUs, also on one that has them: the CPU tests
  were written for gloo and the CPU (``dist.device=auto`` would pick CUDA and NCCL there, and two
  ranks would ask for GPU 1 of a one-GPU machine). For the whole of such a test, its fixtures
  included, the processes it starts see no GPU (``CUDA_VISIBLE_DEVICES=""``) and this process
  reports none (``torch.cuda.is_available()`` is False).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import torch

CUDA_MARK = "cuda"
NO_CUDA_REASON = "no CUDA device"

# Asked once, at import, before any CPU test hides the GPUs: the CUDA runtime reads
# CUDA_VISIBLE_DEVICES when it first counts devices, so this process keeps seeing the real ones
# for the CUDA tests whatever the environment says later.
CUDA_AVAILABLE = torch.cuda.is_available()


# The two tiers (``bash scripts/ci/test.sh --quick`` runs the first, CI and the plain command both):
# every test is in exactly one. By default the unit tests are quick and the multi-process,
# end-to-end, security and CUDA tests full; a ``full`` marker moves a slow unit test out of the
# quick tier, a ``quick`` marker moves a fast multi-process test into it (tests/unit/test_tiers.py).
QUICK, FULL = "quick", "full"
QUICK_FOLDERS = ("unit",)
TESTS = Path(__file__).resolve().parent
TIERS_FILE = "SDNET_TEST_TIERS_FILE"  # where test_tiers.py asks for each test's tiers


def tier_of(item: pytest.Item) -> str:
    explicit = {m.name for m in item.iter_markers() if m.name in (QUICK, FULL)}
    if len(explicit) > 1:
        raise pytest.UsageError(f"{item.nodeid} is marked both quick and full")
    if explicit:
        return explicit.pop()
    try:
        parts = item.path.relative_to(TESTS).parts  # <folder>/test_x.py
    except ValueError:  # a test outside this tree (a test's own temporary suite)
        return FULL
    return QUICK if len(parts) > 1 and parts[0] in QUICK_FOLDERS else FULL


@pytest.hookimpl(tryfirst=True)  # before `-m quick` / `-m full` selects by the marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(tier)
    if path := os.environ.get(TIERS_FILE):
        with open(path, "w") as f:
            for item in items:
                tiers = sorted({m.name for m in item.iter_markers() if m.name in (QUICK, FULL)})
                f.write(f"{item.nodeid}\t{','.join(tiers)}\n")
    if CUDA_AVAILABLE:
        return
    skip = pytest.mark.skip(reason=NO_CUDA_REASON)
    for item in items:
        if item.get_closest_marker(CUDA_MARK) is not None:
            item.add_marker(skip)


def _no_cuda() -> bool:
    return False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    """Hide the GPUs around the whole protocol of a CPU test (setup, call and teardown), so that
    module-scoped fixtures, which start training runs too, are covered as well."""
    if item.get_closest_marker(CUDA_MARK) is not None:
        return (yield)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        patch.setattr(torch.cuda, "is_available", _no_cuda)
        return (yield)


@pytest.fixture
def one_rank() -> Generator[Any, None, None]:
    """A gloo process group of one rank, in this process (no port: an in-memory store), and its
    DistEnv."""
    import torch.distributed as dist

    from sdnet_trainer.distributed import DistEnv

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistEnv(rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    finally:
        dist.destroy_process_group()


@pytest.fixture
def main_in_this_process() -> Generator[None, None, None]:
    """For tests that run the command line's main in this process, which it sets up as a fresh
    process of its own. It configures logging (Hydra's, then ours) on this process's stderr, which
    pytest closes after the test, so later tests would log into a closed stream: the root and
    project loggers are put back as they were. It freezes what the process holds for the garbage
    collector (sdnet_trainer.lazy.freeze_imports), which it does only where nothing is frozen yet
    (pytest_collection_finish below froze this worker's imports): what main froze is unfrozen, so
    that this process's garbage can still be collected, and the worker's own freeze is kept."""
    loggers = [logging.getLogger(), logging.getLogger("sdnet_trainer")]
    saved = [(log, list(log.handlers), log.level, log.propagate) for log in loggers]
    frozen_before = gc.get_freeze_count() > 0
    yield
    for log, handlers, level, propagate in saved:
        for handler in log.handlers[:]:
            if handler not in handlers:
                log.removeHandler(handler)
                handler.close()
        for handler in handlers:
            if handler not in log.handlers:
                log.addHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
    if not frozen_before:
        gc.unfreeze()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, the project, every test module) lives as long as the
    worker: frozen, full garbage collections during the tests do not walk it again (as the CLI's
    processes do, sdnet_trainer/lazy.py)."""
    gc.freeze()


@pytest.fixture(autouse=True)
def no_worker_processes_left() -> Generator[None, None, None]:
    """A test stops the worker processes it started (DataLoader workers, multiprocessing pools):
    one left running is later finalised by the garbage collector inside another test, where it
    can wait out torch's 5-second join timeout per worker (sdnet_trainer.data.loader
    .stop_workers)."""
    yield
    left = multiprocessing.active_children()
    assert not left, f"the test left worker processes running: {[p.name for p in left]}"


@pytest.fixture(scope="session")
def s3_endpoint() -> Generator[str, None, None]:
    """One local S3 server per pytest worker (tests.support.s3_server), started by its first test
    that asks for a bucket."""
    pytest.importorskip("moto.server", reason="moto[server] (a test dependency) is not installed")
    pytest.importorskip("s3fs", reason="s3fs (the s3 extra) is not installed")
    from tests.support import s3_server

    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch):
    """A fresh bucket on the worker's S3 server (tests.support.S3Bucket). This process reaches it
    through its environment (credentials, AWS_ENDPOINT_URL), as do the processes the test starts,
    which inherit it."""
    import s3fs

    from tests.support import new_bucket

    bucket = new_bucket(s3_endpoint)
    for key, value in bucket.env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()  # none made before this environment
    return bucket


@pytest.fixture(scope="module")
def s3_module(s3_endpoint: str):
    """A bucket for a module's fixtures; this process's environment is left as it is: the
    processes that use the bucket get ``.env``."""
    from tests.support import new_bucket

    return new_bucket(s3_endpoint)
