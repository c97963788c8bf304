"""One visible GPU per task (SLURM's --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank): a rank
that sees exactly one device on a node of several ranks runs on cuda:0, whatever its LOCAL_RANK;
a LOCAL_RANK beyond several visible devices stays a clear error. The CUDA calls are simulated
here; tests/cuda/test_gpu_binding_cuda.py opens the session on a real GPU.
"""

from __future__ import annotations

import pytest
import torch

from sdnet_trainer.config.schema import Config, DistConfig
from sdnet_trainer.distributed.env import (
    check_local_rank,
    cuda_index,
    distributed_session,
    resolve_device,
    validate_dist,
)
from sdnet_trainer.errors import ConfigError


@pytest.fixture
def gpus(monkeypatch):
    """Show ``n`` GPUs without touching a real one; returns the devices set_device was given."""
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)

    def show(n: int) -> list[torch.device]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        return chosen

    return show


def _cuda_cfg() -> Config:
    cfg = Config()
    cfg.dist.device = "cuda"
    return cfg


def test_a_task_bound_to_one_gpu_runs_on_cuda_0(gpus, monkeypatch):
    chosen = gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # SLURM's binding: this task's own GPU
    assert cuda_index(1) == 0
    assert resolve_device(DistConfig(device="cuda"), 1) == torch.device("cuda", 0)
    check_local_rank(1)
    validate_dist(_cuda_cfg())
    with distributed_session(DistConfig(device="cuda")) as env:
        assert env.device == torch.device("cuda", 0) and not env.distributed
    assert chosen == [torch.device("cuda", 0)]
    # Any local rank of the node: each sees its own one device as cuda:0.
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device(DistConfig(device="auto"), 3) == torch.device("cuda", 0)


def test_local_rank_beyond_several_visible_gpus_is_still_a_clear_error(gpus, monkeypatch):
    chosen = gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert cuda_index(3) == 3
    message = r"LOCAL_RANK=3 needs GPU 3, .* shows 2 CUDA device\(s\), CUDA_VISIBLE_DEVICES='0,1'"
    with pytest.raises(ConfigError, match=message):
        validate_dist(_cuda_cfg())
    with (
        pytest.raises(ConfigError, match="bind one GPU to each task"),
        distributed_session(DistConfig(device="cuda")),
    ):
        pass
    assert chosen == []  # refused before any set_device
    # Ranks within the visible devices keep their own index.
    assert cuda_index(1) == 1
    check_local_rank(1)


def test_one_gpu_without_a_node_of_several_ranks_keeps_the_error(gpus, monkeypatch):
    """No LOCAL_WORLD_SIZE (no launcher said several ranks share the node): LOCAL_RANK=2 with one
    GPU is a launch error, not a binding."""
    gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert cuda_index(2) == 2
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=2 needs GPU 2, .* shows 1 CUDA device"):
        validate_dist(_cuda_cfg())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE='two' is not an integer"):
        cuda_index(2)
    # The first rank never needs the binding, and asks nothing of the environment.
    assert cuda_index(0) == 0
