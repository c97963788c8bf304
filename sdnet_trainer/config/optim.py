"""Typed schemas of the optimizer (``optim``) and its learning-rate schedule (``sched``), kept
beside ``schema.py``, whose ``Config`` includes them (``training/optim.py`` builds both)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class OptimConfig:
    # Any class in torch.optim, by name (SGD, AdamW, ...), or a dotted path to one.
    name: str = "SGD"
    lr: float = 0.1
    weight_decay: float = 0.0
    # Passed only when set, so each optimizer receives just the arguments it knows.
    momentum: Optional[float] = None
    nesterov: Optional[bool] = None
    betas: Optional[List[float]] = None
    eps: Optional[float] = None
    # Anything else the optimizer's constructor takes (e.g. {betas: ..., capturable: true}).
    kwargs: Dict[str, Any] = field(default_factory=dict)
    # auto: the optimizer's fused kernel where it has one for these parameters (SGD, Adam, AdamW
    # on CPU and CUDA; under FSDP/tensor parallel only Adam and AdamW), else torch's default; or
    # force fused | foreach | for_loop.
    implementation: str = "auto"
    # Exclude biases and normalization weights from weight decay (the common ResNet/ViT recipe).
    no_decay_norm_and_bias: bool = False
    # Gradient clipping: by global L2 norm, by value, or neither (null).
    clip_grad_norm: Optional[float] = None
    clip_grad_value: Optional[float] = None


@dataclass
class SchedConfig:
    # constant | cosine | step | multistep; stepped once per optimizer step.
    name: str = "constant"
    warmup_steps: int = 0
    # The warmup starts at lr * warmup_start_factor and rises linearly to lr.
    warmup_start_factor: float = 0.0
    # cosine: lr decays to lr * min_lr_ratio at the last step.
    min_lr_ratio: float = 0.0
    # step: multiply by gamma every step_size steps; multistep: at each milestone step.
    step_size: int = 1000
    gamma: float = 0.1
    milestones: List[int] = field(default_factory=list)


__all__ = ["OptimConfig", "SchedConfig"]
