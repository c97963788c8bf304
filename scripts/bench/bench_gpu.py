"""GPU throughput: a bf16 matmul (the practical peak), ResNet-50 through the Trainer beside a
hand-written loop, two 1B decoders (gpt_1b, llama3_1b), the loader, and the variants of the GPU
check's second command (float8 and FSDP2 on llama3_1b, the MoE's grouped matmul, context parallel).

What it measures (one CUDA device; sections with --sections, all by default)
    matmul    bf16 8192 x 8192 x 8192 matrix products on this GPU, sustained: a second of products
              first, then the median TFLOP/s of 5 back-to-back rounds of at least 0.3 s each:
              what the GPU's tensor cores keep up for a large dense product here, the roofline
              every other section's achieved TFLOP/s is compared with (beside MFU, which compares
              with the datasheet's peak).
    resnet50  ResNet-50 (torchvision's, model=resnet50), bf16 autocast, channels_last, 224x224
              synthetic images (data=synthetic, 1,000 classes), --batch images per step, SGD
              (lr 0.1, momentum 0.9, weight decay 5e-4, fused kernel), no clipping, eager.
              Two sides:
              trainer  ``python -m sdnet_trainer`` with those keys and a Trainer subclass
                       (``trainer._target_=bench_gpu.GpuBenchTrainer``) that appends one timing
                       hook after the Trainer's own; logging as by default (a log point every 10
                       steps, metrics.jsonl, TensorBoard), no evaluation, no checkpoints
              hand     the loop a user writes with torch alone: the same dataset, DataLoader
                       settings (workers, pinned memory), model, optimizer and autocast;
                       forward, cross-entropy, backward, step, zero_grad, no host sync per step
              images/s of each side (median over rounds), and the Trainer / hand ratio (median of
              the per-round ratios); the achieved TFLOP/s of each side from the Trainer's own FLOP
              count per image (observability/flops.py). For context the table quotes NVIDIA's
              published ResNet-50 v1.5 training figure for one A100 80GB with mixed precision,
              2,470 images/s (NVIDIA Deep Learning Examples, PyTorch, DGX A100): another GPU,
              data pipeline and batch size, so an order of magnitude, not a target.
    gpt_1b    configs/model/gpt_1b (1.04B parameters, 2,048-token context), bf16 autocast, AdamW,
              data=tokens, one GPU (no parallelism), --gpt-batch sequences per step in
              micro-batches of --gpt-micro: tokens/s and MFU as the Trainer itself logs them
              (perf/tokens_per_s, perf/mfu in metrics.jsonl), median over the log points after
              the first (which holds the first step's allocations and kernel selection).
    llama3_1b the same measurement of configs/model/llama3_1b (Llama 3.2 1B's shapes: 1.24B
              parameters, grouped-query attention, a 128,256-token vocabulary, tied output
              layer) on 2,048-token sequences; options --llama-batch, --llama-micro, ...
    loader    the data path's CPU cost: generated JPEGs (--jpegs, about ImageNet's mean size;
              bench_loader.py's images) read through the project's imagefolder training
              dataset as a CUDA run reads it (decode, RandomResizedCrop 224, flip, uint8 tensors
              normalized later on the device): images per CPU second on one core (one process,
              one thread, bench_loader.rate), and images/s with --workers DataLoader workers.
              With the resnet50 section, also how many such cores keep up with the Trainer's
              rate. scripts/bench/bench_loader.py compares the float, uint8 and GPU-decode paths.

The second command's sections (--second; scripts/bench/_variants_worker.py runs a section's
variants as Trainer runs in one process, from the same initial weights, so their losses compare)
    moe       a mixture of experts (the moe family at 4 blocks of width 1,024, 16 experts of 512
              channels, top-2, 2,048-token sequences) in bf16 through torch's grouped matmul, then
              through the loop over experts: tokens/s of each, their ratio, and how far apart
              their losses are (within bf16's rounding).
    cp        context parallel on two ranks sharing the one GPU (gloo with CUDA tensors, as the
              two-rank CUDA tests: a slow link, so the attention paths' costs, not a multi-GPU
              figure): ring attention and the K/V all-gather against one process, on
              16,384-token sequences of a 2-block Llama of width 1,024; tokens/s and losses.
    llama3_1b_variants
              llama3_1b (the --llama-* batch and steps) in bf16, with float8 rowwise and
              tensorwise, and under FSDP2 on its one-rank group, eager; then bf16 and both float8
              recipes compiled per block: each one's tokens/s against bf16's in the same mode.
              float8 is not run without torchao (the float8 extra; the GPU check's wheel folder
              carries it) or on a GPU without float8 tensor cores (compute capability below 8.9).

How
    Each ResNet-50 launchRun (from the repository root, on a machine with one NVIDIA GPU)
    python scripts/bench/bench_gpu.py                      # about 7 minutes on one H100
    python scripts/bench/bench_gpu.py --sections resnet50 --rounds 5
    python scripts/bench/bench_gpu.py --json /tmp/gpu.json # the figures as JSON too (gpu_check.sh)
    python scripts/bench/bench_gpu.py --quick              # gpu_check.sh's first command
    python scripts/bench/bench_gpu.py --second             # gpu_check.sh's second command

--quick: the matmul, ResNet-50, gpt_1b and llama3_1b, one round of each ResNet-50 side (10 + 30
steps), 15 gpt_1b steps, 10 llama3_1b steps, at most 120 s per launch: the figures of a short
check, noisier than the default's medians. Its length on a GPU has not been measured yet; budget
it (--budget-s) rather than trust an estimate. A decoder's weights are initialised on the GPU,
each value computed where it is kept (models/init_values.py); on the CPU the same start is
measured by scripts/bench/bench_start.py.
--second: the matmul, then llama3_1b_variants, moe and cp with --quick's steps; under
--budget-s the variants' launch leaves moe and cp what they need to finish, and its compiled
runs come last in it (a share that runs out loses them first).

--budget-s S: the whole benchmark within S seconds (the GPU check gives it its share): each
launch's timeout is cut to what is left, a launch that would get under 20 s is skipped and said
so, a launch its timeout stops is "not finished in its share" (with the figures of the log points
or variants it finished), and the figures are written to --json after every section, so a run
stopped part way keeps what it finished.

Exit status: 0 after a complete measurement; 1 if a launch failed (the other sections still run);
2 without a CUDA device (nothing is measured); 3 if the budget left a launch out or cut one short.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from _launch import REPO, LaunchError, LaunchTimeout, timed_launch, torchrun  # on sys.path
from _peer_worker import StepWindow, write_json

from sdnet_trainer.training.hooks import HookBase
from sdnet_trainer.training.state import RunState, StepResult
from sdnet_trainer.training.trainer import Trainer

SECTIONS = (
    "matmul",
    "resnet50",
    "gpt_1b",
    "llama3_1b",
    "loader",
    "moe",
    "cp",
    "llama3_1b_variants",
)
QUICK_SECTIONS = ("matmul", "resnet50", "gpt_1b", "llama3_1b")
# The GPU check's second command (--second), in the order they run: llama3_1b's variants first
# (float8 and FSDP2: the claims it is for), its launch's time cut so as to leave the later
# sections what they need to finish (VariantsLaunch.least_s); its compiled runs come last in it,
# so a share too short loses them first.
SECOND_SECTIONS = ("matmul", "llama3_1b_variants", "moe", "cp")
VARIANT_SECTIONS = ("llama3_1b_variants", "moe", "cp")
SIDES = ("trainer", "hand")
SPEC_ENV = "SDNET_GPU_BENCH"
NO_CUDA_EXIT = 2
OVER_BUDGET_EXIT = 3
# A launch with less than this left of --budget-s is not started: it could not get past start-up.
MIN_LAUNCH_S = 20.0
NO_CUDA_MESSAGE = (
    "bench_gpu: no CUDA device (torch.cuda.is_available() is False): this benchmark measures "
    "one NVIDIA GPU; nothing was measured"
)
# NVIDIA Deep Learning Examples, ResNet-50 v1.5 for PyTorch: training throughput of one A100 80GB
# (DGX A100) with mixed precision (AMP), 2,470 images/s.
A100_AMP_IMAGES_PER_S = 2470
IMAGE_SIZE, NUM_CLASSES = 224, 1000
SEED = 0
# The Trainer's default log period, pinned so that a changed default shows here.
LOG_EVERY = 10


class Budget:
    """What is left of --budget-s (unbounded without it): each launch's timeout is cut to it, and
    a launch that would get less than MIN_LAUNCH_S is skipped (``skipped`` names them); a launch
    stopped by its timeout is ``cut`` (what it finished is kept)."""

    def __init__(self, seconds: float | None) -> None:
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.skipped: list[str] = []
        self.cut: list[str] = []

    def timeout(self, wanted: float, what: str, *, reserve: float = 0.0) -> float | None:
        """The timeout to give launch ``what``, keeping ``reserve`` seconds for the launches
        after it; None (and recorded) if it does not fit."""
        if self.deadline is None:
            return wanted
        left = self.deadline - time.monotonic() - reserve
        if left < MIN_LAUNCH_S:
            self.skipped.append(what)
            print(f"  {what}: skipped, {max(left, 0):.0f} s of the budget left", flush=True)
            return None
        return min(wanted, left)


# ---------------------------------------------------------------------------- the matmul roofline


def bench_matmul(
    *,
    device: str,
    size: int,
    dtype: torch.dtype,
    warmup_s: float = 1.0,
    rounds: int = 5,
    round_s: float = 0.3,
) -> dict[str, Any]:
    """TFLOP/s of ``size``-cubed products, sustained: ``warmup_s`` seconds of products first (the
    GPU's clocks and temperature settle, cuBLAS has picked its kernel), then ``rounds`` rounds of
    at least ``round_s`` seconds each, back to back; the median round. A burst of a few products
    from a cold GPU would read its boost clock, which a training step does not keep."""
    gen = torch.Generator(device=device).manual_seed(SEED)
    # a, b and the product; emptied at the end, so the launches after this get the whole GPU.
    tensors = [torch.randn(size, size, device=device, dtype=dtype, generator=gen) for _ in "abc"]

    def products(count: int) -> float:
        synchronize(device)
        started = time.perf_counter()
        for _ in range(count):
            torch.mm(tensors[0], tensors[1], out=tensors[2])
        synchronize(device)
        return time.perf_counter() - started

    warm, count = 0.0, 1
    while warm < warmup_s:
        seconds = products(count)
        warm += seconds
        count = max(1, min(2 * count, int(count * 0.25 / max(seconds, 1e-6)) + 1))
    per_product = seconds / count
    iters = max(1, int(round_s / per_product) + 1)
    rates = [2 * size**3 * iters / products(iters) / 1e12 for _ in range(rounds)]
    tensors.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    summary = {
        "tflops_per_s": statistics.median(rates),
        "min": min(rates),
        "max": max(rates),
        "size": size,
        "dtype": str(dtype).removeprefix("torch."),
        "warmup_s": warm,
        "sustained_s": iters * per_product * rounds,
    }
    print(
        f"\n== matmul: {summary['dtype']} {size}^3, sustained: {warm:.1f} s warm-up, then "
        f"{rounds} rounds of {iters}: {summary['tflops_per_s']:,.0f} TFLOP/s "
        f"(min-max {min(rates):,.0f}-{max(rates):,.0f})",
        flush=True,
    )
    return summary


# ---------------------------------------------------------------------------- ResNet-50 sides


@dataclass(frozen=True)
class ResNetSpec:
    """One ResNet-50 launch; the Trainer side reads it from ``SDNET_GPU_BENCH``."""

    batch: int
    warmup: int
    steps: int
    workers: int
    out: str
    # The run itself; --cpu-smoke shrinks it to check the machinery on a machine without a GPU.
    device: str = "cuda"
    model: str = "resnet50"
    image_size: int = IMAGE_SIZE
    num_classes: int = NUM_CLASSES
    precision: str = "bf16"

    @property
    def train_size(self) -> int:
        # Every step of the launch inside one epoch: no epoch boundary inside the window.
        return self.batch * (self.warmup + self.steps + 2)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> ResNetSpec:
        raw = os.environ.get(SPEC_ENV)
        if raw is None:
            raise RuntimeError(f"{SPEC_ENV} is not set: GpuBenchTrainer runs under bench_gpu.py")
        return cls(**json.loads(raw))


def resnet_keys(spec: ResNetSpec, run_dir: Path) -> list[str]:
    """The Trainer side's command line; the hand side builds the same run from the same spec."""
    return [
        "trainer._target_=bench_gpu.GpuBenchTrainer",
        f"dist.device={spec.device}",
        f"model.name={spec.model}",
        f"model.num_classes={spec.num_classes}",
        "model.channels_last=true",
        "compile.enabled=false",
        "data=synthetic",
        f"data.image_size={spec.image_size}",
        f"data.num_classes={spec.num_classes}",
        f"data.train_size={spec.train_size}",
        f"data.num_workers={spec.workers}",
        "data.pin_memory=true",
        "data.persistent_workers=true",
        "data.prefetch_factor=2",
        "optim=sgd",
        "optim.lr=0.1",
        "optim.momentum=0.9",
        "optim.weight_decay=5e-4",
        "optim.implementation=auto",  # fused on CUDA, as the hand side asks for
        "sched=constant",
        f"precision={spec.precision}",
        f"loop.seed={SEED}",
        f"loop.global_batch_size={spec.batch}",
        f"loop.max_steps={spec.warmup + spec.steps + 1}",
        "loop.eval_at_end=false",
        "loop.eval_at_epoch_end=false",
        f"logging.log_every_n_steps={LOG_EVERY}",
        "logging.progress_bar=off",
        "checkpoint.resume=none",
        "checkpoint.save_on_exit=false",
        f"hydra.run.dir={run_dir}",
    ]


class GpuWindowHook(HookBase):
    """The Trainer side's timing, placed after every hook of the Trainer's own."""

    def __init__(self, spec: ResNetSpec, *, flops_per_image: float | None) -> None:
        self.spec = spec
        self.flops_per_image = flops_per_image
        self.window = StepWindow(spec.warmup, spec.steps)

    def after_step(self, state: RunState, result: StepResult) -> None:
        if state.step in (self.window.warmup, self.window.last):
            synchronize(self.spec.device)
        if self.window.step_done(state.step):
            write_result(
                self.window,
                self.spec,
                side="trainer",
                loss=float(result.loss.item()),
                flops_per_image=self.flops_per_image,
            )


class GpuBenchTrainer(Trainer):
    """The Trainer as a user subclasses it, plus one timing hook. The Trainer's own FLOP count
    per image (what its perf/tflops_per_s uses) goes into the result, for both sides' TFLOP/s."""

    def build_hooks(self) -> list[HookBase]:
        flops = self.figures.flops_per_sample
        return [*super().build_hooks(), GpuWindowHook(ResNetSpec.from_env(), flops_per_image=flops)]


def synchronize(device: str) -> None:
    """At a timed window's ends only: the window holds the GPU's work, not just its queueing."""
    if device == "cuda":
        torch.cuda.synchronize()


def write_result(
    window: StepWindow,
    spec: ResNetSpec,
    *,
    side: str,
    loss: float,
    flops_per_image: float | None = None,
) -> None:
    assert window.elapsed is not None
    write_json(
        Path(spec.out),
        {
            "side": side,
            "images_per_s": spec.steps * spec.batch / window.elapsed,
            "step_s": window.elapsed / spec.steps,
            "final_loss": loss,
            "flops_per_image": flops_per_image,
            "device": torch.cuda.get_device_name() if spec.device == "cuda" else "cpu",
        },
    )


def run_hand(spec: ResNetSpec) -> None:
    """The hand-written loop: what a user writes with torch alone for the same run."""
    from torch.utils.data import DataLoader, RandomSampler

    from sdnet_trainer.config.schema import DataConfig, ModelConfig
    from sdnet_trainer.data import SyntheticImages
    from sdnet_trainer.models import build_model

    cuda = spec.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(SEED)
    model = build_model(ModelConfig(name=spec.model, num_classes=spec.num_classes))
    model.to(device)
    model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, fused=cuda or None
    )
    data = DataConfig()  # the generator settings data=synthetic uses
    dataset = SyntheticImages(
        spec.train_size,
        image_size=spec.image_size,
        channels=3,
        num_classes=spec.num_classes,
        seed=data.synthetic_seed,
        signal=data.signal,
        noise=data.noise,
        split="train",
    )
    loader = DataLoader(
        dataset,
        batch_size=spec.batch,
        sampler=RandomSampler(dataset, generator=torch.Generator().manual_seed(SEED)),
        num_workers=spec.workers,
        pin_memory=cuda,
        persistent_workers=spec.workers > 0,
        prefetch_factor=2 if spec.workers > 0 else None,
        drop_last=True,
    )
    criterion = torch.nn.CrossEntropyLoss()
    window = StepWindow(spec.warmup, spec.steps)
    batches: Iterator[Any] = iter(loader)
    model.train()
    loss = torch.zeros((), device=device)
    for step in range(1, window.run_steps + 1):
        images, labels = next(batches)
        images = images.to(device, non_blocking=True, memory_format=torch.channels_last)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.precision == "bf16"):
            loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step in (window.warmup, window.last):
            synchronize(spec.device)
        if window.step_done(step):
            write_result(window, spec, side="hand", loss=float(loss.item()))


