"""The Trainer: assembles a run from config and drives the training loop.

A custom task subclasses ``Trainer`` and overrides a few small methods (``build_model``,
``build_datasets``, ``build_optimizer``, ``build_scheduler``, ``compute_loss``, ``eval_step`` /
``evaluate``). Everything around them (device placement, data parallelism, precision,
accumulation, clipping, logging, evaluation) is done here, so a subclass never writes
distributed code.

    setup:  seed -> model -> DDP -> optimizer -> data -> schedule -> precision -> hooks
    fit:    for each step: train_step (micro-steps, clip, optimizer, schedule) -> hooks
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from sdnet_trainer.config import Config, micro_batch_size
from sdnet_trainer.data import GlobalBatchSampler, ShardedEvalSampler, build_datasets, build_loader
from sdnet_trainer.distributed import DistEnv, all_reduce_sum, wrap_data_parallel
from sdnet_trainer.distributed.ddp import is_ddp, unwrap
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.hooks import EvalHook, HookBase, MetricsHook
from sdnet_trainer.models import build_model
from sdnet_trainer.observability import MetricsWriter, StepMeter
from sdnet_trainer.optim import build_optimizer, build_scheduler
from sdnet_trainer.precision import Precision

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config, *, output_dir: str | Path, env: DistEnv | None = None) -> None:
        self.cfg = cfg
        self.output_dir = Path(output_dir)
        self.env = env if env is not None else DistEnv()
        self.device = self.env.device
        self.micro_batch_size = micro_batch_size(cfg, self.env.world_size)
        self.step = 0  # optimizer steps taken
        self.skipped_steps = 0  # fp16 steps the GradScaler skipped on inf/NaN gradients
        self.last_step: dict[str, Any] = {}
        self.final_metrics: dict[str, float] = {}
        self.meter = StepMeter()

    # ------------------------------------------------------------------ the subclassing surface

    def build_model(self) -> nn.Module:
        """The bare model, on the CPU; the Trainer moves and wraps it."""
        return build_model(self.cfg.model)

    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        """(train, val) map-style datasets; val may be None to skip evaluation."""
        return build_datasets(self.cfg.data)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(model, self.cfg.optim)

    def build_scheduler(self, optimizer: torch.optim.Optimizer, *, total_steps: int
                        ) -> torch.optim.lr_scheduler.LRScheduler:
        """Stepped once per optimizer step."""
        return build_scheduler(optimizer, self.cfg.sched, total_steps=total_steps)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The mean loss of one micro-batch (already on the device, inside autocast)."""
        inputs, targets = batch
        return self.criterion(self.model(inputs), targets)

    def eval_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """Metric *sums* over one eval batch plus ``count``; ``evaluate`` adds them over batches
        and ranks and divides every other key by the total count."""
        inputs, targets = batch
        logits = unwrap(self.model)(inputs).float()
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices.eq(targets[:, None])
        return {"loss": F.cross_entropy(logits, targets, reduction="sum"),
                "top1": top[:, 0].sum(), "top5": top.any(dim=1).sum(),
                "count": torch.tensor(targets.shape[0], device=targets.device)}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Metrics over the whole validation set, identical on every rank."""
        if self.val_loader is None:
            return {}
        model = unwrap(self.model)
        was_training = model.training
        model.eval()
        totals: dict[str, torch.Tensor] = {}
        for batch in self.val_loader:
            with self.precision.autocast():
                sums = self.eval_step(self.to_device(batch))
            for key, value in sums.items():
                totals[key] = totals.get(key, 0) + value.detach().double()
        model.train(was_training)
        keys = sorted(totals)
        reduced = all_reduce_sum(torch.stack([totals[k] for k in keys])).tolist()
        values = dict(zip(keys, reduced))
        count = values.pop("count")
        return {k: (100.0 * v if k.startswith("top") else v) / count for k, v in values.items()}

    def build_hooks(self) -> list[HookBase]:
        """Called in this order after every step; evaluation first, so its metrics reach the
        summary that MetricsHook prints at the end."""
        return [EvalHook(), MetricsHook()]

    # ------------------------------------------------------------------ assembly

    def setup(self) -> None:
        loop, data = self.cfg.loop, self.cfg.data
        seed_everything(loop.seed, deterministic=loop.deterministic)
        # Same seed on every rank for the model's initial weights (DDP also broadcasts rank 0's).
        model = self.build_model().to(self.device)
        self.model = wrap_data_parallel(model, self.cfg.parallel, self.env)
        self.optimizer = self.build_optimizer(self.model)
        # From here on each rank draws its own random stream (dropout, augmentation).
        torch.manual_seed(loop.seed + 1_000_003 * self.env.rank)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=self.cfg.loss.label_smoothing)

        train_set, val_set = self.build_datasets()
        self.train_sampler = GlobalBatchSampler(
            len(train_set), micro_batch_size=self.micro_batch_size, world_size=self.env.world_size,
            rank=self.env.rank, grad_accum_steps=loop.grad_accum_steps, shuffle=data.shuffle,
            seed=loop.seed, drop_last=data.drop_last)
        self.train_loader = build_loader(train_set, cfg=data, device_type=self.device.type,
                                         batch_sampler=self.train_sampler)
        self.val_loader = None
        if val_set is not None:
            if len(val_set) < self.env.world_size:
                raise ConfigError(f"the validation set has {len(val_set)} samples, fewer than the "
                                  f"world size {self.env.world_size} (data.val_size)")
            self.val_loader = build_loader(
                val_set, cfg=data, device_type=self.device.type,
                sampler=ShardedEvalSampler(len(val_set), world_size=self.env.world_size, rank=self.env.rank),
                batch_size=loop.eval_batch_size or self.micro_batch_size)

        self.steps_per_epoch = self.train_sampler.steps_per_epoch
        self.total_steps = loop.max_steps or loop.max_epochs * self.steps_per_epoch
        self.scheduler = self.build_scheduler(self.optimizer, total_steps=self.total_steps)
        self.precision = Precision(self.cfg.precision, device_type=self.device.type)
        self.writer = MetricsWriter(self.output_dir, enabled=self.env.is_main,
                                    tensorboard=self.cfg.logging.tensorboard, jsonl=self.cfg.logging.jsonl)
        self.hooks = self.build_hooks()
        logger.info("model %s: %.2fM parameters | world size %d on %s | global batch %d = %d ranks x "
                    "%d accumulation x %d micro-batch | %d steps (%d per epoch)",
                    self.cfg.model.name, sum(p.numel() for p in model.parameters()) / 1e6,
                    self.env.world_size, self.device, loop.global_batch_size, self.env.world_size,
                    loop.grad_accum_steps, self.micro_batch_size, self.total_steps, self.steps_per_epoch)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, float]:
        """Train to ``loop.max_steps`` (or ``max_epochs``); returns the final metrics."""
        self.setup()
        self._batches = self._train_batches()
        try:
            for hook in self.hooks:
                hook.before_train(self)
            while self.step < self.total_steps:
                started = time.perf_counter()
                self.last_step = self.train_step()
                self.step += 1
                self.meter.step_done(samples=self.micro_batch_size * self.cfg.loop.grad_accum_steps,
                                     seconds=time.perf_counter() - started)
                for hook in self.hooks:
                    hook.after_step(self)
            for hook in self.hooks:
                hook.after_train(self)
        finally:
            self.writer.close()
        return self.final_metrics

    def close(self) -> None:
        """Release the model, optimizer and loaders before the process group goes away; an
        exception's traceback may keep this Trainer alive past that point."""
        for name in ("model", "optimizer", "scheduler", "train_loader", "val_loader", "_batches"):
            setattr(self, name, None)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``loop.grad_accum_steps`` micro-batches."""
        accum = self.cfg.loop.grad_accum_steps
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        for micro_step in range(accum):
            batch = self._next_batch()
            # DDP all-reduces gradients in backward; skip that on all but the last micro-step.
            sync = micro_step == accum - 1 or not is_ddp(self.model)
            with nullcontext() if sync else self.model.no_sync():
                with self.precision.autocast():
                    loss = self.compute_loss(batch)
                self.precision.scaler.scale(loss / accum).backward()
            loss_sum += loss.detach().float()

        grad_norm = self._clip_gradients()
        scaler = self.precision.scaler
        scale_before = scaler.get_scale() if scaler.is_enabled() else None
        scaler.step(self.optimizer)  # skips optimizer.step when fp16 gradients overflowed
        scaler.update()
        if scale_before is not None and scaler.get_scale() < scale_before:
            self.skipped_steps += 1
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_sum / accum, "grad_norm": grad_norm}

    def _clip_gradients(self) -> torch.Tensor | None:
        """Clip as configured; returns the total gradient norm when it was computed anyway
        (clipping by norm) or is about to be logged."""
        optim = self.cfg.optim
        need_norm = optim.clip_grad_norm is not None or self.is_log_step(self.step + 1)
        if not need_norm and optim.clip_grad_value is None:
            return None
        # Gradients must be in true units before clipping or measuring them.
        self.precision.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if optim.clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(params, optim.clip_grad_value)
        if not need_norm:
            return None
        # Under DDP every rank holds the same all-reduced gradients, so the local norm is global.
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if optim.clip_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, optim.clip_grad_norm, norm)
        return norm

    def is_log_step(self, step: int) -> bool:
        return step % self.cfg.logging.log_every_n_steps == 0 or step == self.total_steps

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    # ------------------------------------------------------------------ data plumbing

    def _train_batches(self) -> Iterator[Any]:
        """Micro-batches forever, epoch after epoch; the sampler is positioned from ``self.step``,
        so the order depends only on the seed, the epoch and the global sample index."""
        while True:
            self.train_sampler.set_epoch(self.epoch)
            self.train_sampler.set_start_step(self.step % self.steps_per_epoch)
            yield from self.train_loader

    def _next_batch(self) -> Any:
        started = time.perf_counter()
        batch = next(self._batches)
        batch = self.to_device(batch)
        self.meter.add_data_wait(time.perf_counter() - started)
        return batch

    def to_device(self, batch: Any) -> Any:
        """Move every tensor in a (nested) batch to the training device."""
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.to_device(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self.to_device(v) for k, v in batch.items()}
        return batch


def seed_everything(seed: int, *, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    if deterministic:
        # cuBLAS needs a fixed workspace for deterministic matmuls; must be set before first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif torch.cuda.is_available():
        torch.backends.cudnn.benchmark = True
