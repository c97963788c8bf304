"""Typed schemas for every config group.

Hydra merges each YAML file of ``configs/`` onto these dataclasses, so a misspelled key or a value
of the wrong type fails at compose time with the key's full name. Cross-field rules (batch split,
world size, incompatible options) live beside the component they concern and run together in
:func:`sdnet_trainer.preflight.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

# fault_tolerance, logging and the language models (model.gpt, llama, moe, lora) are defined
# beside this module.
from sdnet_trainer.config.auto_layout import AutoLayoutConfig
from sdnet_trainer.config.fault_tolerance import FaultToleranceConfig
from sdnet_trainer.config.language_models import GPTConfig, LlamaConfig, LoRAConfig, MoEConfig
from sdnet_trainer.config.loop import LoopConfig
from sdnet_trainer.config.observability import LoggingConfig
from sdnet_trainer.config.optim import OptimConfig, SchedConfig


@dataclass
class EMAConfig:
    # An exponential moving average of the weights (and buffers), updated every every_n_steps
    # optimizer steps as ema = decay * ema + (1 - decay) * weights (torch.optim.swa_utils' EMA
    # function), kept in the layout of the weights (sharded under FSDP), evaluated as val_ema/*,
    # checkpointed, and exported instead of the raw weights with export's ema=true.
    enabled: bool = False
    decay: float = 0.9999  # needs model.ema.enabled=true
    every_n_steps: int = 1  # needs model.ema.enabled=true
    # Until this step the average is a copy of the weights (the early weights are not worth
    # keeping: torchvision's reference resets its EMA during the learning-rate warmup).
    warmup_steps: int = 0  # needs model.ema.enabled=true


@dataclass
class ModelConfig:
    # A name from the model registry: any torchvision classifier (resnet18, resnet152, vit_b_16,
    # ...) or one of the project's own small models (see sdnet_trainer.models).
    name: str = "resnet18"
    # The classifier's outputs; null: data.num_classes, or the count the data states (class
    # folders, CIFAR-10's 10, a shard set's classes, a Hugging Face ClassLabel), logged.
    num_classes: Optional[int] = None
    # Replace the ImageNet stem (7x7/2 conv + max-pool) with a 3x3/1 conv: the usual ResNet
    # adaptation for 32x32 inputs such as CIFAR-10.
    cifar_stem: bool = False
    # torchvision weights enum name (e.g. "IMAGENET1K_V2"); downloads on first use. llama and
    # hf_causal_lm: hf:PATH, a local Hugging Face folder (config.json, safetensors).
    weights: Optional[str] = None
    # llama and hf_causal_lm: the architecture alone, random weights, from a Hugging Face
    # config.json (or its folder).
    hf_config: Optional[str] = None
    # Extra keyword arguments for the model constructor.
    kwargs: Dict[str, Any] = field(default_factory=dict)
    # The GPT-style decoder (model.name=gpt); sizes from tiny to ~1B parameters
    # (configs/model/gpt_*).
    gpt: GPTConfig = field(default_factory=GPTConfig)
    # The Llama family (model.name=llama; configs/model/llama3_*).
    llama: LlamaConfig = field(default_factory=LlamaConfig)
    # The mixture-of-experts family (model.name=moe; configs/model/moe_*).
    moe: MoEConfig = field(default_factory=MoEConfig)
    # Low-rank adapters (LoRA, DoRA) through peft on a language model (docs/language-models.md).
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # CNNs: NHWC memory format for the model's parameters and its input images (faster
    # convolutions on GPUs); under parallel=fsdp only the inputs (FSDP2 takes contiguous
    # parameters; convolutions follow a channels_last input).
    channels_last: bool = False
    ema: EMAConfig = field(default_factory=EMAConfig)


@dataclass
class AugmentConfig:
    # The transforms of image files (imagefolder, cifar10, shards, hf images), built with
    # torchvision's v2 transforms as in its classification reference. preset: auto (cifar when
    # the train crop, train_crop_size or else data.image_size, is at most 64 px, imagenet above;
    # always imagenet under data.decode=cuda) | imagenet (random resized crop
    # + flip; val: resize to crop / 0.875, center crop) | cifar (pad by an eighth and random
    # crop + flip; val: as is) | none (resize to the crop size only, train and val alike).
    preset: str = "auto"
    # null | ta_wide | ra | augmix | imagenet (AutoAugment's ImageNet policy), after the crop.
    auto_augment: Optional[str] = None
    ra_magnitude: int = 9
    augmix_severity: int = 3
    # Probability of RandomErasing on the normalized tensor; 0: off.
    random_erase: float = 0.0
    # bilinear | bicubic | nearest, for every resize and crop.
    interpolation: str = "bilinear"
    # Probability of a horizontal flip in training (imagenet and cifar presets); 0 for data whose
    # mirror image is another class (digits, letters).
    hflip: float = 0.5
    # null: data.image_size for both crops; val_resize_size null: val crop / 0.875 (imagenet).
    train_crop_size: Optional[int] = None
    val_resize_size: Optional[int] = None
    val_crop_size: Optional[int] = None


@dataclass
class DataConfig:
    # synthetic | imagefolder | cifar10 | shards | hf (images) or tokens | text | chat | shards |
    # hf (language models). shards: WebDataset-layout tar shards (data.root: a folder with train/
    # and val/ shard sets, a brace pattern or a URL of either); hf: a Hugging Face dataset saved
    # with save_to_disk, or parquet/arrow files, in data.root.
    name: str = "synthetic"
    # imagefolder: train/ and val/ class folders; cifar10: torchvision's root; text, chat: a file
    # or a folder of them (.txt as bytes without data.tokenizer; .txt/.jsonl/.parquet with one).
    root: Optional[str] = None
    download: bool = False
    image_size: int = 32
    # null: the count the data states (see model.num_classes); a value set here (or there) must
    # agree with it. The synthetic data set generates this many classes (its config says 10).
    num_classes: Optional[int] = None
    channels: int = 3
    # imagefolder: an image file that cannot be decoded (truncated, not an image). error: stop
    # with its path; skip: log it once and load the next index that decodes in its place (the
    # same one every time, so resuming stays exact), counted as data/skipped_samples. CIFAR-10
    # is read from pickled arrays, not per-image files, and is not affected.
    on_bad_sample: str = "error"
    # synthetic only: dataset sizes, generator seed and how strongly the label shows in the image.
    train_size: int = 2048
    val_size: int = 512
    synthetic_seed: int = 1234
    signal: float = 1.0
    noise: float = 1.0
    # tokens / text / chat: tokens per sample (targets: the inputs shifted by one) and the
    # vocabulary, normally interpolated from model.gpt.
    seq_len: int = 128
    vocab_size: int = 256
    # text / chat / text shards, training windows: stride (at multiples of seq_len, each token a
    # target once per epoch) or random (each start drawn from (seed, epoch, sample), as nanoGPT;
    # an epoch: as many windows as stride; exact resume on any world size). See data/windows.py.
    windows: str = "stride"
    # hf: the columns of the image and its label, or of the text (then language-model data:
    # data.tokenizer's ids, or UTF-8 bytes when null); text: the jsonl/parquet text (null: text).
    image_column: str = "image"
    label_column: str = "label"
    text_column: Optional[str] = None
    # text/chat (see data/text.py, chat.py, tokenizer.py): the tokenizer, the token cache's folder
    # (null: beside the data), no loss after EOS, the template (null: the tokenizer's; chatml ...)
    tokenizer: Optional[str] = None
    cache_dir: Optional[str] = None
    mask_documents: bool = False
    chat_template: Optional[str] = None
    # Epoch tail that does not fill a global batch: drop it (True) or wrap around (False).
    drop_last: bool = True
    shuffle: bool = True
    # Loader worker processes per rank. null: on CUDA, this node's cores divided among its local
    # ranks (decoding and augmentation must keep up with the GPU); on CPU, 0 (workers would
    # compete with the training threads for the same cores).
    num_workers: Optional[int] = None
    pin_memory: bool = True
    persistent_workers: bool = True
    prefetch_factor: int = 2
    # Where image files are decoded: cpu (PIL in the loader) or cuda (torchvision's nvjpeg
    # decode_jpeg on the training device; JPEG files only).
    decode: str = "cpu"
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    # torchvision's v2 MixUp / CutMix on each training batch (one of them, chosen at random per
    # batch when both are > 0), with soft targets; 0: off. Seeded from (seed, epoch, the step's
    # position in the epoch's sample order, micro-step, data-parallel rank), so a resumed run
    # mixes the same way.
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0


@dataclass
class DDPConfig:
    # null: torch's default, 25 MB, on every device (scripts/bench/bench_peers.py measured it faster
    # than 5 MB on CPU too, on in-memory and on synthetic data).
    bucket_cap_mb: Optional[float] = None
    static_graph: bool = False
    # False (torch's default): 5-12% faster on CPU in an earlier synthetic-data benchmark (gradients
    # in persistent buckets keep glibc's mmap threshold low); True saves a gradient-sized copy of
    # memory on GPUs.
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True


@dataclass
class FSDPConfig:
    # true: parameters are freed after each block's forward and gathered again for backward
    # (ZeRO-3); false: kept until backward (ZeRO-2: more memory, one all-gather less per step).
    reshard_after_forward: bool = True
    # MixedPrecisionPolicy. param_dtype auto follows precision.dtype (bf16 -> bf16 compute
    # copies of the parameters); gradients are reduced in reduce_dtype.
    param_dtype: str = "auto"
    reduce_dtype: str = "fp32"
    # CUDA only: keep sharded parameters, gradients and optimizer state in CPU memory
    # (CPUOffloadPolicy).
    cpu_offload: bool = False
    # Gradient reduction under loop.grad_accum_steps > 1. every_microstep: reduce-scatter after
    # each micro-step's backward, so a rank only ever holds its gradient shard (1/dp_shard of the
    # fp32 gradients; the communication of one step times grad_accum_steps). last_microstep:
    # accumulate unsharded gradients locally and reduce-scatter once, after the last micro-step
    # (one reduction per step, but every rank holds a full-size fp32 gradient of every
    # parameter until then: 4 bytes x parameters, ~28 GB for 7B).
    grad_sync: str = "every_microstep"


@dataclass
class TensorParallelConfig:
    # Keep the output projection's logits sharded over the vocabulary and compute the loss on the
    # shards (torch's loss_parallel).
    loss_parallel: bool = False
    # Shard the activations of norms and dropout along the sequence between the TP regions.
    sequence_parallel: bool = False


@dataclass
class PipelineConfig:
    # GPipe | 1F1B | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble | ZBVZeroBubble | DualPipeV
    schedule: str = "1F1B"
    # Micro-batches each rank's batch is split into per step (the pipeline's m).
    microbatches: int = 4
    # Module names where a new stage begins (e.g. [layer2, layer3] for a ResNet, [blocks.2] for
    # the GPT): parallel.pp x stages_per_rank - 1 of them. Empty: split evenly by block count.
    split_points: List[str] = field(default_factory=list)
    # Virtual stages per rank; the interleaved and zero-bubble schedules need 2 or more.
    stages_per_rank: int = 1


@dataclass
class ParallelConfig:
    # ddp: DistributedDataParallel; fsdp: FSDP2 fully_shard per block (HSDP when dp_replicate > 1
    # too); zero1: DDP with ZeroRedundancyOptimizer (optimizer state sharded); auto: chosen at
    # launch from the model, the world size and the memory (sdnet_trainer/plan/auto.py), with the
    # degrees, pipeline schedule, activation checkpointing and accumulation. A single process
    # without tp/pp runs the bare model.
    strategy: str = "ddp"
    # The DeviceMesh: dp_replicate x dp_shard x tp x pp = world size. -1 takes what the others
    # leave (at most one degree may be -1).
    dp_replicate: int = -1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    # Context parallel: each sequence split over this many ranks (causally load-balanced), attention
    # computed across the shards (docs/parallel.md). Language models only; data.seq_len must be a
    # multiple of 2 x cp.
    cp: int = 1
    # How attention spans the shards: ring (torch's ring attention, CUDA) | allgather (the whole
    # sequence's keys and values gathered on each rank) | auto (ring on CUDA, allgather elsewhere).
    cp_attention: str = "auto"
    # Expert parallel: a mixture-of-experts model's experts split over this many ranks, tokens sent
    # to their experts' ranks and back by all-to-all (docs/parallel.md). Not a degree of its own:
    # it divides parallel.dp_shard, whose ranks it takes (FSDP shards the experts over the
    # dp_shard / ep ranks left); it must divide model.moe.num_experts.
    ep: int = 1
    # Recompute activations in backward instead of keeping them, per block (transformer block,
    # ResNet residual block). none | full: keep only each block's input, recompute the rest (about
    # one more forward pass) | selective: keep the outputs of matmuls and attention, recompute the
    # cheap ops between them (norms, activations, rotary: less memory than none, less recompute
    # than full).
    activation_checkpointing: str = "none"
    # full: checkpoint every n-th block only (1: all of them), trading memory for recompute.
    activation_checkpointing_every: int = 1
    # Convert BatchNorm layers to SyncBatchNorm (statistics over the global batch).
    sync_batchnorm: bool = False
    # The memory one rank may fill, in GiB: before allocating, each rank's training state
    # (parameters, gradients, optimizer state) is compared with it, and a layout that cannot fit
    # is refused. null: measured (a GPU's free memory; on the CPU, and for what FSDP's CPU offload
    # keeps on the host, the host's available memory shared by the node's ranks). parallel=auto
    # plans with it too (null there: the GPU's total memory, the host's total over its ranks).
    memory_per_rank_gib: Optional[float] = None
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    auto: AutoLayoutConfig = field(default_factory=AutoLayoutConfig)


@dataclass
class PowerSGDConfig:
    # comm.hook=powersgd only. torch's PowerSGDState: matrix_approximation_rank, start_powerSGD_iter
    # (plain all-reduce before it), min_compression_rate, use_error_feedback, warm_start; batched:
    # one flat matrix per bucket (batched_powerSGD_hook).
    rank: int = 1
    start_iter: int = 10
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True
    batched: bool = False


@dataclass
class LocalSGDConfig:
    # comm.hook=local_sgd only: post-local SGD, all-reduce gradients for start_step steps, then
    # step locally and average all replicas' parameters every period steps (PeriodicModelAverager).
    period: int = 4
    start_step: int = 0


@dataclass
class CommConfig:
    # DDP gradient communication: none (plain all-reduce) | fp16 | bf16 (compressed all-reduce)
    # | powersgd | local_sgd. DDP only (parallel.strategy=ddp or zero1).
    hook: str = "none"
    powersgd: PowerSGDConfig = field(default_factory=PowerSGDConfig)
    local_sgd: LocalSGDConfig = field(default_factory=LocalSGDConfig)


@dataclass
class CompileConfig:
    # torch.compile each block (transformer block, ResNet residual block) before wrapping.
    enabled: bool = False
    mode: Optional[str] = None  # default | reduce-overhead | max-autotune (needs compile=on)
    # inductor generates fused kernels; aot_eager traces without code generation (no compiler
    # needed, for checking a model compiles).
    backend: str = "inductor"  # needs compile.enabled=true (compile=on)
    fullgraph: bool = False  # needs compile.enabled=true (compile=on)
    dynamic: Optional[bool] = None  # needs compile.enabled=true (compile=on)


@dataclass
class ProfileConfig:
    # torch.profiler over steps: skip `wait`, warm up `warmup`, record `active`, `repeat` times;
    # traces go to <run dir>/profile for TensorBoard, a table of top operators to the log.
    enabled: bool = False
    wait: int = 1  # needs profile.enabled=true (profile=on)
    warmup: int = 1  # needs profile.enabled=true (profile=on)
    active: int = 3  # needs profile.enabled=true (profile=on)
    repeat: int = 1  # needs profile.enabled=true (profile=on)
    record_shapes: bool = False  # needs profile.enabled=true (profile=on)
    profile_memory: bool = False  # needs profile.enabled=true (profile=on)
    with_stack: bool = False  # needs profile.enabled=true (profile=on)
    # CUDA only: torch.cuda.memory snapshot (pickle for pytorch.org/memory_viz) over the active
    # steps; needs profile.enabled=true.
    memory_snapshot: bool = False
    top_k: int = 15  # needs profile.enabled=true (profile=on)


@dataclass
class PrecisionConfig:
    # fp32 | bf16 | fp16 | auto: the autocast dtype. fp16 adds a GradScaler. auto: bf16 on GPUs
    # and CPUs with native bf16 arithmetic, fp32 elsewhere (the choice and its reason are logged).
    dtype: str = "fp32"
    # CUDA: let fp32 matmuls and convolutions use TF32 tensor cores (and count MFU against the
    # TF32 peak); false keeps full fp32 math.
    tf32: bool = True
    # GradScaler settings (fp16 only).
    init_scale: float = 65536.0
    growth_interval: int = 2000
    # Float8 training through torchao (the float8 extra): null | rowwise | tensorwise, the scaling
    # recipe of convert_to_float8_training for the Linear layers whose sizes are multiples of 16,
    # except the output head and a mixture of experts' routers. Weights, optimizer state and
    # checkpoints stay in high precision; only the matmuls run in float8 (GPUs of compute
    # capability 8.9 and later; the CPU emulates).
    float8: Optional[str] = None


@dataclass
class LossConfig:
    label_smoothing: float = 0.0


@dataclass
class CheckpointConfig:
    # Where checkpoints go; null: <run dir>/checkpoints. Every rank writes its own shard here, so
    # on several nodes it must be a shared filesystem, or an object store's URL (s3://bucket/run,
    # gs://, az://: any fsspec URL; docs/checkpoints.md).
    dir: Optional[str] = None
    # fsspec options of that store, e.g. {endpoint_url: http://minio:9000} or {profile: NAME};
    # credentials are refused here (the config is saved with every checkpoint): the environment.
    storage_options: Dict[str, Any] = field(default_factory=dict)
    every_n_steps: Optional[int] = None
    every_n_minutes: Optional[float] = None
    # Committed checkpoints kept; older ones are deleted only after a newer one is committed.
    keep_last: int = 3
    # DCP async save: the loop blocks only while the state is copied into host memory the run
    # keeps for its next saves (pinned on CUDA): one extra copy of the part of the state this rank
    # writes (replicated tensors are written by one rank: under DDP about 1/world_size of the
    # state) in host memory while the run lasts; the write and the commit finish in the background.
    async_save: bool = False
    # auto: the newest complete checkpoint in dir, if any; none: start fresh; or a checkpoint path.
    resume: str = "auto"
    # Save when training ends normally and when SIGTERM arrives (schedulers send it before
    # preemption).
    save_on_exit: bool = True


@dataclass
class HealthConfig:
    # Non-finite loss or gradients, never applied: abort (exit naming the step and rank, with the
    # last good step's weights) or skip the step (weights, optimizer state and average untouched).
    # Fused optimizers skip on the device and the verdict is read during the next step (no
    # per-step host sync); others read it before the update.
    nonfinite: str = "abort"
    # No step completed for this long: every rank dumps its stacks and exits non-zero; null: off.
    # The default covers a first step that compiles a large model; null: off.
    hang_timeout_s: Optional[float] = 1200.0
    # A per-rank log line (step, step time, data wait) every this many seconds; null: off.
    heartbeat_s: Optional[float] = 60.0


@dataclass
class ElasticConfig:
    # on: torchrun may restart workers with another world size; the batch policy below applies.
    enabled: bool = False
    # keep_global: keep loop.global_batch_size, re-deriving grad accumulation from the world size;
    # keep_per_rank: keep loop.micro_batch_size x grad_accum_steps per rank, the global batch
    # follows.
    batch_policy: str = "keep_global"


@dataclass
class DistConfig:
    # auto picks nccl with CUDA devices, gloo otherwise.
    backend: str = "auto"
    # auto | cpu | cuda
    device: str = "auto"
    # The process group's timeout while the run is set up and through its first step (model
    # building, compilation, a resume's reads), then step_timeout_s (null: keep timeout_s), so a
    # hung collective fails in minutes instead of half an hour.
    timeout_s: float = 1800.0
    step_timeout_s: Optional[float] = 600.0
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
    comm: CommConfig = field(default_factory=CommConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    run: RunConfig = field(default_factory=RunConfig)
    trainer: TrainerTarget = field(default_factory=TrainerTarget)


def names_stock_trainer(cfg: Config) -> bool:
    """Whether ``cfg`` runs the stock Trainer, whose model follows from ``model.*`` alone (a
    subclass's ``build_model`` may build anything: checks of the model wait until it is built)."""
    return cfg.trainer._target_ == TrainerTarget._target_
