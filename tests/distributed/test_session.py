"""The process group's lifetime: created from torchrun's environment, destroyed on every path."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from sdnet_trainer.config import DistConfig
from sdnet_trainer.distributed import distributed_session
from tests.support import free_port


@pytest.fixture
def one_rank_env(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


def test_group_is_destroyed_when_training_raises(one_rank_env):
    with (
        pytest.raises(RuntimeError, match="boom"),
        distributed_session(DistConfig(device="cpu", timeout_s=60)) as env,
    ):
        assert dist.is_initialized() and env.backend == "gloo" and env.world_size == 1
        raise RuntimeError("boom")
    assert not dist.is_initialized()


def test_without_torchrun_there_is_no_group(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with distributed_session(DistConfig()) as env:
        assert not env.distributed and env.world_size == 1 and not dist.is_initialized()


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc only")
def test_cpu_malloc_thresholds_can_be_pinned():
    from sdnet_trainer.distributed.malloc import pin_malloc_thresholds

    assert pin_malloc_thresholds() is True
