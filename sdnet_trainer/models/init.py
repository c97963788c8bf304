"""Initialise a model built on the meta device, after it has been parallelized, to the weights a
CPU build with the same seed gives.

A large model is never whole on a rank: the Trainer builds it under ``torch.device("meta")``
(shapes only), shards it (tensor parallel, FSDP), allocates this rank's pieces with
:func:`allocate` (``Module.to_empty``; under FSDP's CPU offload the parameters in CPU memory, the
buffers on the device) and only then writes values, with :func:`materialize`.

An init is a list of :class:`InitStep`, each setting one module's own tensors. Two kinds:

- A :class:`Draw` sets one parameter to a distribution's values at its elements' indices, from a
  counter-based stream keyed by the model's seed and the parameter's name
  (``models/init_values.py``). Each rank computes exactly its shard, on its device, with no full
  tensor and no communication, and every layout gets the same values. The project's families
  (``models/decoder.py``: GPT, Llama, MoE) declare every parameter this way; their one random
  draw at construction is the seed, from the CPU generator.
- Any other step is *replayed*: it runs on full-size CPU stand-ins of its module's tensors,
  drawing from the CPU generator exactly as construction does, and each real tensor receives the
  part this rank holds. Every rank runs every step, so the generator stays in step on all ranks
  with no communication. This keeps torchvision's ResNets, a user's module with ``init_steps()``
  and peft's adapters exact to their CPU build; it costs each rank the whole model's draws, one
  module's full tensors at a time, and suits models of their size. The families use it only for
  computed buffers (rotary frequencies, routing statistics).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from sdnet_trainer.lazy import loaded_types
from sdnet_trainer.models.init_values import Distribution, fill

if TYPE_CHECKING:
    from torchvision.models.resnet import ResNet


@dataclass(frozen=True)
class InitStep:
    """``fn(module)`` sets the module's own (non-recursive) parameters and buffers in place."""

    module: nn.Module
    fn: Callable[[nn.Module], None]


class Direct:
    """An :class:`InitStep`'s ``fn`` that :func:`materialize` runs on the real module itself
    (its tensors as allocated, DTensor shards included), not on full-size CPU stand-ins."""


def draw_seed() -> int:
    """A model's init seed: one 64-bit draw from the CPU generator."""
    return int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64, device="cpu"))


class SeedDraw(Direct):
    """Construction's draw of the seed (:func:`draw_seed`), made again and discarded (the
    :class:`Draw` steps hold the seed): the CPU generator then ends where a CPU build leaves
    it, so what is initialised after the model (LoRA's adapters) draws the same numbers."""

    def __call__(self, module: nn.Module) -> None:
        draw_seed()


@dataclass(frozen=True)
class Draw(Direct):
    """An :class:`InitStep`'s ``fn`` that sets the module's parameter ``name`` to ``dist``'s
    values at its elements' indices in the whole tensor, from the stream of (``seed``, ``key``):
    ``key`` is the parameter's name in the model as built, so a name the layout changes (a
    pipeline stage's, a wrapper's) draws the same numbers. Works on a whole tensor, a DTensor
    (this rank's block) and, doing nothing, on a meta tensor (not on this rank)."""

    name: str
    key: str
    dist: Distribution
    seed: int

    def __call__(self, module: nn.Module) -> None:
        tensor = module._parameters[self.name]
        assert tensor is not None, f"{self.key} is not a parameter"
        fill(tensor, self.dist, seed=self.seed, key=self.key)


class _DeclaresInit(Protocol):
    """A model that lists its own init (see :func:`init_steps`)."""

    def init_steps(self) -> list[InitStep]: ...


def reset(module: nn.Module) -> None:
    """The layer's own ``reset_parameters`` (what its constructor ran)."""
    module.reset_parameters()  # type: ignore[operator]  # checked by construction_resets


def construction_resets(modules: Iterable[nn.Module]) -> list[InitStep]:
    """The ``reset_parameters`` calls that constructing ``modules`` (in this order) makes:
    torch's layers draw their default init there (Linear, Conv, Embedding), or set constants
    and reset running statistics (LayerNorm, BatchNorm)."""
    return [InitStep(m, reset) for m in modules if callable(getattr(m, "reset_parameters", None))]


def init_steps(model: nn.Module) -> list[InitStep] | None:
    """The model's init as steps (those kept under :data:`CONSTRUCTION_STEPS`, its own
    ``init_steps()``, or this module's for torchvision ResNets), or None where no init
    reproducing the CPU build is known."""
    kept = getattr(model, CONSTRUCTION_STEPS, None)
    if kept is not None:
        return list(kept)
    if callable(getattr(model, "init_steps", None)):
        return cast(_DeclaresInit, model).init_steps()
    # Matched without importing torchvision: a ResNet exists only once it is imported (lazy.py).
    if type(model) in loaded_types("torchvision.models.resnet", "ResNet"):
        return resnet_init_steps(cast("ResNet", model))
    return None


