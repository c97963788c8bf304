"""Optimizer and per-step learning-rate schedule from config, and the checks of their keys."""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from sdnet_trainer.config.checks import check_choice, check_positive
from sdnet_trainer.config.schema import Config, OptimConfig, SchedConfig
from sdnet_trainer.config.synonyms import group_hint
from sdnet_trainer.errors import ConfigError

# ``sched.name``: the learning-rate schedules of lr_multiplier.
LR_SCHEDULES = ("constant", "cosine", "step", "multistep")
OPTIM_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")
# Typed optional fields of OptimConfig, forwarded only when set.
_OPTIONAL_ARGS = ("momentum", "nesterov", "betas", "eps")


def resolve_optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """``optim.name``: a class of torch.optim (``AdamW``) or a dotted path (``my_pkg.Lion``)."""
    module_name, _, cls_name = name.rpartition(".")
    try:
        module = importlib.import_module(module_name or "torch.optim")
        cls = getattr(module, cls_name)
    except (ImportError, AttributeError):
        known = [
            n
            for n in dir(torch.optim)
            if isinstance(getattr(torch.optim, n), type)
            and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
        ]
        close = difflib.get_close_matches(cls_name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"optim.name={name!r} is neither a torch.optim class nor an importable "
            f"dotted path{hint}"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"optim.name={name!r} is not a torch.optim.Optimizer subclass")
    return cls


