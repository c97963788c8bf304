"""One launch of one side of ``bench_peers.py``: the workloads and the four training loops.

Every side trains the same workload (model, data, optimizer, clipping, precision, per-rank batch)
and times it the same way: each rank takes ``time.perf_counter()`` at the end of step ``warmup``
and at the end of step ``warmup + steps``, where the end of a step is the point after the
framework's own per-step work (``zero_grad``, its hooks or callbacks). After that window one small
all-gather collects every rank's elapsed time; rank 0 writes the result (throughput over the
slowest rank) to a JSON file.

Sides run from the command line under torchrun (``hand``, ``lightning``, ``accelerate``):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/bench/_peer_worker.py \\
        --side hand --workload resnet --warmup 3 --steps 8 --out /tmp/hand.json

The Trainer side is the CLI itself, ``torchrun -m sdnet_trainer trainer._target_=
_peer_worker.PeerTrainer ...`` (scripts/ on PYTHONPATH); its run parameters come from the
``SDNET_PEER_BENCH`` environment variable (JSON: workload, data, warmup, steps, out), because the
Trainer's config schema has no keys for them. Lightning and Accelerate are imported only by their
own sides, so the others run without them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset
from torchvision.models.resnet import BasicBlock, Bottleneck

from sdnet_trainer.config.schema import ModelConfig
from sdnet_trainer.data import SyntheticImages
from sdnet_trainer.models import build_model
from sdnet_trainer.training.hooks import HookBase
from sdnet_trainer.training.state import RunState, StepResult
from sdnet_trainer.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
SIDES = ("hand", "trainer", "lightning", "accelerate")
DATA_MODES = ("memory", "synthetic")
SPEC_ENV = "SDNET_PEER_BENCH"
SEED = 0  # model initialisation (torch.manual_seed) on every side, the Trainer's loop.seed
DATA_SEED = 0  # the in-memory tensors
# The images of the image workloads, as the Trainer's data=synthetic defaults describe them.
IMAGE_SIZE, CHANNELS, NUM_CLASSES = 32, 3, 10
# data=synthetic's generator settings (SyntheticImages), for --data synthetic.
SYNTHETIC_SEED, SYNTHETIC_SIGNAL, SYNTHETIC_NOISE = 1234, 1.0, 1.0


@dataclass(frozen=True)
class Workload:
    """What every side trains. ``model`` names configs/model/<model>.yaml (the Trainer's
    ``model=<model>``); ``kind`` is images (labels) or tokens (next-token targets)."""

    name: str
    model: str
    kind: str
    per_rank_batch: int
    optimizer: str  # a torch.optim class
    lr: float
    weight_decay: float
    train_size: int  # samples in the in-memory training set
    warmup: int  # default warm-up steps
    steps: int  # default timed steps
    momentum: float | None = None
    betas: tuple[float, float] | None = None
    clip_grad_norm: float = 1.0
    sharded: bool = False  # FSDP2 (fully_shard per residual block, then the root) instead of DDP


# The one definition of each workload: the driver pins the Trainer's keys from it too.
# torchvision's ResNet-18 (ImageNet stem) on 32x32 images: ~0.7 s per step on 2 CPU cores, so the
# framework's own per-step work is a visible share of it (the CIFAR-stem variant is 5x the compute
# and hides it). Default step counts keep a launch short (5 + 40 resnet steps, about 45 s with
# start-up; gpt_tiny: ~50 ms per step, 10 + 300 steps about 25 s). The first step (DDP's bucket
# rebuild, FSDP's lazy init, the allocator) is the only slow one measured, hence the short
# warm-up. Timed windows are multiples of the Trainer's 10-step log period, so every window holds
# its fair share of log points.
WORKLOADS = {
    "resnet": Workload(
        name="resnet",
        model="resnet18",
        kind="images",
        per_rank_batch=32,
        optimizer="SGD",
        lr=0.05,
        momentum=0.9,
        weight_decay=5e-4,
        train_size=2048,
        warmup=5,
        steps=40,
    ),
    "gpt": Workload(
        name="gpt",
        model="gpt_tiny",
        kind="tokens",
        per_rank_batch=32,
        optimizer="AdamW",
        lr=1e-3,
        betas=(0.9, 0.999),
        weight_decay=0.05,
        train_size=4096,
        warmup=10,
        steps=300,
    ),
}
# The resnet workload under FSDP2: each residual block one unit, then the root.
WORKLOADS["fsdp"] = replace(WORKLOADS["resnet"], name="fsdp", sharded=True)


# ---------------------------------------------------------------------------- the shared workload


def model_config(workload: Workload) -> ModelConfig:
    """configs/model/<model>.yaml on the schema's defaults: the ModelConfig the Trainer builds."""
    base = OmegaConf.structured(ModelConfig)
    merged = OmegaConf.merge(
        base, OmegaConf.load(REPO / "configs" / "model" / f"{workload.model}.yaml")
    )
    config = OmegaConf.to_object(merged)
    assert isinstance(config, ModelConfig)
    if workload.kind == "images":
        config.num_classes = NUM_CLASSES  # what the Trainer takes from the data it is given
    return config


