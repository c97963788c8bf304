"""Stop and resume in one process: the resumed run is bitwise the uninterrupted one."""

from __future__ import annotations

import pytest
import torch

from sdnet_trainer import compose
from tests.support import TINY, FaultTrainer, checkpoint_names, seen_samples

# 256 samples / global batch 32 = 8 steps per epoch; 14 steps cross an epoch boundary.
COMMON = TINY + [
    "loop.max_steps=14",
    "loop.global_batch_size=32",
    "loop.eval_at_end=false",
    "sched=cosine",
    "sched.warmup_steps=3",
]


def _params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    trainer = FaultTrainer(compose(COMMON), output_dir=tmp_path_factory.mktemp("reference"))
    trainer.fit()
    return _params(trainer), trainer.losses


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("stop_at", [3, 8, 11])  # mid-epoch, at the epoch's end, mid-epoch 2
def test_sigterm_then_resume_is_bitwise_equal(
    tmp_path, monkeypatch, reference, stop_at, async_save
):
    cfg = compose(COMMON + [f"checkpoint.async_save={async_save}"])
    # The stop is agreed during the step after the signal's (the verdict is read one step late).
    monkeypatch.setenv("SDNET_TEST_SIGTERM", f"0:{stop_at - 1}")
    first = FaultTrainer(cfg, output_dir=tmp_path)
    with pytest.raises(SystemExit) as stopped:
        first.fit()
    assert stopped.value.code == 143 and first.state.step == stop_at
    monkeypatch.delenv("SDNET_TEST_SIGTERM")

    second = FaultTrainer(cfg, output_dir=tmp_path)
    second.fit()
    assert second.state.step == 14
    params, losses = reference
    assert first.losses + second.losses == losses  # bitwise, step by step
    for name, value in params.items():
        assert torch.equal(_params(second)[name], value), name
    # The data: 8 steps of epoch 0 (every sample once) then 6 steps of epoch 1.
    assert len(seen_samples(tmp_path)) == 14 * 32


def test_nonfinite_skip_leaves_the_step_untouched(tmp_path, monkeypatch):
    monkeypatch.setenv("SDNET_TEST_NAN", "0:3")
    monkeypatch.setenv("SDNET_TEST_DROPOUT", "0")

    class Snapshots(FaultTrainer):
        def train_step(self):
            before = _params(self)
            momentum = {
                k: v["momentum_buffer"].clone() for k, v in enumerate(self.optimizer.state.values())
            }
            out = super().train_step()
            if self.state.step + 1 == 3:
                self.at_nan = (
                    before,
                    _params(self),
                    momentum,
                    {
                        k: v["momentum_buffer"].clone()
                        for k, v in enumerate(self.optimizer.state.values())
                    },
                )
            return out

    trainer = Snapshots(
        compose(COMMON + ["health.nonfinite=skip", "loop.max_steps=5"]), output_dir=tmp_path
    )
    trainer.fit()
    before, after, momentum_before, momentum_after = trainer.at_nan
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(momentum_before[k], momentum_after[k]) for k in momentum_before)
    assert trainer.state.nonfinite_steps == 1 and trainer.state.step == 5
    assert trainer.scheduler.last_epoch == 5  # the schedule follows the step count, skips included


def test_nonfinite_abort_names_the_step(tmp_path, monkeypatch):
    from sdnet_trainer.training.health import NonFiniteError

    monkeypatch.setenv("SDNET_TEST_NAN", "0:2")
    with pytest.raises(NonFiniteError, match=r"at step 2 on rank 0: loss"):
        FaultTrainer(compose(COMMON), output_dir=tmp_path).fit()


def test_explicit_resume_path_and_none(tmp_path, monkeypatch):
    cfg = compose(COMMON + ["loop.max_steps=4", "checkpoint.every_n_steps=2"])
    FaultTrainer(cfg, output_dir=tmp_path / "a").fit()
    step2 = tmp_path / "a" / "checkpoints" / "step_00000002"
    assert step2.is_dir()
    resumed = FaultTrainer(
        compose(COMMON + ["loop.max_steps=4", f"checkpoint.resume={step2}"]),
        output_dir=tmp_path / "b",
    )
    resumed.fit()
    assert len(resumed.losses) == 2  # steps 3 and 4 only
    fresh = FaultTrainer(
        compose(COMMON + ["loop.max_steps=4", "checkpoint.resume=none"]), output_dir=tmp_path / "a"
    )
    fresh.fit()
    assert len(fresh.losses) == 4


def test_resume_with_parameters_that_never_had_gradients(tmp_path):
    class WithUnusedBranch(FaultTrainer):
        def build_model(self):
            class Net(torch.nn.Module):
                def __init__(self, inner):
                    super().__init__()
                    self.inner = inner
                    self.unused = torch.nn.Linear(3, 3)  # never in forward: no gradient, no state

                def forward(self, x):
                    return self.inner(x)

            return Net(super().build_model())

    cfg = compose(COMMON + ["loop.max_steps=4", "checkpoint.every_n_steps=2"])
    WithUnusedBranch(cfg, output_dir=tmp_path / "a").fit()
    resumed = WithUnusedBranch(
        compose(
            COMMON
            + [
                "loop.max_steps=4",
                f"checkpoint.resume={tmp_path / 'a' / 'checkpoints' / 'step_00000002'}",
            ]
        ),
        output_dir=tmp_path / "b",
    )
    resumed.fit()
    assert resumed.state.step == 4 and len(resumed.losses) == 2


