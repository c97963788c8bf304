"""The step's loss weights (sdnet_trainer/training/reduction.py) in one process; every layout against
transformers' own loss is tests/distributed/test_layouts.py's
``test_the_step_loss_over_masked_targets_is_transformers_loss``."""

from __future__ import annotations

import pytest
import torch

from sdnet_trainer.training.reduction import LossWeights, counted_targets
from sdnet_trainer.training.trainer import Trainer


def test_each_micro_batch_weighs_by_its_share_of_the_counted_targets():
    targets = [torch.tensor([[1, -100, -100, -100]]), torch.tensor([[1, 2, 3, -100]])]
    counts = [counted_targets(t) for t in targets]
    assert [int(c) for c in counts] == [1, 3]
    weights = LossWeights(dp=1, peers=1, losses=2)
    weights.start(counts)
    # means 5.0 (over 1 target) and 1.0 (over 3): the step's loss is (5 + 3) / 4, not (5 + 1) / 2.
    step_loss = 5.0 * weights.weight(counts[0]) + 1.0 * weights.weight(counts[1])
    assert float(step_loss) == pytest.approx(2.0)
    # The data-parallel average takes the factor dp back out; groups average the count.
    halves = LossWeights(dp=2, peers=1, losses=1, across_groups=lambda n: n / 2)
    halves.start([counts[1]])
    assert float(halves.weight(counts[1])) == pytest.approx(3 * 2 / (3 / 2))


def test_a_batch_without_counted_targets_weighs_nothing_and_the_step_is_not_nan():
    weights = LossWeights(dp=1, peers=1, losses=1)
    none = counted_targets(torch.full((2, 4), -100))
    weights.start([none])
    assert float(weights.weight(none)) == 0.0 and float(weights.total()) == 1.0


def test_micro_batches_without_a_count_weigh_the_same():
    weights = LossWeights(dp=4, peers=1, losses=4)
    weights.start([None, torch.tensor(3)])
    assert weights.weight(None) == weights.weight(torch.tensor(3)) == 0.25


def test_only_targets_per_position_are_counted():
    """Tokens are counted; one class per sample (images), soft or real-valued targets and batches
    that are not (inputs, targets) pairs are not: their micro-batches weigh the same."""
    tokens = torch.tensor([[5, -100, 7], [-100, -100, 2]])
    assert int(Trainer.count_targets(None, (torch.zeros(2, 3), tokens))) == 3
    assert Trainer.count_targets(None, (torch.zeros(2, 3), torch.tensor([3, 1]))) is None
    assert Trainer.count_targets(None, (torch.zeros(2, 3), torch.rand(2, 10))) is None
    assert Trainer.count_targets(None, {"inputs": torch.zeros(2), "targets": tokens}) is None
    assert Trainer.count_targets(None, (torch.zeros(2, 3), tokens, tokens)) is None
