"""Activation checkpointing per block (``parallel.activation_checkpointing``), in place.

- ``full``: a block's forward runs inside ``torch.utils.checkpoint`` (non-reentrant): only its
  inputs are kept for backward and everything else is recomputed there, every
  ``parallel.activation_checkpointing_every``-th block (1: all of them).
- ``selective``: the same checkpoint with a per-op policy
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of the ops whose
  recomputation costs most, matmuls and attention (and the collectives of sequence and context
  parallel, which would otherwise run again), are saved in forward; the cheap ops between them,
  norms, activations, rotary positions, residual adds, are recomputed. Less memory than ``none``,
  much less recompute than ``full``; every block.

The forward itself is wrapped, not hooked: ``Module.compile`` then traces the checkpoint as one
region of the block's graph (a higher-order op the partitioner recomputes), as torchtitan's
``checkpoint_wrapper`` before compiling does. The composable ``checkpoint`` works by forward hooks
that dynamo refuses to trace: a graph break at every block, and ``compile.fullgraph=true`` fails.
Unlike ``checkpoint_wrapper`` no module is inserted, so parameter names stay as they are: the
block's class becomes a subclass whose ``forward`` checkpoints the original (as ``fully_shard``
swaps classes), so a copy of the block checkpoints its own forward.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from sdnet_trainer.config.checks import check_choice, check_positive
from sdnet_trainer.config.schema import Config
from sdnet_trainer.errors import ConfigError

MODES = ("none", "full", "selective")


# What selective checkpointing keeps: matmuls (a linear layer is an mm or addmm once autograd has
# run), every attention kernel (and its CPU variant), float8's scaled matmul and its amax, and
# the collectives of sequence and context parallel (context parallel's key/value all-gather, a
# custom op of torch's, included). By qualified name, every overload of each.
SAVED_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::_scaled_mm",
        "aten::_grouped_mm",  # a mixture of experts' projections
        "aten::max",
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_attention_math",
        "_c10d_functional::reduce_scatter_tensor",
        "_c10d_functional::all_gather_into_tensor",
        "_c10d_functional::all_reduce",
        "cplib::flex_cp_allgather",
    }
)


def saves(op: Any) -> bool:
    """Whether selective checkpointing keeps the output of ``op`` (an op overload or packet)."""
    packet = getattr(op, "overloadpacket", op)
    return getattr(packet, "_qualified_op_name", None) in SAVED_OPS


def validate_activation_checkpointing(cfg: Config) -> None:
    """``parallel.activation_checkpointing*``, checked before launch."""
    parallel = cfg.parallel
    check_choice("parallel.activation_checkpointing", parallel.activation_checkpointing, MODES)
    every = parallel.activation_checkpointing_every
    check_positive("parallel.activation_checkpointing_every", every)
    if every != 1 and parallel.activation_checkpointing != "full":
        raise ConfigError(
            f"parallel.activation_checkpointing_every={every} picks which blocks "
            f"parallel.activation_checkpointing=full recomputes; with "
            f"parallel.activation_checkpointing={parallel.activation_checkpointing} leave it 1"
        )


def apply_activation_checkpointing(
    blocks: list[nn.Module], mode: str, *, every: int = 1, model_name: str = "the model"
) -> None:
    """Checkpoint ``blocks`` in place as ``mode`` says (``none``: leave them)."""
    if mode == "none":
        return
    if not blocks:
        raise ConfigError(
            f"parallel.activation_checkpointing={mode}: model.name={model_name!r} has no "
            f"blocks to checkpoint"
        )
    for index, block in enumerate(blocks):
        if mode == "selective" or index % every == 0:
            checkpoint_block(block, selective=mode == "selective")


def checkpoint_block(block: nn.Module, *, selective: bool = False) -> None:
    """Run ``block``'s forward under activation checkpointing from now on (module docstring);
    ``selective``: with the per-op policy. A block checkpointed already stays as it is."""
    cls = type(block)
    if cls in _CHECKPOINTED.values():
        return
    key = (cls, selective)
    if key not in _CHECKPOINTED:
        _CHECKPOINTED[key] = _checkpointed_class(cls, selective)
    block.__class__ = _CHECKPOINTED[key]


# (a block class, selective) -> its checkpointed subclass, made once per class and mode.
_CHECKPOINTED: dict[tuple[type[nn.Module], bool], type[nn.Module]] = {}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if saves(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed_class(cls: type[nn.Module], selective: bool) -> type[nn.Module]:
    options: dict[str, Any] = {"use_reentrant": False}
    if selective:
        options["context_fn"] = _selective_contexts

    class Checkpointed(cls):  # type: ignore[valid-type,misc]  # a subclass of a runtime class
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return checkpoint(super().forward, *args, **options, **kwargs)

    prefix = "SelectivelyCheckpointed" if selective else "Checkpointed"
    Checkpointed.__name__ = Checkpointed.__qualname__ = f"{prefix}{cls.__name__}"
    return Checkpointed


__all__ = [
    "MODES",
    "SAVED_OPS",
    "apply_activation_checkpointing",
    "checkpoint_block",
    "saves",
    "validate_activation_checkpointing",
]