def resnet_command(side: str, spec: ResNetSpec, run_dir: Path) -> list[str]:
    if side == "trainer":
        return [sys.executable, "-m", "sdnet_trainer", *resnet_keys(spec, run_dir)]
    return [sys.executable, str(Path(__file__).resolve()), "--worker-spec", spec.to_env()]


@dataclass
class SideRuns:
    images_per_s: dict[int, float]
    other_cores: list[float]
    failed: str | None = None
    cut: bool = False  # stopped by its share: not a failure of the code under test


def bench_resnet(args: argparse.Namespace, out: Path, budget: Budget) -> dict[str, Any]:
    workers = args.workers
    runs = {side: SideRuns({}, []) for side in SIDES}
    flops_per_image: float | None = None
    print(
        f"\n== resnet50: {args.rounds} round(s) of trainer, hand; batch {args.batch}, "
        f"{args.warmup} + {args.steps} steps, {workers} loader workers",
        flush=True,
    )
    for rnd in range(args.rounds):
        shift = rnd % len(SIDES)
        for side in SIDES[shift:] + SIDES[:shift]:
            res = runs[side]
            if res.failed:
                continue
            stem = out / "resnet50" / f"r{rnd + 1}_{side}"
            stem.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(stem, ignore_errors=True)  # the Trainer appends to metrics.jsonl
            result_file = stem.with_suffix(".json")
            result_file.unlink(missing_ok=True)
            spec = ResNetSpec(
                args.batch, args.warmup, args.steps, workers, str(result_file), **args.smoke_run
            )
            timeout = budget.timeout(args.timeout, f"resnet50 round {rnd + 1} {side}")
            if timeout is None:
                continue
            os.environ[SPEC_ENV] = spec.to_env()
            try:
                seconds, other = timed_launch(
                    resnet_command(side, spec, stem), stem.with_suffix(".log"), timeout
                )
                if not result_file.exists():
                    raise LaunchError(f"{side} wrote no result; see {stem.with_suffix('.log')}")
            except LaunchTimeout:
                budget.cut.append(f"resnet50 round {rnd + 1} {side}")
                res.failed, res.cut = not_finished(timeout), True
                continue
            except LaunchError as err:
                print(f"  round {rnd + 1} {side:<8} FAILED: {err}", file=sys.stderr, flush=True)
                res.failed = f"FAILED in round {rnd + 1} (log in {stem.with_suffix('.log')})"
                continue
            finally:
                del os.environ[SPEC_ENV]
            result = json.loads(result_file.read_text())
            res.images_per_s[rnd] = result["images_per_s"]
            flops_per_image = result.get("flops_per_image") or flops_per_image
            load = ""
            if other is not None:
                res.other_cores.append(other)
                load = f"  (other processes: {other:.2f} cores)"
            print(
                f"  round {rnd + 1}/{args.rounds} {side:<8} {seconds:6.1f} s launch  "
                f"{result['step_s']:.4f} s/step  {result['images_per_s']:,.0f} images/s{load}",
                flush=True,
            )
    summary: dict[str, Any] = {
        "batch": args.batch,
        "rounds": args.rounds,
        "workers": workers,
        "flops_per_image": flops_per_image,  # the Trainer's count, the same model on both sides
    }
    for side, res in runs.items():
        values = list(res.images_per_s.values())
        median = statistics.median(values) if values else None
        summary[side] = {
            "images_per_s": median,
            "tflops_per_s": median * flops_per_image / 1e12 if median and flops_per_image else None,
            "min": min(values) if values else None,
            "max": max(values) if values else None,
            "other_cores_max": max(res.other_cores) if res.other_cores else None,
            "failed": res.failed,
            "cut": res.cut,
        }
    paired = [
        v / runs["hand"].images_per_s[r]
        for r, v in runs["trainer"].images_per_s.items()
        if r in runs["hand"].images_per_s
    ]
    summary["ratio"] = statistics.median(paired) if paired else None
    summary["ratio_min"] = min(paired) if paired else None
    summary["ratio_max"] = max(paired) if paired else None
    return summary


