"""What the parallel layouts need to know about a model family.

- **Blocks** (:func:`parallel_blocks`): the repeated units that FSDP shards one at a time, and that
  activation checkpointing and ``torch.compile`` wrap: transformer blocks, ResNet residual blocks.
- **Pipeline units** (:func:`pipeline_units`): module names in execution order whose sequential
  application equals the model's forward; a pipeline stage is a contiguous run of them, so split
  points are given by module name (``layer3``, ``blocks.4``).
- **Tensor-parallel plan**: a model that supports it has ``apply_tensor_parallel(tp_mesh, ...)``.

A model states these itself with ``parallel_blocks()`` / ``pipeline_units()`` methods; torchvision
ResNets and the project's SimpleCNN are described here. The decoder-only language models (GPT,
Llama, the mixture of experts) share one implementation of all three (``models/decoder.py``),
driven by the :class:`DecoderLayout` each family declares below: which modules a block has and
how tensor parallelism splits them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, cast

from torch import nn

from sdnet_trainer.errors import ConfigError
from sdnet_trainer.lazy import loaded_types
from sdnet_trainer.models.simple_cnn import SimpleCNN


@dataclass(frozen=True)
class Unit:
    """One step of a model's forward as a pipeline sees it: ``x = model.get_submodule(name)(x)``,
    after ``x.flatten(1)`` when ``flatten`` (the pooled features entering a classifier head)."""

    name: str
    flatten: bool = False


@dataclass(frozen=True)
class Region:
    """One tensor-parallel region of a block: ``name``'s input is gathered once (the whole
    sequence on every rank), the ``colwise`` projections split by output columns, the ``rowwise``
    ones by input rows, whose partial sums are reduced back into the residual stream."""

    name: str
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]


@dataclass(frozen=True)
class DecoderLayout:
    """A decoder family's module names: ``embed -> blocks[i] -> norm -> head``, where ``embed``
    holds the token embedding ``embed.tok`` (split by vocabulary rows under tensor parallelism)
    and ``replicated`` small tables kept whole on every rank; each block has the ``norms`` and
    the ``regions`` (attention, MLP) in that order."""

    norms: tuple[str, ...]
    regions: tuple[Region, ...]
    replicated: tuple[str, ...] = ()


ATTENTION = Region("attn", colwise=("wq", "wk", "wv"), rowwise=("wo",))
# GPT: learned positions beside the tokens, LayerNorms, a GELU MLP.
GPT_LAYOUT = DecoderLayout(
    norms=("norm1", "norm2"),
    regions=(ATTENTION, Region("mlp", colwise=("w1",), rowwise=("w2",))),
    replicated=("embed.pos",),
)
# Llama: rotary positions inside attention (nothing to replicate), RMSNorms, a SwiGLU MLP whose
# gate (w1) and up (w3) projections split alike.
LLAMA_LAYOUT = DecoderLayout(
    norms=("norm1", "norm2"),
    regions=(ATTENTION, Region("mlp", colwise=("w1", "w3"), rowwise=("w2",))),
)
# Mixture of experts: the Llama's attention region alone; the MoE is whole on every
# tensor-parallel rank (its own plan: models/moe/model.py).
MOE_LAYOUT = DecoderLayout(norms=("norm1", "norm2"), regions=(ATTENTION,))


class _DeclaresBlocks(Protocol):
    """A model that lists its own blocks (see the module docstring)."""

    def parallel_blocks(self) -> Iterable[nn.Module]: ...


class _DeclaresPipelineUnits(Protocol):
    """A model that lists its own pipeline units, as names or Units."""

    def pipeline_units(self) -> Iterable[str | Unit]: ...


def parallel_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model`` (empty when it has none worth wrapping one by one)."""
    if hasattr(model, "parallel_blocks"):
        # The check above found the method; nn.Module's attribute typing cannot express it.
        return list(cast(_DeclaresBlocks, model).parallel_blocks())
    # torchvision's ResNet blocks, matched without importing torchvision, which a model of them
    # has imported already (sdnet_trainer/lazy.py).
    blocks = loaded_types("torchvision.models.resnet", "BasicBlock", "Bottleneck")
    return [m for m in model.modules() if isinstance(m, blocks)]


def pipeline_units(model: nn.Module, model_name: str) -> list[Unit]:
    if hasattr(model, "pipeline_units"):
        # The check above found the method; nn.Module's attribute typing cannot express it.
        units = cast(_DeclaresPipelineUnits, model).pipeline_units()
        return [u if isinstance(u, Unit) else Unit(u) for u in units]
    if isinstance(model, loaded_types("torchvision.models.resnet", "ResNet")):  # as above
        stem = [Unit(n) for n in ("conv1", "bn1", "relu", "maxpool")]
        blocks = [
            Unit(f"layer{i}.{j}")
            for i in range(1, 5)
            for j in range(len(getattr(model, f"layer{i}")))
        ]
        return stem + blocks + [Unit("avgpool"), Unit("fc", flatten=True)]
    if isinstance(model, SimpleCNN):
        features = [Unit(f"features.{i}") for i in range(len(model.features))]
        return features + [Unit("pool"), Unit("fc", flatten=True)]
    if isinstance(model, nn.Sequential):
        return [Unit(name) for name, _ in model.named_children()]
    raise ConfigError(
        f"model.name={model_name!r} has no pipeline split: give the model a pipeline_units() "
        f"method (module names whose sequential application equals its forward)"
    )


def block_unit_indices(model: nn.Module, units: list[Unit]) -> list[int]:
    """Positions in ``units`` of the model's blocks (the default, even split counts these)."""
    blocks = {id(b) for b in parallel_blocks(model)}
    return [i for i, u in enumerate(units) if id(model.get_submodule(u.name)) in blocks]


def supports_tensor_parallel(model: nn.Module) -> bool:
    return hasattr(model, "apply_tensor_parallel")


__all__ = [
    "GPT_LAYOUT",
    "LLAMA_LAYOUT",
    "MOE_LAYOUT",
    "DecoderLayout",
    "Region",
    "Unit",
    "block_unit_indices",
    "parallel_blocks",
    "pipeline_units",
    "supports_tensor_parallel",
]