def resnet_init_steps(model: ResNet) -> list[InitStep]:
    """torchvision's ``ResNet.__init__``: layers in construction order (``_make_layer`` builds a
    block's ``downsample`` before the block itself), then Kaiming-normal convolutions and unit
    norms over ``modules()``, then optionally the last norm of each residual branch at zero.

    A stem replaced after construction (``model.cifar_stem``, see the registry) is replayed as
    built: the original 7x7 convolution draws its numbers in its place (a meta stand-in, nothing
    kept), and the replacement's own reset comes last."""
    from torchvision.models.resnet import BasicBlock, Bottleneck  # imported with the ResNet

    replaced = getattr(model, REPLACED_STEM, None)
    stem = nn.Conv2d(**replaced, device="meta") if replaced is not None else model.conv1

    def constructed(m: nn.Module) -> nn.Module:
        return stem if m is model.conv1 else m

    order: list[nn.Module] = []
    seen: set[int] = set()
    for m in model.modules():
        # modules() is depth-first in registration order; only a downsample moves ahead.
        ahead = getattr(m, "downsample", None) if isinstance(m, (BasicBlock, Bottleneck)) else None
        for sub in [*(ahead.modules() if ahead is not None else ()), m]:
            if id(sub) not in seen:
                seen.add(id(sub))
                order.append(constructed(sub))
    steps = construction_resets(order)
    for m in map(constructed, model.modules()):
        if isinstance(m, nn.Conv2d):
            steps.append(InitStep(m, _kaiming_fan_out))
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            steps.append(InitStep(m, _unit_norm))
    if getattr(model, ZERO_INIT_RESIDUAL, False):
        for m in model.modules():
            last = (
                m.bn3 if isinstance(m, Bottleneck) else m.bn2 if isinstance(m, BasicBlock) else None
            )
            if last is not None and last.weight is not None:
                steps.append(InitStep(last, _zero_weight))
    if replaced is not None:
        steps += construction_resets([model.conv1])
    return steps


# Attributes the registry sets on a torchvision ResNet, which keeps neither: the keyword arguments
# of the convolution a stem replacement removed, and the constructor's zero_init_residual.
REPLACED_STEM = "replaced_stem"
ZERO_INIT_RESIDUAL = "zero_init_residual"
# A model whose layers were wrapped after it was built on the meta device (peft's adapters,
# models/lora.py) keeps its construction's steps here, taken before the wrapping: its own
# init_steps() would walk the wrapped layers, under other names and with the adapters' among them.
CONSTRUCTION_STEPS = "construction_init_steps"


def _kaiming_fan_out(m: nn.Module) -> None:
    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")  # type: ignore[arg-type]


def _unit_norm(m: nn.Module) -> None:
    nn.init.constant_(m.weight, 1)  # type: ignore[arg-type]
    nn.init.constant_(m.bias, 0)  # type: ignore[arg-type]


def _zero_weight(m: nn.Module) -> None:
    nn.init.constant_(m.weight, 0)  # type: ignore[arg-type]


def build_deferred(
    build: Callable[[], nn.Module], *, on_meta: bool
) -> tuple[nn.Module, list[InitStep] | None]:
    """``build()``, on the meta device where that is safe, with the steps that initialise it;
    steps are None for a model built with its values (on the CPU).

    ``on_meta``: the caller knows ``build`` only constructs (no weights loaded from files), so
    it runs under ``torch.device("meta")``; a model without known init steps is then built
    again on the CPU, from the same generator state. Otherwise ``build`` runs as is, and a model
    it returns on the meta device must declare ``init_steps()``."""
    if on_meta:
        state = torch.get_rng_state()
        with torch.device("meta"):
            model = build()
        steps = init_steps(model)
        if steps is not None:
            return model, steps
        torch.set_rng_state(state)
    model = build()
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return model, None
    steps = init_steps(model)
    if steps is None:
        raise TypeError(
            f"build_model returned a {type(model).__name__} on the meta device without an "
            f"init_steps() method; give the model one (see sdnet_trainer.models.init) or build "
            f"it on the CPU"
        )
    return model, steps


def without_parameters(steps: list[InitStep]) -> list[InitStep]:
    """The steps of modules that own no parameters (computed buffers such as rotary
    frequencies): what is left to initialise when a checkpoint sets every parameter."""
    return [s for s in steps if not any(p is not None for p in s.module._parameters.values())]