# ---------------------------------------------------------------------------- decoders


@dataclass(frozen=True)
class Decoder:
    """A decoder section: configs/model/<section> on data=tokens, one GPU, the Trainer's own
    tokens/s and MFU."""

    section: str  # also the model config's name
    family: str  # where that config keeps its sizes: model.gpt, model.llama
    option: str  # its command-line options: --<option>-steps, ...
    steps: int  # by default; --quick runs quick_steps
    quick_steps: int


# gpt_1b: 1.04B parameters, a 32,000-token vocabulary; llama3_1b: 1.24B, 128,256 tokens. Fewer
# steps for the Llama with --quick: its launch (start-up included) stays near a minute on one H100.
DECODERS = (
    Decoder("gpt_1b", "gpt", "gpt", steps=25, quick_steps=15),
    Decoder("llama3_1b", "llama", "llama", steps=20, quick_steps=10),
)
# Both decoders train on 2,048-token sequences (gpt_1b's context; Llama 3.2 allows 131,072).
DECODER_SEQ_LEN = 2048


@dataclass(frozen=True)
class DecoderRun:
    """One decoder launch: the section and its options (--gpt-batch, --llama-steps, ...)."""

    decoder: Decoder
    batch: int
    micro: int
    steps: int
    compile: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace, decoder: Decoder) -> DecoderRun:
        def option(name: str) -> Any:
            return getattr(args, f"{decoder.option}_{name}")

        return cls(decoder, option("batch"), option("micro"), option("steps"), option("compile"))


