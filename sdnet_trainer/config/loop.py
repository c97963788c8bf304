"""Typed schema of the training loop (``loop``): its length, batch split, evaluation and seed, kept
beside ``schema.py``, whose ``Config`` includes it (``training/trainer.py`` runs it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class LoopConfig:
    # Stop after max_steps optimizer steps; if null, after max_epochs passes over the train set.
    max_steps: Optional[int] = 100
    max_epochs: Optional[int] = None
    # Samples per optimizer step over all ranks and micro-steps:
    # global_batch_size = world_size * grad_accum_steps * per-rank micro-batch.
    global_batch_size: int = 64
    grad_accum_steps: int = 1
    # Per-rank samples per forward pass. null: derived (global / (world size x accumulation));
    # set it (with elastic.enabled) to keep it fixed while the world size changes.
    micro_batch_size: Optional[int] = None
    eval_batch_size: Optional[int] = None  # per rank; defaults to the training micro-batch
    eval_every_n_steps: Optional[int] = None
    # Evaluate at every epoch end. null: only where loop.eval_every_n_steps is null (a period the
    # user set is the schedule, and an epoch end does not add to it); true or false forces it.
    eval_at_epoch_end: Optional[bool] = None
    # Validation batches per rank per evaluation. null: the whole split. N: the first N batches
    # of each rank's share (rank r of W holds samples r, r+W, r+2W...: together the split's first
    # N x eval batch size x data-parallel ranks samples), the same ones at every evaluation, so
    # successive evaluations (and val_ema/*) compare; the metrics are their exact means.
    eval_max_batches: Optional[int] = None
    eval_at_end: bool = True
    seed: int = 0
    # torch.use_deterministic_algorithms and friends: slower, bitwise repeatable kernels.
    deterministic: bool = False


__all__ = ["LoopConfig"]