def allocate(module: nn.Module, device: torch.device, *, cpu_offload: bool = False) -> None:
    """Allocate ``module``'s meta tensors (uninitialised: :func:`materialize` writes them).

    Everything goes to ``device``, except under FSDP2's CPU offload (``cpu_offload`` and
    ``module`` wrapped by ``fully_shard``): there the sharded parameters belong in CPU memory,
    where FSDP keeps them between uses and copies them to the device for each all-gather (its
    lazy init refuses parameters allocated anywhere else), while buffers, which FSDP does not
    manage, must be on ``device`` with the computation. ``module.to_empty(device=device)`` alone
    would put the shards on the device, so offloaded runs could not start."""
    if not (cpu_offload and isinstance(module, FSDPModule)):
        module.to_empty(device=device)
        return
    # fully_shard(module) manages every parameter below it (blocks and the root's rest), so all
    # parameters are FSDP shards; FSDPModule's _apply re-registers them (pinned) on the CPU.
    module.to_empty(device=torch.device("cpu"))
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None:
                sub._buffers[name] = torch.empty_like(buffer, device=device)


@torch.no_grad()
def materialize(steps: list[InitStep]) -> None:
    """Run ``steps`` in order: a :class:`Direct` one (a :class:`Draw`: this rank's block) on the
    real module, any other on full-size CPU stand-ins, writing into every real tensor that is
    allocated (not on the meta device) this rank's part of the result. The CPU generator's state
    on entry plays the role of its state at the start of a CPU build."""
    # Scratch buffers back every step's stand-ins, one per position among a module's own tensors
    # (weight, bias, ...), sized for the largest: a fresh allocation per step would leave freed
    # blocks behind in the allocator (resident memory). Separate buffers, not views of one:
    # each stand-in needs its own version counter (below).
    slots: list[int] = []
    for step in steps:
        if isinstance(step.fn, Direct):
            continue
        for i, t in enumerate(_own_tensors(step.module).values()):
            nbytes = t.numel() * t.element_size()
            if i == len(slots):
                slots.append(nbytes)
            else:
                slots[i] = max(slots[i], nbytes)
    scratch = [torch.empty(n, dtype=torch.uint8) for n in slots]
    for step in steps:
        module = step.module
        if isinstance(step.fn, Direct):
            step.fn(module)  # a Draw computes this rank's block itself, on its device
            continue
        real = _own_tensors(module)
        if not real:
            continue
        full: dict[str, torch.Tensor] = {}
        for buffer, (k, t) in zip(scratch, real.items(), strict=False):
            view = buffer[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            full[k] = nn.Parameter(view, t.requires_grad) if k in module._parameters else view
        # Only what the step writes is copied out (a norm's init sets its weights, not its
        # running statistics): in-place writes bump a tensor's version counter.
        versions = {k: t._version for k, t in full.items()}
        params = {k: v for k, v in module._parameters.items() if v is not None}
        buffers = {k: v for k, v in real.items() if k not in params}
        try:
            module._parameters.update({k: cast(nn.Parameter, full[k]) for k in params})
            module._buffers.update({k: full[k] for k in buffers})
            step.fn(module)
        finally:
            module._parameters.update(params)
            module._buffers.update(buffers)
        for k, tensor in real.items():
            if full[k]._version != versions[k]:
                write_full(tensor, full[k].detach())


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {
        k: v for k, v in module._parameters.items() if v is not None
    }
    tensors.update({k: v for k, v in module._buffers.items() if v is not None})
    return tensors


@torch.no_grad()
def write_full(real: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` (the whole tensor) into ``real``: the part of it that ``real`` holds."""
    if real.is_meta:
        return  # not on this rank (pruned by a pipeline split) or never allocated
    if not isinstance(real, DTensor):
        real.copy_(full)
    elif all(type(p) in (Shard, Replicate) for p in real.placements):
        # Even (FSDP) and tensor-parallel shards are one block of the full tensor: copy that
        # block straight from the full tensor, with no intermediate copy.
        shape, offset = compute_local_shape_and_global_offset(
            real.shape, real.device_mesh, real.placements
        )
        block = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        real.to_local().copy_(block)
    else:
        # Strided shards (FSDP over tensor parallelism on one dim): torch cuts the piece. Every
        # rank holds the same full tensor, so src_data_rank=None cuts it locally.
        real.copy_(distribute_tensor(full, real.device_mesh, real.placements, src_data_rank=None))


__all__ = [
    "CONSTRUCTION_STEPS",
    "REPLACED_STEM",
    "Direct",
    "Draw",
    "SeedDraw",
    "ZERO_INIT_RESIDUAL",
    "InitStep",
    "allocate",
    "build_deferred",
    "construction_resets",
    "draw_seed",
    "init_steps",
    "materialize",
    "resnet_init_steps",
    "without_parameters",
    "write_full",
]
