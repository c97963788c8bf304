"""Evaluation on uneven validation shards: every rank runs the same number of batches (a sharded
model's forward is a collective), the padding is not counted, and every sample counts once.

The ranks are simulated in one process here (the loader of each rank, the all-reduce replaced by
a sum over the simulated ranks); tests/distributed/test_layouts.py runs it for real under FSDP.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data import ShardedEvalSampler, SyntheticImages
from sdnet_trainer.data.loader import counted_eval_batches, eval_loader
from sdnet_trainer.data.sampler import EvalBatchSampler
from sdnet_trainer.training import evaluation
from sdnet_trainer.training.evaluation import evaluate_batches, metric_sums

CPU = torch.device("cpu")

# (validation size, ranks, batch size): remainders whose shares need different batch counts
# (25 over 3 ranks in 4s: shares of 9, 8, 8 samples, 3 or 2 batches), ones that do not, shares
# smaller than one batch, and a batch larger than every share.
LAYOUTS = [(25, 3, 4), (65, 4, 4), (10, 3, 2), (7, 3, 1), (5, 4, 8), (12, 3, 4), (9, 1, 4)]


@pytest.mark.parametrize("size, world, batch", LAYOUTS)
def test_every_rank_gets_as_many_batches_and_every_index_counts_once(size, world, batch):
    samplers = [
        EvalBatchSampler(size, batch_size=batch, world_size=world, rank=r) for r in range(world)
    ]
    runs = [list(s) for s in samplers]
    expected_len = math.ceil(math.ceil(size / world) / batch)
    assert [len(run) for run in runs] == [len(s) for s in samplers] == [expected_len] * world
    counted: list[int] = []
    for sampler, run in zip(samplers, runs):
        share = list(ShardedEvalSampler(size, world_size=world, rank=sampler.shard.rank))
        assert sampler.counted_batches == math.ceil(len(share) / batch)
        flags = [sampler.is_padding(i) for i in range(len(run))]
        assert flags == [i >= sampler.counted_batches for i in range(len(run))]
        real = [i for k, b in enumerate(run) if not flags[k] for i in b]
        assert real == share  # the share, in order, each index once
        for k, indices in enumerate(run):
            assert all(0 <= i < size for i in indices)
            if flags[k]:  # padding: a full batch of this rank's own indices
                assert len(indices) == batch and set(indices) <= set(share)
        counted += real
    assert sorted(counted) == list(range(size))


def test_uneven_shares_need_padding_where_their_batch_counts_differ():
    """The hang's cause: 25 samples over 3 ranks in batches of 4 is 3 batches on rank 0 and 2
    on the others; rank 0's third forward would gather the weights alone."""
    shares = [len(ShardedEvalSampler(25, world_size=3, rank=r)) for r in range(3)]
    assert [math.ceil(n / 4) for n in shares] == [3, 2, 2]
    samplers = [EvalBatchSampler(25, batch_size=4, world_size=3, rank=r) for r in range(3)]
    assert [s.counted_batches for s in samplers] == [3, 2, 2]
    assert [len(s) for s in samplers] == [3, 3, 3]
    assert [s.is_padding(2) for s in samplers] == [False, True, True]


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        EvalBatchSampler(10, batch_size=0, world_size=2, rank=0)
    with pytest.raises(ValueError, match="rank"):
        EvalBatchSampler(10, batch_size=2, world_size=2, rank=2)
    assert list(EvalBatchSampler(0, batch_size=2, world_size=2, rank=1)) == []


# ---------------------------------------------------------------- the loader and the evaluation


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 5))


def _evaluate(
    dataset, *, world: int, rank: int, model: nn.Module, max_batches: int | None = None
) -> int:
    """One simulated rank's evaluation (the all-reduce patched by the caller), of at most
    ``max_batches`` batches (loop.eval_max_batches); the number of forwards it ran."""
    loader = eval_loader(
        dataset, cfg=DataConfig(num_workers=0), device_type="cpu", batch_size=4,
        dp_size=world, dp_rank=rank,
    )  # fmt: skip
    forwards = 0

    def eval_step(batch):
        nonlocal forwards
        forwards += 1
        inputs, targets = batch
        return metric_sums(model(inputs), targets)

    evaluate_batches(
        loader,
        eval_step,
        model=model,
        autocast=nullcontext,
        after_batch=lambda: None,
        weight=1.0,
        device=CPU,
        agree_on_keys=False,
        counted_batches=counted_eval_batches(loader),
        max_batches=max_batches,
    )
    assert forwards == (len(loader) if max_batches is None else min(len(loader), max_batches))
    return forwards


