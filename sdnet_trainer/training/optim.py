"""Optimizer and per-step learning-rate schedule from config, and the checks of their keys."""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
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

logger = logging.getLogger(__name__)

# ``sched.name``: the learning-rate schedules of lr_multiplier.
LR_SCHEDULES = ("constant", "cosine", "wsd", "step", "multistep")
# ``sched.decay_type``: the shapes of wsd's decay (torchtitan's names).
DECAY_TYPES = ("linear", "sqrt", "cosine")
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
    _validate_decay(sched, lr=optim.lr, max_steps=cfg.loop.max_steps)
    if sched.name == "step":
        check_positive("sched.step_size", sched.step_size)
    if sched.name == "multistep" and list(sched.milestones) != sorted(set(sched.milestones)):
        raise ConfigError(f"sched.milestones={list(sched.milestones)} must be strictly increasing")

    check_choice("optim.implementation", optim.implementation, OPTIM_IMPLEMENTATIONS)


def _validate_decay(sched: SchedConfig, *, lr: float, max_steps: int | None) -> None:
    """The floor (``min_lr_ratio`` or ``min_lr``) and the decay's length (``decay_steps``,
    ``decay_ratio``, ``decay_type``); wsd's fit in the run where ``loop.max_steps`` gives its
    length (under ``loop.max_epochs`` lr_multiplier checks it once the data says)."""
    if not 0.0 <= sched.min_lr_ratio <= 1.0:
        raise ConfigError(f"sched.min_lr_ratio={sched.min_lr_ratio} must be in [0, 1]")
    if sched.min_lr is not None:
        if sched.min_lr_ratio != 0.0:
            raise ConfigError(
                f"sched.min_lr={sched.min_lr} and sched.min_lr_ratio={sched.min_lr_ratio} are "
                f"both set; give the floor once, as a learning rate or as a fraction of optim.lr "
                f"(after a recipe that sets sched.min_lr_ratio, add sched.min_lr_ratio=0)"
            )
        if not 0.0 <= sched.min_lr <= lr:
            raise ConfigError(f"sched.min_lr={sched.min_lr} must be in [0, optim.lr={lr}]")
    if sched.decay_steps is not None:
        check_positive("sched.decay_steps", sched.decay_steps)
        if sched.name == "cosine" and sched.decay_steps <= sched.warmup_steps:
            raise ConfigError(
                f"sched.decay_steps={sched.decay_steps} must be greater than "
                f"sched.warmup_steps={sched.warmup_steps}: under sched=cosine it is the step the "
                f"decay ends at, counted from the first step, warmup included"
            )
    if sched.decay_ratio is not None:
        if not 0.0 <= sched.decay_ratio <= 1.0:
            raise ConfigError(f"sched.decay_ratio={sched.decay_ratio} must be in [0, 1]")
        if sched.decay_steps is not None:
            raise ConfigError(
                f"sched.decay_steps={sched.decay_steps} and sched.decay_ratio="
                f"{sched.decay_ratio} are both set; give the decay's length once"
            )
    check_choice("sched.decay_type", sched.decay_type, DECAY_TYPES)
    if sched.name == "wsd" and max_steps is not None:
        _wsd_decay_steps(sched, max_steps)


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """One group, or two when ``optim.no_decay_norm_and_bias`` (every 1-D tensor) or
    ``optim.no_decay_embeddings`` (every nn.Embedding's weight) keep tensors out of weight
    decay: the second group has weight_decay 0."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not (cfg.no_decay_norm_and_bias or cfg.no_decay_embeddings) or cfg.weight_decay == 0:
        return [{"params": params}]
    # By identity: an output layer tied to the token embedding is the same tensor, and
    # model.parameters() yields it once.
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}

    def excluded(p: nn.Parameter) -> bool:
        # 1-D tensors are biases and norm scales/shifts in every model here.
        return (cfg.no_decay_norm_and_bias and p.ndim <= 1) or (
            cfg.no_decay_embeddings and id(p) in embeddings
        )

    decay = [p for p in params if not excluded(p)]
    no_decay = [p for p in params if excluded(p)]
    _log_groups(cfg, decay, no_decay)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def _log_groups(cfg: OptimConfig, decay: list[nn.Parameter], no_decay: list[nn.Parameter]) -> None:
    """The two groups' sizes, once per run (other ranks log warnings only). Not for parameters
    on the meta device: the memory check's probe (fits.py) and the dry run build an optimizer
    there too, and their groups are not the run's."""
    if any(p.is_meta for p in decay + no_decay):
        return
    kept = [
        name
        for name, on in (
            ("1-D tensors (biases, norms)", cfg.no_decay_norm_and_bias),
            ("embeddings", cfg.no_decay_embeddings),
        )
        if on
    ]

    def size(group: list[nn.Parameter]) -> str:
        return f"{len(group)} tensors ({sum(p.numel() for p in group) / 1e6:.2f}M parameters)"

    logger.info(
        "weight decay %g on %s; none on %s: %s",
        cfg.weight_decay,
        size(decay),
        size(no_decay),
        " and ".join(kept),
    )


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


