"""The step's reduction contract (sdnet_trainer/distributed/reduction.py) in one process; every
layout against transformers' own loss, and every reducer reading the contract's divisor, is
tests/distributed/test_layouts.py's ``test_the_step_loss_over_masked_targets_is_transformers_loss``
and ``test_every_reducer_divides_by_the_contracts_divisor``."""

from __future__ import annotations

import pytest
import torch

from sdnet_trainer.distributed.mesh import BATCH_DIMS, MESH_DIMS, ParallelDims
from sdnet_trainer.distributed.reduction import StepReduction, counted_targets
from sdnet_trainer.training.trainer import Trainer


def test_each_micro_batch_weighs_by_its_share_of_the_counted_targets():
    targets = [torch.tensor([[1, -100, -100, -100]]), torch.tensor([[1, 2, 3, -100]])]
    counts = [counted_targets(t) for t in targets]
    assert [int(c) for c in counts] == [1, 3]
    weights = StepReduction(ParallelDims(), world_size=1, losses=2)
    weights.start(counts)
    # means 5.0 (over 1 target) and 1.0 (over 3): the step's loss is (5 + 3) / 4, not (5 + 1) / 2.
    step_loss = 5.0 * weights.weight(counts[0]) + 1.0 * weights.weight(counts[1])
    assert float(step_loss) == pytest.approx(2.0)
    # The reducers' average over the batch mesh (2 ranks) takes the divisor back out; a world
    # all-reduce counts each batch once per tensor-parallel copy (2); groups average the count.
    halves = StepReduction(ParallelDims(dp_shard=2, tp=2), world_size=4)
    halves.share_with(lambda: 2, lambda n: n / 2)
    twelve = torch.tensor(12)
    halves.start([twelve])
    assert halves.gradient_divisor == 2
    assert float(halves.weight(twelve)) == pytest.approx(12 * 2 / (12 / 2 / 2))
    # A term per sequence: its mean over the global batch's 8 sequences, shared by 2 groups.
    assert halves.mean_weight(8) == pytest.approx(2 * 2 / 8)


def test_a_batch_without_counted_targets_weighs_nothing_and_the_step_is_not_nan():
    weights = StepReduction(ParallelDims(), world_size=1)
    none = counted_targets(torch.full((2, 4), -100))
    weights.start([none])
    assert float(weights.weight(none)) == 0.0 and float(weights.total()) == 1.0


def test_micro_batches_without_a_count_weigh_the_same():
    weights = StepReduction(ParallelDims(dp_shard=4), world_size=4, losses=4)
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


def test_the_batch_mesh_is_named_once_and_a_reducer_over_another_group_is_refused():
    """The batch dimensions are the mesh's data-parallel and context-parallel ones; the gradient
    divisor is their product, and a reducer that averages over another group (DDP's size is
    fixed by torch) is refused, naming it."""
    assert set(BATCH_DIMS) <= set(MESH_DIMS) and "tp" not in BATCH_DIMS and "pp" not in BATCH_DIMS
    dims = ParallelDims(pp=2, dp_replicate=2, dp_shard=3, cp=2, tp=2)
    reduction = StepReduction(dims, world_size=48)
    assert reduction.gradient_divisor == dims.batch_ranks == 12 and reduction.copies == 4
    reduction.check_average("DDP", 12)
    refusal = r"DDP averages gradients over 6 ranks.* divides by 12 .* has 12 ranks"
    with pytest.raises(RuntimeError, match=refusal):
        reduction.check_average("DDP", 6)
