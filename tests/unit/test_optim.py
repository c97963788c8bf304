"""Optimizer construction from config and the per-step learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sdnet_trainer.config import OptimConfig, SchedConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.training.optim import build_optimizer, build_scheduler, lr_multiplier


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def test_sgd_gets_momentum_and_nesterov():
    opt = build_optimizer(
        _model(), OptimConfig(name="SGD", lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    )
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.SGD)
    assert (group["lr"], group["momentum"], group["nesterov"], group["weight_decay"]) == (
        0.1,
        0.9,
        True,
        1e-4,
    )


def test_adamw_gets_betas_and_extra_kwargs():
    opt = build_optimizer(
        _model(), OptimConfig(name="AdamW", lr=1e-3, betas=[0.8, 0.95], kwargs={"amsgrad": True})
    )
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["betas"] == (0.8, 0.95) and opt.param_groups[0]["amsgrad"] is True


def test_dotted_path_optimizer():
    opt = build_optimizer(_model(), OptimConfig(name="torch.optim.RMSprop", lr=0.01, momentum=0.5))
    assert isinstance(opt, torch.optim.RMSprop)


def test_argument_the_optimizer_does_not_take_is_named():
    with pytest.raises(ConfigError, match=r"optim.name='Adam' does not take optim.momentum"):
        build_optimizer(_model(), OptimConfig(name="Adam", momentum=0.9))
    with pytest.raises(ConfigError, match=r"optim.kwargs.bogus"):
        build_optimizer(_model(), OptimConfig(name="SGD", kwargs={"bogus": 1}))


def test_no_decay_for_norm_and_bias():
    opt = build_optimizer(_model(), OptimConfig(weight_decay=0.1, no_decay_norm_and_bias=True))
    decay, no_decay = opt.param_groups
    assert all(p.ndim == 2 for p in decay["params"]) and len(decay["params"]) == 2
    assert all(p.ndim == 1 for p in no_decay["params"]) and len(no_decay["params"]) == 4
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)


def test_warmup_then_cosine():
    f = lr_multiplier(
        SchedConfig(name="cosine", warmup_steps=10, warmup_start_factor=0.1, min_lr_ratio=0.01),
        total_steps=111,
    )
    assert f(0) == pytest.approx(0.1)
    assert f(5) == pytest.approx(0.55)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.01 + 0.99 * 0.5)  # half-way through the decay
    assert f(110) == pytest.approx(0.01)  # the last step runs at the final value
    values = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_step_multistep_constant():
    step = lr_multiplier(SchedConfig(name="step", step_size=10, gamma=0.5), total_steps=100)
    assert [step(s) for s in (0, 9, 10, 25)] == [1.0, 1.0, 0.5, 0.25]
    multi = lr_multiplier(
        SchedConfig(name="multistep", milestones=[3, 7], gamma=0.1), total_steps=10
    )
    assert [multi(s) for s in (2, 3, 6, 7)] == pytest.approx([1.0, 0.1, 0.1, 0.01])
    assert lr_multiplier(SchedConfig(name="constant"), total_steps=10)(9) == 1.0


def test_scheduler_drives_the_optimizer_lr():
    model = _model()
    opt = build_optimizer(model, OptimConfig(name="SGD", lr=0.2))
    sched = build_scheduler(opt, SchedConfig(name="cosine", warmup_steps=2), total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [0.0, 0.1] + [0.2 * 0.5 * (1 + math.cos(math.pi * t / 3)) for t in range(4)]
    assert expected[-1] == pytest.approx(0.0)
    assert seen == pytest.approx(expected)


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_auto_implementation_is_fused_on_plain_cpu_parameters(name):
    opt = build_optimizer(_model(), OptimConfig(name=name, lr=0.01))
    assert opt.param_groups[0]["fused"] is True


def test_a_foreach_choice_in_kwargs_keeps_auto_from_adding_fused():
    opt = build_optimizer(_model(), OptimConfig(name="SGD", kwargs={"foreach": True}))
    group = opt.param_groups[0]
    assert group["foreach"] is True and not group["fused"]


def test_auto_fuses_sharded_parameters_only_where_torch_can():
    """DTensor parameters (FSDP2, tensor parallel): fused AdamW has a sharding rule, fused SGD
    raises "does not have a sharding strategy registered", so auto leaves SGD to torch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = distribute_module(_model(), init_device_mesh("cpu", (2,)))
        assert not build_optimizer(model, OptimConfig(name="SGD")).param_groups[0]["fused"]
        assert build_optimizer(model, OptimConfig(name="AdamW")).param_groups[0]["fused"] is True
    finally:
        dist.destroy_process_group()