def token_run_keys(
    *, model: str, family: str, batch: int, micro: int, steps: int, seq_len: int, device: str
) -> list[str]:
    """A language model's run on data=tokens with the Trainer's own metrics: bf16 autocast,
    AdamW, a constant rate, five log points (the first, which holds the first step's allocations
    and kernel selection, is left out of the figures), no evaluation, no checkpoint."""
    return [
        f"dist.device={device}",
        f"model={model}",
        "data=tokens",
        # data=tokens reads its sizes from model.gpt; the vocabulary comes from the model config
        # for every family.
        f"data.vocab_size=${{model.{family}.vocab_size}}",
        f"data.seq_len={seq_len}",
        f"data.train_size={batch * (steps + 1)}",
        "data.val_size=8",
        "optim=adamw",
        "sched=constant",
        "precision=bf16",
        f"loop.global_batch_size={batch}",
        f"loop.grad_accum_steps={batch // micro}",
        f"loop.max_steps={steps}",
        "loop.eval_at_end=false",
        "loop.eval_at_epoch_end=false",
        f"logging.log_every_n_steps={max(1, steps // 5)}",
        "logging.progress_bar=off",
        "checkpoint.resume=none",
        "checkpoint.save_on_exit=false",
    ]


def decoder_keys(run: DecoderRun, run_dir: Path | None) -> list[str]:
    """A decoder launch's command line: one GPU, no parallelism, the Trainer's own metrics
    (``run_dir`` None: without the launch's hydra.run.dir)."""
    return [
        *token_run_keys(
            model=run.decoder.section,
            family=run.decoder.family,
            batch=run.batch,
            micro=run.micro,
            steps=run.steps,
            seq_len=DECODER_SEQ_LEN,
            device="cuda",
        ),
        f"compile.enabled={str(run.compile).lower()}",
        *([f"hydra.run.dir={run_dir}"] if run_dir is not None else []),
    ]


def decoder_command(run: DecoderRun, run_dir: Path) -> list[str]:
    """The decoder launch, exactly as started (tests/unit/test_cuda_launches.py composes it)."""
    return [sys.executable, "-m", "sdnet_trainer", *decoder_keys(run, run_dir)]


def not_finished(seconds: float) -> str:
    """What a table says of a launch its share of the budget stopped: not a failure of the code
    under test (the budget, or the launch's own timeout, was too short for it)."""
    return f"not finished in its share ({seconds:.0f} s)"


def bench_decoder(run: DecoderRun, out: Path, *, budget: Budget, timeout: float) -> dict[str, Any]:
    """One decoder launch and its figures (``failed`` says why there are none; ``cut`` that its
    share ended it, with the figures of the log points it reached where there are any)."""
    name = run.decoder.section
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = decoder_command(run, run_dir)
    print(
        f"\n== {name}: {run.steps} steps of {run.batch} x {DECODER_SEQ_LEN} tokens (micro-batch "
        f"{run.micro}), {'compiled' if run.compile else 'eager'}",
        flush=True,
    )
    allowed = budget.timeout(timeout, name)
    if allowed is None:
        return {"failed": "not run: not enough of the budget left", "cut": True}
    run_dir.mkdir(parents=True)
    log = out / f"{name}.log"
    try:
        seconds, other = timed_launch(cmd, log, allowed)
    except LaunchTimeout:
        budget.cut.append(name)
        print(f"  {name}: {not_finished(allowed)}", flush=True)
        cell = decoder_summary(read_metrics(run_dir), run=run, seconds=allowed, other=None)
        cell["cut"] = True
        if cell.get("failed"):
            cell["failed"] = not_finished(allowed)
        return cell
    except LaunchError as err:
        print(f"  {name} FAILED: {err}", file=sys.stderr, flush=True)
        return {"failed": f"FAILED (log in {log})"}
    return decoder_summary(read_metrics(run_dir), run=run, seconds=seconds, other=other)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The Trainer's metrics.jsonl rows (none where the run wrote none; a last line cut by a kill
    is left out)."""
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def token_figures(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A language model run's figures from its metrics rows, past the first log point; None
    where it has no log point past the first."""
    points = [row for row in rows if "perf/tokens_per_s" in row][1:]
    if not points:
        return None
    mfus = [row["perf/mfu"] for row in points if "perf/mfu" in row]
    return {
        "tokens_per_s": statistics.median(row["perf/tokens_per_s"] for row in points),
        "mfu": statistics.median(mfus) if mfus else None,
        "tflops_per_s": statistics.median(row.get("perf/tflops_per_s", 0.0) for row in points),
        "peak_memory_mb": max(row.get("perf/peak_memory_mb", 0.0) for row in points),
        "log_points": len(points),
        # The global loss at every log point, the first included: variants of one run compare.
        "losses": [row["train/loss"] for row in rows if "train/loss" in row],
    }


def decoder_summary(
    rows: list[dict[str, Any]], *, run: DecoderRun, seconds: float, other: float | None
) -> dict[str, Any]:
    """The figures of a decoder launch from its metrics.jsonl rows."""
    figures = token_figures(rows)
    if figures is None:
        return {"failed": "no log point past the first in its metrics.jsonl"}
    summary = {
        **figures,
        "batch": run.batch,
        "seq_len": DECODER_SEQ_LEN,
        "compiled": run.compile,
        "other_cores": other,
    }
    mfu = summary["mfu"]
    mfu_text = f"MFU {mfu:.1%}" if mfu is not None else "no MFU (unknown GPU)"
    print(f"  {seconds:.1f} s launch  {summary['tokens_per_s']:,.0f} tokens/s  {mfu_text}")
    return summary


