"""A non-finite step is never applied (training/optimizer_step.py): under
``health.nonfinite=skip`` the weights, the optimizer state, the weights' average and a mixture of
experts' routing bias after the step are bitwise those before it; under ``abort`` the run ends
with the weights of the last good step. The fused optimizers skip on the device (the verdict
read a step late); the others read it before the update. Two processes:
tests/distributed/test_faults.py's ``test_nonfinite_skip_on_one_rank_skips_on_every_rank``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from sdnet_trainer import compose
from sdnet_trainer.models.moe import MoE
from sdnet_trainer.training.health import NonFiniteError
from sdnet_trainer.training.optimizer_step import skips_on_device
from tests.support import TINY, FaultTrainer

BASE = [*TINY, "loop.max_steps=4", "loop.global_batch_size=32", "loop.eval_at_end=false"]
EMA = ["model.ema.enabled=true", "model.ema.decay=0.5", "model.ema.warmup_steps=1"]
# Fused kernels skip on the device; foreach ones cannot take the flag, and are checked at once.
OPTIMIZERS = {
    "sgd_fused": (["optim=sgd", "optim.momentum=0.9"], True),
    "adamw_fused": (["optim=adamw", "optim.lr=0.01"], True),
    "adamw_foreach": (["optim=adamw", "optim.lr=0.01", "optim.implementation=foreach"], False),
}
MOE_BIAS = [
    "model=moe_debug",
    "data=tokens",
    "data.seq_len=16",
    "data.vocab_size=256",
    "data.train_size=128",
    "model.moe.load_balance=bias",
    "model.moe.bias_update_rate=0.01",
]


def _tensors(tree: object, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree.detach().clone()}
    if isinstance(tree, dict):
        return {
            k: v for key, item in tree.items() for k, v in _tensors(item, f"{prefix}/{key}").items()
        }
    if isinstance(tree, (list, tuple)):
        return {
            k: v for i, item in enumerate(tree) for k, v in _tensors(item, f"{prefix}/{i}").items()
        }
    return {}


class Snapshots(FaultTrainer):
    """The weights (buffers included: a MoE's routing bias), the optimizer state and the
    weights' average at the start of every step, after the previous step's hooks."""

    def train_step(self):
        if not hasattr(self, "at_start"):
            self.at_start: dict[int, dict[str, torch.Tensor]] = {}
        self.at_start[self.state.step + 1] = self.snapshot()
        return super().train_step()

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {
            **_tensors(self.model.state_dict(), "model"),
            **_tensors(self.optimizer.state_dict()["state"], "optimizer"),
            **_tensors(self.ema.state_dict() if self.ema is not None else {}, "ema"),
        }


def _fit(overrides: list[str], tmp_path, monkeypatch, *, nan_at: int) -> Snapshots:
    monkeypatch.setenv("SDNET_TEST_NAN", f"0:{nan_at}")
    monkeypatch.setenv("SDNET_TEST_DROPOUT", "0")
    return Snapshots(compose(BASE + overrides), output_dir=tmp_path)


def _bits(tensor: torch.Tensor) -> tuple[torch.dtype, bytes]:
    """A tensor's dtype and bytes: torch.equal holds -0.0 equal to +0.0."""
    return tensor.dtype, tensor.detach().reshape(-1).contiguous().view(
        torch.uint8
    ).numpy().tobytes()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ, bit for bit."""
    assert a.keys() == b.keys()
    return [k for k in a if _bits(a[k]) != _bits(b[k])]


@pytest.mark.parametrize("name", [*OPTIMIZERS, "moe_bias"])
def test_a_skipped_step_leaves_weights_optimizer_state_and_average_bitwise(
    tmp_path, monkeypatch, name
):
    optim, on_device = OPTIMIZERS.get(name, OPTIMIZERS["adamw_fused"])
    overrides = [*optim, *EMA, "health.nonfinite=skip", *(MOE_BIAS if name == "moe_bias" else [])]
    trainer = _fit(overrides, tmp_path, monkeypatch, nan_at=3)
    trainer.fit()
    assert trainer.stepper.on_device == on_device
    after = trainer.snapshot()
    # Step 3's NaN: everything as it was after step 2's hooks; step 2 and step 4 moved it all.
    assert _same(trainer.at_start[3], trainer.at_start[4]) == []
    moved = set(_same(trainer.at_start[2], trainer.at_start[3]))
    assert moved and set(_same(trainer.at_start[4], after)) >= moved
    assert any(k.startswith("ema/") for k in moved)
    if name == "moe_bias":
        assert any(k.endswith("expert_bias") for k in moved)  # moved by steps 2 and 4, not 3
    assert trainer.state.nonfinite_steps == 1 and trainer.state.step == 4
    assert trainer.scheduler.last_epoch == 4  # the schedule follows the step count


@pytest.mark.parametrize("name", ["sgd_fused", "adamw_foreach"])
def test_abort_ends_the_run_with_the_weights_of_the_last_good_step(tmp_path, monkeypatch, name):
    optim, on_device = OPTIMIZERS[name]
    trainer = _fit([*optim, *EMA], tmp_path, monkeypatch, nan_at=3)
    with pytest.raises(NonFiniteError, match="at step 3 on rank 0"):
        trainer.fit()
    assert trainer.stepper.on_device == on_device
    # Deferred (fused): step 4's forward and backward ran, its update did not; at once: step 3's
    # check stopped it. Either way the weights, state and average are those after step 2.
    assert max(trainer.at_start) == (4 if on_device else 3)
    assert _same(trainer.at_start[3], trainer.snapshot()) == []


def test_a_skipped_step_leaves_the_routing_bias_bitwise_as_it_was():
    """``MoE.update_bias`` under ``applied`` 0.0 (on the device): every bit stays, a -0.0
    included (a masked move adds a zero, and -0.0 + 0.0 is +0.0); 1.0 moves it."""
    layer = MoE(8, 4, 2, 16, load_balance="bias", aux_loss_coeff=0.1)
    bias = torch.tensor([-0.0, 0.25, -0.5, 0.0])
    layer.expert_bias.copy_(bias)
    counts = torch.tensor([10.0, 0.0, 5.0, 5.0])  # mean 5: moves -, +, 0, 0
    layer.update_bias(counts, 0.25, applied=torch.tensor(0.0))
    assert _bits(layer.expert_bias) == _bits(bias)
    layer.update_bias(counts, 0.25, applied=torch.tensor(1.0))
    assert _bits(layer.expert_bias) == _bits(torch.tensor([-0.25, 0.5, -0.5, 0.0]))


def _rule(optimizer: torch.optim.Optimizer, *, scaling: bool = False, hook: str = "none") -> bool:
    precision = SimpleNamespace(scaling=scaling)
    comm = SimpleNamespace(cfg=SimpleNamespace(hook=hook))
    return skips_on_device(optimizer, precision, comm)  # type: ignore[arg-type]


def test_the_update_skips_on_the_device_only_where_nothing_else_reads_the_verdict():
    """Fused SGD/Adam/AdamW take the agreed flag as ``found_inf``; everything else reads the
    verdict before the update: foreach and for-loop kernels (torch refuses ``found_inf``
    there), fp16 (the GradScaler owns ``found_inf``), PowerSGD (its error feedback is dropped
    on the host), a wrapper that does not take ``found_inf`` (ZeRO-1's)."""
    params = [nn.Parameter(torch.ones(2))]
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        assert _rule(cls(params, lr=0.1, fused=True))
        assert not _rule(cls(params, lr=0.1, foreach=True))
        assert not _rule(cls(params, lr=0.1, foreach=False))
        assert not _rule(cls(params, lr=0.1, fused=True), scaling=True)
        assert not _rule(cls(params, lr=0.1, fused=True), hook="powersgd")
        for hook in ("fp16", "bf16", "local_sgd"):  # no memory of the gradients
            assert _rule(cls(params, lr=0.1, fused=True), hook=hook)
    # One group fused, another not: the flag would reach half of the update.
    mixed = torch.optim.AdamW([{"params": params}], lr=0.1, fused=True)
    mixed.add_param_group({"params": [nn.Parameter(torch.ones(2))], "fused": False})
    assert not _rule(mixed)
    assert not getattr(ZeroRedundancyOptimizer, "_step_supports_amp_scaling", False)
