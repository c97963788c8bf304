"""The step's verdict on a GPU: no host synchronisation on a non-log step (issue: a per-step
``.tolist()`` drained the GPU every step), and the deferred verdict still ends a non-finite run."""

from __future__ import annotations

import pytest
import torch

from sdnet_trainer import HookBase, Trainer, compose
from sdnet_trainer.distributed import distributed_session
from sdnet_trainer.training.health import NonFiniteError
from tests.support import CUDA, TINY_RUN, assert_on_cuda

pytestmark = pytest.mark.cuda

LOG_EVERY = 4
GPU = [*TINY_RUN, *CUDA, f"logging.log_every_n_steps={LOG_EVERY}"]


class _SyncsOff(HookBase):
    """Last hook: whatever a step and its hooks did under the sync check ends here."""

    def after_step(self, state, result):
        torch.cuda.set_sync_debug_mode(0)


class _OnDevice(Trainer):
    """Records where the training batches were when the model saw them."""

    def compute_loss(self, batch):
        self.batch_devices = {*getattr(self, "batch_devices", ()), *(str(t.device) for t in batch)}
        return super().compute_loss(batch)


def _fit(trainer_class: type[Trainer], overrides: list[str], tmp_path) -> Trainer:
    """A one-process run on the GPU: the session resolves dist.device=cuda to cuda:0 (a Trainer
    built without an env would train on the CPU, where no sync check can fire)."""
    cfg = compose([*GPU, *overrides])
    with distributed_session(cfg.dist) as env:
        assert env.device.type == "cuda"
        trainer = trainer_class(cfg, output_dir=tmp_path, env=env)
        try:
            trainer.fit()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return trainer


class _NoSyncOnNonLogSteps(_OnDevice):
    """Steps 3+ that are not log steps run, hooks included, with syncs raising."""

    def build_hooks(self):
        return [*super().build_hooks(), _SyncsOff()]

    def train_step(self):
        step = self.state.step + 1
        if step > 2 and step % LOG_EVERY:
            torch.cuda.set_sync_debug_mode("error")
        return super().train_step()


def test_non_log_steps_do_not_synchronise_with_the_gpu(tmp_path):
    trainer = _fit(_NoSyncOnNonLogSteps, ["loop.max_steps=11", "loop.eval_at_end=false"], tmp_path)
    assert trainer.stepper.deferred and trainer.state.step == 11
    assert_on_cuda(trainer.model, trainer.batch_devices)


def test_the_sync_check_fires_on_this_gpu(tmp_path):
    """The check the test above relies on: a host read of a CUDA tensor under
    set_sync_debug_mode("error") raises (so a silent pass there means no sync happened)."""
    value = torch.ones(1, device="cuda")
    assert_on_cuda(value)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            value.item()
    finally:
        torch.cuda.set_sync_debug_mode(0)


class _NanAt(_OnDevice):
    def compute_loss(self, batch):
        loss = super().compute_loss(batch)
        return loss * float("nan") if self.state.step + 1 == 3 else loss


def test_a_nonfinite_step_on_the_gpu_aborts_during_the_next_step(tmp_path):
    cfg = compose([*GPU, "loop.max_steps=6"])
    with distributed_session(cfg.dist) as env:
        trainer = _NanAt(cfg, output_dir=tmp_path, env=env)
        with pytest.raises(NonFiniteError, match="at step 3 on rank 0: loss"):
            trainer.fit()
    assert trainer.state.step == 3
    assert_on_cuda(trainer.model, trainer.batch_devices)
