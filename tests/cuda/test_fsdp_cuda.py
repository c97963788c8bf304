"""FSDP2 on one GPU, in this process, on a one-rank process group (NCCL for CUDA tensors, gloo for
the CPU-offloaded ones), through the real Trainer: the paths the CPU tests can only approximate.

- One-rank FSDP2: meta build, ``fully_shard`` on a mesh of one, allocation on the GPU, init, bf16
  mixed precision, gradient accumulation with a reduce-scatter per micro-step, a DTensor
  checkpoint that a second run resumes from.
- CPU offload from the meta build: the shards are allocated in pinned CPU memory and the buffers
  on the GPU (``models.init.allocate``); ``to_empty(device=cuda)`` left the shards on the GPU and
  FSDP's lazy init refused them. The run trains as the same run without offload does.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from sdnet_trainer import Trainer
from sdnet_trainer.config import compose
from sdnet_trainer.distributed.env import DistEnv
from sdnet_trainer.preflight import validate
from tests.cuda.launches import LAUNCHES

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda", 0)


class DeviceRecorder(Trainer):
    """Records every step's loss and the device of every batch it trained on."""

    def setup(self) -> None:
        super().setup()
        self.losses: list[float] = []
        self.batch_devices: set[str] = set()

    def compute_loss(self, batch):
        self.batch_devices.add(batch[0].device.type)
        return super().compute_loss(batch)

    def train_step(self):
        out = super().train_step()
        self.losses.append(out.loss.item())
        return out


def _fit(tmp_path, name: str, env: DistEnv | None, *run_keys: str) -> DeviceRecorder:
    """The launch ``LAUNCHES[name]`` in this process, ``run_keys`` (this run's paths) after it."""
    cfg = compose([*LAUNCHES[name].keys, *run_keys])
    validate(cfg, world_size=1)
    trainer = DeviceRecorder(cfg, output_dir=tmp_path, env=env)
    trainer.fit()
    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    trainer.final = {k: v.detach().float().cpu() for k, v in state.items()}
    return trainer


@pytest.mark.timeout(600)
def test_one_rank_fsdp_bf16_accumulates_checkpoints_and_resumes(tmp_path, one_rank):
    checkpoints = f"checkpoint.dir={tmp_path}/ck"
    trainer = _fit(tmp_path / "full", "fsdp_bf16_checkpointed", one_rank, checkpoints)
    assert trainer.device.type == "cuda" and trainer.batch_devices == {"cuda"}
    assert isinstance(trainer.model, FSDPModule)
    params = list(trainer.model.parameters())
    assert all(isinstance(p, DTensor) and p.device.type == "cuda" for p in params)
    assert all(p.dtype == torch.float32 for p in params)  # fp32 shards; bf16 compute copies
    assert all(math.isfinite(v) for v in trainer.losses) and len(trainer.losses) == 4
    assert (tmp_path / "ck" / "step_00000004").is_dir()
    trainer.close()

    # Resume from the step-2 checkpoint: steps 3 and 4 again, the same losses.
    resumed = _fit(
        tmp_path / "resumed",
        "fsdp_bf16_resumed",
        one_rank,
        checkpoints,
        f"checkpoint.resume={tmp_path}/ck/step_00000002",
    )
    assert resumed.batch_devices == {"cuda"} and isinstance(resumed.model, FSDPModule)
    torch.testing.assert_close(resumed.losses, trainer.losses[2:], rtol=1e-3, atol=1e-3)
    for name, value in trainer.final.items():
        torch.testing.assert_close(resumed.final[name], value, rtol=1e-3, atol=1e-3, msg=name)
    resumed.close()


@pytest.mark.timeout(600)
def test_cpu_offload_from_meta_keeps_shards_on_the_cpu_and_trains_as_without(tmp_path, one_rank):
    offloaded = _fit(tmp_path / "offload", "fsdp_cpu_offload", one_rank)
    assert offloaded.device.type == "cuda" and offloaded.batch_devices == {"cuda"}
    model = offloaded.model
    assert isinstance(model, FSDPModule)
    params = list(model.parameters())
    assert params and all(isinstance(p, DTensor) for p in params)
    assert {p.to_local().device.type for p in params} == {"cpu"}
    assert all(p.to_local().is_pinned() for p in params)
    buffers = list(model.buffers())
    assert buffers and {b.device.type for b in buffers} == {"cuda"}
    assert all(math.isfinite(v) for v in offloaded.losses)
    offloaded.close()

    on_gpu = _fit(tmp_path / "gpu", "fsdp_on_gpu", one_rank)
    assert {p.device.type for p in on_gpu.model.parameters()} == {"cuda"}
    # The same computation, with the optimizer's update on the CPU: equal up to float rounding.
    torch.testing.assert_close(offloaded.losses, on_gpu.losses, rtol=1e-3, atol=1e-4)
    for name, value in on_gpu.final.items():
        torch.testing.assert_close(offloaded.final[name], value, rtol=1e-3, atol=1e-4, msg=name)
    on_gpu.close()
