"""What the automatic layout needs to know of a model, measured once on the meta device.

The planner weighs hundreds of layouts; building each one, as the dry run does, takes seconds of
a 8B model. The quantities a layout divides are the same for all of them, so they are counted
here once, with the dry run's own counters (``saved_for_backward``, ``optimizer_bytes_per_element``,
FLOPs from ``FlopCounterMode``), and :mod:`~sdnet_trainer.plan.estimate` divides them per layout.
The layout that wins is then built by the dry run itself (``plan/auto.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from sdnet_trainer.config import Config
from sdnet_trainer.data import is_language_model_data
from sdnet_trainer.distributed.env import DistEnv
from sdnet_trainer.distributed.parallelize import checkpoint_block
from sdnet_trainer.models.parallel_spec import parallel_blocks, supports_tensor_parallel
from sdnet_trainer.models.registry import decoder_sizes
from sdnet_trainer.observability.flops import count_flops
from sdnet_trainer.training.classes import resolve_trainer_class
from sdnet_trainer.training.fits import optimizer_bytes_per_element


@dataclass(frozen=True)
class Activations:
    """Bytes one forward of the whole model saves for backward: ``fixed + per_sample x batch``;
    ``params``: the model's elements (a pipeline stage takes its share of the bytes by them)."""

    per_sample: int
    fixed: int
    params: int

    def at(self, batch: int) -> int:
        return self.fixed + self.per_sample * batch


@dataclass(frozen=True)
class ModelStats:
    params: int  # elements, all of them
    head: int  # elements before the first block (embeddings): the first pipeline stage's
    tail: int  # elements after the last block (final norm, output layer): the last stage's
    blocks: tuple[int, ...]  # elements of each repeated block, in order
    unsplit: int  # 1-D elements (norms, biases): tensor parallelism keeps them whole
    bytes_per_param: int  # of a parameter (and its gradient) as the run keeps it
    optim_per_param: float  # optimizer state bytes per trainable element
    activations: Activations  # without activation checkpointing
    checkpointed: Activations | None  # with it (None: no blocks to checkpoint)
    train_flops: float  # forward + backward of one sample
    forward_flops: float  # forward of one sample (what checkpointing recomputes)
    width: int | None  # a decoder's hidden size (the tensor- and pipeline-parallel stream)
    tensor_parallel: bool  # whether the model has a tensor-parallel plan

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)


_MEASURED: dict[str, ModelStats] = {}
_SAVED: dict[tuple[str, bool], Activations] = {}


def _model_key(cfg: Config) -> str:
    """What the measurements depend on (not whether checkpointing is on: both are measured)."""
    model = dataclasses.replace(cfg.model, activation_checkpointing=False)
    return repr((model, cfg.data, cfg.trainer))


def model_stats(cfg: Config) -> ModelStats:
    """The stats of ``cfg``'s model at ``cfg.data``'s sequence length, measured once per model,
    data and optimizer config in a process (a plan, then the dry run of its choice)."""
    key = repr((_model_key(cfg), cfg.optim))
    if key not in _MEASURED:
        _MEASURED[key] = _measure(cfg)
    return _MEASURED[key]


def saved_activations(cfg: Config, checkpointing: bool) -> Activations:
    """What one forward of ``cfg``'s whole model saves for backward, with or without activation
    checkpointing (as ``parallelize`` applies it), measured once per model in a process."""
    key = (_model_key(cfg), checkpointing)
    if key not in _SAVED:
        _measure_activations(cfg, _meta_model(cfg))
    return _SAVED[key]


def _meta_model(cfg: Config) -> nn.Module:
    trainer = resolve_trainer_class(cfg.trainer._target_)(cfg, env=DistEnv())
    with torch.device("meta"):
        return trainer.build_model()


