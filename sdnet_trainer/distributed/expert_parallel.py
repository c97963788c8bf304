"""Expert parallel (``parallel.ep``): a mixture-of-experts model's experts split over ranks.

Each of the ``ep`` ranks of an expert group holds ``num_experts / ep`` whole experts: the experts'
stacked weights become DTensors sharded by expert (``Shard(0)``) on the mesh's ``ep`` dimension,
so checkpoints hold every expert under its usual name and load on any layout. A mixture-of-experts
layer routes its tokens as usual and hands the experts its token copies sorted by expert with
the count per expert; here that call becomes

1. **dispatch**: the counts are exchanged (each rank learns how many rows every peer sends to each
   of its experts; one small all-to-all and the layer's one host synchronisation, for the split
   sizes), then the rows go to their experts' ranks by ``all_to_all_single`` and are regrouped by
   local expert;
2. the grouped expert computation on this rank's experts;
3. **combine**: the rows back in the order they came, and back to the ranks that sent them.

Both exchanges are torch's autograd all-to-all (``_functional_collectives``), whose backward sends
the gradients the other way. ``ep`` takes its ranks from ``dp_shard`` (``distributed/mesh.py``):
the ranks of an expert group see different tokens, as data-parallel ranks do, and FSDP shards each
expert over the ``dp_shard / ep`` ranks that hold the same experts.

**Gradients.** An expert's gradient on its rank already sums the contributions of every token its
group sent it, from ``ep`` data-parallel ranks; FSDP then reduces it over the ``dp_shard / ep``
(and ``dp_replicate``) ranks holding that expert, and divides the sum by the step's reduction
contract's divisor, as every other gradient (``distributed/reduction.py``), not by its own mesh's
size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from sdnet_trainer.config.schema import Config
from sdnet_trainer.distributed.mesh import ParallelDims
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.moe import GroupedExperts


def validate_expert_parallel(cfg: Config, dims: ParallelDims, *, num_experts: int | None) -> None:
    """``parallel.ep`` against the model and the layout, before launch; ``num_experts``: the
    model family's expert count (None: the model has no experts). ``parallel_dims`` has checked
    that ``ep`` divides ``dp_shard``."""
    ep = dims.ep
    if ep == 1:
        return
    if num_experts is None:
        raise ConfigError(
            f"parallel.ep={ep}: model.name={cfg.model.name!r} has no experts to split; expert "
            f"parallel is for mixture-of-experts models (model.name=moe)"
        )
    if num_experts % ep:
        raise ConfigError(
            f"the model's {num_experts} experts (model.moe.num_experts) must be divisible by "
            f"parallel.ep={ep}: every rank of an expert group holds as many whole experts"
        )
    if dims.cp > 1:
        raise ConfigError(
            f"parallel.ep={ep} with parallel.cp={dims.cp}: expert parallel takes its ranks from "
            f"parallel.dp_shard only; use parallel.cp=1"
        )
    if cfg.parallel.activation_checkpointing == "selective":
        # Its recomputation replays the block's ops by count, and the experts' own FSDP unit
        # inside the block runs hooks in backward that the forward did not.
        raise ConfigError(
            f"parallel.ep={ep} with parallel.activation_checkpointing=selective: the experts are "
            f"FSDP units of their own inside each block, which selective checkpointing cannot "
            f"replay; use parallel.activation_checkpointing=full"
        )


class ExpertParallel(ParallelStyle):
    """torch's ``ParallelStyle`` for a :class:`GroupedExperts`: its weights sharded by expert over
    the 1-D ``ep`` mesh, its call wrapped in the dispatch and combine of the module docstring."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            _shard_by_expert,
            # torch annotates input_fn and output_fn as returning None; the hooks it installs
            # pass on what they return (as its docstring says).
            _dispatch,  # type: ignore[arg-type]
            _combine,  # type: ignore[arg-type]
        )


def _shard_by_expert(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for key, param in list(module.named_parameters(recurse=False)):
        # src_data_rank=None: each rank keeps its slice of its own (equal) full tensor, without a
        # scatter; a meta build has nothing to send anyway.
        shard = distribute_tensor(param, mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(key, nn.Parameter(shard, requires_grad=param.requires_grad))


# What the dispatch of the running call hands its combine: the regrouping order and the split
# sizes. A module's calls never interleave (a recomputation in backward runs a whole call again).
_ROUTE = "_expert_parallel_route"


def _dispatch(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    rows, counts = inputs  # (tokens x top_k, dim) sorted by expert; (num_experts,) rows each
    group = mesh.get_group()
    ep = mesh.size()
    local = counts.numel() // ep
    with torch.no_grad():
        # received[s * local + e]: rows peer s sends to this rank's expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        send = counts.view(ep, local).sum(1)
        recv = received.view(ep, local).sum(1)
        sizes = torch.stack([send, recv]).tolist()  # the split sizes, on the host
        # The received rows come grouped by sender, then expert: regroup by expert, then sender.
        block = torch.arange(ep * local, device=counts.device)
        # The output's length given, from the host's sizes: no second synchronisation.
        expert_of_row = torch.repeat_interleave(block % local, received, output_size=sum(sizes[1]))
        order = torch.argsort(expert_of_row, stable=True)
    setattr(module, _ROUTE, (order, sizes))
    exchanged = all_to_all_single_autograd(rows, sizes[1], sizes[0], group)
    return exchanged[order], received.view(ep, local).sum(0)


def _combine(module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    order, sizes = getattr(module, _ROUTE)
    delattr(module, _ROUTE)
    by_sender = output[torch.argsort(order)]
    return all_to_all_single_autograd(by_sender, sizes[0], sizes[1], mesh.get_group())


def apply_expert_parallel(
    model: nn.Module, mesh: DeviceMesh, dims: ParallelDims
) -> list[nn.Module]:
    """Shard every :class:`GroupedExperts` of ``model`` over the ``ep`` dimension of ``mesh``;
    returns them, for FSDP to shard on their own mesh. Under tensor parallel alone (``ep=1``) the
    experts, whole on every tensor-parallel rank, become DTensors replicated on ``tp`` as the rest
    of the model's parameters do (optimizers take one kind of tensor)."""
    experts: list[nn.Module] = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for module in experts:
        if dims.ep > 1:
            parallelize_module(module, mesh["ep"], ExpertParallel())
        elif dims.tp > 1:
            distribute_module(module, mesh["tp"])
    return experts if dims.ep > 1 else []


__all__ = [
    "ExpertParallel",
    "apply_expert_parallel",
    "validate_expert_parallel",
]
