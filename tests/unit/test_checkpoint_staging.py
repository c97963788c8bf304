"""Async checkpoint staging: one storage writer and one DCP stager per CheckpointManager, whose
host buffers are reused from one save to the next, and a run resumed from such saves continues
bitwise.

One process, no process group (DCP's single-process path)."""

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
from sdnet_trainer.training.checkpointer import Checkpointer
from sdnet_trainer.training.state import RunState

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    # The batch depends on the step alone: a resumed run sees the same data.
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict by dotted key, not copied."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            out[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)

    walk("", state)
    return out


def _snapshot(state: dict) -> dict[str, torch.Tensor]:
    return {key: tensor.detach().clone() for key, tensor in _tensors(state).items()}


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Model and optimizer state as the Checkpointer saves them: torch's state-dict helpers,
    live tensors."""
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }


@pytest.fixture
def spies(monkeypatch) -> dict[str, list]:
    """Records every staged state dict DefaultStager returns, every DefaultStager made, and the
    writer object and folder of every shard write."""
    seen: dict[str, list] = {"staged": [], "stagers": [], "writes": []}
    stage, init, write_data = DefaultStager.stage, DefaultStager.__init__, StagingWriter.write_data

    def spy_stage(self, state_dict, **kwargs):
        staged = stage(self, state_dict, **kwargs)
        seen["staged"].append(staged)
        return staged

    def spy_init(self, *args, **kwargs):
        seen["stagers"].append(self)
        init(self, *args, **kwargs)

    def spy_write(self, plan, planner):
        seen["writes"].append((self, Path(self.path)))
        return write_data(self, plan, planner)

    monkeypatch.setattr(DefaultStager, "stage", spy_stage)
    monkeypatch.setattr(DefaultStager, "__init__", spy_init)
    monkeypatch.setattr(StagingWriter, "write_data", spy_write)
    return seen


def test_async_saves_reuse_the_writer_and_the_staged_memory(tmp_path, spies):
    if not reusable_stager():
        pytest.skip(
            f"torch {torch.__version__}: a stager per save (tests/unit/test_torch_compat.py)"
        )
    model, optimizer = _model_and_optimizer(0)
    _train_step(model, optimizer, 0)  # AdamW's state exists
    ckpts = CheckpointManager(tmp_path, keep_last=3, async_save=True, rank=0, world_size=1)

    expected = {}
    for step in (1, 2, 3):
        _train_step(model, optimizer, step)
        expected[step] = _snapshot(_state(model, optimizer))
        ckpts.save(step, _state(model, optimizer))
    ckpts.wait()

    # One stager, one writer, pointed at each save's own staging folder in turn.
    assert len(spies["stagers"]) == 1
    assert len(spies["staged"]) == 3 and len(spies["writes"]) == 3
    assert len({id(writer) for writer, _ in spies["writes"]}) == 1
    assert [path for _, path in spies["writes"]] == [ckpts.staging_dir(s) for s in (1, 2, 3)]
    # Every tensor of the second and third saves was copied into the host memory of the first
    # (the first save's staged dicts are still referenced here: fresh memory could not reuse it).
    first = _tensors(spies["staged"][0])
    assert set(first) == set(expected[1]) and len(first) >= 10  # weights, biases, exp_avg(_sq)...
    for staged in spies["staged"][1:]:
        later = _tensors(staged)
        assert later.keys() == first.keys()
        for key, tensor in later.items():
            assert tensor.device.type == "cpu", key
            assert tensor.untyped_storage().data_ptr() == first[key].untyped_storage().data_ptr()
    # The buffers were refreshed each time: each checkpoint holds the values of its own step.
    for step in (1, 2, 3):
        checkpoint = next(c for c in ckpts.checkpoints() if c.step == step)
        target = _clone_tree(_state(model, optimizer))
        ckpts.load(checkpoint, target)
        got = _tensors(target)
        for key, value in expected[step].items():
            assert torch.equal(got[key], value), (step, key)
    assert not torch.equal(expected[1]["model.0.weight"], expected[3]["model.0.weight"])
    ckpts.close()
    assert ckpts._stager is None  # closed: the host buffers are released with it


def _clone_tree(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone_tree(v) for v in value]
    return value


def test_sync_saves_reuse_the_writer_and_stage_nothing(tmp_path, spies):
    ckpts = CheckpointManager(tmp_path, keep_last=3, async_save=False, rank=0, world_size=1)
    for step in (1, 2):
        ckpts.save(step, {"w": torch.full((4,), float(step))})
    ckpts.close()
    assert spies["stagers"] == [] and spies["staged"] == []
    assert len({id(writer) for writer, _ in spies["writes"]}) == 1
    assert [c.step for c in ckpts.checkpoints()] == [1, 2]


def test_a_save_waits_for_the_previous_write_before_restaging(tmp_path, monkeypatch):
    # The staged buffers are shared by consecutive saves: the second save must not copy into them
    # while the first one's write still reads them.
    release = threading.Event()
    write_data = StagingWriter.write_data

    def held_write_data(self, plan, planner):
        assert release.wait(timeout=60)
        return write_data(self, plan, planner)

    monkeypatch.setattr(StagingWriter, "write_data", held_write_data)
    live = {"w": torch.arange(1000.0)}
    ckpts = CheckpointManager(tmp_path, keep_last=3, async_save=True, rank=0, world_size=1)
    ckpts.save(1, live)
    live["w"].add_(100)
    second = threading.Thread(target=ckpts.save, args=(2, live))
    second.start()
    second.join(timeout=1.0)
    assert second.is_alive(), "the second save did not wait for the first one's write"
    release.set()
    second.join(timeout=60)
    assert not second.is_alive()
    ckpts.wait()
    for step, value in ((1, torch.arange(1000.0)), (2, torch.arange(1000.0) + 100)):
        target = {"w": torch.zeros(1000)}
        ckpts.load(next(c for c in ckpts.checkpoints() if c.step == step), target)
        assert torch.equal(target["w"], value), step
    ckpts.close()


def _checkpointer(directory: Path, model, optimizer, state: RunState) -> Checkpointer:
    parts = {
        "model": Part(ModelState(model)),
        "optim": Part(OptimizerState(model, optimizer)),
        "trainer": Part(state),
    }
    cfg = CheckpointConfig(async_save=True, keep_last=2, resume="auto")
    return Checkpointer(
        cfg,
        directory=directory,
        parts=parts,
        rank=0,
        world_size=1,
        meta={},
        run_id="staging-test",
    )


def test_async_saves_then_resume_is_bitwise_exact(tmp_path, monkeypatch):
    # Reference: 9 steps without interruption.
    model, optimizer = _model_and_optimizer(0)
    for step in range(9):
        _train_step(model, optimizer, step)
    reference = _snapshot(_state(model, optimizer))

    # The same run, saving asynchronously after steps 3 and 6 while training goes on; each
    # write is held until two more steps have changed every tensor in place.
    # One permit per write, given two steps after its save (a permit cannot be missed by a
    # writer thread that reaches the gate late).
    permits = threading.Semaphore(0)
    write_data = StagingWriter.write_data

    def held_write_data(self, plan, planner):
        assert permits.acquire(timeout=60)
        return write_data(self, plan, planner)

    monkeypatch.setattr(StagingWriter, "write_data", held_write_data)
    model, optimizer = _model_and_optimizer(0)
    state = RunState()
    first = _checkpointer(tmp_path, model, optimizer, state)
    for step in range(8):  # killed after step 8; the newest checkpoint is step 6's
        _train_step(model, optimizer, step)
        state.step = step + 1
        if state.step in (3, 6):
            first.save(state)
        if state.step in (5, 8):
            permits.release()
    first.close()
    assert [c.step for c in first.manager.checkpoints()] == [3, 6]

    # Resumed in a fresh model and optimizer (other initial weights), trained to step 9.
    model, optimizer = _model_and_optimizer(1)
    _train_step(model, optimizer, 100)  # some other optimizer state, to be overwritten
    state = RunState()
    second = _checkpointer(tmp_path, model, optimizer, state)
    resumed = second.resume(state)
    assert resumed is not None and resumed.step == 6 and state.step == 6
    for step in range(state.step, 9):
        _train_step(model, optimizer, step)
    second.close()
    got = _snapshot(_state(model, optimizer))
    assert got.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(got[key], value), key


def test_before_save_runs_first_and_can_veto_the_save(tmp_path):
    # The Trainer settles a step verdict in flight there: a rejected step must never be saved.
    model, optimizer = _model_and_optimizer(0)
    state = RunState(step=1)
    calls: list[str] = []

    class Recorded(ModelState):
        def state_dict(self):
            calls.append("state_dict")
            return super().state_dict()

    def settle() -> None:
        calls.append("before_save")
        if state.step == 2:
            raise RuntimeError("step 2 was not finite")

    cfg = CheckpointConfig(async_save=True, keep_last=3, resume="none")
    ckpt = Checkpointer(
        cfg,
        directory=tmp_path,
        parts={"model": Part(Recorded(model))},
        rank=0,
        world_size=1,
        meta={},
        run_id="veto-test",
        before_save=settle,
    )
    ckpt.save(state)
    state.step = 2
    with pytest.raises(RuntimeError, match="step 2 was not finite"):
        ckpt.save(state)
    ckpt.close()
    assert calls == ["before_save", "state_dict", "before_save"]
    assert [c.step for c in ckpt.manager.checkpoints()] == [1]
    assert state.last_checkpoint_step == 1
