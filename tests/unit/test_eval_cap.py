"""loop.eval_max_batches (every evaluation over the first N batches of each rank's share) and
loop.eval_at_epoch_end's default (epoch-end evaluations only where no period is set).

Uneven shares are simulated in one process here, as in tests/unit/test_eval_padding.py; the
real multi-process run (FSDP x pipeline stages, uneven shares, capped) is gpt_fsdp_pp_val_cap in
tests/distributed/test_layouts.py.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from sdnet_trainer import Trainer, compose
from sdnet_trainer.data import SyntheticImages
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.preflight import validate
from sdnet_trainer.training import evaluation
from sdnet_trainer.training.evaluation import evaluate_batches, metric_sums
from sdnet_trainer.training.hooks import EvalHook
from sdnet_trainer.training.state import EpochShape, RunState
from tests.support import TINY
from tests.unit.test_eval_padding import _evaluate, _model

CPU = torch.device("cpu")
# TINY without its loop.eval_at_epoch_end=false: the runs here keep the shipped default (null).
DEFAULT_EPOCH_END = [o for o in TINY if not o.startswith("loop.eval_at_epoch_end=")]


class CountingTrainer(Trainer):
    """Keeps the targets of every batch each evaluation ran (val/* and val_ema/* alike)."""

    def setup(self) -> None:
        super().setup()
        self.evaluations: list[list[torch.Tensor]] = []

    def evaluate(self) -> dict[str, float]:
        self.evaluations.append([])
        return super().evaluate()

    def eval_step(self, batch):
        self.evaluations[-1].append(batch[1].clone())
        return super().eval_step(batch)


def _run(tmp_path, overrides: list[str]) -> tuple[CountingTrainer, dict[str, float]]:
    # 256 training samples in global batches of 64: 4 steps an epoch, which ends at step 4.
    cfg = compose(
        DEFAULT_EPOCH_END
        + [
            "loop.max_steps=5",
            "loop.global_batch_size=64",
            "loop.eval_batch_size=8",  # 101 validation samples: 13 batches
            "loop.eval_every_n_steps=3",
            "model.ema.enabled=true",
            "model.ema.warmup_steps=1",
        ]
        + overrides
    )
    validate(cfg, world_size=1)
    trainer = CountingTrainer(cfg, output_dir=tmp_path)
    return trainer, trainer.fit()


def test_a_cap_bounds_every_evaluation_to_the_same_first_batches(tmp_path):
    trainer, metrics = _run(tmp_path, ["loop.eval_max_batches=3"])
    # Step 3 (the period) and the end, each of the weights and of their average; not the epoch
    # end at step 4: loop.eval_every_n_steps is set and loop.eval_at_epoch_end left null.
    assert len(trainer.evaluations) == 4
    assert [len(batches) for batches in trainer.evaluations] == [3, 3, 3, 3]
    first = trainer.evaluations[0]
    for batches in trainer.evaluations[1:]:  # the same samples every time, so they compare
        assert all(torch.equal(a, b) for a, b in zip(batches, first, strict=True))
    # The metrics are the exact means over those 24 samples: the split's first 24.
    val_set = trainer.data.val_loader.dataset
    assert torch.equal(torch.cat(first), torch.tensor([val_set[i][1] for i in range(24)]))
    model = trainer.model.eval()
    with torch.no_grad():
        images = torch.stack([val_set[i][0] for i in range(24)])
        sums = metric_sums(model(images), torch.cat(first))
    assert metrics["val/loss"] == pytest.approx((sums["loss"] / 24).item(), rel=1e-5)
    assert metrics["val/top1"] == pytest.approx((100 * sums["top1"] / 24).item(), rel=1e-6)
    assert {"val_ema/loss", "val_ema/top1"} <= metrics.keys()


def test_without_a_cap_the_whole_split_and_the_epoch_end_when_no_period(tmp_path):
    trainer, _ = _run(tmp_path, ["loop.eval_every_n_steps=null"])
    # The epoch end (step 4) and the end; every one of the 13 batches, weights and average.
    assert [len(batches) for batches in trainer.evaluations] == [13] * 4
    assert sum(len(t) for t in trainer.evaluations[0]) == 101


def _schedule(overrides: list[str], steps: int = 8) -> list[int]:
    """The steps EvalHook evaluates after, over 2 epochs of 4 steps (the end not included)."""
    cfg = compose(DEFAULT_EPOCH_END + ["loop.eval_at_end=false"] + overrides)
    evaluated: list[int] = []
    state = RunState()
    hook = EvalHook(
        lambda: evaluated.append(state.step) or {},
        cfg.loop,
        writer=None,  # never written: this evaluate returns no metrics
        total_steps=steps,
    )
    for _ in range(steps):
        state.advance(EpochShape(global_batch_size=64, steps_per_epoch=4))
        hook.after_step(state, None)
    return evaluated


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], [4, 8]),  # no period: each epoch end
        (["loop.eval_at_epoch_end=null"], [4, 8]),
        (["loop.eval_every_n_steps=3"], [3, 6]),  # a period: it alone
        (["loop.eval_every_n_steps=3", "loop.eval_at_epoch_end=null"], [3, 6]),
        (["loop.eval_every_n_steps=3", "loop.eval_at_epoch_end=true"], [3, 4, 6, 8]),
        (["loop.eval_at_epoch_end=false"], []),
    ],
)
def test_epoch_end_evaluations_follow_what_the_user_set(overrides, expected):
    assert _schedule(overrides) == expected


def test_a_cap_that_is_not_positive_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"loop\.eval_max_batches=0 must be > 0"):
        validate(compose(TINY + ["loop.eval_max_batches=0"]), world_size=1)


# 25 samples over 3 ranks in batches of 4: shares of 9, 8, 8 samples, rank 0's in 3 batches, the
# others' in 2 and a padding batch. cap -> forwards per rank, samples counted over the ranks.
UNEVEN = [(1, 1, 12), (2, 2, 24), (3, 3, 25), (5, 3, 25), (None, 3, 25)]


@pytest.mark.parametrize("cap, forwards, counted", UNEVEN)
def test_uneven_shares_under_a_cap_stop_together_and_count_each_sample_once(
    monkeypatch, cap, forwards, counted
):
    dataset = SyntheticImages(25, image_size=4, channels=3, num_classes=5, seed=0, split="val")
    model = _model()
    reduced: list[torch.Tensor] = []

    def record(local: torch.Tensor) -> torch.Tensor:  # the all-reduce, one rank at a time
        reduced.append(local.clone())
        return local

    monkeypatch.setattr(evaluation, "all_reduce_sum", record)
    runs = [
        _evaluate(dataset, world=3, rank=rank, model=model, max_batches=cap) for rank in range(3)
    ]
    assert runs == [forwards] * 3  # every rank stops at the same batch
    total = dict(zip(["count", "loss"], torch.stack(reduced).sum(0).tolist()[:2], strict=True))
    assert total["count"] == counted
    # Rank r holds samples r, r+3, ...: the first `counted` samples of the split, each once.
    with torch.no_grad():
        images = torch.stack([dataset[i][0] for i in range(counted)])
        labels = torch.tensor([dataset[i][1] for i in range(counted)])
        expected = metric_sums(model(images), labels)["loss"].item()
    assert total["loss"] == pytest.approx(expected, rel=1e-5)


def test_an_evaluation_over_no_batches_has_no_metrics_and_no_collective(monkeypatch):
    monkeypatch.setattr(evaluation, "all_reduce_sum", pytest.fail)
    result = evaluate_batches(
        (),
        pytest.fail,
        model=nn.Linear(1, 1),
        autocast=nullcontext,
        after_batch=lambda: None,
        weight=1.0,
        device=CPU,
        agree_on_keys=False,
    )
    assert result == {}