def test_resume_with_a_larger_global_batch_moves_to_the_next_epoch(tmp_path):
    # 7 steps of 32 leave 32 samples in the epoch: no full batch of 64, so the resumed run starts
    # epoch 1 rather than waiting for a batch that never comes.
    FaultTrainer(compose(COMMON + ["loop.max_steps=7"]), output_dir=tmp_path).fit()
    resumed = FaultTrainer(
        compose(COMMON + ["loop.max_steps=9", "loop.global_batch_size=64"]), output_dir=tmp_path
    )
    resumed.setup()
    assert (resumed.state.step, resumed.state.epoch, resumed.state.epoch_sample) == (7, 1, 0)
    resumed.close()
    resumed = FaultTrainer(
        compose(COMMON + ["loop.max_steps=9", "loop.global_batch_size=64"]), output_dir=tmp_path
    )
    resumed.fit()
    assert resumed.state.step == 9 and len(resumed.seen) == 2 * 64


class _Jitter(torch.utils.data.Dataset):
    """A random augmentation from both torch's and Python's generators."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        import random

        image, *rest = self.dataset[index]
        return (image + 0.5 * torch.randn_like(image) + random.random(), *rest)


class _AugmentingTrainer(FaultTrainer):
    def build_datasets(self):
        train, val = super().build_datasets()
        return _Jitter(train), val


def test_resume_is_bitwise_with_loader_workers_and_random_augmentation(tmp_path, monkeypatch):
    cfg = compose(COMMON + ["loop.max_steps=6", "data.num_workers=2"])
    reference = _AugmentingTrainer(cfg, output_dir=tmp_path / "ref")
    reference.fit()
    monkeypatch.setenv("SDNET_TEST_SIGTERM", "0:2")  # agreed, and saved, at step 3
    with pytest.raises(SystemExit):
        _AugmentingTrainer(cfg, output_dir=tmp_path / "run").fit()
    monkeypatch.delenv("SDNET_TEST_SIGTERM")
    resumed = _AugmentingTrainer(cfg, output_dir=tmp_path / "run")
    resumed.fit()
    assert resumed.losses == reference.losses[3:]
    for name, value in _params(reference).items():
        assert torch.equal(_params(resumed)[name], value), name


# ---------------------------------------------------------------- verdicts read one step late


def test_a_nonfinite_step_aborts_during_the_next_step(tmp_path, monkeypatch):
    """health.nonfinite=abort defers each step's verdict: the NaN of step 2 ends the run after
    step 3's forward and backward (no host synchronisation between the two steps)."""
    from sdnet_trainer.training.health import NonFiniteError

    monkeypatch.setenv("SDNET_TEST_NAN", "0:2")
    trainer = FaultTrainer(compose(COMMON), output_dir=tmp_path)
    with pytest.raises(NonFiniteError, match="at step 2 on rank 0: loss, gradient norm"):
        trainer.fit()
    assert trainer.stepper.on_device
    assert trainer.state.step == 2 and len(trainer.seen) == 3 * 32  # step 3's batch was trained


def test_a_nonfinite_step_is_never_checkpointed(tmp_path, monkeypatch):
    """The save after step 2 reads step 2's verdict first: the run ends without writing it."""
    from sdnet_trainer.training.health import NonFiniteError

    monkeypatch.setenv("SDNET_TEST_NAN", "0:2")
    cfg = compose(COMMON + ["checkpoint.every_n_steps=1", "checkpoint.keep_last=10"])
    with pytest.raises(NonFiniteError, match="at step 2"):
        FaultTrainer(cfg, output_dir=tmp_path).fit()
    assert checkpoint_names(tmp_path / "checkpoints") == {"step_00000001"}


@pytest.mark.parametrize("nonfinite", ["abort", "skip"])
def test_a_timed_checkpoint_is_saved_one_step_later_when_deferred(tmp_path, nonfinite):
    """Under either policy the fused SGD skips a non-finite step on the device, so the verdict is
    read a step late: step 1's flag is acted on at step 2; step 2's flag was raised before step
    2's save, which serves it; step 3's is acted on at step 4."""
    saved = {2, 4}
    cfg = compose(
        COMMON
        + [
            "loop.max_steps=4",
            f"health.nonfinite={nonfinite}",
            "checkpoint.every_n_minutes=1e-9",  # due after every step, by rank 0's clock
            "checkpoint.keep_last=10",
            "checkpoint.save_on_exit=false",
        ]
    )
    trainer = FaultTrainer(cfg, output_dir=tmp_path)
    trainer.fit()
    assert trainer.stepper.on_device
    names = checkpoint_names(tmp_path / "checkpoints")
    assert names == {f"step_{step:08d}" for step in saved}