def _measure(cfg: Config) -> ModelStats:
    model = _meta_model(cfg)
    blocks = parallel_blocks(model)
    head, tail = _outside_blocks(model, blocks)
    params = list(model.parameters())
    train, forward = _flops(cfg, model)
    plain, checkpointed = _measure_activations(cfg, model)  # checkpoints the blocks: last
    sizes = decoder_sizes(cfg.model)
    return ModelStats(
        params=sum(p.numel() for p in params),
        head=head,
        tail=tail,
        blocks=tuple(sum(p.numel() for p in b.parameters()) for b in blocks),
        unsplit=sum(p.numel() for p in params if p.dim() < 2),
        bytes_per_param=params[0].element_size() if params else 4,
        optim_per_param=optimizer_bytes_per_element(cfg),
        activations=plain,
        checkpointed=checkpointed,
        train_flops=train,
        forward_flops=forward,
        width=sizes[0] if sizes is not None else None,
        tensor_parallel=supports_tensor_parallel(model),
    )


def _measure_activations(cfg: Config, model: nn.Module) -> tuple[Activations, Activations | None]:
    """Saved bytes at batch 1 and 2 (what grows with the batch, and what does not), without and
    with the blocks checkpointed (which this does to ``model``); None where it has no blocks."""
    params = sum(p.numel() for p in model.parameters())

    def measured() -> Activations:
        one = forward_saved_bytes(cfg, model, 1)
        two = forward_saved_bytes(cfg, model, 2)
        return Activations(per_sample=two - one, fixed=max(0, 2 * one - two), params=params)

    key = _model_key(cfg)
    _SAVED[key, False] = plain = measured()
    blocks = parallel_blocks(model)
    for block in blocks:
        checkpoint_block(block)
    _SAVED[key, True] = checkpointed = measured() if blocks else plain
    return plain, (checkpointed if blocks else None)


def sample_input(cfg: Config, batch: int) -> torch.Tensor:
    data = cfg.data
    if is_language_model_data(data):
        return torch.zeros(batch, data.seq_len, dtype=torch.long, device="meta")
    return torch.zeros(batch, 3, data.image_size, data.image_size, device="meta")


T = TypeVar("T")


def saved_for_backward(forward: Callable[[], T], model: nn.Module | None = None) -> tuple[int, T]:
    """Bytes autograd keeps for backward while ``forward`` runs (on the meta device too), and
    what ``forward`` returned. Saved views of ``model``'s parameters (a linear layer keeps its
    weight for the input's gradient) are not counted: they are the parameters' own memory."""
    saved = 0
    owned = {p.untyped_storage()._cdata for p in model.parameters()} if model is not None else set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if t.untyped_storage()._cdata not in owned:
            saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = forward()
    return saved, result


def forward_saved_bytes(cfg: Config, model: nn.Module, micro_batch: int) -> int:
    """Bytes one forward of the whole ``model`` (meta) saves for backward at ``micro_batch``."""
    saved, _ = saved_for_backward(lambda: model(sample_input(cfg, micro_batch)), model)
    return saved


def _outside_blocks(model: nn.Module, blocks: list[nn.Module]) -> tuple[int, int]:
    """Elements registered before the first block and after the last (each counted once)."""
    inside = {id(p) for b in blocks for p in b.parameters()}
    first = {id(p) for p in blocks[0].parameters()} if blocks else set()
    head = tail = 0
    seen: set[int] = set()
    before = True
    for p in model.parameters():
        if id(p) in first:
            before = False
        if id(p) in inside or id(p) in seen:
            continue
        seen.add(id(p))
        if before:
            head += p.numel()
        else:
            tail += p.numel()
    return head, tail


def _flops(cfg: Config, model: nn.Module) -> tuple[float, float]:
    """FLOPs of one sample: forward and backward together, and the forward alone."""
    out: list[torch.Tensor] = []
    forward = count_flops(lambda: out.append(model(sample_input(cfg, 1))))
    backward = count_flops(lambda: out[0].float().sum().backward())
    return float(forward + backward), float(forward)


__all__ = [
    "Activations",
    "ModelStats",
    "forward_saved_bytes",
    "model_stats",
    "sample_input",
    "saved_activations",
    "saved_for_backward",
]
