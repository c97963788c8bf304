"""A rank bound to one GPU of its own (SLURM's --gpus-per-task=1: CUDA_VISIBLE_DEVICES per task)
opens its session on that GPU, cuda:0, whatever its LOCAL_RANK. Before, LOCAL_RANK=1 asked for
GPU 1 of the one the task sees and stopped. tests/unit/test_gpu_binding.py covers the rules with
the CUDA calls simulated."""

from __future__ import annotations

import pytest
import torch

from sdnet_trainer.config.schema import DistConfig
from sdnet_trainer.distributed.env import distributed_session

pytestmark = pytest.mark.cuda


def test_second_local_rank_bound_to_one_gpu_runs_on_cuda_0(monkeypatch):
    if torch.cuda.device_count() != 1:
        pytest.skip("needs a process that sees exactly one GPU (CUDA_VISIBLE_DEVICES=<one id>)")
    monkeypatch.delenv("RANK", raising=False)  # the session alone, no process group
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with distributed_session(DistConfig(device="cuda")) as env:
        assert env.device == torch.device("cuda", 0)
        assert torch.cuda.current_device() == 0
        x = torch.ones(4, device=env.device) * 2
        assert x.device.type == "cuda" and x.sum().item() == 8
