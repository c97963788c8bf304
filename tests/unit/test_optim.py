"""Optimizer construction from config and the per-step learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sdnet_trainer.config import OptimConfig, SchedConfig, compose
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models import build_model
from sdnet_trainer.training.optim import (
    build_optimizer,
    build_scheduler,
    lr_multiplier,
    validate_optim,
)
from tests.support import TINY, main_in_process


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


def _lrs(sched: SchedConfig, *, total_steps: int, lr: float = 1.0, steps: int | None = None):
    """The lr each optimizer step of a run of ``total_steps`` runs at, read off the optimizer."""
    opt = build_optimizer(_model(), OptimConfig(name="SGD", lr=lr))
    scheduler = build_scheduler(opt, sched, total_steps=total_steps)
    seen = []
    for _ in range(total_steps if steps is None else steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return seen


def test_cosine_decay_steps_ends_the_decay_at_that_step_as_nanogpt():
    lr, min_lr, warmup, decay_steps = 0.5, 0.05, 2, 8

    # nanoGPT's get_lr (train.py) of the 0-based step, with lr_decay_iters = decay_steps - 1:
    # nanoGPT's loop runs max_iters + 1 iterations, so its lr_decay_iters=max_iters puts the last
    # at the floor, as decay_steps=loop.max_steps (the N-th step) does here.
    def nanogpt(step: int) -> float:
        if step < warmup:
            return lr * step / warmup  # this project's warmup: from warmup_start_factor=0
        if step > decay_steps - 1:
            return min_lr
        ratio = (step - warmup) / (decay_steps - 1 - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)

    cfg = SchedConfig(name="cosine", warmup_steps=warmup, min_lr=min_lr, decay_steps=decay_steps)
    seen = _lrs(cfg, total_steps=12, lr=lr)
    assert seen == pytest.approx([nanogpt(s) for s in range(12)])
    assert seen[decay_steps - 1] == pytest.approx(min_lr) and seen[decay_steps - 2] > min_lr
    assert seen[decay_steps:] == pytest.approx([min_lr] * 4)  # then stays at the floor
    # null: the decay ends at the run's last step, as decay_steps=max_steps.
    as_max = SchedConfig(name="cosine", warmup_steps=warmup, min_lr_ratio=0.1, decay_steps=12)
    default = SchedConfig(name="cosine", warmup_steps=warmup, min_lr_ratio=0.1)
    assert _lrs(as_max, total_steps=12) == _lrs(default, total_steps=12)


def test_wsd_warms_up_holds_then_decays_over_the_last_steps():
    # 10 steps: warmup 2, constant, then the last 4 from the peak (step 6) to the floor (step 9).
    linear = SchedConfig(name="wsd", warmup_steps=2, decay_steps=4, min_lr_ratio=0.1)
    assert _lrs(linear, total_steps=10) == pytest.approx(
        [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.1 + 0.9 * 2 / 3, 0.1 + 0.9 / 3, 0.1]
    )
    # decay_ratio: the decay's length as a fraction of the run (torchtitan's), rounded.
    ratio = SchedConfig(name="wsd", warmup_steps=2, decay_ratio=0.4, min_lr_ratio=0.1)
    assert _lrs(ratio, total_steps=10) == _lrs(linear, total_steps=10)
    shapes = {
        "linear": lambda p: 1 - p,
        "sqrt": lambda p: 1 - math.sqrt(p),
        "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    }
    for name, shape in shapes.items():
        cfg = SchedConfig(name="wsd", decay_steps=5, decay_type=name, min_lr=0.02)
        expected = [0.2] * 15 + [0.02 + 0.18 * shape(t / 4) for t in range(5)]
        assert _lrs(cfg, total_steps=20, lr=0.2) == pytest.approx(expected), name


def test_wsd_without_a_length_decays_after_the_warmup_like_cosine():
    wsd = SchedConfig(name="wsd", warmup_steps=3, decay_type="cosine", min_lr_ratio=0.1)
    cosine = SchedConfig(name="cosine", warmup_steps=3, min_lr_ratio=0.1)
    assert _lrs(wsd, total_steps=11) == pytest.approx(_lrs(cosine, total_steps=11))


def test_the_schedule_resumes_exactly_from_its_state():
    cfg = SchedConfig(name="wsd", warmup_steps=2, decay_steps=5, decay_type="sqrt", min_lr=0.01)
    whole = _lrs(cfg, total_steps=12, lr=0.1)
    opt = build_optimizer(_model(), OptimConfig(name="SGD", lr=0.1))
    first = build_scheduler(opt, cfg, total_steps=12)
    for _ in range(8):
        opt.step()
        first.step()
    state = first.state_dict()
    opt2 = build_optimizer(_model(), OptimConfig(name="SGD", lr=0.1))
    second = build_scheduler(opt2, cfg, total_steps=12)
    second.load_state_dict(state)
    opt2.param_groups[0]["lr"] = second.get_last_lr()[0]  # as the optimizer's state restores it
    resumed = []
    for _ in range(4):
        resumed.append(opt2.param_groups[0]["lr"])
        opt2.step()
        second.step()
    assert resumed == whole[8:]  # bitwise


@pytest.mark.parametrize(
    "keys, named",
    [
        (
            ["sched.min_lr=0.01", "sched.min_lr_ratio=0.1"],
            ["sched.min_lr=0.01", "min_lr_ratio=0.1"],
        ),
        (["sched.min_lr=0.5"], ["sched.min_lr=0.5", "optim.lr=0.1"]),
        (["sched.decay_steps=10", "sched.decay_ratio=0.2"], ["decay_steps=10", "decay_ratio=0.2"]),
        (["sched.decay_steps=95", "sched.warmup_steps=10"], ["decay_steps=95", "100 steps"]),
        (["sched.decay_ratio=0.95", "sched.warmup_steps=10"], ["decay_ratio=0.95", "100 steps"]),
        (["sched.decay_type=exp"], ["sched.decay_type='exp'"]),
        (["sched.name=cosine", "sched.decay_steps=5", "sched.warmup_steps=5"], ["decay_steps=5"]),
    ],
)
def test_bad_schedule_keys_are_refused_naming_them(keys, named):
    cfg = compose(["sched=wsd", "optim.lr=0.1", "loop.max_steps=100", *keys])
    with pytest.raises(ConfigError) as err:
        validate_optim(cfg)
    assert all(word in str(err.value) for word in named), str(err.value)


def test_wsd_that_does_not_fit_a_run_of_epochs_is_refused_at_build():
    cfg = SchedConfig(name="wsd", warmup_steps=5, decay_steps=10)
    with pytest.raises(ConfigError, match=r"decay_steps=10 and sched.warmup_steps=5 .* 12 steps"):
        lr_multiplier(cfg, total_steps=12)


@pytest.mark.usefixtures("main_in_this_process")
def test_the_command_line_refuses_both_floors(tmp_path, monkeypatch, capfd):
    argv = [*TINY, f"run.root={tmp_path}", "sched=cosine", "sched.min_lr=0.001"]
    code, output = main_in_process([*argv, "sched.min_lr_ratio=0.1"], monkeypatch, capfd)
    assert code == 2, output[-3000:]
    assert "sched.min_lr=0.001 and sched.min_lr_ratio=0.1 are both set" in output
    assert "Traceback" not in output


def _groups(model: nn.Module, **flags) -> tuple[set[int], set[int]]:
    opt = build_optimizer(model, OptimConfig(name="AdamW", lr=1e-3, weight_decay=0.1, **flags))
    decay, no_decay = opt.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    return {id(p) for p in decay["params"]}, {id(p) for p in no_decay["params"]}


def test_no_decay_embeddings_takes_a_tied_head_out_once(caplog):
    model = build_model(compose(["model=llama3_debug", "model.llama.tie_embeddings=true"]).model)
    tok = model.embed.tok.weight
    assert model.head.weight is tok
    params = list(model.parameters())
    one_d = {id(p) for p in params if p.ndim == 1}
    assert one_d  # the RMSNorm scales
    with caplog.at_level("INFO", logger="sdnet_trainer.training.optim"):
        decay, no_decay = _groups(model, no_decay_embeddings=True)
    assert no_decay == {id(tok)} and len(decay) == len(params) - 1
    (line,) = [r.getMessage() for r in caplog.records if "weight decay" in r.getMessage()]
    assert f"none on 1 tensors ({tok.numel() / 1e6:.2f}M parameters): embeddings" in line
    # With the 1-D tensors too; the tied tensor counted once over the two groups.
    decay, no_decay = _groups(model, no_decay_embeddings=True, no_decay_norm_and_bias=True)
    assert no_decay == one_d | {id(tok)} and not decay & no_decay
    assert len(decay) + len(no_decay) == len(params)
    # The old key alone: every 1-D tensor, the embedding decayed.
    decay, no_decay = _groups(model, no_decay_norm_and_bias=True)
    assert no_decay == one_d and id(tok) in decay


def test_no_decay_embeddings_on_the_gpt_takes_token_and_position_embeddings():
    model = build_model(compose(["model=gpt_tiny"]).model)
    decay, no_decay = _groups(model, no_decay_embeddings=True)
    assert no_decay == {id(model.embed.tok.weight), id(model.embed.pos.weight)}
    assert id(model.head.weight) in decay  # the GPT's head is its own tensor