# ---------------------------------------------------------------------------- variants of a run
# The second command's sections (--second): each compares variants of one run, measured by the
# Trainer itself, in launches of scripts/bench/_variants_worker.py (several runs per process).


@dataclass(frozen=True)
class Variant:
    """One run of a variants launch: its name (its folder), what the table calls it, its keys,
    and the run it is compared with (``versus``: another variant's name in the same section)."""

    name: str
    label: str
    keys: tuple[str, ...]
    versus: str | None = None
    moe_loop: bool = False  # the MoE experts' loop over experts instead of the grouped matmul
    # What the worker must report it built (_variants_worker.built): (key, whether it is > 0),
    # so that a variant that silently ran as another (no float8 layer, no FSDP2) fails.
    ran_as: tuple[tuple[str, bool], ...] = ()


@dataclass(frozen=True)
class VariantsLaunch:
    """One launch of the variants worker: ``nproc`` None is one plain process, N a torchrun of
    N (on the one GPU together, over gloo, with ``share_gpu``)."""

    name: str
    variants: tuple[Variant, ...]
    nproc: int | None = None
    share_gpu: bool = False
    timeout: float = 180.0
    # What it needs to finish its first variant (start-up, initialisation, the steps): kept back
    # for it from the launches before it, under --budget-s.
    least_s: float = 30.0

    def command(self, out: Path) -> list[str]:
        spec = {
            "variants": [
                {"name": v.name, "keys": list(v.keys), "moe_loop": v.moe_loop}
                for v in self.variants
            ],
            "share_gpu": self.share_gpu,
        }
        worker = [str(BENCH_DIR / "_variants_worker.py"), str(out), json.dumps(spec)]
        return [sys.executable, *worker] if self.nproc is None else torchrun(self.nproc, *worker)


BENCH_DIR = Path(__file__).resolve().parent
FLOAT8_RECIPES = ("rowwise", "tensorwise")


def llama3_1b_variants(args: argparse.Namespace, device: str, float8: bool) -> list[VariantsLaunch]:
    """llama3_1b (the --llama-* options' batch and steps) in bf16, with each float8 recipe, and
    under FSDP2 on its one-rank group, eager; then bf16 and both recipes compiled per block. One
    launch: one initialisation, one process start (torchrun: FSDP2 needs the group)."""
    run = DecoderRun.from_args(args, DECODERS[1])
    base = token_run_keys(
        model="llama3_debug" if args.cpu_smoke else run.decoder.section,
        family=run.decoder.family,
        batch=run.batch,
        micro=run.micro,
        steps=run.steps,
        seq_len=args.smoke_seq_len or DECODER_SEQ_LEN,
        device=device,
    )
    recipes = FLOAT8_RECIPES if float8 else ()
    variants = []
    for compiled in (False, True) if not args.cpu_smoke else (False,):
        mode = "compiled" if compiled else "eager"
        keys = (*base, f"compile.enabled={str(compiled).lower()}")
        bf16 = f"bf16_{mode}"
        blocks = (("compiled", compiled), ("fsdp", False))
        plain = (*blocks, ("float8_linears", False))
        variants.append(Variant(bf16, f"bf16 {mode}", keys, ran_as=plain))
        for recipe in recipes:
            variants.append(
                Variant(
                    f"float8_{recipe}_{mode}",
                    f"float8 {recipe} {mode}",
                    (*keys, f"precision.float8={recipe}"),
                    versus=bf16,
                    ran_as=(*blocks, ("float8_linears", True)),
                )
            )
        if not compiled:
            variants.append(
                Variant(
                    "fsdp2_eager",
                    "FSDP2 bf16 eager",
                    (*keys, "parallel=fsdp"),
                    versus=bf16,
                    ran_as=(("fsdp", True), ("float8_linears", False)),
                )
            )
    launch = VariantsLaunch(
        "llama3_1b_variants", tuple(variants), nproc=1, timeout=420.0, least_s=60.0
    )
    return [launch]


def moe_variants(args: argparse.Namespace, device: str) -> list[VariantsLaunch]:
    """A mixture of experts (moe_debug's family at a size where the experts' matmuls count: 4
    blocks of width 1,024, 16 experts of 512 channels, top-2) in bf16 through torch's grouped
    matmul, then through the loop over experts from the same initial weights: tokens/s of each,
    and their losses, which must agree within bf16's rounding."""
    if args.cpu_smoke:
        sizes: list[str] = []
    else:
        sizes = [
            "model.moe.vocab_size=32000",
            "model.moe.seq_len=2048",
            "model.moe.dim=1024",
            "model.moe.n_layers=4",
            "model.moe.n_heads=16",
            "model.moe.n_kv_heads=4",
            "model.moe.head_dim=64",
            "model.moe.num_experts=16",
            "model.moe.moe_hidden_dim=512",
        ]
    keys = (
        *token_run_keys(
            model="moe_debug",
            family="moe",
            batch=8,
            micro=4,
            steps=args.llama_steps,
            seq_len=args.smoke_seq_len or 2048,
            device=device,
        ),
        *sizes,
    )
    variants = (
        Variant("grouped", "grouped matmul bf16", keys, ran_as=(("grouped_mm_calls", True),)),
        Variant(
            "loop",
            "loop over experts bf16",
            keys,
            versus="grouped",
            moe_loop=True,
            ran_as=(("grouped_mm_calls", False),),
        ),
    )
    return [VariantsLaunch("moe", variants, timeout=240.0, least_s=45.0)]


def cp_variants(args: argparse.Namespace, device: str) -> list[VariantsLaunch]:
    """Context parallel on two ranks sharing the GPU (over gloo, as tests/cuda's two-rank tests:
    the transport is host memory, so these are the attention paths' costs with a slow link, not
    a multi-GPU figure): ring attention and the K/V all-gather against one process, on 16,384-token
    sequences of a 2-block Llama of width 1,024. The losses must agree."""
    if args.cpu_smoke:
        sizes: list[str] = []
        seq_len = args.smoke_seq_len
    else:
        seq_len = 16384
        sizes = [
            f"model.llama.seq_len={seq_len}",
            "model.llama.dim=1024",
            "model.llama.n_heads=16",
            "model.llama.n_kv_heads=8",
            "model.llama.hidden_dim=3584",
        ]
    keys = (
        *token_run_keys(
            model="llama3_debug",
            family="llama",
            batch=2,
            micro=2,
            steps=args.llama_steps,
            seq_len=seq_len,
            device=device,
        ),
        *sizes,
    )
    two = (*keys, "dist.backend=gloo", "parallel.cp=2")
    # Ring attention is torch's CUDA path; the CPU smoke runs only the all-gather.
    attentions = ("allgather",) if args.cpu_smoke else ("ring", "allgather")
    return [
        VariantsLaunch("cp_one_process", (Variant("one_process", "one process", keys),)),
        *(
            VariantsLaunch(
                f"cp_{attention}",
                (
                    Variant(
                        attention,
                        f"cp=2 {attention}",
                        (*two, f"parallel.cp_attention={attention}"),
                        versus="one_process",
                    ),
                ),
                nproc=2,
                share_gpu=True,
            )
            for attention in attentions
        ),
    ]


