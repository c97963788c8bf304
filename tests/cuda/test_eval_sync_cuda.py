"""Evaluation's per-batch metric sums on a GPU queue their work without a host sync: the sample
count is written on the device (``torch.full``), not copied from the host (``torch.tensor``,
which waits for the GPU's queued work on every eval batch). On the CPU no sync can be observed;
tests/unit/test_eval_padding.py checks the count itself there."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from sdnet_trainer.training import evaluation
from sdnet_trainer.training.evaluation import metric_sums

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda", 0)


def _batch(*shape: int, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    logits = torch.randn(*shape, classes, device=DEVICE, generator=generator)
    targets = torch.randint(0, classes, shape, device=DEVICE, generator=generator)
    return logits, targets


@pytest.mark.parametrize("shape", [(64,), (4, 16)])  # classifier, and (batch, time) positions
def test_metric_sums_do_not_sync_the_host(shape):
    logits, targets = _batch(*shape)
    metric_sums(logits, targets)  # first calls may initialise kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call below raises
    try:
        sums = metric_sums(logits, targets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.device.type == "cuda"
    assert {v.device.type for v in sums.values()} == {"cuda"}
    assert sums["count"].dtype == torch.int64 and sums["count"].item() == targets.numel()


def test_the_eval_loop_queues_every_batch_without_a_sync(monkeypatch):
    """The whole loop over the batches, padding included, runs under sync-debug "error"; only
    the one reduction at the end (left out here, captured) reads results back."""
    model = nn.Linear(10, 10).to(DEVICE)
    batches = [_batch(32) for _ in range(3)]
    captured: dict[str, torch.Tensor] = {}

    def capture(totals, **kwargs):
        captured.update(totals)
        return {}

    monkeypatch.setattr(evaluation, "reduce_metric_sums", capture)

    def eval_step(batch):
        logits, targets = batch
        return metric_sums(model(logits), targets)

    eval_step(batches[0])  # first calls may initialise kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        evaluation.evaluate_batches(
            batches,
            eval_step,
            model=model,
            autocast=nullcontext,
            after_batch=lambda: None,
            weight=1.0,
            device=DEVICE,
            agree_on_keys=False,
            counted_batches=2,  # the third is padding
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert next(model.parameters()).device.type == "cuda"
    assert captured["count"].device.type == "cuda" and captured["count"].item() == 64
    with torch.no_grad():
        expected = sum(metric_sums(model(x), y)["loss"].double() for x, y in batches[:2])
    torch.testing.assert_close(captured["loss"], expected)