def test_padded_ranks_sum_to_the_single_process_evaluation(monkeypatch):
    dataset = SyntheticImages(25, image_size=4, channels=3, num_classes=5, seed=0, split="val")
    model = _model()
    single = _single_process(dataset, model)
    reduced: list[torch.Tensor] = []

    def record(local: torch.Tensor) -> torch.Tensor:  # the all-reduce, one rank at a time
        reduced.append(local.clone())
        return local

    monkeypatch.setattr(evaluation, "all_reduce_sum", record)
    forwards = [_evaluate(dataset, world=3, rank=r, model=model) for r in range(3)]
    assert forwards == [3, 3, 3]  # rank 0's 9 samples take 3 batches; the others pad to 3
    keys = ["count", "loss", "top1", "top5"]  # reduce_metric_sums stacks the sorted keys
    total = dict(zip(keys, torch.stack(reduced).sum(0).tolist(), strict=True))
    assert total["count"] == 25  # every sample once, no padding
    # Batch sums in float32, added in another grouping than the reference's: rel 1e-6.
    assert total["loss"] / total["count"] == pytest.approx(single["loss"], rel=1e-6)
    assert 100 * total["top1"] / total["count"] == pytest.approx(single["top1"], rel=1e-6)
    assert 100 * total["top5"] / total["count"] == pytest.approx(single["top5"], rel=1e-6)


def _single_process(dataset, model) -> dict[str, float]:
    loader = eval_loader(
        dataset, cfg=DataConfig(num_workers=0), device_type="cpu", batch_size=4,
        dp_size=1, dp_rank=0,
    )  # fmt: skip
    assert counted_eval_batches(loader) == len(loader) == 7  # one rank: nothing to pad
    with torch.no_grad():
        images = torch.stack([dataset[i][0] for i in range(len(dataset))])
        labels = torch.tensor([dataset[i][1] for i in range(len(dataset))])
        logits = model(images)
    result = evaluate_batches(
        [(images, labels)],
        lambda batch: metric_sums(model(batch[0]), batch[1]),
        model=model,
        autocast=nullcontext,
        after_batch=lambda: None,
        weight=1.0,
        device=CPU,
        agree_on_keys=False,
    )
    top1 = (logits.argmax(1) == labels).double().mean().item() * 100
    assert result["top1"] == pytest.approx(top1)  # the reference itself is right
    return result


def test_padding_batches_run_but_do_not_count_even_when_not_finite():
    model = _model()
    calls = []

    def eval_step(batch):
        calls.append(batch)
        return {"loss": torch.tensor(batch), "count": torch.tensor(1)}

    result = evaluate_batches(
        [1.0, 3.0, float("nan")],  # the third is padding: run, dropped
        eval_step,
        model=model,
        autocast=nullcontext,
        after_batch=lambda: None,
        weight=1.0,
        device=CPU,
        agree_on_keys=False,
        counted_batches=2,
    )
    assert calls == [1.0, 3.0, pytest.approx(float("nan"), nan_ok=True)]
    assert result == {"loss": 2.0}


@pytest.mark.parametrize("shape", [(6,), (3, 4)])
def test_metric_sums_counts_every_sample_or_position(shape):
    torch.manual_seed(0)
    targets = torch.randint(0, 7, shape)
    logits = torch.randn(*shape, 7)
    sums = metric_sums(logits, targets)
    assert sums["count"].dtype == torch.int64 and sums["count"].dim() == 0
    assert sums["count"].item() == targets.numel()
    assert sums["count"].device == targets.device
    expected = nn.functional.cross_entropy(
        logits.reshape(-1, 7), targets.reshape(-1), reduction="sum"
    )
    torch.testing.assert_close(sums["loss"], expected)
