"""The mixture of experts' state-dict adapter: its tensors under Hugging Face's Qwen3-MoE or
Mixtral names, in a folder's layout (``hf.py``: :class:`~sdnet_trainer.models.moe.hf.Layout`,
:func:`~sdnet_trainer.models.moe.hf.stored_as`), each value over the model's own storage, for
``model.weights=hf:PATH`` to read into (``weights.py``), and for ``format=hf`` and serving's
``transformers`` twin to take.

Attention, norms, embedding, head and router map one to one. The stacked experts (``[E, rows,
cols]``; under expert parallelism DTensors sharded by expert over ``ep``, and by FSDP over the
ranks that hold the same experts) become:

- in the hub's per-expert layout, one tensor per expert this rank holds: a view of that
  expert's local rows, plain where only the experts' dimension is sharded (the expert is whole
  here), else a DTensor over the remaining dimensions' placements, so DCP reads only the block
  this rank holds and no stacked tensor is ever assembled;
- in transformers 5's fused layout, the stacked tensor itself: ``down_proj`` as it is, and the
  gate and up projections each under a key of its own, a
  :class:`~sdnet_trainer.models.hf_folder.Block` of ``gate_up_proj``'s rows (the gate's first).

No value is transformed: Qwen3-MoE and Mixtral use the Llama's rotary layout (``rotate_half``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.hf_folder import Block, HFState
from sdnet_trainer.models.lora_names import base_state
from sdnet_trainer.models.moe.hf import Layout, Stored, hf_model_type, stored_as, written_layout


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of ``model`` (this rank's) under their base names: peft's adapters and the
    buffers left out (the routing bias and the counters, which no Hugging Face folder holds)."""
    buffers = {name for name, _ in model.named_buffers()}
    return {name: value for name, value in base_state(model).items() if name not in buffers}


def hf_sources(
    state: Mapping[str, torch.Tensor], layout: Layout, *, tied: bool
) -> dict[str, Stored]:
    """Where each of ``state``'s tensors is in a folder of ``layout``; with ``tied`` the output
    layer is left out (the embedding's values, stored once). A tensor no Qwen3-MoE or Mixtral
    has is refused."""
    sources = {}
    for name, value in state.items():
        if tied and name == "head.weight":
            continue
        stored = stored_as(name, tuple(value.shape), layout)
        if stored is None:
            raise ConfigError(
                f"model.weights: the model's {name} has no counterpart in a Qwen3-MoE or Mixtral "
                f"checkpoint (shared experts: leave model.kwargs.num_shared_experts unset)"
            )
        sources[name] = stored
    return sources


def to_hf(state: Mapping[str, torch.Tensor], layout: Layout, *, tied: bool) -> HFState:
    """``state`` (:func:`model_state`: the whole model's, or this rank's shards) under the names
    of a folder of ``layout``, each value over the same storage."""
    tensors: dict[str, torch.Tensor] = {}
    blocks: dict[str, Block] = {}
    for name, stored in hf_sources(state, layout, tied=tied).items():
        value = state[name]
        if stored.per_expert:
            tensors |= _per_expert(value, stored.names)
        elif stored.shape != tuple(value.shape):  # a half of a fused gate_up_proj
            rows = stored.row_offset
            key = f"{stored.names[0]}[:, {rows}:{rows + value.shape[1]}]"
            blocks[key] = Block(stored.names[0], (0, rows, 0))
            tensors[key] = value
        else:
            tensors[stored.names[0]] = value
    return HFState(tensors, blocks)


def _per_expert(stacked: torch.Tensor, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The experts of ``stacked`` this rank holds, each a tensor of its own over the same
    storage (``names``: every expert's, in order)."""
    if not isinstance(stacked, DTensor):
        return dict(zip(names, stacked.unbind(0), strict=True))
    mesh, placements = stacked.device_mesh, stacked.placements
    # The run of experts this rank holds, as torch places it (DCP's chunks use the same).
    held, offset = compute_local_shape_and_global_offset(stacked.shape, mesh, placements)
    local = stacked.to_local()
    rest = [_past_experts(p) for p in placements]
    whole = all(isinstance(p, Replicate) for p in rest)
    experts: dict[str, torch.Tensor] = {}
    for i in range(held[0]):
        rows = local[i]
        experts[names[offset[0] + i]] = (
            rows
            if whole
            else DTensor.from_local(
                rows,
                mesh,
                rest,
                shape=stacked.shape[1:],
                stride=stacked.stride()[1:],
                run_check=False,
            )
        )
    return experts


def _past_experts(placement: Placement) -> Placement:
    """``placement`` for one expert's tensor: the experts' dimension gone (what shards it leaves
    each expert whole), the others one lower."""
    # _StridedShard first: before torch 2.14 it subclasses Shard.
    if isinstance(placement, _StridedShard):
        if placement.dim == 0:
            return Replicate()
        return _StridedShard(placement.dim - 1, split_factor=placement.split_factor)
    if isinstance(placement, Shard):
        return Replicate() if placement.dim == 0 else Shard(placement.dim - 1)
    return placement


def hf_tensors(model: nn.Module, layout: Layout | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face's names, in ``layout`` (default: the hub's
    per-expert one, which ``format=hf`` writes: each expert's projections as views of the stacked
    experts); a tied output layer once, as the embedding (transformers ties it back). In the
    fused layout a layer's gate and up projections become one new tensor, gate rows first."""
    layout = layout or written_layout(hf_model_type(model))
    moe: Any = model  # its sizes are plain attributes
    state = to_hf(model_state(model), layout, tied=bool(moe.tie_embeddings))
    tensors = {key: value for key, value in state.tensors.items() if key not in state.blocks}
    halves: dict[str, dict[int, torch.Tensor]] = {}  # a fused gate_up_proj's, by first row
    for key, block in state.blocks.items():
        halves.setdefault(block.name, {})[block.offsets[1]] = state.tensors[key]
    for fused, parts in halves.items():
        tensors[fused] = torch.cat([parts[row] for row in sorted(parts)], dim=1)
    return tensors


__all__ = ["hf_sources", "hf_tensors", "model_state", "to_hf"]