def validate_optim(cfg: Config) -> None:
    """``optim.*``, ``sched.*`` and ``loss.label_smoothing``, checked before launch."""
    optim, sched = cfg.optim, cfg.sched
    cls = resolve_optimizer_class(optim.name)
    # The keys the optimizer would not take (optim.name=AdamW over the sgd group's momentum),
    # refused before launch; build_optimizer checks again with the implementation's flags.
    user_kwargs: dict[str, Any] = {"lr": optim.lr, "weight_decay": optim.weight_decay}
    user_kwargs.update(
        {k: getattr(optim, k) for k in _OPTIONAL_ARGS if getattr(optim, k) is not None}
    )
    user_kwargs.update(optim.kwargs)
    _check_accepted(cls, optim, user_kwargs)
    check_positive("optim.lr", optim.lr, allow_zero=True)
    if optim.clip_grad_norm is not None and optim.clip_grad_value is not None:
        raise ConfigError(
            f"optim.clip_grad_norm={optim.clip_grad_norm} and optim.clip_grad_value="
            f"{optim.clip_grad_value} are both set; clip by norm or by value, not both"
        )
    check_positive("optim.clip_grad_norm", optim.clip_grad_norm, allow_none=True)
    check_positive("optim.clip_grad_value", optim.clip_grad_value, allow_none=True)
    if not 0.0 <= cfg.loss.label_smoothing < 1.0:
        raise ConfigError(f"loss.label_smoothing={cfg.loss.label_smoothing} must be in [0, 1)")

    check_choice("sched.name", sched.name, LR_SCHEDULES)
    check_positive("sched.warmup_steps", sched.warmup_steps, allow_zero=True)
    if not 0.0 <= sched.warmup_start_factor <= 1.0:
        raise ConfigError(
            f"sched.warmup_start_factor={sched.warmup_start_factor} must be in [0, 1]"
        )
    if not 0.0 <= sched.min_lr_ratio <= 1.0:
        raise ConfigError(f"sched.min_lr_ratio={sched.min_lr_ratio} must be in [0, 1]")
    if sched.name == "step":
        check_positive("sched.step_size", sched.step_size)
    if sched.name == "multistep" and list(sched.milestones) != sorted(set(sched.milestones)):
        raise ConfigError(f"sched.milestones={list(sched.milestones)} must be strictly increasing")

    check_choice("optim.implementation", optim.implementation, OPTIM_IMPLEMENTATIONS)


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """One group, or two when biases and normalization weights are kept out of weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not cfg.no_decay_norm_and_bias or cfg.weight_decay == 0:
        return [{"params": params}]
    # 1-D tensors are biases and norm scales/shifts in every torchvision model.
    decay = [p for p in params if p.ndim > 1]
    no_decay = [p for p in params if p.ndim <= 1]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    *,
    zero_group: dist.ProcessGroup | None | bool = False,
) -> torch.optim.Optimizer:
    """The optimizer of ``optim.*`` over ``model``'s parameters.

    ``zero_group`` (a process group, or None for all ranks) shards the optimizer state over the
    data-parallel ranks with ZeroRedundancyOptimizer (ZeRO-1); False builds the plain optimizer.
    """
    cls = resolve_optimizer_class(cfg.name)
    # Keyword arguments of the optimizer's constructor, checked against its signature below.
    kwargs: dict[str, Any] = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    for name in _OPTIONAL_ARGS:
        value = getattr(cfg, name)
        if value is not None:
            kwargs[name] = tuple(value) if name == "betas" else value
    kwargs.update(_implementation_kwargs(cls, cfg, list(model.parameters())))
    kwargs.update(cfg.kwargs)
    _check_accepted(cls, cfg, kwargs)
    if zero_group is not False:
        group = None if zero_group is True else zero_group
        return ZeroRedundancyOptimizer(
            param_groups(model, cfg), optimizer_class=cls, process_group=group, **kwargs
        )
    return cls(param_groups(model, cfg), **kwargs)


def _check_accepted(cls: type[torch.optim.Optimizer], cfg: OptimConfig, kwargs: dict) -> None:
    """Each of ``kwargs`` an argument of ``cls``'s constructor; else a ConfigError naming the keys
    and, where ``optim.name`` names an option of the optim group, the group to choose instead
    (``optim.name=AdamW`` keeps the sgd group's momentum; ``optim=adamw`` brings AdamW's keys)."""
    accepted = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return
    unknown = sorted(k for k in kwargs if k not in accepted)
    if unknown:
        keys = ", ".join(
            f"optim.{k}" if k in _OPTIONAL_ARGS else f"optim.kwargs.{k}" for k in unknown
        )
        hint = group_hint("optim", cfg.name)
        raise ConfigError(
            f"optim.name={cfg.name!r} does not take {keys}" + (f"; {hint}" if hint else "")
        )


def _implementation_kwargs(
    cls: type[torch.optim.Optimizer], cfg: OptimConfig, params: list[nn.Parameter]
) -> dict:
    """``optim.implementation``: auto picks the fused kernels wherever the optimizer has them for
    these parameters, else torch's own default (foreach on CUDA, a loop on the CPU).

    Fused means one pass over each parameter's memory instead of one per operation: on this
    project's CPU benchmark machine a ResNet-18 SGD-with-momentum step took about a third of the
    time of torch's CPU default, AdamW a fifth, so the CPU gets them too (torchtitan also
    defaults to fused)."""
    accepted = inspect.signature(cls).parameters
    impl = cfg.implementation
    if impl == "auto":
        chosen_by_user = "fused" in cfg.kwargs or "foreach" in cfg.kwargs
        fused = "fused" in accepted and not chosen_by_user and _fused_runs_on(cls, params)
        return {"fused": True} if fused else {}
    flag = {"fused": "fused", "foreach": "foreach", "for_loop": "foreach"}[impl]
    if flag not in accepted:
        raise ConfigError(
            f"optim.implementation={impl}: optim.name={cfg.name!r} has no {flag!r} argument"
        )
    return {flag: impl != "for_loop"}


def _fused_runs_on(cls: type[torch.optim.Optimizer], params: list[nn.Parameter]) -> bool:
    """Whether ``cls``'s fused kernel takes ``params``: sharded parameters (FSDP2, tensor
    parallel: DTensors) only where torch registered a sharding rule for that kernel (Adam and
    AdamW have one; SGD's fused kernel raises on DTensors)."""
    if not any(isinstance(p, DTensor) for p in params):
        return True
    op = getattr(torch.ops.aten, f"_fused_{cls.__name__.lower()}_", None)
    propagator = DTensor._op_dispatcher.sharding_propagator
    tables = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")
    return op is not None and any(op.default in getattr(propagator, t, {}) for t in tables)


def lr_multiplier(cfg: SchedConfig, total_steps: int) -> Callable[[int], float]:
    """The factor applied to the base lr before optimizer step ``step`` (0-based).

    Linear warmup from ``warmup_start_factor`` to 1 over ``warmup_steps``, then the named decay
    over the remaining steps (step and multistep count absolute steps, like torch's StepLR and
    MultiStepLR). A pure function of the step, so resuming needs only the step.
    """
    warmup = cfg.warmup_steps
    # The last step (total_steps - 1) runs at exactly the final value.
    decay_steps = max(total_steps - warmup - 1, 1)

    def factor(step: int) -> float:
        if step < warmup:
            return cfg.warmup_start_factor + (1.0 - cfg.warmup_start_factor) * step / warmup
        t = step - warmup
        if cfg.name == "cosine":
            progress = min(t / decay_steps, 1.0)
            return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (
                1.0 + math.cos(math.pi * progress)
            )
        if cfg.name == "step":
            return cfg.gamma ** (step // cfg.step_size)
        if cfg.name == "multistep":
            return cfg.gamma ** sum(step >= m for m in cfg.milestones)
        return 1.0

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedConfig, *, total_steps: int
) -> LambdaLR:
    return LambdaLR(optimizer, lr_multiplier(cfg, total_steps))
