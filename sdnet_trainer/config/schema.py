"""Typed schemas for every config group.

Hydra merges each YAML file of ``configs/`` onto these dataclasses, so a misspelled key or a value
of the wrong type fails at compose time with the key's full name. Cross-field rules (batch split,
world size, incompatible options) live in :mod:`sdnet_trainer.config.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class ModelConfig:
    # A name from the model registry: any torchvision classifier (resnet18, resnet152, vit_b_16, ...)
    # or one of the project's own small models (see sdnet_trainer.models).
    name: str = "resnet18"
    num_classes: int = 10
    # Replace the ImageNet stem (7x7/2 conv + max-pool) with a 3x3/1 conv: the usual ResNet
    # adaptation for 32x32 inputs such as CIFAR-10.
    cifar_stem: bool = False
    # torchvision weights enum name (e.g. "IMAGENET1K_V2"); downloads on first use.
    weights: Optional[str] = None
    # Extra keyword arguments for the model constructor.
    kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    # synthetic | imagefolder | cifar10
    name: str = "synthetic"
    # imagefolder: a folder with train/ and val/ class sub-folders; cifar10: torchvision's root.
    root: Optional[str] = None
    download: bool = False
    image_size: int = 32
    num_classes: int = 10
    channels: int = 3
    # synthetic only: dataset sizes, generator seed and how strongly the label shows in the image.
    train_size: int = 2048
    val_size: int = 512
    synthetic_seed: int = 1234
    signal: float = 1.0
    noise: float = 1.0
    # Epoch tail that does not fill a global batch: drop it (True) or wrap around (False).
    drop_last: bool = True
    shuffle: bool = True
    num_workers: int = 0
    pin_memory: bool = True
    persistent_workers: bool = True
    prefetch_factor: int = 2


@dataclass
class OptimConfig:
    # Any class in torch.optim, by name (SGD, AdamW, ...), or a dotted path to one.
    name: str = "SGD"
    lr: float = 0.1
    weight_decay: float = 0.0
    # Passed only when set, so each optimizer receives just the arguments it knows.
    momentum: Optional[float] = None
    nesterov: Optional[bool] = None
    betas: Optional[List[float]] = None
    eps: Optional[float] = None
    # Anything else the optimizer's constructor takes (e.g. {foreach: true, fused: false}).
    kwargs: Dict[str, Any] = field(default_factory=dict)
    # Exclude biases and normalization weights from weight decay (the common ResNet/ViT recipe).
    no_decay_norm_and_bias: bool = False
    # Gradient clipping: by global L2 norm, by value, or neither (null).
    clip_grad_norm: Optional[float] = None
    clip_grad_value: Optional[float] = None


@dataclass
class SchedConfig:
    # constant | cosine | step | multistep; stepped once per optimizer step.
    name: str = "constant"
    warmup_steps: int = 0
    # The warmup starts at lr * warmup_start_factor and rises linearly to lr.
    warmup_start_factor: float = 0.0
    # cosine: lr decays to lr * min_lr_ratio at the last step.
    min_lr_ratio: float = 0.0
    # step: multiply by gamma every step_size steps; multistep: at each milestone step.
    step_size: int = 1000
    gamma: float = 0.1
    milestones: List[int] = field(default_factory=list)


@dataclass
class DDPConfig:
    bucket_cap_mb: float = 25.0
    static_graph: bool = False
    # False (torch's default): measured faster on CPU (scripts/bench_overhead.py); True saves a
    # gradient-sized copy of memory on GPUs.
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True


@dataclass
class ParallelConfig:
    # ddp: torch DistributedDataParallel (a single process runs the bare model).
    strategy: str = "ddp"
    # Convert BatchNorm layers to SyncBatchNorm (statistics over the global batch).
    sync_batchnorm: bool = False
    ddp: DDPConfig = field(default_factory=DDPConfig)


@dataclass
class PrecisionConfig:
    # fp32 | bf16 | fp16: the autocast dtype. fp16 adds a GradScaler.
    dtype: str = "fp32"
    # GradScaler settings (fp16 only).
    init_scale: float = 65536.0
    growth_interval: int = 2000


@dataclass
class LossConfig:
    label_smoothing: float = 0.0


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
    eval_at_epoch_end: bool = True
    eval_at_end: bool = True
    seed: int = 0
    # torch.use_deterministic_algorithms and friends: slower, bitwise repeatable kernels.
    deterministic: bool = False


@dataclass
class LoggingConfig:
    log_every_n_steps: int = 10
    tensorboard: bool = True
    jsonl: bool = True
    # auto: a progress bar on rank 0 only when stderr is a terminal; on / off force it.
    progress_bar: str = "auto"
    level: str = "INFO"


@dataclass
class CheckpointConfig:
    # Where checkpoints go; null: <run dir>/checkpoints. Every rank writes its own shard here, so
    # on several nodes it must be a shared filesystem.
    dir: Optional[str] = None
    every_n_steps: Optional[int] = None
    every_n_minutes: Optional[float] = None
    # Committed checkpoints kept; older ones are deleted only after a newer one is committed.
    keep_last: int = 3
    # DCP async save: the loop blocks only while the state is staged (copied to CPU memory).
    async_save: bool = False
    # auto: the newest complete checkpoint in dir, if any; none: start fresh; or a checkpoint path.
    resume: str = "auto"
    # Save when training ends normally and when SIGTERM arrives (schedulers send it before preemption).
    save_on_exit: bool = True


@dataclass
class HealthConfig:
    # Non-finite loss or gradients: abort (exit naming the step, rank and tensors) or skip the step.
    nonfinite: str = "abort"
    # No step completed for this long: every rank dumps its stacks and exits non-zero; null: off.
    hang_timeout_s: Optional[float] = None
    # A per-rank log line (step, step time, data wait) every this many seconds; null: off.
    heartbeat_s: Optional[float] = 60.0


@dataclass
class ElasticConfig:
    # on: torchrun may restart workers with another world size; the batch policy below applies.
    enabled: bool = False
    # keep_global: keep loop.global_batch_size, re-deriving grad accumulation from the world size;
    # keep_per_rank: keep loop.micro_batch_size x grad_accum_steps per rank, the global batch follows.
    batch_policy: str = "keep_global"


@dataclass
class DistConfig:
    # auto picks nccl with CUDA devices, gloo otherwise.
    backend: str = "auto"
    # auto | cpu | cuda
    device: str = "auto"
    timeout_s: float = 1800.0
    # CPU training: pin glibc malloc's mmap/trim thresholds so large activation buffers stay in
    # the heap instead of being mapped and page-faulted again every step.
    pin_cpu_malloc: bool = True


@dataclass
class RunConfig:
    # Outputs go to ${run.root}/${run.name}/${run.id} (Hydra's run dir): TensorBoard events,
    # metrics.jsonl, train.log, and the resolved config under .hydra/.
    name: str = "default"
    root: str = "outputs"
    # Identical on every rank of one launch: SDNET_RUN_ID, else torchrun's --rdzv-id on several
    # nodes, else the launch time (see sdnet_trainer.config.resolvers).
    id: str = "${sdnet.run_id:}"


@dataclass
class TrainerTarget:
    # The Trainer class to run; a subclass is named by its dotted path.
    _target_: str = "sdnet_trainer.Trainer"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    run: RunConfig = field(default_factory=RunConfig)
    trainer: TrainerTarget = field(default_factory=TrainerTarget)