def section_launches(
    args: argparse.Namespace, section: str, *, float8: bool
) -> list[VariantsLaunch]:
    """A variants section's launches (``float8``: with the float8 recipes' runs)."""
    device = "cpu" if args.cpu_smoke else "cuda"
    if section == "moe":
        return moe_variants(args, device)
    if section == "cp":
        return cp_variants(args, device)
    return llama3_1b_variants(args, device, float8=float8)


def float8_missing(args: argparse.Namespace) -> str | None:
    """Why float8 cannot run here, or None: torchao absent (the float8 extra), a GPU without
    float8 tensor cores, or the CPU smoke (float8 on the CPU is torchao's emulation)."""
    if args.cpu_smoke:
        return "the CPU smoke run: float8 kernels are the GPU's"
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'sdnet_trainer[float8]')"
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) < (8, 9):
        return f"compute capability {major}.{minor}: no float8 tensor cores (8.9 and later)"
    return None


def bench_variants(
    args: argparse.Namespace, section: str, out: Path, budget: Budget, *, reserve: float = 0.0
) -> dict[str, Any]:
    """A section's launches and one row per variant: its figures, or why there are none, and
    its tokens/s and losses against the variant it is compared with. ``reserve``: the seconds the
    sections after this one need (each launch leaves them, and its own section's later ones)."""
    rows: dict[str, dict[str, Any]] = {}
    missing = float8_missing(args) if section == "llama3_1b_variants" else None
    launches = section_launches(args, section, float8=missing is None)
    for i, launch in enumerate(launches):
        later = reserve + sum(other.least_s for other in launches[i + 1 :])
        folder = out / section / launch.name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        names = ", ".join(v.label for v in launch.variants)
        print(f"\n== {section}: {names}", flush=True)
        log = out / section / f"{launch.name}.log"
        outcome = None
        allowed = budget.timeout(launch.timeout, f"{section} {launch.name}", reserve=later)
        if allowed is None:
            outcome = "not run: not enough of the budget left"
        else:
            try:
                seconds, _ = timed_launch(launch.command(folder), log, allowed)
                print(f"  {seconds:.1f} s launch", flush=True)
            except LaunchTimeout:
                budget.cut.append(f"{section} {launch.name}")
                outcome = not_finished(allowed)
            except LaunchError as err:
                print(f"  {launch.name} FAILED: {err}", file=sys.stderr, flush=True)
                outcome = f"FAILED (log in {log})"
        finished = _finished_variants(folder)
        for variant in launch.variants:
            figures = token_figures(read_metrics(folder / variant.name))
            rows[variant.name] = {
                "label": variant.label,
                "versus": variant.versus,
                **variant_outcome(variant, finished.get(variant.name), figures, outcome),
            }
    for row in rows.values():
        other = rows.get(row["versus"] or "")
        if row["failed"] is None and other is not None and other["failed"] is None:
            row["ratio"] = row["tokens_per_s"] / other["tokens_per_s"]
            row["loss_gap"] = max(
                abs(a - b) / abs(b) for a, b in zip(row["losses"], other["losses"], strict=False)
            )
        print(f"  {row['label']}: {variant_text(row, rows)}", flush=True)
    return {"rows": rows, **({"float8_not_run": missing} if missing else {})}


def variant_outcome(
    variant: Variant,
    record: dict[str, Any] | None,
    figures: dict[str, Any] | None,
    launch_outcome: str | None,
) -> dict[str, Any]:
    """A variant's figures, or why there are none (``failed``); ``cut`` where its launch's share
    ended before it finished (or before it started): not a failure of the code under test.
    ``record`` is what the worker says it built where it finished the variant; ``launch_outcome``
    why the launch ended early, if it did."""
    if record is None:
        failed = launch_outcome or "FAILED: the launch ended without it"
        return {"failed": failed, "cut": not failed.startswith("FAILED")}
    wrong = [key for key, positive in variant.ran_as if bool(record[key]) != positive]
    if wrong:
        # It ran, but not as named: no float8 layer, not sharded, the other experts' path.
        return {"failed": f"FAILED: built as {record}, not as named ({wrong})", "cut": False}
    if figures is None:
        return {"failed": "FAILED: no log point past the first in its metrics", "cut": False}
    return {**figures, "built": record, "failed": None, "cut": False}


def variant_text(row: dict[str, Any], rows: dict[str, dict[str, Any]]) -> str:
    """A variant's figures in one line: tokens/s, and against its reference the ratio and how far
    apart their losses were (the largest relative gap over the log points)."""
    if row["failed"]:
        return row["failed"]
    text = f"{row['tokens_per_s']:,.0f} tokens/s, peak memory {row['peak_memory_mb']:,.0f} MB"
    if "ratio" in row:
        text += f" ({row['ratio']:.3f}x {rows[row['versus']]['label']}, losses within "
        text += f"{row['loss_gap']:.1e})"
    return text


def _finished_variants(folder: Path) -> dict[str, dict[str, Any]]:
    """The variants the worker finished and what each ran as (its results.json, rewritten after
    each variant)."""
    results = folder / "results.json"
    return json.loads(results.read_text()) if results.exists() else {}


# ---------------------------------------------------------------------------- every launch


@dataclass(frozen=True)
class PlannedLaunch:
    """A Trainer run the benchmark would start with ``argv``: its overrides as launched
    (``dist.device=cuda`` among them, the launch's hydra.* keys left out), its process count (None:
    one plain process; N: torchrun with N) and whether one step of it fits a CPU test."""

    name: str
    keys: tuple[str, ...]
    nproc: int | None
    cpu_step: bool = False


def planned_launches(argv: list[str]) -> list[PlannedLaunch]:
    """Every Trainer run of ``bench_gpu.py ARGV`` (the GPU check's commands: ``--quick``,
    ``--second``), without starting any: tests/unit/test_cuda_launches.py composes each on the
    CPU, so a key or an override order that would fail costs no GPU time. None of them fits a CPU
    step: their models are sized for a GPU (the CPU smoke runs the same code on small ones)."""
    args = parse_args(argv)
    launches = []
    if "resnet50" in args.sections:
        spec = ResNetSpec(args.batch, args.warmup, args.steps, args.workers, "result.json")
        keys = tuple(k for k in resnet_keys(spec, Path("run")) if not k.startswith("hydra."))
        launches.append(PlannedLaunch("resnet50 trainer", keys, None))
    for dec in DECODERS:
        if dec.section in args.sections:
            keys = tuple(decoder_keys(DecoderRun.from_args(args, dec), None))
            launches.append(PlannedLaunch(dec.section, keys, None))
    for section in VARIANT_SECTIONS:
        if section not in args.sections:
            continue
        for launch in section_launches(args, section, float8=True):
            for variant in launch.variants:
                name = f"{section} {variant.label}"
                launches.append(PlannedLaunch(name, variant.keys, launch.nproc))
    return launches