def seq_len(workload: Workload) -> int:
    return model_config(workload).gpt.seq_len


def items_per_sample(workload: Workload) -> int:
    """What the throughput counts per sample: an image, or a sequence's tokens."""
    return seq_len(workload) if workload.kind == "tokens" else 1


def seeded_model(workload: Workload) -> nn.Module:
    """The project's model, initialised after ``torch.manual_seed(SEED)`` (as the Trainer does
    with loop.seed), so every side starts from the same weights."""
    torch.manual_seed(SEED)
    return build_model(model_config(workload))


def train_dataset(workload: Workload, data: str) -> Dataset:
    """The training set. ``memory``: tensors generated once, up front, from a fixed generator
    (normalised float32 images or int64 tokens), so a batch costs only indexing and stacking.
    ``synthetic``: the project's SyntheticImages (one small randn per sample), image workloads
    only."""
    if data == "synthetic" and workload.kind == "images":
        return SyntheticImages(
            workload.train_size,
            image_size=IMAGE_SIZE,
            channels=CHANNELS,
            num_classes=NUM_CLASSES,
            seed=SYNTHETIC_SEED,
            signal=SYNTHETIC_SIGNAL,
            noise=SYNTHETIC_NOISE,
            split="train",
        )
    gen = torch.Generator().manual_seed(DATA_SEED)
    n = workload.train_size
    if workload.kind == "images":
        images = torch.randn(n, CHANNELS, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
        labels = torch.randint(NUM_CLASSES, (n,), generator=gen)
        return TensorDataset(images, labels)
    cfg = model_config(workload).gpt
    tokens = torch.randint(cfg.vocab_size, (n, cfg.seq_len + 1), generator=gen)
    # Inputs and next-token targets as separate contiguous tensors, like the Trainer's LM data.
    return TensorDataset(tokens[:, :-1].clone(), tokens[:, 1:].clone())


def make_optimizer(params: Iterable[nn.Parameter], workload: Workload) -> torch.optim.Optimizer:
    kwargs: dict[str, Any] = {"lr": workload.lr, "weight_decay": workload.weight_decay}
    if workload.momentum is not None:
        kwargs["momentum"] = workload.momentum
    if workload.betas is not None:
        kwargs["betas"] = workload.betas
    cls = getattr(torch.optim, workload.optimizer)
    optimizer: torch.optim.Optimizer = cls(params, **kwargs)
    return optimizer


def loss_of(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy; a sequence model's (B, T, V) logits over every position."""
    if outputs.dim() == 3:
        outputs, targets = outputs.flatten(0, 1), targets.flatten(0, 1)
    return F.cross_entropy(outputs, targets)


def shard_model(model: nn.Module, mesh: Any = None) -> None:
    """FSDP2 as a user writes it: each residual block its own unit (freed after its forward), then
    the root, whose parameters are needed again right at the start of backward. The Trainer's
    parallel=fsdp lays ResNets out the same way."""
    for module in model.modules():
        if isinstance(module, (BasicBlock, Bottleneck)):
            fully_shard(module, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)


def init_checksum(model: nn.Module) -> float:
    """Sum of every initial weight of the bare model: a cheap check that all sides start from the
    same weights."""
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Which implementation of the optimizer a side runs: fused, foreach or torch's default
    (a per-parameter loop on the CPU, foreach on CUDA)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds it
    group = optimizer.param_groups[0]
    implementation = (
        "fused" if group.get("fused") else "foreach" if group.get("foreach") else "torch default"
    )
    return {"optimizer": f"{type(optimizer).__name__} ({implementation})"}


def wrapper_settings(model: nn.Module) -> dict[str, Any]:
    """The data-parallel settings a side actually runs with (found in the module tree)."""
    for module in model.modules():
        if isinstance(module, DDP):
            return {
                "wrapper": "DDP",
                "bucket_cap_mb": module.bucket_bytes_cap / 2**20,
                "gradient_as_bucket_view": module.gradient_as_bucket_view,
                "static_graph": module.static_graph,
                "find_unused_parameters": module.find_unused_parameters,
                "broadcast_buffers": getattr(
                    module, "forward_sync_buffers", getattr(module, "broadcast_buffers", None)
                ),
            }
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    if units:
        return {"wrapper": f"FSDP2 fully_shard ({units} units)"}
    return {"wrapper": type(model).__name__}


# ---------------------------------------------------------------------------- timing and result


class StepWindow:
    """This rank's wall time from the end of step ``warmup`` to the end of step
    ``warmup + steps`` (steps counted from 1).

    Every side runs one step more than that (``run_steps``): what a framework does at the end of
    a run (the Trainer's log point at its last step, whatever period it has) stays outside the
    window, which holds only the work of an ordinary step.
    """

    def __init__(self, warmup: int, steps: int) -> None:
        if warmup < 1 or steps < 1:
            raise ValueError(f"need warmup >= 1 and steps >= 1, got {warmup}, {steps}")
        self.warmup, self.last = warmup, warmup + steps
        self.started: float | None = None
        self.elapsed: float | None = None

    @property
    def run_steps(self) -> int:
        return self.last + 1

    def step_done(self, step: int) -> bool:
        """Call at the end of every step; True at the end of the window."""
        if step == self.warmup:
            self.started = time.perf_counter()
        elif step == self.last:
            assert self.started is not None, "the window's first step was not seen"
            self.elapsed = time.perf_counter() - self.started
            return True
        return False


def report(
    window: StepWindow,
    *,
    side: str,
    workload: Workload,
    data: str,
    out: Path,
    final_loss: float,
    checksum: float | None,
    settings: dict[str, Any],
) -> None:
    """Gather every rank's elapsed time (one small all-gather, after the window) and let rank 0
    write the result. Called by every rank."""
    assert window.elapsed is not None, "report() before the window closed"
    world = dist.get_world_size()
    mine = torch.tensor([window.elapsed], dtype=torch.float64)
    per_rank = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(per_rank, mine)
    if dist.get_rank() != 0:
        return
    elapsed = [float(t.item()) for t in per_rank]
    steps = window.last - window.warmup
    items_per_step = workload.per_rank_batch * world * items_per_sample(workload)
    result = {
        "side": side,
        "workload": workload.name,
        "data": data,
        "world_size": world,
        "warmup": window.warmup,
        "steps": steps,
        "per_rank_batch": workload.per_rank_batch,
        "unit": "tokens/s" if workload.kind == "tokens" else "images/s",
        "items_per_step": items_per_step,
        "elapsed_s": max(elapsed),  # the slowest rank sets the pace
        "elapsed_s_rank": elapsed,
        "throughput": steps * items_per_step / max(elapsed),
        "step_s": max(elapsed) / steps,
        "final_loss": final_loss,
        "init_checksum": checksum,
        "settings": {**settings, "torch_threads": torch.get_num_threads()},
        "not_runnable": None,
    }
    write_json(out, result)


def write_json(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)


def not_runnable(out: Path, *, side: str, workload: Workload, reason: str) -> None:
    """Rank 0 records that this side cannot run this workload here (the driver shows the reason)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_json(out, {"side": side, "workload": workload.name, "not_runnable": reason})


def epochs(loader: DataLoader, sampler: DistributedSampler | None = None) -> Iterator[Any]:
    """Batches forever, epoch after epoch (a new epoch starts inside the step that needs it)."""
    epoch = 0
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


# ---------------------------------------------------------------------------- hand-written


def run_hand(workload: Workload, data: str, window: StepWindow, out: Path) -> None:
    """The loop a user writes with torch alone: DDP (or FSDP2) + DistributedSampler + DataLoader."""
    dist.init_process_group("gloo")
    model = seeded_model(workload)
    checksum = init_checksum(model)
    wrapped: nn.Module
    if workload.sharded:
        shard_model(model)
        wrapped = model
    else:
        wrapped = DDP(model)
    optimizer = make_optimizer(wrapped.parameters(), workload)
    dataset = train_dataset(workload, data)
    sampler: DistributedSampler = DistributedSampler(
        dataset, shuffle=True, seed=SEED, drop_last=True
    )
    loader = DataLoader(
        dataset, batch_size=workload.per_rank_batch, sampler=sampler, num_workers=0, drop_last=True
    )
    batches = epochs(loader, sampler)
    wrapped.train()
    step = 0
    loss = torch.zeros(())
    while step < window.run_steps:
        inputs, targets = next(batches)
        loss = loss_of(wrapped(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(wrapped.parameters(), workload.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        window.step_done(step)
    report(
        window,
        side="hand",
        workload=workload,
        data=data,
        out=out,
        final_loss=float(loss.item()),
        checksum=checksum,
        settings={**wrapper_settings(wrapped), **optimizer_settings(optimizer)},
    )
    # A DDP/FSDP module still alive when its group goes away can abort gloo at exit: drop it first.
    del wrapped, model, optimizer, batches, loader
    gc.collect()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- the Trainer


@dataclass(frozen=True)
class TrainerSpec:
    """What the Trainer side needs beyond its config, from ``SDNET_PEER_BENCH``."""

    workload: str
    data: str
    warmup: int
    steps: int
    out: str

    @classmethod
    def from_env(cls) -> TrainerSpec:
        raw = os.environ.get(SPEC_ENV)
        if raw is None:
            raise RuntimeError(f"{SPEC_ENV} is not set: PeerTrainer runs under bench_peers.py")
        return cls(**json.loads(raw))

    def to_env(self) -> str:
        return json.dumps(self.__dict__)


class WindowHook(HookBase):
    """The Trainer side's timing: placed last in ``build_hooks``, so the end of a step is after
    every hook of the Trainer's own (metrics and their log points, heartbeat) has run."""

    def __init__(self, trainer: PeerTrainer, spec: TrainerSpec) -> None:
        self.trainer = trainer
        self.spec = spec
        self.window = StepWindow(spec.warmup, spec.steps)

    def before_train(self, state: RunState) -> None:
        if self.trainer.total_steps != self.window.run_steps:
            raise RuntimeError(
                f"loop.max_steps gives {self.trainer.total_steps} steps; the window needs "
                f"{self.window.run_steps}"
            )

    def after_step(self, state: RunState, result: StepResult) -> None:
        if self.window.step_done(state.step):
            report(
                self.window,
                side="trainer",
                workload=WORKLOADS[self.spec.workload],
                data=self.spec.data,
                out=Path(self.spec.out),
                final_loss=float(result.loss.item()),
                checksum=self.trainer.model_checksum,
                settings={
                    **wrapper_settings(self.trainer.model),
                    **optimizer_settings(self.trainer.optimizer),
                },
            )


class PeerTrainer(Trainer):
    """The Trainer as a user subclasses it: the benchmark's in-memory data set (no validation
    set) and one timing hook after the Trainer's own."""

    model_checksum: float | None = None

    def build_model(self) -> nn.Module:
        model = super().build_model()
        # The first call builds the training model (before the Trainer wraps or shards it); the
        # FLOP count builds more copies later, on the meta device.
        if self.model_checksum is None:
            self.model_checksum = init_checksum(model)
        return model

    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        spec = TrainerSpec.from_env()
        workload = WORKLOADS[spec.workload]
        if spec.data == "synthetic" and workload.kind == "images":
            train, _ = super().build_datasets()  # data=synthetic, pinned by the driver
            return train, None
        return train_dataset(workload, spec.data), None

    def build_hooks(self) -> list[HookBase]:
        return [*super().build_hooks(), WindowHook(self, TrainerSpec.from_env())]


# ---------------------------------------------------------------------------- Lightning


def run_lightning(workload: Workload, data: str, window: StepWindow, out: Path) -> None:
    """PyTorch Lightning: a LightningModule around the same model, ``Trainer(strategy="ddp")``
    (or ModelParallelStrategy with FSDP2 for the sharded workload), under torchrun."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    world = int(os.environ["WORLD_SIZE"])

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = seeded_model(workload)
            self.checksum = init_checksum(self.model)  # before configure_model shards it

        def configure_model(self) -> None:
            # ModelParallelStrategy leaves the parallel layout to the module (FSDP2 here).
            if workload.sharded and not isinstance(self.model, FSDPModule):
                mesh = self.device_mesh  # set by the strategy before this hook
                assert mesh is not None
                shard_model(self.model, mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            return loss_of(self.model(inputs), targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters(), workload)

    class Timer(pl.Callback):
        def __init__(self, checksum: float | None) -> None:
            self.checksum = checksum

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            check_no_spawn(trainer, world)

        def on_train_batch_end(
            self,
            trainer: pl.Trainer,
            pl_module: pl.LightningModule,
            outputs: Any,
            batch: Any,
            batch_idx: int,
        ) -> None:
            # global_step: optimizer steps completed, this one included.
            if window.step_done(trainer.global_step):
                active: Any = trainer.strategy  # a ParallelStrategy: DDP or ModelParallel
                settings = {
                    "strategy": type(active).__name__
                    + (" (FSDP2, fully_shard in configure_model)" if workload.sharded else ""),
                    "cluster_environment": type(active.cluster_environment).__name__,
                    **wrapper_settings(active.model if active.model is not None else pl_module),
                    **optimizer_settings(trainer.optimizers[0]),
                }
                report(
                    window,
                    side="lightning",
                    workload=workload,
                    data=data,
                    out=out,
                    final_loss=float(outputs["loss"].item()),
                    checksum=self.checksum,
                    settings=settings,
                )

    strategy: Any = "ddp"
    if workload.sharded:
        # FSDPStrategy (FSDP1) cannot clip by norm through gradient_clip_val; ModelParallelStrategy
        # runs FSDP2 like the other sides, on CPU with gloo.
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=1,
        strategy=strategy,
        precision="32-true",
        gradient_clip_val=workload.clip_grad_norm,
        gradient_clip_algorithm="norm",
        max_steps=window.run_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Timer(module.checksum)],
    )
    # A plain shuffled loader: Lightning swaps in a DistributedSampler (use_distributed_sampler).
    loader = DataLoader(
        train_dataset(workload, data),
        batch_size=workload.per_rank_batch,
        shuffle=True,
        num_workers=0,
        drop_last=True,
    )
    trainer.fit(module, train_dataloaders=loader)
    del trainer, module, loader
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def check_no_spawn(trainer: Any, world: int) -> None:
    """Lightning under torchrun must use torchrun's processes, not start its own: the world size
    is torchrun's, every rank is a distinct process, and no rank has child processes."""
    strategy = trainer.strategy
    env = strategy.cluster_environment
    if not env.creates_processes_externally or trainer.world_size != world:
        raise RuntimeError(
            f"Lightning did not take torchrun's processes: cluster environment "
            f"{type(env).__name__}, world size {trainer.world_size} (torchrun: {world})"
        )
    pids: list[int] = [0] * world
    dist.all_gather_object(pids, os.getpid())
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    spawned = children.read_text().split() if children.exists() else []
    if len(set(pids)) != world or spawned:
        raise RuntimeError(f"Lightning started extra processes: pids {pids}, children {spawned}")


# ---------------------------------------------------------------------------- Accelerate


def run_accelerate(workload: Workload, data: str, window: StepWindow, out: Path) -> None:
    """Hugging Face Accelerate: ``Accelerator(cpu=True)`` under torchrun, ``prepare``,
    ``accelerator.backward`` and ``accelerator.clip_grad_norm_``."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    accelerator: Any
    if workload.sharded:
        from accelerate import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            reshard_after_forward=True,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["BasicBlock"],
        )
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        if accelerator.distributed_type != DistributedType.FSDP:
            # Accelerate turns a plugin into FSDP only for accelerator devices (MULTI_GPU, NPU,
            # XPU, ...); on the CPU it would silently train plain DDP.
            not_runnable(
                out,
                side="accelerate",
                workload=workload,
                reason=f"Accelerator(cpu=True, fsdp_plugin=...) runs as "
                f"{accelerator.distributed_type.value}, not FSDP (Accelerate enables FSDP only on "
                f"GPU-type devices)",
            )
            accelerator.end_training()
            return
    else:
        accelerator = Accelerator(cpu=True)
    model = seeded_model(workload)
    checksum = init_checksum(model)
    optimizer = make_optimizer(model.parameters(), workload)
    loader = DataLoader(
        train_dataset(workload, data),
        batch_size=workload.per_rank_batch,
        shuffle=True,
        num_workers=0,
        drop_last=True,
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # Accelerate's DataLoaderShard advances its own epoch each time it is iterated again.
    batches = epochs(loader)
    model.train()
    step = 0
    loss = torch.zeros(())
    while step < window.run_steps:
        inputs, targets = next(batches)
        loss = loss_of(model(inputs), targets)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), workload.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        window.step_done(step)
    settings = {
        "distributed_type": accelerator.distributed_type.value,
        **wrapper_settings(model),
        **optimizer_settings(optimizer),
    }
    report(
        window,
        side="accelerate",
        workload=workload,
        data=data,
        out=out,
        final_loss=float(loss.item()),
        checksum=checksum,
        settings=settings,
    )
    del model, optimizer, loader, batches
    gc.collect()
    accelerator.end_training()  # destroys the process group


# ---------------------------------------------------------------------------- entry point

RUNNERS = {"hand": run_hand, "lightning": run_lightning, "accelerate": run_accelerate}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--side", choices=sorted(RUNNERS), required=True)
    p.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    p.add_argument("--data", choices=DATA_MODES, default="memory")
    p.add_argument("--warmup", type=int, required=True, help="steps before the timed window")
    p.add_argument("--steps", type=int, required=True, help="steps in the timed window")
    p.add_argument("--out", type=Path, required=True, help="JSON file written by rank 0")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("run under torchrun (see the module docstring)")
    window = StepWindow(args.warmup, args.steps)
    RUNNERS[args.side](WORKLOADS[args.workload], args.data, window, args.out)


if __name__ == "__main__":
    main()