def lr_multiplier(
    cfg: SchedConfig, total_steps: int, *, base_lr: float | None = None
) -> Callable[[int], float]:
    """The factor applied to the base lr before optimizer step ``step`` (0-based).

    Linear warmup from ``warmup_start_factor`` to 1 over ``warmup_steps``, then the named decay
    (step and multistep count absolute steps, like torch's StepLR and MultiStepLR). Cosine and
    wsd end at the floor, ``min_lr_ratio`` or ``min_lr / base_lr`` (``base_lr``: the lr of the
    group it drives, needed with ``min_lr``). A pure function of the step, so resuming needs
    only the step.
    """
    warmup = cfg.warmup_steps
    if cfg.min_lr is None:
        floor = cfg.min_lr_ratio
    elif base_lr is None:
        raise TypeError("lr_multiplier: sched.min_lr needs the group's base_lr")
    else:
        floor = cfg.min_lr / base_lr if base_lr else 0.0
    # cosine: the step that runs at the floor (0-based; null: the run's last); the decay starts
    # at the peak right after the warmup, as nanoGPT's from warmup_iters to lr_decay_iters.
    last = (total_steps if cfg.decay_steps is None else cfg.decay_steps) - 1
    cosine_steps = max(last - warmup, 1)
    # wsd: the decay takes the last wsd_steps steps, the first at the peak, the last at the floor.
    wsd_steps = _wsd_decay_steps(cfg, total_steps) if cfg.name == "wsd" else 0
    wsd_start = total_steps - wsd_steps

    def decayed(shape: str, progress: float) -> float:
        p = min(progress, 1.0)  # past the decay's end the lr stays at the floor
        if shape == "linear":
            left = 1.0 - p
        elif shape == "sqrt":
            left = 1.0 - math.sqrt(p)
        else:
            left = 0.5 * (1.0 + math.cos(math.pi * p))
        return floor + (1.0 - floor) * left

    def factor(step: int) -> float:
        if step < warmup:
            return cfg.warmup_start_factor + (1.0 - cfg.warmup_start_factor) * step / warmup
        if cfg.name == "cosine":
            return decayed("cosine", (step - warmup) / cosine_steps)
        if cfg.name == "wsd":
            if wsd_steps == 0 or step < wsd_start:
                return 1.0
            return decayed(cfg.decay_type, (step - wsd_start) / max(wsd_steps - 1, 1))
        if cfg.name == "step":
            return cfg.gamma ** (step // cfg.step_size)
        if cfg.name == "multistep":
            return cfg.gamma ** sum(step >= m for m in cfg.milestones)
        return 1.0

    return factor


def _wsd_decay_steps(cfg: SchedConfig, total_steps: int) -> int:
    """wsd: how many of the run's last steps the decay takes (``decay_steps``, ``decay_ratio``
    of the run rounded, or all after the warmup); a ConfigError where warmup and decay do not
    fit in the run."""
    if cfg.decay_steps is not None:
        steps, given = cfg.decay_steps, f"sched.decay_steps={cfg.decay_steps}"
    elif cfg.decay_ratio is not None:
        steps = round(total_steps * cfg.decay_ratio)
        given = f"sched.decay_ratio={cfg.decay_ratio} ({steps} steps)"
    else:
        return max(total_steps - cfg.warmup_steps, 0)
    if cfg.warmup_steps + steps > total_steps:
        raise ConfigError(
            f"{given} and sched.warmup_steps={cfg.warmup_steps} do not fit in the run's "
            f"{total_steps} steps; shorten the decay or the warmup"
        )
    return steps


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedConfig, *, total_steps: int
) -> LambdaLR:
    """The schedule as torch's LambdaLR (its state, the step, is what a checkpoint keeps): one
    factor per parameter group, since sched.min_lr is a learning rate, a different fraction of
    each group's own lr."""
    factors = [
        lr_multiplier(cfg, total_steps, base_lr=group.get("initial_lr", group["lr"]))
        for group in optimizer.param_groups
    ]
    return LambdaLR(optimizer, factors)
