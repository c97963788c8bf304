"""Evaluation metrics: per-batch sums, and their reduction over batches and ranks.

A batch contributes *sums* (loss, top-k hits) plus a ``count``; the reduction adds them over every
batch and rank and divides by the total count, so the result is the exact mean over the whole
validation set whatever the world size or the last batch's size. Padding batches (which every
rank runs so that all run as many forwards, see ``data/sampler.py``'s EvalBatchSampler) are run
and not counted. ``loop.eval_max_batches`` stops every rank after the same number of batches:
the means are then those of the samples evaluated, each counted once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from itertools import islice
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from sdnet_trainer.data.token_cache import IGNORE_INDEX
from sdnet_trainer.distributed import all_reduce_sum
from sdnet_trainer.distributed.ops import all_gather_objects


def token_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, label_smoothing: float = 0.0
) -> torch.Tensor:
    """The mean cross-entropy over the targets that count: ``IGNORE_INDEX`` (-100) targets (chat
    prompts, masked document boundaries) add nothing to the loss or to the gradient. A batch
    without a counted target has loss 0 (not 0/0). ``logits`` may be vocabulary-sharded
    (tensor-parallel ``loss_parallel``): the sum is computed on the shards, the count is a plain
    scalar tensor, and nothing waits for the device."""
    total = F.cross_entropy(
        logits,
        targets,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        label_smoothing=label_smoothing,
    )
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)


def metric_sums(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Loss, top-1 and top-5 hits summed over samples (over positions for sequence models);
    ``IGNORE_INDEX`` targets are left out of every sum and of the count."""
    if isinstance(logits, DTensor):  # vocabulary-sharded logits (tensor-parallel loss_parallel)
        logits = logits.full_tensor()
    logits = logits.float()
    if logits.dim() == 3:
        logits, targets = logits.flatten(0, 1), targets.flatten(0, 1)
    counted = targets != IGNORE_INDEX
    top = logits.topk(min(5, logits.shape[1]), dim=1).indices.eq(targets[:, None])
    return {
        "loss": F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum"),
        "top1": (top[:, 0] & counted).sum(),
        "top5": (top.any(dim=1) & counted).sum(),
        # Counted on the device: a host count would wait for the GPU's queued work every batch.
        "count": counted.sum(),
    }


@torch.no_grad()
def evaluate_batches(
    batches: Iterable[Any],
    eval_step: Callable[[Any], dict[str, torch.Tensor]],
    *,
    model: torch.nn.Module,
    autocast: Callable[[], AbstractContextManager[Any]],
    after_batch: Callable[[], None],
    weight: float,
    device: torch.device,
    agree_on_keys: bool,
    counted_batches: int | None = None,
    max_batches: int | None = None,
) -> dict[str, float]:
    """Run ``eval_step`` over the first ``max_batches`` batches (None: all) with ``model`` in
    eval mode (restored afterwards), add up the sums of the first ``counted_batches`` (None: all)
    and reduce them over ranks (see :func:`reduce_metric_sums`). The batches after those are
    padding: their forward still runs, as a sharded model's forward is a collective every rank
    must join, but their sums are dropped (not weighted by zero: a padding batch's non-finite
    loss would still poison a sum).

    Every rank (every pipeline stage too) has as many batches and the same ``max_batches``, so
    all stop at the same batch, and the count of what they summed stays exact; a rank whose
    share runs out before ``max_batches`` runs its padding batches up to it. No batch at all
    (no validation set, on every rank alike) is no metrics: ``{}``, without a collective."""
    was_training = model.training
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    ran = 0
    try:
        # islice stops before asking the loader for the batch after the last one evaluated.
        for index, batch in enumerate(islice(batches, max_batches)):
            ran += 1
            with autocast():
                sums = eval_step(batch)
            after_batch()
            if counted_batches is not None and index >= counted_batches:
                continue
            for key, value in sums.items():
                totals[key] = totals.get(key, 0) + value.detach().double()
    finally:
        model.train(was_training)
    if not ran:
        return {}
    return reduce_metric_sums(totals, weight=weight, device=device, agree_on_keys=agree_on_keys)


def reduce_metric_sums(
    totals: dict[str, torch.Tensor], *, weight: float, device: torch.device, agree_on_keys: bool
) -> dict[str, float]:
    """Means over all ranks of this rank's summed metrics, identical on every rank (collective).

    ``weight`` is 0 on ranks whose sums must not count (earlier pipeline stages, tensor-parallel
    copies); such ranks may hold no sums at all, so with ``agree_on_keys`` the ranks first agree
    on the keys. ``top*`` keys become percentages."""
    keys = sorted(totals)
    if agree_on_keys:
        keys = sorted(set().union(*all_gather_objects(keys)))
    zero = torch.zeros((), dtype=torch.float64, device=device)
    local = torch.stack([totals.get(k, zero) for k in keys])
    values = dict(zip(keys, all_reduce_sum(local * weight).tolist(), strict=True))
    count = values.pop("count")
    return {k: (100.0 * v if k.startswith("top") else v) / count for k, v in values.items()}
