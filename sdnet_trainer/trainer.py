"""The Trainer: assembles a run from config and drives the training loop.

A custom task subclasses ``Trainer`` and overrides a few small methods (``build_model``,
``build_datasets``, ``build_optimizer``, ``build_scheduler``, ``compute_loss``, ``eval_step`` /
``evaluate``). Everything around them (device placement, data parallelism, precision,
accumulation, clipping, logging, evaluation) is done here, so a subclass never writes
distributed code.

    setup:  seed -> mesh -> model -> parallelize (pipeline split, TP, activation checkpointing,
            compile, FSDP/DDP) -> optimizer (ZeRO-1) -> data -> schedule -> precision -> hooks
            -> checkpoint manager -> resume (checkpoint.resume)
    fit:    for each step: train_step (micro-steps or the pipeline schedule, agree, clip,
            optimizer, schedule) -> hooks (evaluate, checkpoint, metrics) -> watchdog beat

Parallel layouts come from ``parallel.*`` (a DeviceMesh of pp x dp_replicate x dp_shard x tp).
Ranks that share data-parallel coordinates load the same samples; metrics count each sample once
(on the last pipeline stage, tensor-parallel rank 0).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import Dataset, default_collate

from sdnet_trainer import rng
from sdnet_trainer.checkpoint import Checkpoint, CheckpointManager
from sdnet_trainer.config import Config, batch_layout
from sdnet_trainer.config.validate import LM_DATASETS
from sdnet_trainer.data import GlobalBatchSampler, ShardedEvalSampler, build_datasets, build_loader
from sdnet_trainer.data.loader import shutdown_loader
from sdnet_trainer.data.seeding import EpochTaggedBatches, SampleSeeded
from sdnet_trainer.distributed import DistEnv, all_reduce_sum
from sdnet_trainer.distributed.comm import GradientComm
from sdnet_trainer.distributed.ddp import is_ddp, unwrap
from sdnet_trainer.distributed.grad_norm import global_grad_norm
from sdnet_trainer.distributed.mesh import build_mesh, parallel_dims
from sdnet_trainer.distributed.ops import all_gather_objects, all_reduce_max
from sdnet_trainer.distributed.parallelize import parallelize, set_gradient_sync
from sdnet_trainer.distributed.pipeline import Pipeline, build_pipeline
from sdnet_trainer.distributed.zero import load_zero_param_groups, materialize_zero_state, zero_state_dict
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.health import (Heartbeat, NonFiniteError, PhaseTracker, Watchdog, hang_log_path,
                                  nonfinite_tensor_names)
from sdnet_trainer.hooks import CheckpointHook, EvalHook, HookBase, MetricsHook
from sdnet_trainer.models import build_model
from sdnet_trainer.observability import MetricsWriter, StepMeter
from sdnet_trainer.observability.flops import peak_tflops, train_flops_per_sample
from sdnet_trainer.observability.profiler import StepProfiler
from sdnet_trainer.optim import build_optimizer, build_scheduler
from sdnet_trainer.precision import Precision

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config, *, output_dir: str | Path, env: DistEnv | None = None) -> None:
        self.cfg = cfg
        self.output_dir = Path(output_dir)
        self.env = env if env is not None else DistEnv()
        self.device = self.env.device
        self.layout = batch_layout(cfg, self.env.world_size)
        self.micro_batch_size = self.layout.micro_batch_size
        self.dims = parallel_dims(cfg.parallel, self.env.world_size)
        self.dp_rank = self.dims.dp_rank(self.env.rank)
        self.mesh = None  # the DeviceMesh, built in setup once the process group is up
        self.pipeline: Pipeline | None = None
        self.comm: GradientComm | None = None  # DDP's gradient communication (comm.*)
        self.flops_per_sample: float | None = None  # model FLOPs of forward + backward
        self.peak_tflops: float | None = None  # per device, for MFU
        # Counters, all saved in checkpoints. A step counts even when it was skipped.
        self.step = 0  # optimizer steps taken
        self.epoch = 0
        self.epoch_sample = 0  # position in the current epoch's sample order
        self.samples_seen = 0
        self.skipped_steps = 0  # fp16 steps the GradScaler skipped on inf/NaN gradients
        self.nonfinite_steps = 0  # steps skipped by health.nonfinite=skip
        # Decided by all ranks together at the end of every step (see _agree).
        self.epoch_ended = False
        self.checkpoint_due = False
        self.stop_requested = False
        self._sigterm = False
        self.last_step: dict[str, Any] = {}
        self.phase = PhaseTracker()
        self.watchdog: Watchdog | None = None  # armed by fit when health.hang_timeout_s is set
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
        """Over the parallelized model (FSDP's sharded parameters); ZeRO-1 under parallel=zero1."""
        zero = self.cfg.parallel.strategy == "zero1" and self.env.distributed
        return build_optimizer(model, self.cfg.optim, device_type=self.device.type,
                               zero_group=None if zero else False)

    def build_scheduler(self, optimizer: torch.optim.Optimizer, *, total_steps: int
                        ) -> torch.optim.lr_scheduler.LRScheduler:
        """Stepped once per optimizer step."""
        return build_scheduler(optimizer, self.cfg.sched, total_steps=total_steps)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The mean loss of one micro-batch (already on the device, inside autocast)."""
        inputs, targets = batch
        return self.loss_fn(self.model(inputs), targets)

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy over classes, or over the vocabulary at every position of a sequence
        model's (batch, time, vocab) logits. Also the pipeline's loss on its last stage."""
        if outputs.dim() == 3:
            outputs, targets = outputs.flatten(0, 1), targets.flatten(0, 1)
        return self.criterion(outputs, targets)

    def eval_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """Metric *sums* over one eval batch plus ``count``; ``evaluate`` adds them over batches
        and ranks and divides every other key by the total count. Under pipeline parallelism
        the default runs the batch through the stages and only the last stage returns sums."""
        inputs, targets = batch
        if self.pipeline is not None:
            logits = self.pipeline.forward(inputs)
            return {} if logits is None else self.metric_sums(logits, targets)
        return self.metric_sums(unwrap(self.model)(inputs), targets)

    @staticmethod
    def metric_sums(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Loss, top-1 and top-5 hits summed over samples (over positions for sequence models)."""
        if isinstance(logits, DTensor):  # vocabulary-sharded logits (tensor-parallel loss_parallel)
            logits = logits.full_tensor()
        logits = logits.float()
        if logits.dim() == 3:
            logits, targets = logits.flatten(0, 1), targets.flatten(0, 1)
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
            self.beat()
            for key, value in sums.items():
                totals[key] = totals.get(key, 0) + value.detach().double()
        model.train(was_training)
        # Ranks whose sums do not count (earlier pipeline stages, tensor-parallel copies) may hold
        # none or duplicates: agree on the keys, then weigh each rank's sums.
        keys = sorted(set().union(*all_gather_objects(sorted(totals)))) if self.dims.pp > 1 else sorted(totals)
        local = [totals[k] if k in totals else torch.zeros((), dtype=torch.float64, device=self.device)
                 for k in keys]
        reduced = all_reduce_sum(torch.stack(local) * self.metric_weight).tolist()
        values = dict(zip(keys, reduced))
        count = values.pop("count")
        return {k: (100.0 * v if k.startswith("top") else v) / count for k, v in values.items()}

    def build_hooks(self) -> list[HookBase]:
        """Called in this order after every step: evaluation, then checkpointing, then metrics
        (so the summary MetricsHook prints at the end includes the final evaluation)."""
        return [EvalHook(), CheckpointHook(), MetricsHook()]

    # ------------------------------------------------------------------ checkpointed state

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs, as a DCP state dict. Model and optimizer go through
        torch's distributed state-dict helpers (the same code serves DDP and sharded layouts);
        the RNG entry is per rank, under the rank's own key."""
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            model_state = get_model_state_dict(self.model)
            optim_state = zero_state_dict(unwrap(self.model), self.optimizer)
        else:
            untouched = not self.optimizer.state
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            if untouched:
                # get_state_dict materialises optimizer state with a zero-lr step (AdamW would then
                # count step 1); keep the live optimizer as it was, the copy above is enough to save.
                self.optimizer.state.clear()
        state = {"model": model_state, "optim": optim_state, "scheduler": self.scheduler.state_dict(),
                 "trainer": {"step": self.step, "epoch": self.epoch, "epoch_sample": self.epoch_sample,
                             "samples_seen": self.samples_seen, "skipped_steps": self.skipped_steps,
                             "nonfinite_steps": self.nonfinite_steps},
                 f"rng/rank{self.env.rank}": rng.capture(self.device)}
        if self.comm is not None and (comm_state := self.comm.state_dict()):
            # Per rank like the RNG: PowerSGD's error feedback differs between ranks.
            state[f"comm/rank{self.env.rank}"] = comm_state
        if self.precision.scaling:
            state["scaler"] = self.precision.scaler.state_dict()
        return state

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        zero = isinstance(self.optimizer, ZeroRedundancyOptimizer)
        if zero:
            materialize_zero_state(self.optimizer)  # the state dict then holds the live tensors to fill
        state = self.state_dict()
        rng_key = f"rng/rank{self.env.rank}"
        same_layout = checkpoint.world_size == self.env.world_size and checkpoint.has_key(rng_key)
        comm_key = f"comm/rank{self.env.rank}"
        if not same_layout:
            del state[rng_key]
        if comm_key in state and not (same_layout and checkpoint.has_key(comm_key)):
            del state[comm_key]  # another world size, or written without this comm hook: start afresh
        if "scaler" in state and not checkpoint.has_key("scaler"):
            del state["scaler"]  # written without fp16: keep the fresh scaler
        # Parameters that never had a gradient (unused branches) have no optimizer state in the
        # checkpoint; the fresh state materialised for them here is dropped rather than looked up.
        optim_state = state["optim"]["state"]
        for name in [n for n in optim_state if not checkpoint.has_key(f"optim.state.{n}")]:
            del optim_state[name]
        self.checkpointer.load(checkpoint, state)
        set_model_state_dict(self.model, state["model"])
        if zero:
            load_zero_param_groups(self.optimizer, state["optim"]["param_groups"])
        else:
            # Not strict: parameters without a gradient so far rightly have no optimizer state.
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"],
                                     options=StateDictOptions(strict=False))
        self.scheduler.load_state_dict(state["scheduler"])
        if "scaler" in state:
            self.precision.scaler.load_state_dict(state["scaler"])
        counters = state["trainer"]
        self.step, self.epoch = counters["step"], counters["epoch"]
        self.epoch_sample, self.samples_seen = counters["epoch_sample"], counters["samples_seen"]
        if self._epoch_exhausted():
            # A larger global batch than the writer's (elastic keep_per_rank, or a changed config)
            # may leave no full batch in the interrupted epoch: continue with the next one.
            self.epoch, self.epoch_sample = self.epoch + 1, 0
        self.skipped_steps, self.nonfinite_steps = counters["skipped_steps"], counters["nonfinite_steps"]
        if comm_key in state:
            self.comm.load_state_dict(state[comm_key])
        if same_layout:
            rng.restore(state[rng_key], self.device)
        else:
            # Old ranks do not map onto new ones: re-derive every stream from (seed, rank, step).
            rng.reseed(self.cfg.loop.seed, rank=self.env.rank, step=self.step)
        logger.info("resumed from %s: step %d, epoch %d, sample %d of the epoch (written by %d ranks%s)",
                    checkpoint.path, self.step, self.epoch, self.epoch_sample, checkpoint.world_size,
                    "" if same_layout else "; random streams re-derived")

    def save_checkpoint(self) -> None:
        self.phase.enter("checkpoint save", step=self.step)
        # The resolved config and Trainer class travel with the weights: export rebuilds the model
        # from them without the run directory.
        meta = {"global_batch_size": self.layout.global_batch_size, "world_size": self.env.world_size,
                "trainer": f"{type(self).__module__}.{type(self).__qualname__}",
                "config": OmegaConf.to_container(OmegaConf.structured(self.cfg))}
        self.checkpointer.save(self.step, self.state_dict(), meta=meta)
        self.last_checkpoint_step = self.step
        self.last_checkpoint_time = time.monotonic()

    # ------------------------------------------------------------------ assembly

    def setup(self) -> None:
        loop, data = self.cfg.loop, self.cfg.data
        rng.seed_everything(loop.seed, deterministic=loop.deterministic)
        if self.env.distributed:
            self.mesh = build_mesh(self.dims, self.device.type)
        # Same seed on every rank for the model's initial weights (DDP also broadcasts rank 0's);
        # pipeline stages and tensor-parallel shards are cut from identical full models.
        model = self.build_model().to(self.device)
        num_parameters = sum(p.numel() for p in model.parameters())
        parallel = parallelize(model, self.cfg, self.env, self.mesh, self.dims)
        self.model = parallel.model
        if parallel.stages is not None:
            self.pipeline = build_pipeline(parallel.stages, parallel.stage_ids, parallel.num_stages,
                                           self.cfg.parallel.pipeline, group=self.mesh["pp"].get_group(),
                                           device=self.device, loss_fn=self.loss_fn)
        coords = self.dims.coordinates(self.env.rank)
        # This rank's metrics count once: last pipeline stage, first tensor-parallel peer.
        last_stage = self.pipeline is None or self.pipeline.has_last
        self.metric_weight = 1.0 if last_stage and coords["tp"] == 0 else 0.0
        self.optimizer = self.build_optimizer(self.model)
        if is_ddp(self.model):
            self.comm = GradientComm(self.model, self.cfg.comm, process_group=self.model.process_group)
        # From here on each rank draws its own random stream (dropout, augmentation).
        rng.reseed(loop.seed, rank=self.env.rank, step=0)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=self.cfg.loss.label_smoothing)

        train_set, val_set = self.build_datasets()
        self.train_sampler = GlobalBatchSampler(
            len(train_set), micro_batch_size=self.micro_batch_size, world_size=self.dims.dp,
            rank=self.dp_rank, grad_accum_steps=self.layout.grad_accum_steps, shuffle=data.shuffle,
            seed=loop.seed, drop_last=data.drop_last)
        # The loader gets its own generator: creating an iterator must not draw from the global
        # stream, or a resumed run (which creates one mid-epoch) would diverge from an
        # uninterrupted one. Augmentations are seeded per sample (SampleSeeded), so which worker
        # loads a sample does not matter either.
        self.train_loader = build_loader(SampleSeeded(train_set, seed=loop.seed), cfg=data,
                                         device_type=self.device.type,
                                         batch_sampler=EpochTaggedBatches(self.train_sampler),
                                         generator=torch.Generator())
        self.val_loader = None
        if val_set is not None:
            if len(val_set) < self.dims.dp:
                raise ConfigError(f"the validation set has {len(val_set)} samples, fewer than the "
                                  f"{self.dims.dp} data-parallel ranks (data.val_size)")
            self.val_loader = build_loader(
                val_set, cfg=data, device_type=self.device.type,
                sampler=ShardedEvalSampler(len(val_set), world_size=self.dims.dp, rank=self.dp_rank),
                batch_size=loop.eval_batch_size or self.micro_batch_size)

        self.steps_per_epoch = self.train_sampler.steps_per_epoch
        self.tokens_per_sample = data.seq_len if data.name in LM_DATASETS else None
        if self.cfg.logging.flops:
            self._count_flops(train_set)
        # For max_epochs this counts steps at the current batch layout (the schedule's length).
        self.total_steps = loop.max_steps or loop.max_epochs * self.steps_per_epoch
        self.scheduler = self.build_scheduler(self.optimizer, total_steps=self.total_steps)
        self.precision = Precision(self.cfg.precision, device_type=self.device.type)
        self.writer = MetricsWriter(self.output_dir, enabled=self.env.is_main,
                                    tensorboard=self.cfg.logging.tensorboard, jsonl=self.cfg.logging.jsonl)
        self.hooks = self.build_hooks()
        self.checkpointer = CheckpointManager(
            self.cfg.checkpoint.dir or self.output_dir / "checkpoints", keep_last=self.cfg.checkpoint.keep_last,
            async_save=self.cfg.checkpoint.async_save, rank=self.env.rank, world_size=self.env.world_size)
        self.last_checkpoint_step = -1
        self.last_checkpoint_time = time.monotonic()
        resume_from = self.checkpointer.resolve_resume(self.cfg.checkpoint.resume)
        if resume_from is not None:
            self.load_checkpoint(resume_from)
            self.last_checkpoint_step = self.step
        logger.info("model %s: %.2fM parameters | world size %d on %s (%s, %s) | global batch %d = %d "
                    "data-parallel ranks x %d accumulation x %d micro-batch | %d steps (%d per epoch)",
                    self.cfg.model.name, num_parameters / 1e6, self.env.world_size, self.device,
                    self.dims.describe(), self.cfg.parallel.strategy, self.layout.global_batch_size,
                    self.dims.dp, self.layout.grad_accum_steps, self.micro_batch_size, self.total_steps, self.steps_per_epoch)

    def _count_flops(self, train_set: Dataset) -> None:
        """Forward + backward FLOPs per sample, counted once on a meta-device copy of the model
        (no memory, no collectives), and the device peak that turns them into MFU."""
        example = default_collate([train_set[i] for i in range(min(2, len(train_set)))])
        try:
            self.flops_per_sample = train_flops_per_sample(
                self.build_model, example, lambda model, batch: self.loss_fn(model(batch[0]), batch[1]))
        except Exception as err:  # a custom model or batch the counter cannot run: no FLOPs metrics
            logger.warning("model FLOPs not counted (%s: %s); set logging.flops=false to skip", type(err).__name__, err)
            return
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.cfg.precision.dtype, torch.float32)
        self.peak_tflops = peak_tflops(self.device, dtype, self.cfg.logging.peak_tflops)
        logger.info("model FLOPs: %.3g per sample (forward + backward)%s", self.flops_per_sample,
                    f"; device peak {self.peak_tflops:g} TFLOPs" if self.peak_tflops else "")

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, float]:
        """Train to ``loop.max_steps`` (or ``max_epochs``); returns the final metrics."""
        self.setup()
        self._batches = self._train_batches()
        health = self.cfg.health
        heartbeat = Heartbeat(health.heartbeat_s, rank=self.env.rank) if health.heartbeat_s else None
        try:
            with ExitStack() as guards:
                guards.enter_context(_handle_sigterm(self))
                profiler = guards.enter_context(StepProfiler(self.cfg.profile, output_dir=self.output_dir,
                                                             rank=self.env.rank, device=self.device))
                if health.hang_timeout_s is not None:
                    self.watchdog = guards.enter_context(Watchdog(
                        health.hang_timeout_s, rank=self.env.rank, describe=self.phase.describe,
                        log_file=hang_log_path(self.output_dir, self.env.rank)))
                for hook in self.hooks:
                    hook.before_train(self)
                while not self._finished():
                    started = time.perf_counter()
                    self.last_step = self.train_step()
                    self._advance()
                    self.last_step_s = time.perf_counter() - started
                    # Ranks that share samples (tensor/pipeline peers) share the count as well.
                    self.meter.step_done(samples=self.layout.global_batch_size / self.env.world_size,
                                         seconds=self.last_step_s)
                    profiler.step()
                    for hook in self.hooks:
                        hook.after_step(self)
                    self.beat()
                    if heartbeat is not None:
                        heartbeat.maybe_log(self.step, step_s=self.last_step_s,
                                            data_wait_s=self.last_step.get("data_wait_s", 0.0))
                    if self.stop_requested and not self._finished():
                        logger.warning("SIGTERM: stopped at step %d%s", self.step,
                                       " after saving a checkpoint" if self.cfg.checkpoint.save_on_exit else "")
                        raise SystemExit(EXIT_TERMINATED)
                for hook in self.hooks:
                    hook.after_train(self)
        finally:
            self._batches.close()  # ends the loader iteration in flight
            shutdown_loader(self.train_loader)
            shutdown_loader(self.val_loader)
            self.writer.close()
            self.checkpointer.close()  # waits for an async save in flight
        return self.final_metrics

    def _finished(self) -> bool:
        loop = self.cfg.loop
        return self.step >= loop.max_steps if loop.max_steps else self.epoch >= loop.max_epochs

    def _advance(self) -> None:
        """Count the step that just ran and move the data position; epochs end when no full
        global batch is left."""
        batch = self.layout.global_batch_size
        self.step += 1
        self.samples_seen += batch
        self.epoch_sample += batch
        self.epoch_ended = self._epoch_exhausted()
        if self.epoch_ended:
            self.epoch += 1
            self.epoch_sample = 0

    def _epoch_exhausted(self) -> bool:
        """No full global batch is left in the current epoch from ``epoch_sample`` on."""
        batch = self.layout.global_batch_size
        return self.epoch_sample + batch > self.steps_per_epoch * batch

    def beat(self) -> None:
        """Progress for the hang watchdog (also called inside long evaluations)."""
        if self.watchdog is not None:
            self.watchdog.beat()

    def close(self) -> None:
        """Release the model, optimizer and loaders before the process group goes away; an
        exception's traceback may keep this Trainer alive past that point."""
        for name in ("model", "pipeline", "optimizer", "scheduler", "train_loader", "val_loader", "_batches"):
            setattr(self, name, None)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``grad_accum_steps`` micro-batches."""
        accum = self.layout.grad_accum_steps
        step_started = time.perf_counter()
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        data_wait = 0.0
        for micro_step in range(accum):
            started = time.perf_counter()
            self.phase.enter("data", step=self.step + 1)
            batch = self._next_batch()
            data_wait += time.perf_counter() - started  # fetch and copy to the device
            # Data parallelism reduces gradients in backward; skip that on all but the last micro-step.
            sync = micro_step == accum - 1
            self.phase.enter("forward/backward (gradient reduction)" if sync else "forward/backward",
                             step=self.step + 1)
            with self._gradient_sync(sync), self._loss_parallel():
                if self.pipeline is not None:
                    loss = self._pipeline_step(batch)
                else:
                    with self.precision.autocast():
                        loss = self.compute_loss(batch)
                    self.precision.scaler.scale(loss / accum).backward()
            if isinstance(loss, DTensor):  # loss_parallel: the loss of vocabulary shards, replicated
                loss = loss.full_tensor()
            loss_sum += loss.detach().float()
        loss = loss_sum / accum
        backward_done = time.perf_counter()

        grad_norm = self._grad_norm()
        nonfinite = self._agree(loss, grad_norm)
        if nonfinite:
            self._on_nonfinite(loss)
        else:
            self.phase.enter("optimizer", step=self.step + 1)
            self._clip(grad_norm)
            scaler = self.precision.scaler
            scale_before = scaler.get_scale() if scaler.is_enabled() else None
            scaler.step(self.optimizer)  # skips optimizer.step when fp16 gradients overflowed
            scaler.update()
            if scale_before is not None and scaler.get_scale() < scale_before:
                self.skipped_steps += 1
                if self.comm is not None:
                    self.comm.discard_error_feedback()  # PowerSGD's memory holds this step's inf
            if self.comm is not None:
                self.comm.after_optimizer_step(self.model.parameters())  # local SGD: average replicas
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.meter.add_data_wait(data_wait)
        self.meter.add_phases(compute=backward_done - step_started - data_wait,
                              optimizer=time.perf_counter() - backward_done)
        return {"loss": loss, "grad_norm": grad_norm, "data_wait_s": data_wait, "nonfinite": nonfinite}

    def _pipeline_step(self, batch: Any) -> torch.Tensor:
        """One schedule step over the pipeline's micro-batches: the mean loss on the last stage's
        rank, zero elsewhere (metric_weight keeps it out of the logged mean)."""
        inputs, targets = batch
        with self.precision.autocast():
            losses = self.pipeline.train_step(inputs, targets)
        return torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)

    def _gradient_sync(self, enabled: bool):
        """DDP's no_sync, or FSDP's requires_gradient_sync, on accumulation micro-steps."""
        if enabled:
            return nullcontext()
        if is_ddp(self.model):
            return self.model.no_sync()
        return _without_gradient_sync(self.model)

    def _loss_parallel(self):
        """Tensor parallel with vocabulary-sharded logits: the loss and its backward run on shards."""
        return loss_parallel() if self.cfg.parallel.tensor_parallel.loss_parallel else nullcontext()

    def _grad_norm(self) -> torch.Tensor:
        """The total gradient norm in true units (unscaled under fp16), every step: it serves the
        non-finite check, clipping and logging, and costs one pass over the gradients. It is the
        global norm under every layout (sharded and pipelined gradients included)."""
        self.precision.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 else None
        return global_grad_norm(grads, pp_group=pp_group, device=self.device)

    def _agree(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """One small all-reduce per step so every rank takes the same branch: non-finite values
        seen by any rank, SIGTERM received by any rank, rank 0's clock saying a timed checkpoint
        is due. Returns whether the step is non-finite."""
        self.phase.enter("step agreement all-reduce", step=self.step + 1)
        # Under fp16 an overflowing gradient is routine (the GradScaler skips that step), so only
        # the loss counts as a health event there.
        bad = ~torch.isfinite(loss) if self.precision.scaling else ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        minutes = self.cfg.checkpoint.every_n_minutes
        timed = (self.env.is_main and minutes is not None
                 and time.monotonic() - self.last_checkpoint_time >= 60 * minutes)
        host_flags = torch.tensor([float(self._sigterm), float(timed)]).to(self.device, non_blocking=True)
        flags = torch.cat([bad.float().reshape(1), host_flags])
        # The one host synchronisation per step: every rank must know the verdict before stepping.
        nonfinite, stop, due = (bool(v) for v in all_reduce_max(flags).tolist())
        self.stop_requested = stop
        self.checkpoint_due = due
        return nonfinite

    def _on_nonfinite(self, loss: torch.Tensor) -> None:
        names = nonfinite_tensor_names(
            ((name, p.grad) for name, p in unwrap(self.model).named_parameters()),
            loss=loss if not torch.isfinite(loss) else None)
        if self.cfg.health.nonfinite == "abort":
            raise NonFiniteError(step=self.step + 1, rank=self.env.rank, names=names)
        # skip: parameters and optimizer state stay as they were; the schedule moves on with the
        # step count, as it does when the fp16 GradScaler skips a step.
        self.nonfinite_steps += 1
        if self.comm is not None:
            self.comm.discard_error_feedback()
        if self.precision.scaling:
            self.precision.scaler.update()  # closes this step's unscale_; lowers the scale
        self.scheduler.step()
        logger.warning("non-finite values at step %d (%s): step skipped (%d so far)", self.step + 1,
                       ", ".join(names) or "on another rank", self.nonfinite_steps)

    def _clip(self, grad_norm: torch.Tensor) -> None:
        optim = self.cfg.optim
        params = [p for p in self.model.parameters() if p.grad is not None]
        if optim.clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(params, optim.clip_grad_value)
        if optim.clip_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, optim.clip_grad_norm, grad_norm)

    def is_log_step(self, step: int) -> bool:
        return step % self.cfg.logging.log_every_n_steps == 0 or step == self.total_steps

    # ------------------------------------------------------------------ data plumbing

    def _train_batches(self) -> Iterator[Any]:
        """Micro-batches forever, epoch after epoch; the sampler is positioned from the epoch and
        the sample position, so the order depends only on the seed, the epoch and the global
        sample index (not on the world size or on where a previous run stopped)."""
        while True:
            self.train_sampler.set_epoch(self.epoch)
            self.train_sampler.set_start_sample(self.epoch_sample)
            yield from self.train_loader

    def _next_batch(self) -> Any:
        return self.to_device(next(self._batches))

    def to_device(self, batch: Any) -> Any:
        """Move every tensor in a (nested) batch to the training device."""
        if isinstance(batch, torch.Tensor):
            if self.cfg.model.channels_last and batch.dim() == 4 and batch.is_floating_point():
                return batch.to(self.device, memory_format=torch.channels_last, non_blocking=True)
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.to_device(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self.to_device(v) for k, v in batch.items()}
        return batch


EXIT_TERMINATED = 128 + signal.SIGTERM  # the shell's convention for "ended by SIGTERM"


@contextmanager
def _without_gradient_sync(model: nn.Module) -> Iterator[None]:
    set_gradient_sync([model], False)
    try:
        yield
    finally:
        set_gradient_sync([model], True)


class _handle_sigterm:
    """While training, SIGTERM (a scheduler's notice before preemption) only sets a flag; the
    ranks agree on it at the end of the step, save a checkpoint and exit together."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def __enter__(self) -> None:
        def handler(signum, frame):
            if self.trainer._sigterm:
                # A second SIGTERM: the first was not acted upon (a rank stuck before the step's
                # agreement), so terminate now, the default way.
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
            self.trainer._sigterm = True

        self.previous = signal.signal(signal.SIGTERM, handler)

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGTERM, self.previous)
