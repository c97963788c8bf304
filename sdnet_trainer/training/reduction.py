"""What a training step is made of besides the model: its batches, the weight of each
micro-batch's loss, and whether the step counts.

**The step's loss.** A micro-batch's loss (``Trainer.compute_loss``, ``Trainer.loss_fn``) is the
mean over its *counted* targets: every target but ``IGNORE_INDEX`` (-100: chat prompts, masked
document boundaries, padding). The step weighs it by the micro-batch's share of the counted targets
of the whole global batch, ``n_m / N``, so the step's loss is

    sum over m of mean_m x n_m / N  =  (sum of the target losses over the global batch) / N

for every layout: accumulation, data-parallel ranks, pipeline micro-batches, fault-tolerant replica
groups. A mean of micro-batch means would instead weigh a micro-batch with 3 counted targets as
much as one with 300, and change with the world size and the micro-batch size. ``N`` is summed over
every micro-batch of every data-parallel rank by one small all-reduce, started once the step's
batches are fetched and read when the first loss is weighted, after the first forward (on a GPU the
stream waits for it, not the host). DDP and FSDP average gradients over the ``dp`` data-parallel
ranks, so the weight carries a factor ``dp`` that their average takes back out; torchft averages
over the replica groups, so there ``N`` is the groups' mean count (``dp`` x groups undone the same
way). Where a micro-batch has no count (``Trainer.count_targets`` returns None: one target per
sample, as for images, or a batch that is not an ``(inputs, targets)`` pair), every loss of the step
weighs the same, ``1 / losses``, with no count and no collective: an image model's step is the
mean of its micro-batches' means, which is its mean over the global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from sdnet_trainer.data.token_cache import IGNORE_INDEX
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


class LossWeights:
    """The weights of one step's micro-batch losses (module docstring). ``start(counts)`` begins
    the count's all-reduce; ``weight(count)`` is a micro-batch's factor ``count x dp / N``, or
    ``1 / losses`` without counts (``losses``: the loss terms of a step on a rank, micro-steps x
    pipeline micro-batches).

    ``peers``: the ranks that load each data-parallel rank's samples (tensor-parallel peers and
    pipeline stages): the all-reduce runs over the world, whose sum counts every batch ``peers``
    times. ``across_groups`` averages the group's count over the fault-tolerant replica groups
    (identity without them)."""

    def __init__(
        self,
        *,
        dp: int,
        peers: int,
        losses: int,
        across_groups: Callable[[torch.Tensor], torch.Tensor] = lambda count: count,
    ) -> None:
        self.dp, self.peers, self.losses = dp, peers, losses
        self.across_groups = across_groups
        self._total: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._ready = False

    def start(self, counts: Sequence[torch.Tensor | None]) -> None:
        """The step's micro-batch counts (None: no counts, equal weights); starts the sum."""
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
        """N: the counted targets of the global batch (at least 1: a batch without any has loss 0,
        not 0/0)."""
        assert self._total is not None, "start() received no counts"
        if not self._ready:
            if self._work is not None:
                self._work.wait()  # NCCL: the stream waits for the collective; the host does not
                self._work = None
            self._total = self.across_groups(self._total / self.peers).clamp(min=1)
            self._ready = True
        return self._total

    def weight(self, count: torch.Tensor | None) -> torch.Tensor | float:
        """A micro-batch's factor on its mean loss."""
        if count is None or self._total is None:
            return 1.0 / self.losses
        return (count.double() * self.dp / self.total()).float()


__all__ = ["LossWeights", "counted_targets"]
