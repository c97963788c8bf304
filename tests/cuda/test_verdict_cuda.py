"""The step's verdict on a GPU: no host synchronisation on a non-log step (issue: a per-step
``.tolist()`` drained the GPU every step), and the deferred verdict still ends a non-finite run."""

from __future__ import annotations

import pytest
import torch

from sdnet_trainer import HookBase, Trainer, compose
from sdnet_trainer.training.health import NonFiniteError
from tests.support import CUDA, TINY_RUN

pytestmark = pytest.mark.cuda

LOG_EVERY = 4
GPU = [*TINY_RUN, *CUDA, f"logging.log_every_n_steps={LOG_EVERY}"]


class _SyncsOff(HookBase):
    """Last hook: whatever a step and its hooks did under the sync check ends here."""

    def after_step(self, state, result):
        torch.cuda.set_sync_debug_mode(0)


class _NoSyncOnNonLogSteps(Trainer):
    """Steps 3+ that are not log steps run, hooks included, with syncs raising."""

    def build_hooks(self):
        return [*super().build_hooks(), _SyncsOff()]

    def train_step(self):
        step = self.state.step + 1
        if step > 2 and step % LOG_EVERY:
            torch.cuda.set_sync_debug_mode("error")
        return super().train_step()


def test_non_log_steps_do_not_synchronise_with_the_gpu(tmp_path):
    trainer = _NoSyncOnNonLogSteps(
        compose([*GPU, "loop.max_steps=11", "loop.eval_at_end=false"]), output_dir=tmp_path
    )
    try:
        trainer.fit()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert trainer.stepper.deferred and trainer.state.step == 11


class _NanAt(Trainer):
    def compute_loss(self, batch):
        loss = super().compute_loss(batch)
        return loss * float("nan") if self.state.step + 1 == 3 else loss


def test_a_nonfinite_step_on_the_gpu_aborts_during_the_next_step(tmp_path):
    trainer = _NanAt(compose([*GPU, "loop.max_steps=6"]), output_dir=tmp_path)
    with pytest.raises(NonFiniteError, match="at step 3 on rank 0: loss"):
        trainer.fit()
    assert trainer.state.step == 3
