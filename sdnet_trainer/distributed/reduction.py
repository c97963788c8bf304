"""The step's reduction contract: what every loss term is divided by, and what every gradient
reducer divides by, in one object (:class:`StepReduction`).

**The batch mesh.** ``distributed/mesh.py`` names the mesh dimensions whose ranks see different
targets of a step (``BATCH_DIMS``: the data-parallel replicas and shards, and the
context-parallel ranks, which hold different positions of the same sequences); every other
dimension (tensor parallel, pipeline stages) holds copies of the same targets. Adding a mesh
dimension means naming it there, nowhere else. Fault tolerance's replica groups are a batch
dimension outside the mesh: they divide each step's global batch among themselves
(``training/step_source.py``).

**The loss.** A micro-batch's loss (``Trainer.compute_loss``, ``Trainer.loss_fn``) is the mean
over its *counted* targets: every target but ``IGNORE_INDEX`` (-100: chat prompts, masked
document boundaries, padding). Each loss term is divided by its own global count, so the step's
loss is the sum of the term over the global batch divided by that count, on every layout
(accumulation, data-parallel ranks, pipeline micro-batches, replica groups):

- the token loss: ``N``, the counted targets of the global batch, summed by one small
  all-reduce started once the step's batches are fetched (:meth:`StepReduction.start`) and read
  when the first loss is weighted, after the first forward (on a GPU the stream waits for it, not
  the host); a micro-batch of ``n`` counted targets weighs ``n x D / N``
  (:meth:`StepReduction.weight`). A mean of micro-batch means would instead weigh a micro-batch
  with 3 counted targets as much as one with 300, and change with the world size.
- a term per sequence, as a mixture of experts' auxiliary loss: the global batch's sequences
  (:meth:`StepReduction.mean_weight`).
- where a micro-batch has no count (``Trainer.count_targets`` returns None: one target per
  sample, as for images), every loss of the step weighs the same, with no count and no
  collective: the mean of the micro-batches' means, the mean over the global batch.

**The gradients.** Every reducer sums the gradients over the batch mesh and divides the sum by
one factor, ``D`` = the batch mesh's size (:attr:`StepReduction.gradient_divisor`), which the
weights above carry so that it cancels:

- FSDP2 and HSDP: every unit is told ``D`` (:meth:`StepReduction.divide_fsdp`), the experts
  of expert parallel too (their own mesh is smaller: the ranks holding the same experts);
- DDP and its communication hooks: torch divides by the process group's size, so the group is
  checked to be the batch mesh (:meth:`StepReduction.check_average`);
- the pipeline schedule does not scale (``scale_grads=False``): the loss function it runs on the
  last stage is weighted per pipeline micro-batch like a micro-step's;
- tensor-parallel peers do not reduce (their gradients are shards, or replicated partials);
- fault tolerance's replica groups average the gradients over the groups, so ``N`` is there the
  groups' mean count (:meth:`StepReduction.share_with`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.nn import Module

from sdnet_trainer.data.token_cache import IGNORE_INDEX
from sdnet_trainer.distributed.mesh import BATCH_DIMS, ParallelDims
from sdnet_trainer.distributed.ops import is_distributed


def counted_targets(targets: torch.Tensor) -> torch.Tensor | None:
    """How many of ``targets`` the mean loss averages over (those not ``IGNORE_INDEX``), on the
    device (counting on the host would wait for the GPU), for targets per position: class
    indices with a time axis, (batch, time). None for one target per sample (images: every
    micro-batch of a step holds as many samples, so they weigh the same without a count) and for
    soft or real-valued targets."""
    if targets.dim() < 2 or targets.is_floating_point():
        return None
    return (targets != IGNORE_INDEX).sum()


class StepReduction:
    """The contract (module docstring), for a run on ``dims`` over ``world_size`` ranks.
    ``losses``: the loss terms of a step on one rank (micro-steps x pipeline micro-batches)."""

    def __init__(self, dims: ParallelDims, *, world_size: int, losses: int = 1) -> None:
        self.batch_ranks = dims.batch_ranks
        # The count's all-reduce runs over the world, whose sum counts every batch this many
        # times: once per rank that holds a copy of the same targets (tp x pp).
        self.copies = world_size // self.batch_ranks
        self.losses = losses
        self.groups: Callable[[], int] = lambda: 1
        self._across_groups: Callable[[torch.Tensor], torch.Tensor] = lambda count: count
        self._total: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._ready = False

    @property
    def gradient_divisor(self) -> int:
        """What every gradient reducer divides the sum over the batch mesh by (``D``)."""
        return self.batch_ranks

    # ---------------------------------------------------------------- the reducers' side

    def divide_fsdp(self, unit: Module, mesh: DeviceMesh) -> None:
        """FSDP2 (HSDP, expert parallel's experts): ``unit``, sharded over ``mesh``, divides its
        reduced gradients by ``D``."""
        fsdp = cast(FSDPModule, unit)
        fsdp.set_gradient_divide_factor(float(self.gradient_divisor))
        if mesh.device_type != "cuda" and mesh.size(mesh.ndim - 1) > 1:
            # A factor other than the reduce-scatter group's (the mesh's last dimension) size is
            # NCCL's PREMUL_SUM, which gloo lacks: sum, then divide. Not where that group is one
            # rank: torch 2.14 then divides while copying instead of reduce-scattering, and would
            # divide twice.
            fsdp.set_force_sum_reduction_for_comms(True)

    def check_average(self, reducer: str, group_size: int) -> None:
        """A reducer that divides by its group's size (DDP: torch fixes it) must reduce over the
        batch mesh, or the weights' ``D`` would not cancel."""
        if group_size != self.gradient_divisor:
            raise RuntimeError(
                f"{reducer} averages gradients over {group_size} ranks, but the step's reduction "
                f"divides by {self.gradient_divisor} (its batch mesh, {' x '.join(BATCH_DIMS)}, "
                f"has {self.batch_ranks} ranks): the loss weights would not cancel its average "
                f"(distributed/reduction.py)"
            )

    def share_with(
        self, groups: Callable[[], int], average: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Replica groups that share each step (fault tolerance): ``groups()`` of them now (the
        quorum may change), ``average`` the mean of a count over them."""
        self.groups, self._across_groups = groups, average

    # ---------------------------------------------------------------- the loss terms' side

    def start(self, counts: Sequence[torch.Tensor | None]) -> None:
        """The step's micro-batch counts (None: no counts, equal weights); starts their sum."""
        if self._work is not None:
            # A rank that weighed no loss last step (a pipeline's first stage) joined that
            # collective without reading it: it is waited for before its handle goes.
            self._work.wait()
        self._total, self._work, self._ready = None, None, False
        if not counts or any(count is None for count in counts):
            return
        # float64: exact for any count a global batch holds, and every backend reduces it.
        self._total = torch.stack([c.double() for c in counts if c is not None]).sum()
        if is_distributed():
            self._work = dist.all_reduce(self._total, async_op=True)

    def total(self) -> torch.Tensor:
        """N: the counted targets of the global batch, per replica group (at least 1: a batch
        without any has loss 0, not 0/0)."""
        assert self._total is not None, "start() received no counts"
        if not self._ready:
            if self._work is not None:
                self._work.wait()  # NCCL: the stream waits for the collective; the host does not
                self._work = None
            self._total = self._across_groups(self._total / self.copies).clamp(min=1)
            self._ready = True
        return self._total

    def weight(self, count: torch.Tensor | None) -> torch.Tensor | float:
        """A micro-batch's factor on its mean token loss: ``count x D / N``; without counts
        the step's mean of means."""
        if count is None or self._total is None:
            return self.gradient_divisor / (self.losses * self.batch_ranks)
        return (count.double() * self.gradient_divisor / self.total()).float()

    def mean_weight(self, global_count: float) -> float:
        """The factor on a rank's sum of a per-item term (a MoE layer's auxiliary loss per
        sequence) that makes the step's term its mean over the ``global_count`` items of the
        global batch (read at each forward: the replica groups' quorum may change)."""
        return self.gradient_divisor * self.groups() / global_count


__all__ = ["StepReduction", "counted_targets"]
