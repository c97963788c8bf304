"""The step's verdict on a GPU: no host synchronisation on a non-log step (issue: a per-step
``.tolist()`` drained the GPU every step), and the deferred verdict still ends a non-finite run.

The sync check's window (``sync_check_armed``) is exercised on the CPU by
tests/unit/test_cuda_windows.py, which imports this module: a window that arms the check over a
point that synchronises fails there, before a GPU run is spent on it."""

from __future__ import annotations

import pytest
import torch

from sdnet_trainer import HookBase, Trainer, compose
from sdnet_trainer.distributed import distributed_session
from sdnet_trainer.training.health import NonFiniteError
from sdnet_trainer.training.hooks import MetricsHook
from tests.cuda.launches import LAUNCHES, VERDICT_RUN, VERDICT_SYNC_CHECK
from tests.support import assert_on_cuda

pytestmark = pytest.mark.cuda

# The first steps are not checked: they compile, autotune and allocate (pinned buffers included).
WARM_UP_STEPS = 2
# The launches' parts without the device, which tests/unit/test_cuda_windows.py runs on the CPU:
# the tiny run logging every 4 steps, and the sync check's 11 steps (tests/cuda/launches.py).
RUN = list(VERDICT_RUN)
SYNC_CHECK_RUN = list(VERDICT_SYNC_CHECK)


class _SyncsOff(HookBase):
    """Last hook: whatever a step and its hooks did under the sync check ends here, so the end
    of the run (after_train: the last verdict, evaluation, the save on exit) runs unchecked."""

    def after_step(self, state, result):
        torch.cuda.set_sync_debug_mode(0)


class _OnDevice(Trainer):
    """Records where the training batches were when the model saw them."""

    def compute_loss(self, batch):
        self.batch_devices = {*getattr(self, "batch_devices", ()), *(str(t.device) for t in batch)}
        return super().compute_loss(batch)


def _fit(trainer_class: type[Trainer], name: str, tmp_path) -> Trainer:
    """The launch ``LAUNCHES[name]``, one process on the GPU: the session resolves
    dist.device=cuda to cuda:0 (a Trainer built without an env would train on the CPU, where no
    sync check can fire)."""
    cfg = compose(LAUNCHES[name].keys)
    with distributed_session(cfg.dist) as env:
        assert env.device.type == "cuda"
        trainer = trainer_class(cfg, output_dir=tmp_path, env=env)
        try:
            trainer.fit()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return trainer


def sync_check_armed(trainer: Trainer, step: int) -> bool:
    """Whether ``step`` (with its hooks) runs under the sync check: past the warm-up, and not a
    log point. Whether it is one is the Trainer's own metrics hook's decision (its period, and
    the last step of the run), not this test's arithmetic: a log point reads the loss back."""
    (metrics,) = [hook for hook in trainer.hooks if isinstance(hook, MetricsHook)]
    return step > WARM_UP_STEPS and not metrics.is_log_step(step)


class NoSyncOnNonLogSteps(_OnDevice):
    """The steps ``sync_check_armed`` names run, hooks included, with syncs raising."""

    def build_hooks(self):
        return [*super().build_hooks(), _SyncsOff()]

    def train_step(self):
        if sync_check_armed(self, self.state.step + 1):
            torch.cuda.set_sync_debug_mode("error")
        return super().train_step()


def test_non_log_steps_do_not_synchronise_with_the_gpu(tmp_path):
    trainer = _fit(NoSyncOnNonLogSteps, "verdict_sync_check", tmp_path)
    assert trainer.stepper.on_device and trainer.state.step == 11
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
    cfg = compose(LAUNCHES["verdict_nonfinite"].keys)
    with distributed_session(cfg.dist) as env:
        trainer = _NanAt(cfg, output_dir=tmp_path, env=env)
        with pytest.raises(NonFiniteError, match="at step 3 on rank 0: loss"):
            trainer.fit()
    assert trainer.state.step == 3
    assert_on_cuda(trainer.model, trainer.batch_devices)
