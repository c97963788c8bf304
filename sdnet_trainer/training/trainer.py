"""The Trainer: assembles a run from config and drives the training loop.

A custom task subclasses ``Trainer`` and overrides a few small methods (``build_model``,
``build_datasets``, ``build_optimizer``, ``build_scheduler``, ``compute_loss``, ``eval_step`` /
``evaluate``, ``build_hooks``). Everything around them (device placement, parallel layout,
precision, accumulation, clipping, logging, evaluation, checkpoints) is done here, so a subclass
never writes distributed code. ``build_model`` and ``build_datasets`` read only ``self.cfg``:
export calls them on a Trainer that was never set up.

    setup:  model (mesh, parallelize) -> data -> optimization (optimizer, comm, precision,
            schedule) -> observability -> checkpointing (resume) -> hooks
    fit:    for each step: train_step (the step's batches and their counted targets, then
            forward_backward on each: micro-steps or the pipeline schedule, then OptimizerStep:
            norm, agreement, update) -> hooks, in the order of ``build_hooks``

The run's counters live in ``self.state`` (a ``RunState``), which hooks and the checkpointer
read. Ranks that share data-parallel coordinates load the same samples; metrics count each
sample once (on the last pipeline stage, tensor-parallel rank 0).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from sdnet_trainer.config import Config
from sdnet_trainer.data import (
    build_datasets,
    host_decoded,
    is_language_model_data,
    resolve_num_classes,
    skipped_samples,
)
from sdnet_trainer.data.loader import RunData
from sdnet_trainer.distributed import DistEnv
from sdnet_trainer.distributed.batching import BatchLayout, batch_layout
from sdnet_trainer.distributed.comm import GradientComm
from sdnet_trainer.distributed.context_parallel import ContextParallel
from sdnet_trainer.distributed.ddp import unwrap
from sdnet_trainer.distributed.env import shorten_timeout
from sdnet_trainer.distributed.mesh import ParallelDims, build_mesh, parallel_dims
from sdnet_trainer.distributed.parallelize import gradient_sync, parallelize
from sdnet_trainer.distributed.pipeline import Pipeline
from sdnet_trainer.distributed.reduction import StepReduction, counted_targets
from sdnet_trainer.ft.checks import check_lighthouse, lighthouse_address
from sdnet_trainer.models import build_model, init_adapters
from sdnet_trainer.models.init import allocate, build_deferred, materialize, without_parameters
from sdnet_trainer.models.registry import hf_weights_reader
from sdnet_trainer.observability import MetricsWriter, StepMeter
from sdnet_trainer.observability.figures import RunFigures
from sdnet_trainer.observability.flops import run_flops
from sdnet_trainer.observability.profiler import StepProfiler
from sdnet_trainer.observability.prometheus import PrometheusExporter, prometheus_enabled
from sdnet_trainer.runtime import rng
from sdnet_trainer.runtime.precision import Precision
from sdnet_trainer.runtime.signals import StopSignals
from sdnet_trainer.training.checkpointer import Checkpointer, plain_config, run_meta, run_parts
from sdnet_trainer.training.ema import WeightAverage
from sdnet_trainer.training.evaluation import evaluate_batches, metric_sums, token_cross_entropy
from sdnet_trainer.training.fits import check_fits
from sdnet_trainer.training.health import Heartbeat, PhaseTracker, Watchdog, hang_log_path
from sdnet_trainer.training.hooks import (
    EvalHook,
    HeartbeatHook,
    HookBase,
    MetricsHook,
    ProfilerHook,
    WatchdogHook,
)
from sdnet_trainer.training.moe import expert_balance
from sdnet_trainer.training.optim import build_optimizer, build_scheduler
from sdnet_trainer.training.optimizer_step import OptimizerStep
from sdnet_trainer.training.state import EpochShape, RunState, StepResult
from sdnet_trainer.training.step_source import StepSource

logger = logging.getLogger(__name__)


class Trainer:
    # Built by setup(), phase by phase (see setup).
    layout: BatchLayout
    dims: ParallelDims
    mesh: DeviceMesh | None
    model: nn.Module
    num_parameters: int
    pipeline: Pipeline | None  # this rank's stages under parallel.pp > 1
    metric_weight: float  # 1 where this rank's loss and metrics count (see _setup_model)
    ema: WeightAverage | None  # model.ema's average of the weights
    optimizer: torch.optim.Optimizer
    comm: GradientComm | None  # DDP's gradient communication (comm.*)
    precision: Precision
    criterion: nn.Module
    data: RunData  # the training and validation loaders
    context: ContextParallel | None  # parallel.cp > 1: this rank's share of each sequence
    steps_per_epoch: int
    epoch_shape: EpochShape
    total_steps: int  # for max_epochs: counted at the current batch layout (the schedule's length)
    scheduler: torch.optim.lr_scheduler.LRScheduler
    writer: MetricsWriter
    figures: RunFigures
    watchdog: Watchdog | None  # when health.hang_timeout_s is set
    stepper: OptimizerStep  # norm, agreement and update after backward
    checkpointer: Checkpointer
    source: StepSource  # the step's batches and replica groups (training/step_source.py)
    reduction: StepReduction  # the loss terms' and the reducers' one contract (distributed/)
    ft_hook: HookBase | None  # the ft room's figures at each log point
    hooks: list[HookBase]

    def __init__(
        self, cfg: Config, *, output_dir: str | Path | None = None, env: DistEnv | None = None
    ) -> None:
        self.cfg = cfg
        self.output_dir = Path(output_dir) if output_dir is not None else Path.cwd()
        self.env = env if env is not None else DistEnv()
        self.device = self.env.device
        self.state = RunState()
        self.signals = StopSignals()
        self.phase = PhaseTracker()  # what this rank is doing, for the hang watchdog's report
        self.meter = StepMeter(self.device)

    # ------------------------------------------------------------------ the subclassing surface

    def build_model(self) -> nn.Module:
        """The bare model; the Trainer moves and wraps it.

        An override returns the model on the CPU, with its values (built, or loaded): the
        Trainer moves it to the device, then parallelizes it. The stock models instead are built
        on the meta device, parallelized, and only then allocated and initialised, each rank its
        own shard (see ``sdnet_trainer.models.init``); an override can do the same by returning
        a model on the meta device that has an ``init_steps()`` method."""
        return build_model(self.cfg.model)

    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        """(train, val) map-style datasets; val may be None to skip evaluation."""
        return build_datasets(self.cfg.data)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """Over the parallelized model (FSDP's sharded parameters); ZeRO-1 under parallel=zero1."""
        zero = self.cfg.parallel.strategy == "zero1" and self.env.distributed
        return build_optimizer(model, self.cfg.optim, zero_group=None if zero else False)

    def build_scheduler(
        self, optimizer: torch.optim.Optimizer, *, total_steps: int
    ) -> torch.optim.lr_scheduler.LRScheduler:
        """Stepped once per optimizer step."""
        return build_scheduler(optimizer, self.cfg.sched, total_steps=total_steps)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The mean loss of one micro-batch over its counted targets (already on the device,
        inside autocast); the step weighs it by ``count_targets(batch)``."""
        inputs, targets = batch
        return self.loss_fn(self.model(inputs), targets)

    def count_targets(self, batch: Any) -> torch.Tensor | None:
        """How many targets ``compute_loss``'s mean averages over (not -100): its weight in the
        step's loss, the mean over the global batch's counted targets (distributed/reduction.py).
        None: every micro-batch of the step weighs the same."""
        pair = isinstance(batch, (tuple, list)) and len(batch) == 2 and torch.is_tensor(batch[1])
        return counted_targets(batch[1]) if pair else None

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy over classes, or over the vocabulary at every position of a sequence
        model's (batch, time, vocab) logits: the mean over the positions whose target is not
        -100 (``token_cross_entropy``; chat prompts, masked document boundaries), per
        micro-batch. Also the pipeline's loss on its last stage, weighted there per pipeline
        micro-batch like a micro-step's."""
        if outputs.dim() == 3:
            return token_cross_entropy(
                outputs.flatten(0, 1),
                targets.flatten(0, 1),
                label_smoothing=self.cfg.loss.label_smoothing,
            )
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

    # Loss, top-1 and top-5 hit sums of a batch of logits (see sdnet_trainer.training.evaluation).
    metric_sums = staticmethod(metric_sums)

    def evaluate(self) -> dict[str, float]:
        """Metrics over the validation set (loop.eval_max_batches), identical on every rank."""
        return evaluate_batches(
            map(self.to_device, self.data.val_loader or ()),  # no validation set: no metrics
            self.eval_step,
            model=unwrap(self.model),
            autocast=self.precision.autocast,
            after_batch=self._beat,  # a long evaluation is progress for the hang watchdog
            weight=self.metric_weight,
            device=self.device,
            agree_on_keys=self.dims.pp > 1,  # only the last stage has sums
            counted_batches=self.data.val_counted_batches,  # the rest pad the ranks' batch counts
            max_batches=self.cfg.loop.eval_max_batches,  # every rank stops at the same batch
        )

    def build_hooks(self) -> list[HookBase]:
        """Called in this order after every step: the profiler's step, a mixture of experts' load
        (``training/moe.py``), the weight average's update (``model.ema``), evaluation,
        checkpointing, metrics (after evaluation, so the summary includes the final evaluation),
        then the hang watchdog's beat and the heartbeat line. Extend the list for periodic work."""
        cfg, rank, heartbeat_s = self.cfg, self.env.rank, self.cfg.health.heartbeat_s
        profiler = StepProfiler(
            cfg.profile, output_dir=self.output_dir, rank=rank, device=self.device
        )
        evaluation = EvalHook(
            self.evaluate, cfg.loop, writer=self.writer, total_steps=self.total_steps,
            phase=self.phase, swap_average=self.ema.swapped_in if self.ema is not None else None,
        )  # fmt: skip
        metrics = MetricsHook(
            cfg.logging,
            self.figures,
            writer=self.writer,
            meter=self.meter,
            device=self.device,
            lr=lambda: float(self.scheduler.get_last_lr()[0]),
            comm_bytes=self.comm.bytes_per_step if self.comm is not None else None,
            loss_scale=self.precision.scaler.get_scale if self.precision.scaling else None,
            rank=self.env.rank,
            bad_samples=skipped_samples(self.data.train_loader.dataset),
        )
        balance = expert_balance(  # a MoE's routing bias moved before it is averaged or saved
            cfg, self.model, self.dims, rank=rank, global_batch_size=self.layout.global_batch_size,
            reduction=self.reduction, writer=self.writer, total_steps=self.total_steps,
            device=self.device,
        )  # fmt: skip
        hooks = [
            ProfilerHook(profiler) if profiler.enabled else None,
            balance,
            self.ema,  # updated before it is evaluated or saved
            evaluation,
            self.checkpointer,
            metrics,
            WatchdogHook(self.watchdog) if self.watchdog else None,
            HeartbeatHook(Heartbeat(heartbeat_s, rank=rank)) if heartbeat_s else None,
            self.ft_hook,
        ]
        return [hook for hook in hooks if hook is not None]

    # ------------------------------------------------------------------ assembly

    def setup(self) -> None:
        """Build the run in its phases; each reads only what the earlier ones built."""
        ft = self.cfg.fault_tolerance
        if ft.enabled and self.env.rank == 0:  # an unreachable lighthouse fails before any work
            check_lighthouse(lighthouse_address(ft), connect_s=ft.timeouts.connect_s)
        # The data first: it decides the class count the model is built with. Seeded as the
        # model is, so a data set that draws random numbers (a split) is the same on every rank.
        rng.seed_everything(self.cfg.loop.seed, deterministic=self.cfg.loop.deterministic)
        train_set, val_set = self.build_datasets()
        resolve_num_classes(self.cfg, train_set)
        self._setup_model()
        self._setup_data(train_set, val_set)
        self._setup_optimization()
        self._setup_observability(train_set)
        self._setup_checkpointing()
        self._setup_fault_tolerance()
        self.hooks = self.build_hooks()
        logger.info(
            f"model {self.cfg.model.name}: {self.num_parameters / 1e6:.2f}M parameters | "
            f"world size {self.env.world_size} on {self.device} ({self.dims.describe()}, "
            f"{self.cfg.parallel.strategy}) | {self.layout.describe(self.dims.dp)} | "
            f"{self.total_steps} steps ({self.steps_per_epoch} per epoch)"
        )

    def _setup_model(self) -> None:
        """The mesh and this rank's part of the parallel model."""
        cfg, env = self.cfg, self.env
        self.layout = batch_layout(cfg, env.world_size)
        self.dims = parallel_dims(cfg.parallel, env.world_size)
        rng.seed_everything(cfg.loop.seed, deterministic=cfg.loop.deterministic)
        self.mesh = build_mesh(self.dims, self.device.type) if env.distributed else None
        # Same seed on every rank for the model's initial weights (DDP also broadcasts rank 0's);
        # pipeline stages and tensor-parallel shards hold the values of identical full models.
        seeded = torch.get_rng_state()
        # The stock build_model only constructs (unless it loads weights: torchvision's, a
        # transformers model's), so it runs on the meta device; an override decides for itself.
        # A family's reader of model.weights=hf:PATH checks the folder against the meta build
        # before anything is allocated, and reads after sharding, each rank its own slices.
        reader = hf_weights_reader(cfg.model)
        # Weights the builder reads itself (transformers', torchvision's) need a real build.
        own_weights = cfg.model.weights is not None and reader is None
        stock = type(self).build_model is Trainer.build_model and not own_weights
        model, steps = build_deferred(self.build_model, on_meta=stock)
        if reader is not None:
            reader.check(model)
        # loop.deterministic on CUDA: refuse modules without a deterministic backward up front.
        rng.check_deterministic(model, self.device, deterministic=cfg.loop.deterministic)
        fill = None
        if steps is None:
            model = model.to(self.device)
            if reader is not None:
                reader.load(model)
        else:

            def fill(parts: list[nn.Module]) -> None:
                # This rank's meta shards against its memory; then allocated and filled from the
                # generator state a CPU build starts from: the same weights as the CPU build's.
                check_fits(parts, cfg, self.device, dp=self.dims.dp)
                for part in parts:
                    allocate(part, self.device, cpu_offload=cfg.parallel.fsdp.cpu_offload)
                torch.set_rng_state(seeded)
                # A folder sets the base's parameters: only computed buffers need their init then.
                materialize(steps if reader is None else without_parameters(steps))
                if reader is not None:
                    reader.load(model)
                init_adapters(model)  # model.lora's: after the base's values (models/lora.py)

        self.num_parameters = sum(p.numel() for p in model.parameters())  # of the whole model
        pipe = cfg.parallel.pipeline.microbatches if self.dims.pp > 1 else 1
        losses = self.layout.grad_accum_steps * pipe  # a step's loss terms on one rank
        self.reduction = StepReduction(self.dims, world_size=env.world_size, losses=losses)
        parallel = parallelize(
            model, cfg, env, self.mesh, self.dims, reduction=self.reduction,
            loss_fn=self._weighted_loss, materialize=fill,
        )  # fmt: skip
        self.model, self.pipeline = parallel.model, parallel.pipeline
        self.context = parallel.context
        # This rank's metrics count once: last pipeline stage, first tensor-parallel peer.
        last_stage = self.pipeline is None or self.pipeline.has_last
        first_tp = self.dims.coordinates(env.rank)["tp"] == 0
        self.metric_weight = 1.0 if last_stage and first_tp else 0.0
        # model.ema: the average starts as a copy of the initial weights, in their layout.
        stages, ema = self.pipeline.modules if self.pipeline else [], cfg.model.ema
        self.ema = WeightAverage(self.model, ema, stages=stages) if ema.enabled else None
        # From here on each rank draws its own random stream (dropout, augmentation).
        rng.reseed(cfg.loop.seed, rank=env.rank, step=0)

    def _setup_data(self, train_set: Dataset, val_set: Dataset | None) -> None:
        """Samplers and loaders over the data sets; the schedule's length follows from them."""
        loop, layout = self.cfg.loop, self.layout
        self.data = RunData(
            train_set,
            val_set,
            cfg=self.cfg.data,
            device=self.device,
            micro_batch_size=layout.micro_batch_size,
            grad_accum_steps=layout.grad_accum_steps,
            eval_batch_size=loop.eval_batch_size or layout.micro_batch_size,
            dp_size=self.dims.dp,
            dp_rank=self.dims.dp_rank(self.env.rank),
            seed=loop.seed,
            channels_last=self.cfg.model.channels_last,
            shard=self.context.shard if self.context is not None else None,
        )
        self.steps_per_epoch = self.data.steps_per_epoch
        self.epoch_shape = EpochShape(layout.global_batch_size, self.steps_per_epoch)
        self.total_steps = loop.max_steps or (loop.max_epochs or 0) * self.steps_per_epoch

    def _setup_optimization(self) -> None:
        """Optimizer, gradient communication, precision, loss, schedule and the update step."""
        cfg = self.cfg
        self.optimizer = self.build_optimizer(self.model)
        self.comm = None
        if isinstance(self.model, DistributedDataParallel):
            self.comm = GradientComm(self.model, cfg.comm, process_group=self.model.process_group)
        self.precision = Precision(cfg.precision, device_type=self.device.type)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.loss.label_smoothing)
        self.scheduler = self.build_scheduler(self.optimizer, total_steps=self.total_steps)
        self.stepper = OptimizerStep(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            precision=self.precision,
            comm=self.comm,
            cfg=cfg.optim,
            nonfinite=cfg.health.nonfinite,
            pp_group=self.pipeline.group if self.pipeline is not None else None,
            device=self.device,
            state=self.state,
            phase=self.phase,
            rank=self.env.rank,
            host_flags=lambda: (self.signals.received, self.checkpointer.save_due()),
        )

    def _setup_observability(self, train_set: Dataset) -> None:
        """Metrics writer, the run's figures (FLOPs for MFU included) and the hang watchdog."""
        cfg, env, logs = self.cfg, self.env, self.cfg.logging
        sinks = []
        if prometheus_enabled(logs.prometheus):  # every rank serves its own /metrics
            sinks.append(
                PrometheusExporter(
                    logs.prometheus,
                    rank=env.rank,
                    local_rank=env.local_rank,
                    world_size=env.world_size,
                    run_name=cfg.run.name,
                    run_id=cfg.run.id,
                    node=socket.gethostname(),
                    device=self.device,
                )
            )
        self.writer = MetricsWriter(
            self.output_dir,
            logs,
            enabled=env.is_main,
            run_name=cfg.run.name,
            config=plain_config(cfg),
            sinks=sinks,
        )
        flops, peak = None, None
        if logs.flops:  # counted once on a meta-device copy of the model
            # Decoded on the GPU (data.decode=cuda): count on the same images decoded on the host.
            counted = host_decoded(train_set)
            flops, peak = run_flops(
                self.build_model,
                counted,
                lambda model, batch: self.loss_fn(model(batch[0]), batch[1]),
                device=self.device,
                dtype=self.precision.dtype,
                peak_override=logs.peak_tflops,
                tf32=self.precision.tf32,
            )
        self.figures = RunFigures(
            total_steps=self.total_steps,
            samples_per_epoch=self.steps_per_epoch * self.layout.global_batch_size,
            metric_weight=self.metric_weight,
            world_size=env.world_size,
            tokens_per_sample=(
                cfg.data.seq_len if is_language_model_data(cfg.data, train_set) else None
            ),
            flops_per_sample=flops,
            peak_tflops=peak,
        )
        timeout, log_file = cfg.health.hang_timeout_s, hang_log_path(self.output_dir, env.rank)
        self.watchdog = (
            None
            if timeout is None
            else Watchdog(timeout, rank=env.rank, describe=self.phase.describe, log_file=log_file)
        )

    def _setup_checkpointing(self) -> None:
        """The checkpointer over the run's stateful parts, then ``checkpoint.resume``."""
        cfg, env = self.cfg, self.env
        parts = run_parts(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            state=self.state,
            scaler=self.precision.scaler if self.precision.scaling else None,
            comm=self.comm,
            rng_state=rng.RngState(
                self.device, seed=cfg.loop.seed, rank=env.rank, step=lambda: self.state.step
            ),
            # Another world size cannot map old ranks to new ones: derive from (seed, rank, step).
            rederive_rng=lambda: rng.reseed(cfg.loop.seed, rank=env.rank, step=self.state.step),
            ema=self.ema,
            trackers=self.writer,
        )
        meta = run_meta(cfg, type(self), self.layout.global_batch_size, env.world_size)
        directory = cfg.checkpoint.dir or self.output_dir / "checkpoints"
        # The run id claims the directory for this run (torchrun's restarts keep it).
        self.checkpointer = Checkpointer(
            cfg.checkpoint, directory=directory, parts=parts, rank=env.rank,
            world_size=env.world_size, meta=meta, run_id=cfg.run.id, phase=self.phase,
            # A deferred verdict is read before any save: a non-finite step is never saved.
            before_save=lambda: self.stepper.settle(saving=True),
            report=self.writer.write,
        )  # fmt: skip
        try:
            resumed = self.checkpointer.resume(self.state) is not None
        except BaseException:
            self.checkpointer.close()  # releases the directory for the next attempt
            raise
        if resumed and self.epoch_shape.exhausted(self.state.epoch_sample):
            # A larger global batch than the writer's (elastic keep_per_rank, or a changed config)
            # may leave no full batch in the interrupted epoch: continue with the next one.
            self.state.next_epoch()

    def _setup_fault_tolerance(self) -> None:
        """The step's source (the ft room's under ``fault_tolerance.enabled``), whose replica
        groups share the step's reduction."""
        self.source, self.ft_hook = StepSource(self.data), None
        if self.cfg.fault_tolerance.enabled:
            from sdnet_trainer.training.fault_tolerance import attach

            self.source, self.ft_hook = attach(
                self.cfg, self.env, self.dims, data=self.data, state=self.state, writer=self.writer,
                parts=self.checkpointer.parts, global_batch_size=self.layout.global_batch_size,
            )  # fmt: skip
        source = self.source
        self.reduction.share_with(lambda: source.groups, source.average_count)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, float]:
        """Train to ``loop.max_steps`` (or ``max_epochs``); returns the final metrics."""
        self.setup()
        first_step = self.state.step + 1  # after a resume too
        with self._running(), self.source.running(self.model, self.optimizer):
            while not self._finished():
                result = self.train_step()
                if not result.committed:
                    continue  # the same samples again, divided among the next quorum's groups
                self.state.advance(self.epoch_shape)
                for hook in self.hooks:
                    hook.after_step(self.state, result)
                if self.state.step == first_step:
                    # Set-up and the first step (compilation) are done: a hung collective from
                    # here on fails after dist.step_timeout_s instead of the long set-up timeout.
                    shorten_timeout(self.cfg.dist.step_timeout_s, mesh=self.mesh)
                if result.stop_requested and not self._finished():
                    self.signals.exit(self.state.step, saved=self.cfg.checkpoint.save_on_exit)
            self.stepper.settle()  # the last step's verdict, before the final save and evaluation
            for hook in self.hooks:
                hook.after_train(self.state)
        return self.state.metrics

    @contextmanager
    def _running(self) -> Iterator[None]:
        """Stop signals and the hooks' lifetimes around the loop; loaders, writer and an async
        checkpoint in flight are closed on every path."""
        self.data.start(self.state)
        try:
            with self.signals:
                self.writer.start()  # the tracker runs: a resumed run continues its own
                for hook in self.hooks:
                    hook.before_train(self.state)
                yield
        finally:
            for hook in reversed(self.hooks):
                hook.close()
            self.data.close()
            self.writer.close()

    def _finished(self) -> bool:
        if self.cfg.loop.max_steps:
            return self.state.step >= self.total_steps
        return self.state.epoch >= (self.cfg.loop.max_epochs or 0)

    def _beat(self) -> None:
        """Progress for the hang watchdog (also called inside long evaluations)."""
        if self.watchdog:
            self.watchdog.beat()

    def close(self) -> None:
        """Release the model, optimizer, DDP's comm wrapper, the ft room and the loaders before
        the process group goes away; an exception's traceback may keep this Trainer alive."""
        comm = getattr(self, "comm", None)
        if comm is not None:
            comm.release()  # it holds the DDP model too
        writer = getattr(self, "writer", None)
        if writer is not None:
            # Closed by fit on every path; here when set-up failed after it was built (its
            # Prometheus port, threads and files would outlive this Trainer).
            writer.close()
        source = getattr(self, "source", None)
        if source is not None:
            source.close()  # closed by its hook on every path through fit; here when set-up failed
        held = "model pipeline optimizer comm scheduler stepper data checkpointer hooks ema writer"
        for name in [*held.split(), "source", "ft_hook", "reduction"]:
            setattr(self, name, None)

    def train_step(self) -> StepResult:
        """One optimizer step: the step's micro-batches, the sum of their counted targets over the
        batch mesh (``reduction``), ``forward_backward`` on each, the replica groups'
        agreement (``self.source``), then the update (``OptimizerStep``)."""
        step_started = time.perf_counter()
        self.source.begin_step()  # fault tolerance: the quorum (a joining group receives the state)
        clock = self.meter.clock  # the phases, and under CUDA the step times: the GPU's timeline
        clock.start()
        if not unwrap(self.model).training:  # evaluation restores the unwrapped model only
            self.model.train()
        step, started = self.state.step + 1, time.perf_counter()
        self.phase.enter("data", step=step)
        # All of the step's batches first: each one's weight needs the count of all of them.
        batches = [self.source.next_batch() for _ in range(self.layout.grad_accum_steps)]
        counts = [self.count_targets(batch) for batch in batches]
        self.reduction.start(counts)
        data_wait = time.perf_counter() - started  # fetch and copy to the device
        clock.mark("data_wait")
        loss = torch.zeros((), device=self.device)
        for index, (batch, count) in enumerate(zip(batches, counts)):
            # DDP reduces gradients in backward on the last micro-step only; FSDP2 reduce-scatters
            # on every micro-step unless parallel.fsdp.grad_sync=last_microstep (gradient_sync).
            sync = index == len(batches) - 1
            phase = "forward/backward (gradient reduction)" if sync else "forward/backward"
            self.phase.enter(phase, step=step)
            loss += self.forward_backward(batch, count=count, sync=sync)
            clock.mark("fwd_bwd")
        if not self.source.commit(self.model):  # a peer group failed during the step: discard it
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(
                loss=loss, grad_norm=torch.zeros_like(loss), data_wait_s=data_wait,
                seconds=time.perf_counter() - step_started, nonfinite=False,
                stop_requested=False, save_due=False, committed=False,
            )  # fmt: skip
        grad_norm, verdict, applied = self.stepper.apply(loss)
        clock.mark("optimizer")
        done = time.perf_counter()
        # This rank's samples: tensor/pipeline peers share them; ft groups share the global batch.
        samples = self.layout.global_batch_size / self.env.world_size / self.source.groups
        # Host time: under CUDA the meter takes the GPU's instead (the host runs a step ahead).
        self.meter.step_done(samples=samples, seconds=done - step_started)
        return StepResult(
            loss=loss, grad_norm=grad_norm, data_wait_s=data_wait, seconds=done - step_started,
            nonfinite=verdict.nonfinite, stop_requested=verdict.stop, save_due=verdict.save_due,
            applied=applied,
        )  # fmt: skip

    def forward_backward(self, batch: Any, *, count: Tensor | None, sync: bool) -> Tensor:
        """Forward and backward of one micro-batch (or the pipeline schedule over it); returns its
        share of the step's loss, detached. ``count``: its ``count_targets``; ``sync``: the last,
        whose backward reduces gradients."""
        with (
            gradient_sync(self.model, sync, fsdp_grad_sync=self.cfg.parallel.fsdp.grad_sync),
            # The loss and its backward on vocabulary-sharded logits (tensor parallel).
            loss_parallel() if self.cfg.parallel.tensor_parallel.loss_parallel else nullcontext(),
        ):
            if self.pipeline is not None:  # the schedule runs forward and backward
                with self.precision.autocast():
                    loss = self.pipeline.train_step(*batch)  # weighted by _weighted_loss
            else:
                with self.precision.autocast():
                    loss = self.compute_loss(batch)
                    # After the forward: the count's all-reduce ran meanwhile.
                    loss = loss * self.reduction.weight(count)
                self.precision.scaler.scale(loss).backward()
        if isinstance(loss, DTensor):  # loss_parallel: the replicated loss of vocab shards
            loss = loss.full_tensor()
        return loss.detach().float()

    def _weighted_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The pipeline's loss on its last stage, per pipeline micro-batch: ``loss_fn`` weighted
        by the micro-batch's share of the step's counted targets."""
        return self.loss_fn(outputs, targets) * self.reduction.weight(counted_targets(targets))

    def to_device(self, batch: Any) -> Any:
        """Move every tensor in a (nested) batch to the training device."""
        return self.data.to_device(batch)
