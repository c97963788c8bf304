"""Checkpoints of a model on one GPU.

- Async saves stage the CUDA state into pinned host memory, the same buffers at every save where
  torch's stager can be reused (torch >= 2.13, ``compat.reusable_stager``), fresh ones otherwise.
- Checkpoint exactness with dropout, sync and async: a run resumed from a checkpoint continues
  bitwise as the uninterrupted run, dropout masks included (the CUDA random stream is part of
  the checkpoint), while async writes overlap the training steps that follow them.

Through the product's Checkpointer and parts (model, optimizer, counters, random streams), in
this process; a small MLP, whose CUDA kernels repeat bitwise run to run on one device.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from sdnet_trainer.checkpoint.disk import StagingWriter
from sdnet_trainer.checkpoint.manager import CheckpointManager
from sdnet_trainer.checkpoint.parts import ModelState, OptimizerState, Part
from sdnet_trainer.compat import reusable_stager
from sdnet_trainer.config.schema import CheckpointConfig
from sdnet_trainer.runtime.rng import RngState
from sdnet_trainer.training.checkpointer import Checkpointer
from sdnet_trainer.training.state import RunState
from tests.support import assert_on_cuda

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

DEVICE = torch.device("cuda", 0)


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)  # the CPU and every CUDA generator: dropout draws from the latter
    model = nn.Sequential(
        nn.Linear(32, 64), nn.Dropout(0.3), nn.GELU(), nn.Linear(64, 8), nn.Dropout(0.1)
    ).to(DEVICE)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)  # the data depends on the step alone
    x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
    loss = nn.functional.mse_loss(model(x.to(DEVICE)), y.to(DEVICE))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            out[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)

    walk("", state)
    return out


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    return {key: t.detach().clone() for key, t in _tensors(state).items()}


def test_async_staging_is_pinned_and_reused(tmp_path, monkeypatch):
    staged: list[dict] = []
    stagers: list[DefaultStager] = []
    stage = DefaultStager.stage

    def spy_stage(self, state_dict, **kwargs):
        result = stage(self, state_dict, **kwargs)
        staged.append(result)
        stagers.append(self)
        return result

    monkeypatch.setattr(DefaultStager, "stage", spy_stage)
    model, optimizer = _model_and_optimizer(0)
    _train_step(model, optimizer, 0)
    moments = optimizer.state[next(model.parameters())]
    assert_on_cuda(model, moments["exp_avg"], moments["exp_avg_sq"])
    ckpts = CheckpointManager(tmp_path, keep_last=2, async_save=True, rank=0, world_size=1)
    expected = {}
    for step in (1, 2):
        _train_step(model, optimizer, step)
        expected[step] = _snapshot(model, optimizer)
        ckpts.save(
            step,
            {
                "model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, optimizer),
            },
        )
    ckpts.wait()
    assert len(staged) == 2
    first, second = _tensors(staged[0]), _tensors(staged[1])
    assert first.keys() == second.keys() == expected[1].keys()
    reused = reusable_stager()
    # One stager for the run where torch allows; otherwise a stager (and host buffers) per save.
    assert (stagers[0] is stagers[1]) is reused
    pinned = 0
    for key, tensor in first.items():
        assert tensor.device.type == "cpu", key
        # torch's stager pins every buffer but the tiniest (AdamW's 4-byte step counters).
        if tensor.untyped_storage().nbytes() >= 5:
            assert tensor.is_pinned() and second[key].is_pinned(), key
            pinned += 1
        if reused:
            assert second[key].untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    assert pinned >= 8  # 4 weights and biases, and their exp_avg and exp_avg_sq
    for step in (1, 2):
        checkpoint = next(c for c in ckpts.checkpoints() if c.step == step)
        target = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer),
        }
        target = {k: _clone_tree(v) for k, v in target.items()}
        ckpts.load(checkpoint, target)
        for key, value in _tensors(target).items():
            assert torch.equal(value, expected[step][key]), (step, key)
    ckpts.close()


def _clone_tree(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone_tree(v) for v in value]
    return value


def _checkpointer(
    directory: Path, model, optimizer, state: RunState, *, async_save: bool
) -> Checkpointer:
    parts = {
        "model": Part(ModelState(model)),
        "optim": Part(OptimizerState(model, optimizer)),
        "trainer": Part(state),
        "rng": Part(RngState(DEVICE, step=lambda: state.step), per_rank=True),
    }
    cfg = CheckpointConfig(async_save=async_save, keep_last=2, resume="auto")
    return Checkpointer(
        cfg,
        directory=directory,
        parts=parts,
        rank=0,
        world_size=1,
        meta={},
        run_id="cuda-test",
    )


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_with_dropout_is_bitwise_exact(tmp_path, monkeypatch, async_save):
    model, optimizer = _model_and_optimizer(0)
    for step in range(9):
        _train_step(model, optimizer, step)
    reference = _snapshot(model, optimizer)

    # The same run, saving after steps 3 and 6; async writes are held until two more steps have
    # changed every tensor (and drawn new dropout masks).
    # One permit per write, given two steps after its save (a permit cannot be missed by a
    # writer thread that reaches the gate late). Sync writes run inside save(): not held.
    permits = threading.Semaphore(0)
    write_data = StagingWriter.write_data

    def held_write_data(self, plan, planner):
        assert permits.acquire(timeout=60)
        return write_data(self, plan, planner)

    if async_save:
        monkeypatch.setattr(StagingWriter, "write_data", held_write_data)
    model, optimizer = _model_and_optimizer(0)
    state = RunState()
    first = _checkpointer(tmp_path, model, optimizer, state, async_save=async_save)
    for step in range(8):  # stops after step 8: the newest checkpoint is step 6's
        _train_step(model, optimizer, step)
        state.step = step + 1
        if state.step in (3, 6):
            first.save(state)
        if state.step in (5, 8):
            permits.release()
    first.close()
    assert [c.step for c in first.manager.checkpoints()] == [3, 6]
    assert first.manager.latest().has_key("rng/rank0.cuda")

    # Resumed with other weights and another CUDA stream: both must come from the checkpoint.
    model, optimizer = _model_and_optimizer(1)
    _train_step(model, optimizer, 100)
    state = RunState()
    second = _checkpointer(tmp_path, model, optimizer, state, async_save=async_save)
    resumed = second.resume(state)
    assert resumed is not None and resumed.step == 6 and state.step == 6
    for step in range(state.step, 9):
        _train_step(model, optimizer, step)
    second.close()
    assert_on_cuda(model)
    got = _snapshot(model, optimizer)
    assert got.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(got[key], value), key
