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
    # Exclude every 1-D tensor from weight decay: biases and normalization scales and shifts in
    # the models here (the common ResNet/ViT recipe), but also any other 1-D parameter. Embedding
    # weights (2-D) stay decayed unless no_decay_embeddings is set.
    no_decay_norm_and_bias: bool = False
    # Exclude the weights of every nn.Embedding (token and position embeddings, and an output
    # layer tied to the token embedding: the same tensor) from weight decay; with
    # no_decay_norm_and_bias too, the usual LLM choice (nanoGPT, OLMo).
    no_decay_embeddings: bool = False
    # Gradient clipping: by global L2 norm, by value, or neither (null).
    clip_grad_norm: Optional[float] = None
    clip_grad_value: Optional[float] = None


@dataclass
class SchedConfig:
    # constant | cosine | wsd | step | multistep; stepped once per optimizer step. wsd: warmup,
    # then the peak lr, then a decay over the run's last steps (decay_steps or decay_ratio).
    name: str = "constant"
    warmup_steps: int = 0
    # The warmup starts at lr * warmup_start_factor and rises linearly to lr.
    warmup_start_factor: float = 0.0
    # cosine, wsd: the decay ends at lr * min_lr_ratio.
    min_lr_ratio: float = 0.0
    # cosine, wsd: the decay ends at this learning rate instead (nanoGPT's min_lr; at most
    # optim.lr); null: lr * min_lr_ratio. Setting it and min_lr_ratio is an error.
    min_lr: Optional[float] = None
    # cosine: the step the decay ends at, counted from the run's first step, warmup included
    # (nanoGPT's lr_decay_iters): the cosine runs from the warmup's end to step N, the N-th step
    # runs at the floor and every later one stays there; null: loop.max_steps (under
    # loop.max_epochs, the run's total steps), so the last step runs at the floor.
    # wsd: the decay's length: it takes the run's last N steps, from the peak at the first of
    # them to the floor at the last.
    decay_steps: Optional[int] = None
    # wsd: the decay's length as a fraction of the run's steps, rounded (torchtitan's
    # decay_ratio; 0.2 is the usual choice). Null, with decay_steps null too: the decay starts
    # where the warmup ends (no constant phase, torchtitan's default).
    decay_ratio: Optional[float] = None
    # wsd: the decay's shape over its progress p from 0 to 1 (torchtitan's decay_type): linear
    # (1 - p), sqrt (1 - sqrt(p)) or cosine (half a cosine period), scaled to end at the floor.
    decay_type: str = "linear"
    # step: multiply by gamma every step_size steps; multistep: at each milestone step.
    step_size: int = 1000
    gamma: float = 0.1
    milestones: List[int] = field(default_factory=list)


__all__ = ["OptimConfig", "SchedConfig"]
