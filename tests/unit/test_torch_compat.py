"""The torch releases the project supports (sdnet_trainer/compat.py): the declared minimum, the
one-line refusal of an older torch, and the behaviours of torch 2.11 and 2.12 that the checkpoint
manager works around, each simulated here on the installed torch (the manager's way must work
there, and the simulation must reproduce the failure it avoids)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager

from sdnet_trainer import compat
from sdnet_trainer.checkpoint.manager import CheckpointError, CheckpointManager
from sdnet_trainer.config.schema import PipelineConfig
from sdnet_trainer.distributed.pipeline import (
    check_schedule,
    warn_if_shape_inference_updates_buffers,
)
from sdnet_trainer.errors import ConfigError
from tests.support import REPO


@pytest.mark.parametrize(
    ("version", "release"),
    [("2.11.0+cu130", (2, 11)), ("2.13.0a0+git1234abc", (2, 13)), ("3.0.1", (3, 0))],
)
def test_torch_release_reads_major_and_minor(version, release):
    assert compat.torch_release(version) == release


def test_an_unreadable_version_is_an_error():
    with pytest.raises(ValueError, match="cannot read a torch release from 'nightly'"):
        compat.torch_release("nightly")


def test_the_minimum_is_the_one_pyproject_declares():
    declared = re.search(r'"torch>=(\d+)\.(\d+)"', (REPO / "pyproject.toml").read_text())
    assert declared is not None
    assert (int(declared[1]), int(declared[2])) == compat.TORCH_MIN
    assert compat.torch_release() >= compat.TORCH_MIN  # this machine's torch is supported


def test_an_older_torch_is_refused_in_one_line_naming_the_torch_needed():
    with pytest.raises(RuntimeError) as err:
        compat.check_torch("2.10.1+cu128")
    assert str(err.value) == "sdnet_trainer needs torch>=2.11; this Python has torch 2.10.1+cu128"
    compat.check_torch("2.11.0")  # the oldest supported: no error


def test_the_stager_is_reusable_from_torch_2_13(monkeypatch):
    for version, reusable in (("2.11.0", False), ("2.12.1", False), ("2.13.0", True)):
        monkeypatch.setattr(torch, "__version__", version)
        assert compat.reusable_stager() is reusable, version


# ---------------------------------------------------------------------- the stager of 2.11/2.12


@pytest.fixture
def closing_stager(monkeypatch) -> list[DefaultStager]:
    """DefaultStager as in torch 2.11 and 2.12: stage() closes its StateDictStager (its buffer
    cache and its table of copiers) after every copy. Returns the stagers that staged."""
    stagers: list[DefaultStager] = []
    stage = DefaultStager.stage

    def closing_stage(self, state_dict, **kwargs):
        staged = stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        stagers.append(self)
        return staged

    monkeypatch.setattr(DefaultStager, "stage", closing_stage)
    return stagers


def _three_async_saves(directory) -> CheckpointManager:
    manager = CheckpointManager(directory, keep_last=3, async_save=True, rank=0, world_size=1)
    state = {"w": torch.arange(1000.0), "nested": {"b": torch.ones(10)}}
    for step in (1, 2, 3):
        state["w"].add_(1)
        manager.save(step, state)
    manager.wait()
    return manager


def test_on_torch_2_11_each_async_save_takes_a_stager_of_its_own(
    tmp_path, monkeypatch, closing_stager
):
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    manager = _three_async_saves(tmp_path)
    try:
        assert len(closing_stager) == 3 and len({id(s) for s in closing_stager}) == 3
        for step in (1, 2, 3):
            checkpoint = next(c for c in manager.checkpoints() if c.step == step)
            target = {"w": torch.zeros(1000), "nested": {"b": torch.zeros(10)}}
            manager.load(checkpoint, target)
            assert torch.equal(target["w"], torch.arange(1000.0) + step), step
            assert torch.equal(target["nested"]["b"], torch.ones(10))
    finally:
        manager.close()


def test_reusing_the_stager_of_torch_2_11_fails_as_torch_2_11_does(tmp_path, closing_stager):
    """The simulation above is faithful: one stager for all saves (what the manager does on torch
    2.13 and later) breaks at the second save with 2.11's own error."""
    if not compat.reusable_stager():
        pytest.skip(f"torch {torch.__version__}: the manager already takes a stager per save")
    with pytest.raises(CheckpointError, match="KeyError: <class 'type'>"):
        _three_async_saves(tmp_path).close()


# ---------------------------------------------------------------------- DCP's metadata of 2.11


def test_a_save_commits_when_dcp_returns_metadata_without_storage_data(tmp_path, monkeypatch):
    """torch 2.11's FileSystemWriter.finish records where each item's bytes are on a copy of the
    metadata; dcp.save then returns metadata whose storage_data is None, and the commit must still
    find every file it wrote."""
    finish = FileSystemWriter.finish
    returned = []

    def finish_on_a_copy(self, metadata, results):
        finish(self, dataclasses.replace(metadata), results)
        returned.append(metadata)

    monkeypatch.setattr(FileSystemWriter, "finish", finish_on_a_copy)
    manager = CheckpointManager(tmp_path, keep_last=2, async_save=False, rank=0, world_size=1)
    try:
        manager.save(1, {"w": torch.arange(10.0)})
        assert len(returned) == 1
        (checkpoint,) = manager.checkpoints()
        target = {"w": torch.zeros(10)}
        manager.load(checkpoint, target)
        assert torch.equal(target["w"], torch.arange(10.0))
    finally:
        manager.close()


# ---------------------------------------------------------------------- the V schedules of 2.11


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_v_schedules_are_refused_before_launch_on_torch_2_11(monkeypatch, schedule):
    cfg = PipelineConfig(schedule=schedule, stages_per_rank=2, microbatches=4)
    if compat.local_stage_handoff():
        check_schedule(cfg, pp=2)  # this torch hands tensors between a rank's stages
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert not compat.local_stage_handoff()
    with pytest.raises(ConfigError, match=rf"schedule={schedule} needs torch>=2.12 .*2\.11\.0"):
        check_schedule(cfg, pp=2)
    # The other multi-stage schedules keep working there.
    check_schedule(PipelineConfig(schedule="Interleaved1F1B", stages_per_rank=2), pp=2)


def test_pipelines_of_models_with_buffers_warn_before_torch_2_14(monkeypatch, caplog):
    """torch 2.11 (tests/distributed/test_layouts.py's ResNet pipelines): the weights train as one
    process's, BatchNorm's running statistics take one more update from the shape inference."""
    with_buffers = [nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))]
    plain = [nn.Linear(4, 4)]
    if compat.pipeline_keeps_buffers():
        assert not warn_if_shape_inference_updates_buffers(with_buffers)  # this torch
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    assert not compat.pipeline_keeps_buffers()
    assert not warn_if_shape_inference_updates_buffers(plain)
    with caplog.at_level("WARNING", logger="sdnet_trainer.distributed.pipeline"):
        assert warn_if_shape_inference_updates_buffers(with_buffers)
    assert "torch 2.11.0: the pipeline stages infer their shapes" in caplog.text
