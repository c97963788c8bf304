"""model.ema: the moving average against one computed by hand, its evaluation, resume and export.
(Under FSDP, tensor and pipeline parallel: tests/distributed/test_layouts.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdnet_trainer import Trainer, compose
from sdnet_trainer.config.schema import EMAConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.export.cli import main as export_main
from sdnet_trainer.preflight import validate
from sdnet_trainer.training.ema import WeightAverage
from tests.support import TINY

DECAY, EVERY, WARMUP = 0.7, 2, 2
EMA = TINY + [
    "loop.global_batch_size=32",
    "loop.eval_at_end=true",
    "model.ema.enabled=true",
    f"model.ema.decay={DECAY}",
    f"model.ema.every_n_steps={EVERY}",
    f"model.ema.warmup_steps={WARMUP}",
]


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


class WeightsPerStep(Trainer):
    """Keeps the weights before the first step and after every step."""

    def setup(self) -> None:
        super().setup()
        self.history = [_weights(self)]

    def train_step(self):
        out = super().train_step()
        self.history.append(_weights(self))
        return out


def _by_hand(history: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """ema_0 = w_0; at every EVERY-th step s: w_s while s <= WARMUP, else
    DECAY * ema + (1 - DECAY) * w_s. Integer buffers follow the weights."""
    ema = {k: v.clone() for k, v in history[0].items()}
    for step in range(1, len(history)):
        if step % EVERY:
            continue
        for name, weight in history[step].items():
            if not weight.is_floating_point() or step <= WARMUP:
                ema[name] = weight.clone()
            else:
                ema[name] = DECAY * ema[name] + (1 - DECAY) * weight
    return ema


def test_the_average_is_the_one_computed_by_hand(tmp_path):
    trainer = WeightsPerStep(compose(EMA + ["loop.max_steps=7"]), output_dir=tmp_path)
    metrics = trainer.fit()
    expected = _by_hand(trainer.history)
    average = trainer.ema.state_dict()
    assert average.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(average[name], value, rtol=1e-6, atol=1e-7, msg=name)
    # Steps 4 and 6 averaged: the average is neither the last weights nor any earlier ones.
    weight = "fc.weight" if "fc.weight" in expected else next(iter(expected))
    assert not any(torch.equal(average[weight], w[weight]) for w in trainer.history)

    # val_ema/* is the evaluation of the average in the model's place; the weights come back.
    assert {"val_ema/loss", "val_ema/top1"} <= metrics.keys()
    assert metrics["val_ema/loss"] != metrics["val/loss"]
    before = _weights(trainer)
    with trainer.ema.swapped_in():
        swapped = trainer.evaluate()
        for name, value in expected.items():
            if value.is_floating_point():
                torch.testing.assert_close(trainer.model.state_dict()[name], average[name])
    assert swapped["loss"] == pytest.approx(metrics["val_ema/loss"], rel=1e-9)
    for name, value in _weights(trainer).items():
        assert torch.equal(value, before[name]), name


def test_resumed_average_is_bitwise_the_uninterrupted_one(tmp_path):
    whole = Trainer(compose(EMA + ["loop.max_steps=8"]), output_dir=tmp_path / "whole")
    whole.fit()
    first = Trainer(compose(EMA + ["loop.max_steps=5"]), output_dir=tmp_path / "parts")
    first.fit()  # saves step 5 on exit
    second = Trainer(compose(EMA + ["loop.max_steps=8"]), output_dir=tmp_path / "parts")
    second.fit()
    assert second.state.step == 8
    for name, value in whole.ema.state_dict().items():
        assert torch.equal(second.ema.state_dict()[name], value), name


def test_enabling_it_on_resume_starts_from_the_resumed_weights(tmp_path):
    Trainer(compose(TINY + ["loop.max_steps=3"]), output_dir=tmp_path).fit()
    resumed = WeightsPerStep(compose(EMA + ["loop.max_steps=3"]), output_dir=tmp_path)
    resumed.fit()  # nothing left to train: the average is the checkpoint's weights
    assert resumed.state.step == 3
    for name, value in resumed.ema.state_dict().items():
        assert torch.equal(value, resumed.history[0][name]), name


def test_export_writes_the_average_or_names_its_absence(tmp_path):
    trainer = Trainer(compose(EMA + ["loop.max_steps=4"]), output_dir=tmp_path / "ema")
    trainer.fit()
    step = tmp_path / "ema" / "checkpoints" / "step_00000004"
    assert export_main([f"checkpoint={step}", "ema=true", f"out={tmp_path / 'out'}"]) == 0
    exported = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    for name, value in trainer.ema.state_dict().items():
        assert torch.equal(exported[name], value), name

    Trainer(compose(TINY + ["loop.max_steps=2"]), output_dir=tmp_path / "plain").fit()
    plain = tmp_path / "plain" / "checkpoints" / "step_00000002"
    assert export_main([f"checkpoint={plain}", "ema=true", f"out={tmp_path / 'none'}"]) == 2
    assert not (tmp_path / "none" / "model.pt").exists()


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.ema.decay=1.5", "model.ema.decay"),
        ("model.ema.every_n_steps=0", "model.ema.every_n_steps"),
        ("model.ema.warmup_steps=-1", "model.ema.warmup_steps"),
    ],
)
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        validate(compose(EMA + [override]), world_size=1)


def _bits(ema: WeightAverage) -> dict[str, bytes]:
    """The average's bytes: torch.equal holds -0.0 equal to +0.0."""
    return {k: v.detach().numpy().tobytes() for k, v in ema.state_dict().items()}


@pytest.mark.parametrize("decay", [0.9, 0.5, 0.0])  # lerp's two formulas (weight < 0.5 or not)
def test_a_skipped_step_leaves_the_average_bitwise_as_it_was(decay):
    """``applied`` 0.0 on the device (a skipped step): every bit of the average stays, zeros of
    either sign included (a masked lerp adds a zero, and -0.0 + 0.0 is +0.0); 1.0 moves it."""
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[-0.0, 0.0, 1.5], [-2.0, -0.0, 3.0]]))
        model.bias.copy_(torch.tensor([-0.0, 5.0]))
    ema = WeightAverage(model, EMAConfig(enabled=True, decay=decay, warmup_steps=1))
    copied = [[-0.0, -1.0, 2.0], [-0.0, 4.0, -0.0]]
    averaged = [[1.0, -0.0, -3.0], [0.5, -7.0, 1.0]]
    # Step 1 applied (the warmup's copy), step 2 skipped, step 3 applied (a lerp), 4 skipped.
    for step, weights in [(1, copied), (3, averaged)]:
        with torch.no_grad():
            model.weight.copy_(torch.tensor(weights))
        ema.update(step, torch.tensor(1.0))
        before = _bits(ema)
        ema.update(step + 1, torch.tensor(0.0))  # the weights as they were, and the average
        assert _bits(ema) == before, f"step {step + 1}"
    expected = decay * torch.tensor(copied) + (1 - decay) * torch.tensor(averaged)
    torch.testing.assert_close(ema.state_dict()["weight"], expected)