# ---------------------------------------------------------------------------- the loader


def bench_loader(args: argparse.Namespace, out: Path, resnet_rate: float | None) -> dict[str, Any]:
    """The training loader's CPU cost on the GPU path (uint8 crops, normalized on the device),
    measured as scripts/bench/bench_loader.py does (its images and its per-CPU-second rate)."""
    from bench_loader import rate, write_images
    from torch.utils.data import DataLoader

    from sdnet_trainer.data.folders import CheckedImageFolder, imagenet_transforms
    from sdnet_trainer.data.normalize import defer_normalization

    root = out / "jpegs"
    shutil.rmtree(root, ignore_errors=True)
    print(
        f"\n== loader: {args.jpegs} generated JPEGs, data=imagefolder at {IMAGE_SIZE}", flush=True
    )
    write_images(root, args.jpegs)
    train_transform, _ = imagenet_transforms(IMAGE_SIZE)
    floats = CheckedImageFolder(str(root / "train"), transform=train_transform)
    deferred = defer_normalization(floats)
    dataset = deferred[0] if deferred is not None else floats
    path = "uint8" if deferred is not None else "float"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: PIL decodes on the calling thread
    try:
        per_core, wall = rate(dataset, repeats=args.loader_repeats)
    finally:
        torch.set_num_threads(threads)
    print(f"  one core ({path} path): {per_core:,.0f} images/s per CPU second", flush=True)
    workers = args.workers
    size = len(floats)
    loader = DataLoader(
        dataset,
        batch_size=min(32, size),
        shuffle=True,
        num_workers=workers,
        drop_last=True,
        persistent_workers=workers > 0,
    )
    batches = (batch for _ in range(2) for batch in loader)  # two epochs, the same workers
    next(batches)  # workers started and warm
    started, images = time.perf_counter(), 0
    for images_batch, _labels in batches:
        images += len(images_batch)
    pooled = images / (time.perf_counter() - started) if images else None
    if pooled is not None:
        print(f"  {workers} workers: {pooled:,.0f} images/s", flush=True)
    summary: dict[str, Any] = {
        "path": path,
        "images_per_s_per_core": per_core,
        "images_per_s_one_core_wall": wall,
        "workers": workers,
        "images_per_s_workers": pooled,
        "jpegs": args.jpegs,
    }
    if resnet_rate:
        summary["cores_for_trainer_rate"] = resnet_rate / per_core
    return summary


# ---------------------------------------------------------------------------- driver


# Batches each ResNet-50 loader worker keeps ready (data.prefetch_factor on both sides).
PREFETCH = 2
SHM = Path("/dev/shm")


