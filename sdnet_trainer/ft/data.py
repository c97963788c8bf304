"""Each step's global batch divided among the groups in that step's quorum.

The epoch's order is the global-index sampler's (``data.sampler.GlobalBatchSampler``: seeded by
``loop.seed`` and the epoch), and the run's position (``RunState.epoch`` / ``epoch_sample``) says
where the step's global batch starts. With ``N`` groups in the quorum, ``W`` ranks per group and
``G`` the global batch, the group at place ``q`` of the quorum takes the ``G/N`` positions from
``epoch_sample + q*G/N``, and its rank ``r`` the ``G/(N*W)`` of them from ``r*G/(N*W)``.

The guarantee: a committed step has trained exactly the ``G`` samples at its positions, each
once, whatever the quorum's size (the gradients are averaged over the ``N`` groups, each the mean
over its share, so the update is the mean over ``G``). A step that is not committed (a group died
during it, or the quorum fell below ``min_groups``) moves neither the position nor the
parameters: the next quorum trains the same ``G`` samples, divided among the groups left. A group
that joins receives the position with the rest of the state. So within an epoch no sample is
dropped or trained twice in the committed updates; the one compromise is compute: the work of an
uncommitted step is discarded (counted as ``ft/skipped_steps``).

Semi-sync modes (``local_sgd``, ``diloco``) have no per-step quorum: group ``g`` of ``groups``
takes the fixed share ``g`` of every global batch; while a group is down its share is not trained
(torchft's ``DistributedSampler`` makes the same trade).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset, default_collate

from sdnet_trainer.data.sampler import GlobalBatchSampler
from sdnet_trainer.data.seeding import SampleSeeded


@dataclass(frozen=True)
class StepShare:
    """This group's place in one step's division of the global batch."""

    groups: int  # groups the global batch is divided among (the quorum's size under sync)
    index: int  # this group's place among them


class ShareBatches:
    """This rank's share of each step's global batch, from the run's position."""

    def __init__(
        self,
        dataset: Dataset,
        sampler: GlobalBatchSampler,
        *,
        global_batch_size: int,
        group_size: int,
        group_rank: int,
    ) -> None:
        self.dataset, self.sampler = dataset, sampler
        self.global_batch_size = global_batch_size
        self.group_size, self.group_rank = group_size, group_rank
        self._epoch: int | None = None
        self._order: list[int] = []

    def positions(self, share: StepShare, *, epoch_sample: int) -> range:
        """The epoch positions this rank trains in the step starting at ``epoch_sample``."""
        split = share.groups * self.group_size
        if self.global_batch_size % split:
            raise RuntimeError(
                f"loop.global_batch_size={self.global_batch_size} cannot be divided among "
                f"{share.groups} groups x {self.group_size} ranks; a quorum larger than "
                f"fault_tolerance.groups joined"
            )
        size = self.global_batch_size // split
        start = epoch_sample + (share.index * self.group_size + self.group_rank) * size
        return range(start, start + size)

    def batch(self, share: StepShare, *, epoch: int, epoch_sample: int) -> Any:
        """The collated samples at this rank's positions (on the host)."""
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._order, self._epoch = self.sampler.epoch_order(), epoch
        order = self._order
        indices = [order[p % len(order)] for p in self.positions(share, epoch_sample=epoch_sample)]
        # The loader's data set: seeded per sample where loading draws random numbers, keyed
        # (epoch, index) then, so a sample's augmentation is the same in any group.
        seeded = isinstance(self.dataset, SampleSeeded)
        keys = [(epoch, i) for i in indices] if seeded else indices
        return default_collate([self.dataset[key] for key in keys])


__all__ = ["ShareBatches", "StepShare"]