def default_workers(*, batch: int, shm_bytes: int | None = None) -> int:
    """Loader workers for the ResNet-50 sides: the machine's cores but one for the training
    process and one for the driver, at most 12, and no more than /dev/shm holds: each worker
    hands its PREFETCH float32 batches over in shared memory (256 images at 224 px: 154 MB each),
    and a container's default 64 MB /dev/shm would kill the loader (a bus error) where a node's
    was not grown (scripts/ci/gpu_check.sh grows it where it may)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = max(1, min(12, (cores or 2) - 2))
    if shm_bytes is None:
        try:
            shm_bytes = shutil.disk_usage(SHM).free
        except OSError:
            return workers  # no /dev/shm to measure: torch's own default sharing applies
    batch_bytes = batch * 3 * IMAGE_SIZE * IMAGE_SIZE * 4
    # Three quarters of it: pinned staging and the other side's leftovers need room too.
    fits = int(0.75 * shm_bytes) // (PREFETCH * batch_bytes)
    return max(0, min(workers, fits))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sections",
        default=None,
        help=f"comma-separated, from {', '.join(SECTIONS)} (default: all; "
        f"{','.join(QUICK_SECTIONS)} with --quick)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a short run: {', '.join(QUICK_SECTIONS)}, one round, fewer steps, 120 s per launch",
    )
    p.add_argument(
        "--second",
        action="store_true",
        help=f"the GPU check's second command: {', '.join(SECOND_SECTIONS)}, the --quick steps",
    )
    p.add_argument("--rounds", type=int, default=3, help="ResNet-50 rounds per side (3)")
    p.add_argument("--batch", type=int, default=256, help="ResNet-50 images per step (256)")
    p.add_argument("--warmup", type=int, default=15, help="ResNet-50 steps before the window")
    p.add_argument("--steps", type=int, default=40, help="ResNet-50 timed steps (40)")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="loader workers (default: the cores but two, at most 12, as many as /dev/shm holds)",
    )
    p.add_argument(
        "--matmul-size", type=int, default=8192, help="the matmul section's square size (8192)"
    )
    for dec in DECODERS:
        name, opt = dec.section, dec.option
        p.add_argument(f"--{opt}-batch", type=int, default=8, help=f"{name} sequences per step (8)")
        p.add_argument(f"--{opt}-micro", type=int, default=4, help=f"{name} micro-batch (4)")
        p.add_argument(f"--{opt}-steps", type=int, default=dec.steps, help=f"{name} steps")
        p.add_argument(f"--{opt}-compile", action="store_true", help=f"compile {name}'s blocks")
    p.add_argument("--jpegs", type=int, default=256, help="generated JPEGs for the loader (256)")
    p.add_argument("--loader-repeats", type=int, default=3, help="loader passes, best kept (3)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per launch (420)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="the whole benchmark within this many seconds: launches that would not fit are "
        "skipped (exit code 3), each launch's timeout cut to what is left",
    )
    p.add_argument("--out", type=Path, default=None, help="output directory (default: temp)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--worker-spec", default=None, help=argparse.SUPPRESS)  # the hand side
    # The machinery (launches, both sides, the loader, the table) on a machine without a GPU, at
    # a size that says nothing about speed: for the CPU test suite (tests/unit/test_cuda_lane.py).
    p.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick and args.second:
        p.error("--quick and --second are the GPU check's two commands: one at a time")
    if args.sections is None:
        preset = QUICK_SECTIONS if args.quick else SECOND_SECTIONS if args.second else SECTIONS
        args.sections = ",".join(preset)
    if args.quick or args.second:
        args.rounds, args.warmup, args.steps, args.timeout = 1, 10, 30, 120.0
        for dec in DECODERS:
            setattr(args, f"{dec.option}_steps", dec.quick_steps)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        p.error(f"--sections {args.sections!r}: choose from {', '.join(SECTIONS)}")
    args.sections = sections
    args.smoke_run = {}
    args.smoke_seq_len = None
    if args.cpu_smoke:
        decoders = {dec.section for dec in DECODERS}  # 1B parameters: not on a CPU
        args.sections = [s for s in sections if s not in decoders]
        args.rounds, args.batch, args.warmup, args.steps = 1, 8, 1, 2
        args.workers, args.jpegs, args.loader_repeats = 0, 8, 1
        args.matmul_size = 64
        args.llama_batch, args.llama_micro, args.llama_steps = 4, 2, 4
        args.smoke_seq_len = 64  # the debug models' context
        args.smoke_run = {
            "device": "cpu",
            "model": "resnet18",
            "image_size": 32,
            "num_classes": 10,
            "precision": "fp32",
        }
    if min(args.rounds, args.batch, args.warmup, args.steps) < 1:
        p.error("--rounds, --batch, --warmup and --steps must be >= 1")
    if args.workers is None:
        args.workers = default_workers(batch=args.batch)
    for dec in DECODERS:
        run = DecoderRun.from_args(args, dec)
        opt = f"--{dec.option}"
        if min(run.batch, run.micro, run.steps) < 1:
            p.error(f"{opt}-batch, {opt}-micro and {opt}-steps must be >= 1")
        if run.batch % run.micro:
            p.error(f"{opt}-batch {run.batch} is not a multiple of {opt}-micro {run.micro}")
    return args


def print_table(figures: dict[str, Any]) -> None:
    print(
        f"\nbench_gpu on {figures['device']} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    )
    matmul = figures.get("matmul")
    if matmul:
        print(
            f"matmul {matmul['dtype']} {matmul['size']}^3: {matmul['tflops_per_s']:,.0f} TFLOP/s "
            "(the practical peak below)"
        )
    resnet = figures.get("resnet50")
    if resnet:
        print(
            f"resnet50 bf16 channels_last, batch {resnet['batch']}, median of {resnet['rounds']}:"
        )
        for side in SIDES:
            cell = resnet[side]
            if cell["images_per_s"] is None:
                print(f"  {side:<8} {cell['failed'] or 'not run: the budget ran out'}")
                continue
            print(
                f"  {side:<8} {cell['images_per_s']:>8,.0f} images/s  "
                f"(min-max {cell['min']:,.0f}-{cell['max']:,.0f})"
            )
        if resnet["ratio"] is not None:
            print(
                f"  trainer / hand {resnet['ratio']:.3f} (min-max {resnet['ratio_min']:.3f}-"
                f"{resnet['ratio_max']:.3f})"
            )
        print(
            f"  for context: NVIDIA's published ResNet-50 v1.5 AMP training figure for one A100 "
            f"80GB is {A100_AMP_IMAGES_PER_S:,} images/s (another GPU and pipeline)"
        )
    for name in figures.get("decoders", ()):
        cell = figures[name]
        if cell.get("failed"):
            print(f"{name}: {cell['failed']}")
            continue
        mfu = f"{cell['mfu']:.1%}" if cell["mfu"] is not None else "n/a (unknown GPU)"
        print(
            f"{name} bf16 {'compiled' if cell['compiled'] else 'eager'}: "
            f"{cell['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, "
            f"{cell['tflops_per_s']:.0f} TFLOP/s, peak memory {cell['peak_memory_mb']:,.0f} MB"
        )
    for section in figures.get("variant_sections", ()):
        print(f"{section}:")
        for row in figures[section]["rows"].values():
            print(f"  {row['label']:<28} {variant_text(row, figures[section]['rows'])}")
        if figures[section].get("float8_not_run"):
            print(f"  float8 not run: {figures[section]['float8_not_run']}")
    loader = figures.get("loader")
    if loader:
        line = (
            f"loader (ImageFolder JPEG, CPU decode, {IMAGE_SIZE} crop, {loader['path']}): "
            f"{loader['images_per_s_per_core']:,.0f} images/s per core"
        )
        if loader["images_per_s_workers"] is not None:
            line += f", {loader['images_per_s_workers']:,.0f} with {loader['workers']} workers"
        print(line)
        if "cores_for_trainer_rate" in loader:
            print(
                f"  cores to feed the Trainer's ResNet-50 rate: "
                f"{loader['cores_for_trainer_rate']:.1f}"
            )
    loads: list[float] = [
        float(cell["other_cores_max"])
        for cell in (resnet or {}).values()
        if isinstance(cell, dict) and cell.get("other_cores_max") is not None
    ]
    if loads and max(loads) > 1.0:
        print(
            f"warning: other processes used up to {max(loads):.1f} cores during the launches; "
            "rerun on an otherwise idle machine for figures to quote"
        )


def main() -> int:
    args = parse_args()
    # The Trainer imports its subclass (trainer._target_) from scripts/bench/, as a user's module.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(BENCH_DIR), str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    if args.worker_spec is not None:
        run_hand(ResNetSpec(**json.loads(args.worker_spec)))
        return 0
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return NO_CUDA_EXIT
    out = (args.out or Path(tempfile.mkdtemp(prefix="bench_gpu_"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu (a smoke run: no figure means anything)" if args.cpu_smoke else None
    figures: dict[str, Any] = {"device": device or torch.cuda.get_device_name(0)}
    print(f"bench_gpu: {', '.join(args.sections)} on {figures['device']}; output in {out}")
    started = time.perf_counter()
    budget = Budget(args.budget_s)

    def save() -> None:
        """The figures so far, after every section: a run stopped part way keeps them."""
        figures["seconds"] = time.perf_counter() - started
        figures["skipped"] = budget.skipped
        figures["cut"] = budget.cut
        if args.json is not None:
            write_json(args.json, figures)

    ok = True
    if "matmul" in args.sections:
        device = "cpu" if args.cpu_smoke else "cuda"
        dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
        figures["matmul"] = bench_matmul(device=device, size=args.matmul_size, dtype=dtype)
        save()
    if "resnet50" in args.sections:
        figures["resnet50"] = bench_resnet(args, out, budget)
        ok &= all(
            figures["resnet50"][side]["failed"] is None or figures["resnet50"][side]["cut"]
            for side in SIDES
        )
        save()
    # The decoder sections run, in order: gpu_check.sh's table prints a row for each.
    figures["decoders"] = [dec.section for dec in DECODERS if dec.section in args.sections]
    for dec in DECODERS:
        if dec.section in args.sections:
            run = DecoderRun.from_args(args, dec)
            cell = bench_decoder(run, out, budget=budget, timeout=args.timeout)
            figures[dec.section] = cell
            ok &= not cell.get("failed") or bool(cell.get("cut"))
            save()
    # The second command's sections, each a row per variant in the table.
    sections = [s for s in VARIANT_SECTIONS if s in args.sections]
    figures["variant_sections"] = sections
    for i, section in enumerate(sections):
        # What the sections after this one need to finish at all, kept back from this one.
        reserve = sum(
            launch.least_s
            for later in sections[i + 1 :]
            for launch in section_launches(args, later, float8=False)
        )
        figures[section] = bench_variants(args, section, out, budget, reserve=reserve)
        ok &= all(row["failed"] is None or row["cut"] for row in figures[section]["rows"].values())
        save()
    if "loader" in args.sections:
        rate = (figures.get("resnet50") or {}).get("trainer", {}).get("images_per_s")
        figures["loader"] = bench_loader(args, out, rate)
    save()
    print_table(figures)
    print(f"\n({figures['seconds']:.0f} s in all; logs and results in {out})")
    if not ok:
        return 1
    return OVER_BUDGET_EXIT if budget.skipped or budget.cut else 0


if __name__ == "__main__":
    sys.exit(main())
